"""Nemotron-H's multi-token-prediction head (checkpoint tensors `mtp.*`, config
`num_nextn_predict_layers: 1` and `mtp_hybrid_override_pattern`, e.g. "*E": attention then a
mixture of experts), used as the model's inline draft (runner/mtp_draft.py).

One step of the head pairs the target's final hidden state at position t (after `norm_f`, as the
target's lm_head sees it) with the embedding of token t+1 and predicts token t+2:
    h = eh_proj(concat(enorm(embed(x[t+1])), hnorm(hidden[t])))
    h = layers(h)            (pre-norm residual blocks; attention keeps its own KV cache)
    out = final_layernorm(h) ; logits = lm_head(out)
The target's embeddings and lm_head are shared (passed in, never copied). Drafting further than
one token feeds the head's own `out` back as the next step's hidden, as mlx-vlm 0.7.10 does
(speculative/drafters/nemotron_h_mtp). The MoE is Nemotron-H's: sigmoid router scores plus a
correction bias pick the experts (grouped top-k), the unbiased scores weigh them, squared-ReLU
experts, optional shared experts and latent projections.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from runner.kv_cache import KVCache
from runner.models import nemotron_h as text
from runner.nn.linear import Linear
from runner.nn.norm import RMSNorm
from runner.nn.switch_linear import SwitchLinear

PREFIX = "mtp."


@dataclass
class MTPArgs:
    hidden_size: int
    pattern: str
    eps: float
    n_routed_experts: int = 0
    num_experts_per_tok: int = 1
    moe_intermediate_size: int = 0
    moe_shared_expert_intermediate_size: int | None = None
    n_shared_experts: int | None = None
    moe_latent_size: int | None = None
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    mlp_bias: bool = False


_BLOCK_CHARS = {"attention": "*", "moe": "E", "mlp": "-"}


def mtp_pattern(config: dict[str, Any]) -> str | None:
    """The head's layer kinds ("*", "E", "-"), or None when the config declares no head."""
    if int(config.get("num_nextn_predict_layers") or 0) < 1:
        return None
    pattern = config.get("mtp_hybrid_override_pattern")
    if pattern is None:
        kinds = config.get("mtp_layers_block_type")
        if not isinstance(kinds, list) or any(k not in _BLOCK_CHARS for k in kinds):
            raise ValueError("num_nextn_predict_layers needs mtp_hybrid_override_pattern")
        pattern = [_BLOCK_CHARS[k] for k in kinds]
    pattern = "".join(pattern)
    if not pattern or set(pattern) - set("*E-"):
        raise ValueError(f"mtp_hybrid_override_pattern {pattern!r} may hold only *, E and -")
    if int(config["num_nextn_predict_layers"]) != 1:
        raise ValueError("only num_nextn_predict_layers 1 is supported")
    return pattern


def mtp_args(config: dict[str, Any]) -> MTPArgs | None:
    pattern = mtp_pattern(config)
    if pattern is None:
        return None
    known = MTPArgs.__dataclass_fields__
    rest = {k: v for k, v in config.items()
            if k in known and k not in ("hidden_size", "pattern", "eps") and v is not None}
    args = MTPArgs(int(config["hidden_size"]), pattern,
                   float(config.get("layer_norm_epsilon") or 1e-5), **rest)
    if "E" in pattern and (args.n_routed_experts <= 0 or args.moe_intermediate_size <= 0):
        raise ValueError("an MTP MoE layer needs n_routed_experts and moe_intermediate_size")
    return args


class SquaredReLUMLP(nn.Module):
    def __init__(self, hidden: int, inner: int, bias: bool) -> None:
        super().__init__()
        self.up_proj = Linear(hidden, inner, bias=bias)
        self.down_proj = Linear(inner, hidden, bias=bias)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.relu2(self.up_proj(x)))


