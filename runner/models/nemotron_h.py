"""Nemotron-H (model_type "nemotron_h"; NemotronHForCausalLM): a hybrid stack whose
`hybrid_override_pattern` names each layer: `M` a Mamba2 mixer, `*` attention (no RoPE: the
Mamba layers carry position), `-` an MLP with squared ReLU. Every layer is pre-norm with a
residual. Caches exist for `M` (runner.kv_cache.RecurrentCache) and `*` (KVCache) layers only,
in layer order. Self-contained, as in mlx-lm; the Mamba2 mixer is runner.nn.ssm's.

A checkpoint whose config declares `num_nextn_predict_layers` and that carries `mtp.*` tensors
gets its multi-token-prediction head as `mtp` (_nemotron_h_mtp.py), the model's inline draft;
`forward_hidden` gives the final hidden states the head pairs with the next tokens.
"""

from __future__ import annotations

import dataclasses
import inspect
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from runner.kv_cache import KVCache, RecurrentCache
from runner.nn.conv import CausalConv1d
from runner.nn.embedding import Embedding, QuantizedEmbedding
from runner.nn.linear import Linear, QuantizedLinear
from runner.nn.norm import RMSNorm
from runner.nn.ssm import GatedRMSNorm, Mamba2Mixer

ARCHITECTURES = ("NemotronHForCausalLM",)
BLOCK_CHARS = {"mamba": "M", "attention": "*", "mlp": "-", "linear_attention": "M",
               "full_attention": "*"}


def layer_pattern(config: dict[str, Any]) -> str:
    """The layer kinds as one string of M, * and -, from either spelling config.json uses."""
    pattern = config.get("hybrid_override_pattern")
    if pattern is None:
        kinds = config.get("layers_block_type") or config.get("layer_types")
        if not isinstance(kinds, list) or any(k not in BLOCK_CHARS for k in kinds):
            raise ValueError("hybrid_override_pattern (or layers_block_type of mamba, "
                             "attention, mlp) is required")
        pattern = [BLOCK_CHARS[k] for k in kinds]
    text = "".join(pattern)
    if not text or set(text) - set("M*-"):
        raise ValueError(f"hybrid_override_pattern {text!r} may hold only M, * and - "
                         "(mixture-of-experts layers are not supported)")
    return text


