"""write_plan quantizes on QUANT_WORKERS threads at once; blobs and layers keep their order."""

from __future__ import annotations

import threading

import pytest

from registry.store import Store
from runner.quant import parse_quant_type
from workflows.create import write
from workflows.create.errors import CreateCancelled
from workflows.create.inventory import take_inventory
from workflows.create.plan import plan_model


def test_two_tensors_quantize_at_once_and_the_result_is_the_sequential_one(
        make_checkpoint, tmp_path, monkeypatch):
    plan = plan_model(take_inventory(make_checkpoint("llama")), parse_quant_type("int4"))
    sequential_store = Store(tmp_path / "one")
    monkeypatch.setattr(write, "QUANT_WORKERS", 1)  # one tensor in hand at a time
    monkeypatch.setattr(write, "_pools", {})  # and a pool of that size
    sequential = write.write_plan(plan, sequential_store, lambda e: None, threading.Event())

    # The first two blobs meet at a barrier: it breaks (and the create fails) unless both are
    # being prepared at the same time. The first is then held back until the second is done,
    # so the second finishes first, yet the blobs go to the writer in plan order.
    monkeypatch.setattr(write, "QUANT_WORKERS", 2)
    monkeypatch.setattr(write, "_pools", {})
    met = threading.Barrier(2, timeout=30)
    second_done = threading.Event()
    real = write.tensor_blob_chunks
    calls: list[str] = []

    def chunks(blob, sources):
        calls.append(blob.name)
        index = len(calls)
        if index <= 2:
            met.wait()
        if index == 1:
            assert second_done.wait(30)
        out = real(blob, sources)
        if index == 2:
            second_done.set()
        return out

    monkeypatch.setattr(write, "tensor_blob_chunks", chunks)
    order: list[str] = []
    store = Store(tmp_path / "two")
    layers = write.write_plan(plan, store, lambda e: order.append(e["status"]),
                              threading.Event())
    assert layers == sequential
    assert order == [f"{'quantizing' if any(t.quant for t in b.tensors) else 'copying'} "
                     f"{b.name}" for b in plan.blobs]
    assert not list(store.blobs_dir.glob(".tmp-*"))


def test_an_error_while_quantizing_waits_for_the_jobs_in_hand(make_checkpoint, tmp_path,
                                                              monkeypatch):
    plan = plan_model(take_inventory(make_checkpoint("llama")), parse_quant_type("int4"))
    real = write.tensor_blob_chunks
    calls: list[str] = []
    finished = threading.Event()

    def chunks(blob, sources):
        calls.append(blob.name)
        if len(calls) == 3:
            raise RuntimeError("no memory for this tensor")
        if len(calls) == 4:  # in hand when the error surfaces: write_plan waits for it
            threading.Event().wait(0.3)
            finished.set()
        return real(blob, sources)

    monkeypatch.setattr(write, "tensor_blob_chunks", chunks)
    store = Store(tmp_path / "models")
    with pytest.raises(RuntimeError, match="no memory"):
        write.write_plan(plan, store, lambda e: None, threading.Event())
    assert len(calls) == 4 and finished.is_set()
    assert not list(store.blobs_dir.glob(".tmp-*"))
    # A cancel stops it the same way: nothing left half-written.
    cancel = threading.Event()
    monkeypatch.setattr(write, "tensor_blob_chunks", real)
    with pytest.raises(CreateCancelled):
        write.write_plan(plan, store, lambda e: cancel.set(), cancel)
    assert not list(store.blobs_dir.glob(".tmp-*"))


@pytest.mark.parametrize("qtype", ["int4", "int8", "nvfp4", "mxfp4", "mxfp8"])
def test_large_tensors_quantized_in_halves_equal_the_whole(make_checkpoint, tmp_path,
                                                            monkeypatch, qtype):
    """With the split threshold below every tensor's size, each quantized tensor is done in
    two halves on two threads (the second on the split thread, seen running); the blobs are
    byte for byte those of whole-tensor quantizing."""
    plan = plan_model(take_inventory(make_checkpoint("llama")), parse_quant_type(qtype))
    whole = write.write_plan(plan, Store(tmp_path / "whole"), lambda e: None, threading.Event())

    seen: set[str] = set()
    real, kernel = write.quantize, write.cpu_quantize.affine

    def traced(weight, qt):
        seen.add(threading.current_thread().name.split("_")[0])
        return real(weight, qt)

    def traced_kernel(*args):  # int4 and int8 on a CPU device
        seen.add(threading.current_thread().name.split("_")[0])
        return kernel(*args)

    monkeypatch.setattr(write, "quantize", traced)
    monkeypatch.setattr(write.cpu_quantize, "affine", traced_kernel)
    monkeypatch.setattr(write, "SPLIT_BYTES", 1)
    store = Store(tmp_path / "halves")
    halves = write.write_plan(plan, store, lambda e: None, threading.Event())
    assert "ferry-quantize-split" in seen
    assert halves == whole
    for layer in halves:
        assert store.read_blob(layer.digest) == Store(tmp_path / "whole").read_blob(layer.digest)