class Router(nn.Module):
    """`gate.weight` and `gate.e_score_correction_bias`: which experts, with what weight."""

    def __init__(self, args: MTPArgs) -> None:
        super().__init__()
        self.args = args
        self.weight = mx.zeros((args.n_routed_experts, args.hidden_size))
        self.e_score_correction_bias = mx.zeros((args.n_routed_experts,))

    def __call__(self, x: mx.array) -> tuple[mx.array, mx.array]:
        args = self.args
        scores = mx.sigmoid((x @ self["weight"].T).astype(mx.float32))
        biased = scores + self["e_score_correction_bias"].astype(mx.float32)
        if args.n_group > 1:  # keep the topk_group groups whose two best experts score most
            grouped = mx.unflatten(biased, -1, (args.n_group, -1))
            best = mx.topk(grouped, 2, axis=-1).sum(axis=-1, keepdims=True)
            dropped = mx.argpartition(best, kth=args.n_group - args.topk_group - 1,
                                      axis=-2)[..., :args.n_group - args.topk_group, :]
            grouped = mx.put_along_axis(grouped, dropped, mx.array(0.0), axis=-2)
            biased = mx.flatten(grouped, -2, -1)
        k = args.num_experts_per_tok
        chosen = mx.argpartition(-biased, kth=k - 1, axis=-1)[..., :k]
        weights = mx.take_along_axis(scores, chosen, axis=-1)
        if k > 1 and args.norm_topk_prob:
            weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
        return chosen, weights * args.routed_scaling_factor


class Experts(nn.Module):
    """Stacked `experts.up_proj` / `experts.down_proj` ([experts, out, in], as create stacks
    them): each token through its routed experts only."""

    def __init__(self, dims: int, inner: int, count: int) -> None:
        super().__init__()
        self.up_proj = SwitchLinear(dims, inner, count)
        self.down_proj = SwitchLinear(inner, dims, count)

    def __call__(self, x: mx.array, chosen: mx.array) -> mx.array:
        x = mx.expand_dims(x, (-2, -3))
        return self.down_proj(nn.relu2(self.up_proj(x, chosen)), chosen).squeeze(-2)


class MoE(nn.Module):
    def __init__(self, args: MTPArgs) -> None:
        super().__init__()
        self.args = args
        dims = args.moe_latent_size or args.hidden_size
        self.gate = Router(args)
        self.experts = Experts(dims, args.moe_intermediate_size, args.n_routed_experts)
        if args.n_shared_experts:
            inner = args.moe_shared_expert_intermediate_size or args.moe_intermediate_size
            self.shared_experts = SquaredReLUMLP(args.hidden_size, inner, args.mlp_bias)
        if args.moe_latent_size:
            self.fc1_latent_proj = Linear(args.hidden_size, args.moe_latent_size,
                                          bias=args.mlp_bias)
            self.fc2_latent_proj = Linear(args.moe_latent_size, args.hidden_size,
                                          bias=args.mlp_bias)

    def __call__(self, x: mx.array) -> mx.array:
        chosen, weights = self.gate(x)
        routed = self.fc1_latent_proj(x) if "fc1_latent_proj" in self else x
        y = self.experts(routed, chosen)
        y = (y * weights[..., None].astype(y.dtype)).sum(axis=-2)
        if "fc2_latent_proj" in self:
            y = self.fc2_latent_proj(y)
        if "shared_experts" in self:
            y = y + self.shared_experts(x)
        return y


class Block(nn.Module):
    """One head layer; the first carries enorm/hnorm/eh_proj, the last final_layernorm."""

    def __init__(self, args: MTPArgs, target: text.ModelArgs, kind: str, first: bool,
                 last: bool) -> None:
        super().__init__()
        self.kind = kind
        hidden = args.hidden_size
        if first:
            self.enorm = RMSNorm(hidden, args.eps)
            self.hnorm = RMSNorm(hidden, args.eps)
            self.eh_proj = Linear(2 * hidden, hidden, bias=False)
        self.norm = RMSNorm(hidden, args.eps)
        if kind == "*":
            self.mixer: nn.Module = text.Attention(target)
        elif kind == "E":
            self.mixer = MoE(args)
        else:
            self.mixer = SquaredReLUMLP(hidden, target.intermediate_size, args.mlp_bias)
        if last:
            self.final_layernorm = RMSNorm(hidden, args.eps)

    def __call__(self, x: mx.array, cache: KVCache | None) -> mx.array:
        y = self.norm(x)
        return x + (self.mixer(y, cache) if self.kind == "*" else self.mixer(y))