@dataclass
class ModelArgs:
    model_type: str
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    mamba_num_heads: int
    mamba_head_dim: int
    ssm_state_size: int
    hybrid_override_pattern: Any = None
    layers_block_type: list[str] | None = None
    conv_kernel: int = 4
    n_groups: int = 1
    head_dim: int | None = None
    attention_head_dim: int | None = None  # older configs' name for head_dim
    layer_norm_epsilon: float = 1e-5
    attention_bias: bool = False
    mlp_bias: bool = False
    mamba_proj_bias: bool | None = None  # older configs: use_bias
    use_bias: bool = False
    use_conv_bias: bool = True
    time_step_limit: tuple[float, float] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    mtp_config: dict[str, Any] | None = None  # config.json, when it declares an MTP head

    @classmethod
    def from_dict(cls, params: dict[str, Any]) -> ModelArgs:
        """Build from config.json, ignoring the keys this architecture does not use."""
        known = inspect.signature(cls).parameters
        args = cls(**{k: v for k, v in params.items() if k in known and k != "mtp_config"})
        if int(params.get("num_nextn_predict_layers") or 0) > 0:
            args.mtp_config = dict(params)
        return args

    def __post_init__(self) -> None:
        self.hybrid_override_pattern = layer_pattern(
            {"hybrid_override_pattern": self.hybrid_override_pattern,
             "layers_block_type": self.layers_block_type})
        if self.head_dim is None:
            self.head_dim = (self.attention_head_dim
                             or self.hidden_size // self.num_attention_heads)
        if self.mamba_proj_bias is None:
            self.mamba_proj_bias = self.use_bias
        limit = self.time_step_limit or (0.0, float("inf"))
        self.time_step_limit = (float(limit[0]), float(limit[1]))


class Attention(nn.Module):
    """GQA attention without positional encoding."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        assert args.head_dim is not None
        self.heads, self.kv_heads, self.head_dim = (args.num_attention_heads,
                                                    args.num_key_value_heads, args.head_dim)
        self.scale = args.head_dim ** -0.5
        bias, hidden = args.attention_bias, args.hidden_size
        self.q_proj = Linear(hidden, self.heads * self.head_dim, bias=bias)
        self.k_proj = Linear(hidden, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = Linear(hidden, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = Linear(self.heads * self.head_dim, hidden, bias=bias)

    def __call__(self, x: mx.array, cache: KVCache | None) -> mx.array:
        batch, length, _ = x.shape
        q, k, v = (proj(x).reshape(batch, length, heads, -1).transpose(0, 2, 1, 3)
                   for proj, heads in ((self.q_proj, self.heads), (self.k_proj, self.kv_heads),
                                       (self.v_proj, self.kv_heads)))
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        mask = "causal" if length > 1 else None
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(batch, length, -1))

    def step(self, x: mx.array, keys: mx.array, values: mx.array, offset: mx.array
             ) -> tuple[mx.array, mx.array, mx.array]:
        """One token against a KV buffer whose first `offset` slots hold the history (the rest
        is masked): (output, the new key, the new value), the caller writing the two into the
        buffer afterwards. Shapes depend only on the buffer's capacity, not on the offset, so a
        traced graph serves every token until the buffer grows."""
        batch = x.shape[0]
        rep = self.heads // self.kv_heads
        q = self.q_proj(x).reshape(batch, self.kv_heads, rep, self.head_dim) * self.scale
        k = self.k_proj(x).reshape(batch, self.kv_heads, 1, self.head_dim)
        v = self.v_proj(x).reshape(batch, self.kv_heads, 1, self.head_dim)
        held = mx.arange(keys.shape[2]) < offset
        past = mx.where(held, q @ keys.astype(q.dtype).swapaxes(-1, -2), -mx.inf)
        scores = mx.softmax(mx.concatenate([past, q @ k.swapaxes(-1, -2)], axis=-1), axis=-1,
                            precise=True)
        out = scores[..., :-1] @ values.astype(q.dtype) + scores[..., -1:] @ v
        return self.o_proj(out.reshape(batch, 1, -1)), k.astype(keys.dtype), v.astype(
            values.dtype)


class MLP(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.up_proj = Linear(args.hidden_size, args.intermediate_size, bias=args.mlp_bias)
        self.down_proj = Linear(args.intermediate_size, args.hidden_size, bias=args.mlp_bias)

    def __call__(self, x: mx.array, cache: None = None) -> mx.array:
        return self.down_proj(nn.relu2(self.up_proj(x)))


def _mixer(args: ModelArgs, kind: str) -> nn.Module:
    if kind == "M":
        assert args.time_step_limit is not None
        return Mamba2Mixer(args.hidden_size, args.mamba_num_heads, args.mamba_head_dim,
                           args.n_groups, args.ssm_state_size, args.conv_kernel,
                           args.layer_norm_epsilon, args.time_step_limit,
                           bool(args.mamba_proj_bias), args.use_conv_bias)
    return Attention(args) if kind == "*" else MLP(args)


class Block(nn.Module):
    def __init__(self, args: ModelArgs, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.norm = RMSNorm(args.hidden_size, args.layer_norm_epsilon)
        self.mixer = _mixer(args, kind)

    def __call__(self, x: mx.array, cache: Any) -> mx.array:
        return x + self.mixer(self.norm(x), cache)


class Backbone(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.embeddings = Embedding(args.vocab_size, args.hidden_size)
        self.layers = [Block(args, kind) for kind in args.hybrid_override_pattern]
        self.norm_f = RMSNorm(args.hidden_size, args.layer_norm_epsilon)

    def __call__(self, inputs: mx.array, cache: list[Any] | None) -> mx.array:
        h = self.embeddings(inputs)
        caches = iter(cache) if cache is not None else None
        for layer in self.layers:
            own = next(caches) if caches is not None and layer.kind != "-" else None
            h = layer(h, own)
        return self.norm_f(h)


class Model(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.backbone = Backbone(args)
        if not args.tie_word_embeddings:
            self.lm_head = Linear(args.hidden_size, args.vocab_size)
        if args.mtp_config is not None:
            from runner.models import _nemotron_h_mtp as mtp  # it builds on this file

            head_args = mtp.mtp_args(args.mtp_config)
            if head_args is not None:
                self.mtp = mtp.MTPHead(head_args, args)
        self._compiled_decode: Callable[..., tuple[mx.array, mx.array, list[mx.array]]] | None = (
            None)
        self._traceable: bool | None = None
        self.graph_tokens = 0  # tokens decoded through the whole-model graph (tests, profiling)

    def __call__(self, inputs: mx.array, cache: list[Any] | None = None) -> mx.array:
        return self.forward_hidden(inputs, cache)[0]

    def forward_hidden(self, inputs: mx.array, cache: list[Any] | None = None
                       ) -> tuple[mx.array, mx.array]:
        """(logits, final hidden states after norm_f): what the MTP head pairs with the next
        tokens."""
        if inputs.shape[1] == 1 and cache is not None and self._decodable(cache):
            return self._decode(inputs, cache)
        h = self.backbone(inputs, cache)
        return self._logits(h), h

    def fit_weights(self, weights: dict[str, mx.array], prefix: str = "") -> None:
        """Drop the MTP head when the checkpoint does not carry it (the config may declare one
        that a conversion left out): the model then loads and runs without a draft."""
        if "mtp" in self and not any(k.startswith(prefix + "mtp.") for k in weights):
            del self["mtp"]

    def draft_embed(self, ids: mx.array) -> mx.array:
        """Token embeddings as the MTP head takes them."""
        return self.backbone.embeddings(ids)

    def draft_head(self) -> nn.Module | None:
        """The inline MTP head, when loaded."""
        return self.get("mtp")

    def _logits(self, h: mx.array) -> mx.array:
        if "lm_head" in self:
            return self.lm_head(h)
        return self.backbone.embeddings.as_linear(h)

    def _decodable(self, cache: list[Any]) -> bool:
        """Whether a token can take the whole-model decode graph: every layer's cache has a
        history (the first token builds them op by op), of the kinds make_cache makes, and
        every module is one of MLX's own ops (`traceable`; the fused int4 kernel and the mapped
        embedding compute on the host, which a compiled graph cannot call)."""
        if self._traceable is None:
            self._traceable = traceable(self)
            self._compiled_decode = _compiled(self) if self._traceable else None
        if not self._traceable:
            return False
        return all((c.keys is not None) if type(c) is KVCache
                   else type(c) is RecurrentCache and c.ssm is not None for c in cache)

    def _decode(self, inputs: mx.array, cache: list[Any]) -> tuple[mx.array, mx.array]:
        """One token through the whole model as one compiled graph, the caches' arrays passed
        in and the new ones out: per token a few dozen kernels (matmuls, fused elementwise
        runs, reductions) instead of ~250 separate dispatches and their Python. The KV buffers
        are read whole (shape changes only when they grow, 256 positions at a time, so the
        graph is traced again that rarely) and the new positions written in place after."""
        states: list[mx.array] = []
        for c in cache:
            if type(c) is KVCache:
                c.reserve(1)
                assert c.keys is not None and c.values is not None
                states += [c.keys, c.values, mx.array(c.offset, mx.int32)]
            else:
                states += [c.conv, c.ssm]
        assert self._compiled_decode is not None
        logits, hidden, new = self._compiled_decode(self.backbone.embeddings(inputs), states)
        self.graph_tokens += 1
        pairs = iter(zip(new[::2], new[1::2], strict=True))
        for c in cache:
            first, second = next(pairs)
            if type(c) is KVCache:
                c.append(first, second)
            else:
                c.update(first, second, 1)
        return logits, hidden

    def _decode_graph(self, h: mx.array, states: list[mx.array]
                      ) -> tuple[mx.array, mx.array, list[mx.array]]:
        """The traced body of `_decode`: (logits, final hidden, per cached layer its two new
        arrays)."""
        new: list[mx.array] = []
        given = iter(states)
        for layer in self.layers:
            x = layer.norm(h)
            if layer.kind == "M":
                y, conv, ssm = layer.mixer.step(x, next(given), next(given))
                new += [conv, ssm]
            elif layer.kind == "*":
                y, k, v = layer.mixer.step(x, next(given), next(given), next(given))
                new += [k, v]
            else:
                y = layer.mixer(x)
            h = h + y
        h = self.backbone.norm_f(h)
        return self._logits(h), h, new

    @property
    def layers(self) -> list[Block]:
        return self.backbone.layers

    def make_cache(self) -> list[KVCache | RecurrentCache]:
        return [RecurrentCache() if layer.kind == "M" else KVCache()
                for layer in self.layers if layer.kind != "-"]


def _compiled(model: Model) -> Callable[..., tuple[mx.array, mx.array, list[mx.array]]]:
    """`model`'s decode graph compiled; the function holds the model weakly, so the model (and
    the weights the compiled graph keeps) go as soon as nothing else refers to it."""
    ref = weakref.ref(model)

    def graph(h: mx.array, states: list[mx.array]
              ) -> tuple[mx.array, mx.array, list[mx.array]]:
        owner = ref()
        assert owner is not None
        return owner._decode_graph(h, states)

    return mx.compile(graph)


def traceable(model: nn.Module) -> bool:
    """Whether every module of `model` is one this file knows to be built of MLX ops only (the
    MTP head is not part of the decode graph)."""
    known = (Model, Backbone, Block, Attention, MLP, Mamba2Mixer, CausalConv1d, GatedRMSNorm,
             RMSNorm, Linear, QuantizedLinear, Embedding, QuantizedEmbedding)
    return all(type(module) in known for name, module in model.named_modules()
               if name != "mtp" and not name.startswith("mtp."))


def sanitize(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """Checkpoints store conv1d as [channels, 1, kernel]; the layer wants [channels, kernel, 1].
    The multi-token-prediction head (`mtp.`) goes through its own file's sanitize. Float32
    projection matrices are laid out column-major (see `column_major`)."""
    from runner.models import _nemotron_h_mtp as mtp

    out = mtp.sanitize({k: v for k, v in weights.items() if k.startswith("mtp.")})
    for key, value in weights.items():
        if key.startswith("mtp."):
            continue
        if key.endswith("conv1d.weight") and value.shape[-1] != 1:
            value = value.moveaxis(2, 1)
        elif key.endswith("proj.weight") or key == "lm_head.weight":
            value = column_major(value)
        out[key] = value
    return out


def column_major(weight: mx.array) -> mx.array:
    """A float32 [out, in] matrix with the same shape and values, stored transposed: `x @ W.T`
    then reads W.T as a row-major [in, out] operand, which BLAS multiplies without first
    packing a transposed copy. Decode (a vector times every matrix, once per token) spends
    most of its time there: ~25% less CPU per token for the matrix-vector products (measured
    on this architecture's bench fixture). Other dtypes go to MLX's own kernels: unchanged."""
    if weight.dtype != mx.float32 or weight.ndim != 2:
        return weight
    return mx.contiguous(weight.T).T


def _positive(config: dict[str, Any], key: str, default: int | None = None) -> int:
    value = config.get(key)
    value = default if value is None else value
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{key} must be a positive integer, got {value!r}")
    return value


def tensor_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Every tensor the checkpoint must hold, in its stored (Hugging Face) layout."""
    return expected_shapes(dataclasses.asdict(args))


def optional_tensor_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """The MTP head's tensors, when the config declares one: a checkpoint may leave the head
    out (it then loads without a draft), but one that carries any of it must carry all of it,
    each in its shape."""
    from runner.models import _nemotron_h_mtp as mtp  # it builds on this file

    return mtp.tensor_shapes(args.mtp_config) if args.mtp_config is not None else {}


def expected_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """The layout from config.json's own keys (older configs' spellings included)."""
    hidden, vocab = _positive(config, "hidden_size"), _positive(config, "vocab_size")
    shapes: dict[str, tuple[int, ...]] = {"backbone.embeddings.weight": (vocab, hidden),
                                          "backbone.norm_f.weight": (hidden,),
                                          "lm_head.weight": (vocab, hidden)}
    for i, kind in enumerate(layer_pattern(config)):
        p = f"backbone.layers.{i}"
        shapes[f"{p}.norm.weight"] = (hidden,)
        shapes.update({f"{p}.mixer.{k}": v for k, v in _mixer_shapes(config, kind).items()})
    return shapes


def _mixer_shapes(config: dict[str, Any], kind: str) -> dict[str, tuple[int, ...]]:
    """A mixer's weights and, where the config turns them on, their biases."""
    shapes = _mixer_weights(config, kind)
    key = {"-": "mlp_bias", "*": "attention_bias"}.get(kind)
    on = bool(config.get(key)) if key else bool(config.get("mamba_proj_bias",
                                                             config.get("use_bias")))
    if on:
        projections = [k for k in shapes if k.endswith("proj.weight")]
        shapes |= {k.replace(".weight", ".bias"): shapes[k][:1] for k in projections}
    return shapes


def _mixer_weights(config: dict[str, Any], kind: str) -> dict[str, tuple[int, ...]]:
    hidden = _positive(config, "hidden_size")
    if kind == "-":
        inter = _positive(config, "intermediate_size")
        return {"up_proj.weight": (inter, hidden), "down_proj.weight": (hidden, inter)}
    if kind == "*":
        heads = _positive(config, "num_attention_heads")
        kv = _positive(config, "num_key_value_heads", heads)
        dim = _positive(config, "head_dim",
                        config.get("attention_head_dim") or hidden // heads)
        return {"q_proj.weight": (heads * dim, hidden), "k_proj.weight": (kv * dim, hidden),
                "v_proj.weight": (kv * dim, hidden), "o_proj.weight": (hidden, heads * dim)}
    heads, dim = _positive(config, "mamba_num_heads"), _positive(config, "mamba_head_dim")
    groups, state = _positive(config, "n_groups", 1), _positive(config, "ssm_state_size")
    inner, kernel = heads * dim, _positive(config, "conv_kernel", 4)
    conv = inner + 2 * groups * state
    bias = {"conv1d.bias": (conv,)} if config.get("use_conv_bias", True) else {}
    return bias | {"in_proj.weight": (inner + conv + heads, hidden),
                   "conv1d.weight": (conv, 1, kernel), "A_log": (heads,), "D": (heads,),
                   "dt_bias": (heads,), "norm.weight": (inner,),
                   "out_proj.weight": (hidden, inner)}
