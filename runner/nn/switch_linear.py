"""Stacked expert projections for mixture-of-experts layers, dense or quantized.

One `[experts, out, in]` weight per projection (what create writes when it stacks per-expert
tensors, and what GGUF files store as `ffn_*_exps`); each token is multiplied by its routed
experts only, with `mx.gather_mm` / `mx.gather_qmm`, so there is no Python loop over tokens or
experts. `SwitchGLU` sorts the (token, expert) pairs by expert when there are many, so each
expert's weights are read once per batch, as mlx-lm's switch_layers does.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from runner.nn.quantized import matmul_parts
from runner.quant import QuantType

SORT_THRESHOLD = 64  # (token, expert) pairs from which sorting by expert pays off


class SwitchLinear(nn.Module):
    def __init__(self, input_dims: int, output_dims: int, num_experts: int) -> None:
        super().__init__()
        self.weight = mx.zeros((num_experts, output_dims, input_dims))

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        weight = self["weight"]
        if weight.dtype != mx.float32 and mx.default_device().type == mx.DeviceType.cpu:
            return _half_gather_mm_on_cpu(x, weight, indices, sorted_indices)
        return mx.gather_mm(x, weight.swapaxes(-1, -2), rhs_indices=indices,
                            sorted_indices=sorted_indices)

    def to_quantized(self, qtype: QuantType) -> QuantizedSwitchLinear:
        experts, out_dims, in_dims = self["weight"].shape
        return QuantizedSwitchLinear(in_dims, out_dims, experts, qtype)


class QuantizedSwitchLinear(nn.Module):
    def __init__(self, input_dims: int, output_dims: int, num_experts: int,
                 qtype: QuantType) -> None:
        super().__init__()
        self.group_size, self.bits, self.mode = qtype.group_size, qtype.bits, qtype.mode
        self.zero_point = qtype.zero_point  # symmetric: biases derived (runner/nn/quantized.py)
        packed = input_dims * qtype.bits // 32
        self.weight = mx.zeros((num_experts, output_dims, packed), dtype=mx.uint32)
        self.scales = mx.zeros((num_experts, output_dims, input_dims // qtype.group_size))
        if qtype.stored_bias:
            self.biases = mx.zeros((num_experts, output_dims, input_dims // qtype.group_size))

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        scales, biases = matmul_parts(self, x)
        return mx.gather_qmm(x, self["weight"], scales, biases,
                             rhs_indices=indices, transpose=True, group_size=self.group_size,
                             bits=self.bits, mode=self.mode, sorted_indices=sorted_indices)


class SwitchGLU(nn.Module):
    """down(silu(gate(x)) * up(x)) through each token's routed experts: [..., k, dims] out."""

    def __init__(self, input_dims: int, hidden_dims: int, num_experts: int) -> None:
        super().__init__()
        self.gate_proj = SwitchLinear(input_dims, hidden_dims, num_experts)
        self.up_proj = SwitchLinear(input_dims, hidden_dims, num_experts)
        self.down_proj = SwitchLinear(hidden_dims, input_dims, num_experts)

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        x = mx.expand_dims(x, (-2, -3))
        do_sort = indices.size >= SORT_THRESHOLD
        idx, inverse = indices, None
        if do_sort:
            x, idx, inverse = _sort_by_expert(x, indices)
        h = nn.silu(self.gate_proj(x, idx, do_sort)) * self.up_proj(x, idx, do_sort)
        out = self.down_proj(h, idx, do_sort)
        if inverse is not None:
            out = mx.unflatten(out[inverse], 0, indices.shape)
        return out.squeeze(-2)


def _half_gather_mm_on_cpu(x: mx.array, weight: mx.array, indices: mx.array,
                           sorted_indices: bool) -> mx.array:
    """MLX's CPU gather_mm takes float32 only, and a half-precision model too big for float32
    runs natively. Fewer (token, expert) pairs than experts (decode): take just those experts'
    weights, in float32; more (prefill): the layer's experts in float32 for this call, a
    transient twice their stored size. Both are lazy ops of static shape, so compiled graphs
    keep working."""
    if indices.size < weight.shape[0]:
        chosen = mx.take(weight, indices, axis=0).astype(mx.float32)  # [..., k, out, in]
        out = x.astype(mx.float32) @ chosen.swapaxes(-1, -2)
    else:
        out = mx.gather_mm(x.astype(mx.float32), weight.astype(mx.float32).swapaxes(-1, -2),
                           rhs_indices=indices, sorted_indices=sorted_indices)
    return out.astype(x.dtype)


def _sort_by_expert(x: mx.array, indices: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    k = indices.shape[-1]
    flat = indices.flatten()
    order = mx.argsort(flat)
    return x.flatten(0, -3)[order // k], flat[order], mx.argsort(order)
