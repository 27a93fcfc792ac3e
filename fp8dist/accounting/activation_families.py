"""What autograd saves for backward in one decoder layer, per Hugging Face ``model_type`` (:data:`FAMILIES`; others
get no figure). T tokens, hidden h, intermediate i, a query and kv key/value heads of dim d, c/r/n bytes (``Saves``).
Not modelled: eager attention's scores, a router's jitter, ``output_router_logits``, rotary cos/sin, the input ids."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["Saves", "Family", "FAMILIES", "ACTIVATION_SAVES", "dims", "activation_note", "kept_by_selective"]

ACTIVATION_SAVES = {"silu": 1, "swish": 1, "gelu": 1, "gelu_pytorch_tanh": 1, "gelu_new": 4, "gelu_fast": 7,
                    "gelu_python": 3, "gelu_accurate": 4, "quick_gelu": 2, "relu": 0, "relu2": 1, "mish": 1}
"""Tensors of the input's size that transformers' ``ACT2FN[name]`` saves besides its output (which the next GEMM
saves anyway)."""

_INDEX = 8  # bytes of an int64 index
_FP32 = 4


@dataclass(frozen=True)
class Saves:
    """One micro-batch: T tokens; c bytes of the compute dtype; r of the residual stream (c under FSDP/DeepSpeed,
    the model's own dtype under an autocast forward); n of a norm's output (r, or 4 where autocast runs LayerNorm
    in fp32); each module's plan precision; the bytes per element of the quantized input copy an FP8 Linear saves
    instead of the high-precision input (``fp8_input``: TE and MS-AMP 1, NVFP4 0.5625; 0 where it saves the
    high-precision input: torchao's float8 and MXFP8 recipes), whether the FP8 backend swapped the norms for its own
    (TE's keep only input and rsigma), and whether the forward builds a KV cache (``use_cache``, off under
    compile)."""

    T: int
    c: int
    r: int
    n: int
    decisions: Mapping[str, str]
    fp8_input: float
    swapped_norms: bool
    kv_cache: bool

    def inputs(self, names: Sequence[str], elements: int, in_bytes: int) -> int:
        """Bytes the GEMMs ``names`` save of the one tensor they read: once in c when shared, once per GEMM where
        autocast casts it (``in_bytes`` != c), a quantized copy per FP8 GEMM that saves one."""
        present = [m for m in names if m in self.decisions] or list(names)
        fp8 = sum(1 for m in present if self.fp8_input and self.decisions.get(m) == "fp8")
        rest = len(present) - fp8
        high = (self.c if rest else 0) if in_bytes == self.c else rest * self.c
        return round(elements * (high + fp8 * self.fp8_input))

    def fp8_copies(self, names: Sequence[str], elements: int) -> int:
        """Extra bytes of the GEMMs ``names`` reading a tensor of ``elements`` already saved in c: only the quantized
        copy each FP8 one saves is new (0 where none of them is planned FP8)."""
        return round(elements * self.fp8_input * sum(1 for m in names if self.fp8_input and
                                                      self.decisions.get(m) == "fp8"))

    def rms_norm(self, h: int) -> int:
        """Bytes an RMSNorm of width ``h`` saves over the micro-batch's tokens: its fp32 upcast and normalized input
        (only the latter where the backend swaps the norm for its own), and its fp32 rsqrt."""
        # fp32 upcast, the normalized input, the rsqrt
        return (self.r * self.T * h if self.swapped_norms else (_FP32 + self.r) * self.T * h) + _FP32 * self.T

    def layer_norm(self, h: int, *, input_saved: bool = True) -> int:
        """Bytes a LayerNorm of width ``h`` saves over the micro-batch's tokens: its input (unless ``input_saved`` is
        False: the producer saved it already) and its fp32 mean and rstd."""
        # the input, fp32 mean and rstd
        return (self.n * self.T * h if input_saved else 0) + 2 * _FP32 * self.T

    def dropout(self, p: Any, elements: int) -> int:
        """Bytes dropout saves over ``elements``: CUDA's ``native_dropout`` keeps a 1-byte mask when ``p`` > 0 (a
        CPU run saves its noise instead); 0 when ``p`` is 0."""
        return elements if p else 0


def dims(config: Any) -> dict[str, int] | None:
    """h, i, layers, heads, kv heads, head dim and vocabulary from a Hugging Face config (None without one)."""
    try:
        h, layers, heads, vocab = (int(getattr(config, k)) for k in
                                   ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"))
    except (AttributeError, TypeError):
        return None
    kv = getattr(config, "num_key_value_heads", None) or heads
    inter = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * h
    head_dim = getattr(config, "head_dim", None) or h // heads
    return {"h": h, "i": int(inter), "layers": layers, "a": heads, "kv": int(kv), "d": int(head_dim), "V": vocab}


def _names(prefix: str, *names: str) -> list[str]:
    return [prefix + m for m in names]


def _rope_attention(s: Saves, d: dict[str, int], prefix: str) -> int:
    """q/k/v's input, q and k after RoPE and v as handed to SDPA, the output, the fp32 log-sum-exp (4Ta)."""
    T = s.T
    h = d["h"]
    a = d["a"]
    kv = d["kv"]
    hd = d["d"]
    total = s.inputs(_names(prefix, "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), T * h, s.r)
    total += s.c * T * (2 * a * hd + 2 * kv * hd) + _FP32 * T * a
    return total + s.fp8_copies(_names(prefix, "self_attn.o_proj"), T * a * hd)


def _llama_layer(s: Saves, d: dict[str, int], prefix: str, config: Any) -> int:
    T = s.T
    h = d["h"]
    i = d["i"]
    total = 2 * s.rms_norm(h) + _rope_attention(s, d, prefix)
    total += s.inputs(_names(prefix, "mlp.gate_proj", "mlp.up_proj"), T * h, s.r)
    total += 3 * s.c * T * i  # gate, up, silu(gate)
    return total + s.inputs(_names(prefix, "mlp.down_proj"), T * i, s.c)


def _mixtral_layer(s: Saves, d: dict[str, int], prefix: str, config: Any) -> int:
    """Experts through transformers' grouped_mm path, in the weights' dtype (r), for T x top_k token-expert pairs."""
    T = s.T
    h = d["h"]
    i = d["i"]
    experts, top_k = int(config.num_local_experts), int(config.num_experts_per_tok)
    pairs = T * top_k  # token-expert pairs, tokens / expert = pairs / experts on average
    total = 2 * s.rms_norm(h) + _rope_attention(s, d, prefix)
    total += s.inputs(_names(prefix, "mlp.gate"), T * h, s.r)
    total += T * (_FP32 * experts + (_INDEX + _FP32) * top_k + _FP32)  # softmax, top-k ids and weights, their sum
    total += s.r * pairs * (2 * h + 4 * i)  # gathered input, gate_up output, silu(gate), product, expert output
    return total + pairs * (_FP32 + 3 * _INDEX) + 4 * experts  # routing weights, index vectors; int32 offsets


def _activation(config: Any, key: str) -> tuple[int, str | None]:
    name = getattr(config, key, None)
    if name in ACTIVATION_SAVES:
        return ACTIVATION_SAVES[name], None
    return 1, f"{key}={name!r} is not in the activation table: counted as saving its input once"


def _gpt2_layer(s: Saves, d: dict[str, int], prefix: str, config: Any) -> int:
    """Fused c_attn: q a view of its output (kept whole), k and v the KV cache's copies (views without a cache)."""
    T = s.T
    h = d["h"]
    i = d["i"]
    a = d["a"]
    total = s.layer_norm(h) + s.inputs(_names(prefix, "attn.c_attn"), T * h, s.n)
    total += s.c * T * h * (3 + (2 if s.kv_cache else 0) + 1) + _FP32 * T * a  # q's storage, k, v, output
    total += s.fp8_copies(_names(prefix, "attn.c_proj"), T * h)
    total += s.layer_norm(h) + s.inputs(_names(prefix, "mlp.c_fc"), T * h, s.n)
    total += _activation(config, "activation_function")[0] * s.c * T * i
    total += s.inputs(_names(prefix, "mlp.c_proj"), T * i, s.c)
    return total + 2 * s.dropout(config.resid_pdrop, T * h)  # after the attention and after the MLP


def _gpt_neox_layer(s: Saves, d: dict[str, int], prefix: str, config: Any) -> int:
    """Fused query_key_value, partial RoPE (q, k from its concatenation), v the cache's copy (else a view of the
    fused output), dense's contiguous copy of the output; the parallel residual's norms share one saved input."""
    T = s.T
    h = d["h"]
    i = d["i"]
    a = d["a"]
    shared = config.use_parallel_residual and s.n == s.r  # both norms read the layer's input, saved once
    total = s.layer_norm(h) + s.layer_norm(h, input_saved=not shared)
    total += s.inputs(_names(prefix, "attention.query_key_value"), T * h, s.n)
    total += s.c * T * h * (2 + (1 if s.kv_cache else 3) + 1) + _FP32 * T * a  # q, k, v's storage, output
    total += s.inputs(_names(prefix, "attention.dense"), T * h, s.c)  # a contiguous copy of the output
    total += s.inputs(_names(prefix, "mlp.dense_h_to_4h"), T * h, s.n)
    total += _activation(config, "hidden_act")[0] * s.c * T * i
    total += s.inputs(_names(prefix, "mlp.dense_4h_to_h"), T * i, s.c)
    return total + 2 * s.dropout(config.hidden_dropout, T * h)


@dataclass(frozen=True)
class Family:
    """How one model family saves activations."""

    layer: Callable[[Saves, dict[str, int], str, Any], int]
    """Bytes of one decoder layer: ``(saves, dims, "model.layers.3.", hf_config)``."""
    final_norm: Literal["rms", "layer"]
    cast_types: tuple[str, ...]
    """Module types whose weights autocast casts to the compute dtype (a copy each until backward)."""
    embeddings: Callable[[Saves, dict[str, int], Any], int] | None = None
    """Bytes saved around the embeddings (GPT-2's embedding dropout)."""
    activation_key: str | None = None
    """The config key naming the MLP activation, when the family reads it from ACTIVATION_SAVES."""
    gemms: Callable[[dict[str, int], Any], list[int]] | None = None
    """Output width (elements per token) of each GEMM a decoder layer runs, in forward order (what selective
    checkpointing counts, fp8dist.pipeline.blocks.SELECTIVE_GEMMS); None: selective is not modelled."""
    gemm_names: tuple[str, ...] = ()
    """The module running each GEMM of ``gemms``, relative to its decoder layer (the plan says its recipe)."""


def _llama_gemms(d: dict[str, int], config: Any) -> list[int]:
    return [d["a"] * d["d"], d["kv"] * d["d"], d["kv"] * d["d"], d["h"], d["i"], d["i"], d["h"]]  # q k v o gate up down


def _fused_qkv_gemms(d: dict[str, int], config: Any) -> list[int]:
    return [3 * d["h"], d["h"], d["i"], d["h"]]  # fused q/k/v, attention out, MLP in, MLP out


FAMILIES: dict[str, Family] = {
    "llama": Family(_llama_layer, "rms", ("Linear",), gemms=_llama_gemms,
                    gemm_names=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                                "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")),
    "mixtral": Family(_mixtral_layer, "rms", ("Linear", "MixtralTopKRouter")),
    "gpt2": Family(_gpt2_layer, "layer", ("Linear", "Conv1D"), activation_key="activation_function",
                   embeddings=lambda s, d, config: s.dropout(config.embd_pdrop, s.T * d["h"]), gemms=_fused_qkv_gemms,
                   gemm_names=("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")),
    "gpt_neox": Family(_gpt_neox_layer, "layer", ("Linear",), activation_key="hidden_act", gemms=_fused_qkv_gemms,
                       gemm_names=("attention.query_key_value", "attention.dense", "mlp.dense_h_to_4h",
                                   "mlp.dense_4h_to_h")),
}
"""Each checked against the tensors autograd saves on a small real model (tests/test_estimate.py)."""


def activation_note(family: Family, config: Any) -> str | None:
    """The note to show when the MLP activation ``config`` (the model's Hugging Face config) names is not in the
    activation table (counted as saving its input once); None when it is, or the family has no such key."""
    return _activation(config, family.activation_key)[1] if family.activation_key else None


def kept_by_selective(family: Family, s: Saves, d: dict[str, int], config: Any, counted: Sequence[bool]) -> int:
    """Bytes one decoder layer keeps under selective checkpointing besides its input: the fused attention's output
    (c) and fp32 log-sum-exp, and the 1st, 3rd, 5th... output of the GEMMs the policy counts (c, the GEMM's output
    dtype under autocast and FP8 alike); ``counted``: per GEMM of ``family.gemms``, whether the policy counts its op
    (a GEMM it does not count is recomputed). Every other tensor, FP8 copies included, is recomputed in backward.
    Call only where ``family.gemms`` is set."""
    kept, seen = 0, 0
    for width, counts in zip(family.gemms(d, config), counted, strict=True):
        seen += counts
        kept += width if counts and seen % 2 else 0
    return s.T * (s.c * d["a"] * d["d"] + _FP32 * d["a"] + s.c * kept)