class MTPHead(nn.Module):
    """The `mtp.` module; `__call__` takes embedded tokens t+1 and target hiddens t."""

    def __init__(self, args: MTPArgs, target: text.ModelArgs) -> None:
        super().__init__()
        last = len(args.pattern) - 1
        self.layers = [Block(args, target, kind, i == 0, i == last)
                       for i, kind in enumerate(args.pattern)]

    def __call__(self, embedded: mx.array, hidden: mx.array,
                 cache: list[KVCache]) -> mx.array:
        """(batch, L, hidden) embeddings of tokens t+1.. and target hiddens at t.. -> the
        head's normed output (what the lm_head scores, and the next step's hidden)."""
        first = self.layers[0]
        h = first.eh_proj(mx.concatenate([first.enorm(embedded), first.hnorm(hidden)], axis=-1))
        caches = iter(cache)
        for layer in self.layers:
            h = layer(h, next(caches) if layer.kind == "*" else None)
        return self.layers[-1].final_layernorm(h)

    def make_cache(self) -> list[KVCache]:
        return [KVCache() for layer in self.layers if layer.kind == "*"]


Embed = Callable[[mx.array], mx.array]
Head = Callable[[mx.array], mx.array]


def tensor_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """The head's tensors as Hugging Face checkpoints name them (per-expert, unstacked);
    empty when the config declares no head."""
    args = mtp_args(config)
    if args is None:
        return {}
    hidden = args.hidden_size
    shapes: dict[str, tuple[int, ...]] = {
        f"{PREFIX}layers.0.enorm.weight": (hidden,), f"{PREFIX}layers.0.hnorm.weight": (hidden,),
        f"{PREFIX}layers.0.eh_proj.weight": (hidden, 2 * hidden),
        f"{PREFIX}layers.{len(args.pattern) - 1}.final_layernorm.weight": (hidden,)}
    for i, kind in enumerate(args.pattern):
        p = f"{PREFIX}layers.{i}"
        shapes[f"{p}.norm.weight"] = (hidden,)
        if kind != "E":
            shapes.update({f"{p}.mixer.{k}": v
                           for k, v in text._mixer_shapes(config, kind).items()})
            continue
        experts, inner = args.n_routed_experts, args.moe_intermediate_size
        dims = args.moe_latent_size or hidden
        shapes[f"{p}.mixer.gate.weight"] = (experts, hidden)
        shapes[f"{p}.mixer.gate.e_score_correction_bias"] = (experts,)
        for e in range(experts):
            shapes[f"{p}.mixer.experts.{e}.up_proj.weight"] = (inner, dims)
            shapes[f"{p}.mixer.experts.{e}.down_proj.weight"] = (dims, inner)
        if args.n_shared_experts:
            shared = args.moe_shared_expert_intermediate_size or inner
            shapes[f"{p}.mixer.shared_experts.up_proj.weight"] = (shared, hidden)
            shapes[f"{p}.mixer.shared_experts.down_proj.weight"] = (hidden, shared)
        if args.moe_latent_size:
            shapes[f"{p}.mixer.fc1_latent_proj.weight"] = (dims, hidden)
            shapes[f"{p}.mixer.fc2_latent_proj.weight"] = (hidden, dims)
    return shapes


def sanitize(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """`mtp.*` tensors as the head's modules name them: per-expert tensors stacked (create
    already stacks them; a checkpoint loaded directly may not), projections column-major."""
    out: dict[str, mx.array] = {}
    experts: dict[str, dict[int, mx.array]] = {}
    for key, value in weights.items():
        parts = key.split(".")
        if ".mixer.experts." in key and parts[-3].isdigit():
            group = ".".join(parts[:-3] + parts[-2:])
            experts.setdefault(group, {})[int(parts[-3])] = value
            continue
        out[key] = text.column_major(value) if key.endswith("proj.weight") else value
    for group, by_index in experts.items():
        out[group] = mx.stack([by_index[i] for i in range(len(by_index))])
    return out
