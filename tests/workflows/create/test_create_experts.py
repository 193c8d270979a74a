"""Per-expert tensors are stacked per layer and projection (reference 2.2 "Plan -> blobs")."""

from __future__ import annotations

import threading

import mlx.core as mx
import numpy as np
from safetensors.numpy import save_file

from registry.store import Store
from runner.quant import QuantType, dequantize, parse_quant_type
from workflows.create.inventory import take_inventory
from workflows.create.plan import plan_model
from workflows.create.write import write_plan

SHAPES = {"gate_proj": (64, 128), "up_proj": (64, 128), "down_proj": (128, 64)}


def _moe_checkpoint(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {"model.layers.0.mlp.gate.weight": rng.standard_normal((2, 128)).astype(np.float16)}
    for i in range(2):
        for proj, shape in SHAPES.items():
            name = f"model.layers.0.mlp.experts.{i}.{proj}.weight"
            tensors[name] = (rng.standard_normal(shape) * 0.02).astype(np.float16)
    tmp_path.mkdir(parents=True)
    (tmp_path / "config.json").write_text("{}")
    save_file(tensors, str(tmp_path / "model.safetensors"))
    return tmp_path, tensors


def test_experts_share_one_blob_when_their_quantization_agrees(tmp_path):
    ckpt, source = _moe_checkpoint(tmp_path / "ckpt")
    plan = plan_model(take_inventory(ckpt), parse_quant_type("int8"))
    by_name = {b.name: b for b in plan.blobs}
    assert by_name["model.layers.0.mlp.gate.weight"].tensors[0].quant is None  # router
    group = by_name["model.layers.0.mlp.experts"]
    assert [t.name for t in group.tensors] == [
        f"model.layers.0.mlp.experts.{p}.weight" for p in sorted(SHAPES)]
    assert all(t.shape == (2, *SHAPES[t.name.split(".")[-2]]) for t in group.tensors)

    store = Store(tmp_path / "models")
    layers = write_plan(plan, store, lambda e: None, threading.Event())
    layer = next(x for x in layers if x.name == "model.layers.0.mlp.experts")
    arrays, metadata = mx.load(str(store.blob_path(layer.digest)), format="safetensors",
                               return_metadata=True)
    qtype = QuantType.from_metadata(metadata)
    assert qtype is not None and qtype.name == "int8"
    for proj in SHAPES:
        key = f"model.layers.0.mlp.experts.{proj}.weight"
        stacked = np.stack([source[f"model.layers.0.mlp.experts.{i}.{proj}.weight"]
                            for i in range(2)]).astype(np.float32)
        restored = dequantize(arrays[key], arrays[f"{key}.scale"], arrays[f"{key}.bias"], qtype)
        error = np.abs(np.array(restored.astype(mx.float32)) - stacked).max()
        assert error < 0.02 * np.abs(stacked).max()


def test_experts_split_per_projection_when_int4_promotes_down_proj(tmp_path):
    ckpt, _ = _moe_checkpoint(tmp_path / "ckpt")
    plan = plan_model(take_inventory(ckpt), parse_quant_type("int4"))
    quant = {b.name: b.tensors[0].quant.name for b in plan.blobs if b.tensors[0].quant}
    assert quant == {"model.layers.0.mlp.experts.down_proj.weight": "int8",
                     "model.layers.0.mlp.experts.gate_proj.weight": "int4",
                     "model.layers.0.mlp.experts.up_proj.weight": "int4"}


def test_unquantized_experts_are_stacked_byte_for_byte(tmp_path):
    ckpt, source = _moe_checkpoint(tmp_path / "ckpt")
    store = Store(tmp_path / "models")
    layers = write_plan(plan_model(take_inventory(ckpt), None), store, lambda e: None,
                        threading.Event())
    layer = next(x for x in layers if x.name == "model.layers.0.mlp.experts")
    arrays = mx.load(str(store.blob_path(layer.digest)), format="safetensors")
    key = "model.layers.0.mlp.experts.up_proj.weight"
    expected = np.stack([source[f"model.layers.0.mlp.experts.{i}.up_proj.weight"]
                         for i in range(2)])
    assert np.array_equal(np.array(arrays[key]), expected)
