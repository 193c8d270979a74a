"""Create quantizes int4/int8 with the C kernel on a CPU device; its blobs are byte for byte
those of MLX's quantize, for every source dtype, stacked experts and tensors done in halves."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from safetensors.numpy import save_file

from registry.store import Store
from runner.kernels import cpu_quantize
from runner.quant import parse_quant_type
from workflows.create import write
from workflows.create.inventory import take_inventory
from workflows.create.plan import plan_model

pytestmark = pytest.mark.skipif(not cpu_quantize.available(),
                                reason="no C compiler: create uses MLX's quantize")


def _moe_checkpoint(root):
    """Two experts per projection (stacked into one tensor each), float16."""
    rng = np.random.default_rng(1)
    tensors = {}
    for i in range(2):
        for proj, shape in {"gate_proj": (64, 128), "down_proj": (128, 64)}.items():
            tensors[f"model.layers.0.mlp.experts.{i}.{proj}.weight"] = (
                rng.standard_normal(shape) * 0.02).astype(np.float16)
    root.mkdir()
    (root / "config.json").write_text("{}")
    save_file(tensors, str(root / "model.safetensors"))
    return root


def _write(plan, store, monkeypatch, native: bool, split_bytes: int | None = None):
    calls = {"kernel": 0, "mlx": 0}
    threads: set[str] = set()
    for blob in plan.blobs:  # each kind's one check against MLX runs here, not counted
        for tensor in blob.tensors:
            write.native_quantize(tensor)
    kernel, mlx = cpu_quantize.affine, write.quantize

    def counted_kernel(*args, **kwargs):
        calls["kernel"] += 1
        threads.add(threading.current_thread().name.split("_")[0])
        return kernel(*args, **kwargs)

    def counted_mlx(*args, **kwargs):
        calls["mlx"] += 1
        return mlx(*args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(cpu_quantize, "affine", counted_kernel)
        patch.setattr(write, "quantize", counted_mlx)
        patch.setattr(cpu_quantize, "usable", lambda: native)
        if split_bytes is not None:
            patch.setattr(write, "SPLIT_BYTES", split_bytes)
        layers = write.write_plan(plan, store, lambda e: None, threading.Event())
    return layers, calls, threads


@pytest.mark.parametrize("qtype", ["int4", "int8"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_kernel_blobs_are_mlx_blobs(make_checkpoint, tmp_path, monkeypatch, qtype, dtype):
    plan = plan_model(take_inventory(make_checkpoint("llama", dtype=dtype)),
                      parse_quant_type(qtype))
    by_mlx, mlx_calls, _ = _write(plan, Store(tmp_path / "mlx"), monkeypatch, native=False)
    by_kernel, kernel_calls, _ = _write(plan, Store(tmp_path / "kernel"), monkeypatch,
                                        native=True)
    assert mlx_calls["kernel"] == 0 and mlx_calls["mlx"] > 0
    assert kernel_calls["mlx"] == 0 and kernel_calls["kernel"] == mlx_calls["mlx"]
    assert by_kernel == by_mlx  # same digests, sizes and names, in the same order


def test_kernel_halves_and_stacked_experts_are_mlx_blobs(make_checkpoint, tmp_path,
                                                         monkeypatch):
    """Every tensor in two halves (the second on the split thread), and stacked experts one
    block per expert, alternating between the threads: the bytes are still MLX's."""
    for name, root in [("llama", make_checkpoint("llama")),
                       ("moe", _moe_checkpoint(tmp_path / "moe-ckpt"))]:
        plan = plan_model(take_inventory(root), parse_quant_type("int8"))
        by_mlx, _, _ = _write(plan, Store(tmp_path / f"{name}-mlx"), monkeypatch, native=False)
        split = 1 if name == "llama" else None
        by_kernel, calls, threads = _write(plan, Store(tmp_path / f"{name}-kernel"),
                                           monkeypatch, native=True, split_bytes=split)
        assert calls["mlx"] == 0 and "ferry-quantize-split" in threads
        assert by_kernel == by_mlx, name


def test_a_source_shorter_than_its_header_says_fails_the_create_cleanly(tmp_path,
                                                                        monkeypatch):
    root = tmp_path / "ckpt"
    root.mkdir()
    (root / "config.json").write_text("{}")
    tensors = {"model.layers.0.mlp.up_proj.weight": np.ones((64, 128), dtype=np.float16)}
    save_file(tensors, str(root / "model.safetensors"))
    plan = plan_model(take_inventory(root), parse_quant_type("int4"))
    with open(root / "model.safetensors", "r+b") as fh:  # cut after the plan was made
        fh.truncate(fh.seek(0, 2) - 10)
    store = Store(tmp_path / "models")
    with pytest.raises(OSError, match="unexpected end of file"):
        _write(plan, store, monkeypatch, native=True)
    assert not list(store.blobs_dir.glob(".tmp-*"))


@pytest.mark.parametrize("qtype", ["nvfp4", "mxfp4", "mxfp8"])
def test_fp_creates_take_the_kernel_and_write_mlx_blobs(make_checkpoint, tmp_path,
                                                                   monkeypatch, qtype):
    plan = plan_model(take_inventory(make_checkpoint("llama")), parse_quant_type(qtype))
    by_mlx, _, _ = _write(plan, Store(tmp_path / "mlx"), monkeypatch, native=False)
    codes = []
    real = cpu_quantize.scaled_codes
    monkeypatch.setattr(cpu_quantize, "scaled_codes", lambda *a: codes.append(1) or real(*a))
    by_kernel, _, _ = _write(plan, Store(tmp_path / "kernel"), monkeypatch, native=True)
    assert codes and by_kernel == by_mlx
