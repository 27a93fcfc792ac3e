"""Activation memory of a Llama-style decoder for one micro-batch (the private half of :mod:`fp8dist.estimate`).

An estimate, not a measurement: the tensors autograd saves for backward in a Hugging Face Llama forward with SDPA
(flash-style: no s x s score matrix), no activation checkpointing, T = micro_batch x seq_len tokens, hidden h,
intermediate i, a query heads, kv key/value heads of head_dim d, vocabulary V; c = bytes of the compute dtype
(param_dtype), r = bytes of the residual stream (c under FSDP/DeepSpeed, which cast the weights; the model's
own dtype under DDP/none, whose autocast casts only GEMM inputs). Per decoder layer:

- each RMSNorm: its fp32 upcast (4Th), the normalized input in r (rTh), the rsqrt (4T); a TE RMSNorm saves only
  its input (rTh) and rsigma (4T)
- q/k/v, gate/up and down projections: their input, saved once in c when the Linears share it, once per
  Linear when autocast casts it (r != c); an FP8 Linear of Transformer Engine or MS-AMP saves its own FP8 copy
  (1 byte per element) instead, torchao saves the high-precision input (as a plain Linear)
- attention: q, k, v after RoPE and the output in c (o_proj reads that same tensor), the log-sum-exp in fp32
  (4Ta)
- MLP: gate and up outputs and silu(gate) in c (3cTi)

Then the final norm, the lm_head input, the logits in c (kept by the model output) and the fp32 log-softmax the
loss saves (4TV). Under autocast (ddp/none) each Linear also keeps its c-cast weight until backward; TE and
MS-AMP keep each FP8 weight (TE: with its transpose). Checked against the tensors autograd saves (a
``saved_tensors_hooks`` count) for the built-in Llamas on CPU: within 1% (bf16 weights as under FSDP) and 0.5%
(fp32 weights under bf16 autocast).
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["activation_items"]

_ROLES = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("self_attn.o_proj",),
          ("mlp.gate_proj", "mlp.up_proj"), ("mlp.down_proj",))
_FP8_WEIGHT_COPY = {"te": 2, "msamp": 1}
_NAMES = {2: "16-bit", 4: "fp32"}  # bytes per converted weight element held from forward to backward


def _dims(config: Any) -> dict[str, int] | None:
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


def _saved_inputs(names: list[str], decisions: dict[str, str], fp8_saves: bool, elements: int, in_bytes: int,
                  c: int) -> int:
    """Bytes the Linears ``names`` save of their common input (``elements`` per copy)."""
    present = [n for n in names if n in decisions] or names
    fp8 = sum(1 for n in present if fp8_saves and decisions.get(n) == "fp8")
    rest = len(present) - fp8
    high = (c if rest else 0) if in_bytes == c else rest * c
    return elements * (high + fp8)


def _norm(T: int, h: int, r: int, te_norm: bool) -> int:
    return (r * T * h if te_norm else (4 + r) * T * h) + 4 * T


def _layer(prefix: str, dims: dict[str, int], T: int, c: int, r: int, decisions: dict[str, str],
           fp8_saves: bool, te_norms: bool) -> int:
    h, i, a, kv, d = dims["h"], dims["i"], dims["a"], dims["kv"], dims["d"]
    names = [[f"{prefix}{n}" for n in role] for role in _ROLES]
    total = 2 * _norm(T, h, r, te_norms)
    total += _saved_inputs(names[0], decisions, fp8_saves, T * h, r, c)
    total += c * T * (2 * a * d + 2 * kv * d) + 4 * T * a  # q, k, v, output; log-sum-exp
    if fp8_saves:  # o_proj shares the attention output it reads; only an FP8 copy is extra
        total += T * a * d * sum(1 for n in names[1] if decisions.get(n) == "fp8")
    total += _saved_inputs(names[2], decisions, fp8_saves, T * h, r, c)
    total += 3 * c * T * i  # gate, up and silu(gate)
    total += _saved_inputs(names[3], decisions, fp8_saves, T * i, c, c)
    return total


def _module_name(model: nn.Module, target: nn.Module | None) -> str | None:
    return next((n for n, m in model.named_modules() if m is target), None) if target is not None else None


def activation_items(model: nn.Module, plan: Any, cfg: Any, blocks: list[str], *, micro_batch_size: int,
                     seq_len: int, stored_bytes: int, c: int) -> tuple[list[tuple[str, int]], list[str]]:
    """``([(item, bytes), ...], notes)`` for one micro-batch on one rank; empty items without a HF config."""
    dims = _dims(getattr(model, "config", None))
    if dims is None:
        return [], ["activations not estimated: the model has no Hugging Face config with hidden_size, "
                    "num_hidden_layers, num_attention_heads and vocab_size"]
    T, backend = micro_batch_size * seq_len, cfg.precision.fp8
    r = stored_bytes if cfg.parallel.strategy in ("ddp", "none") else c
    decisions = {e.name: e.precision for e in plan} if plan is not None else {}
    fp8_saves = backend in _FP8_WEIGHT_COPY
    te_norms = backend == "te" and any(e.converted_to in ("te.RMSNorm", "te.LayerNorm") for e in plan)
    prefixes = [f"{b}." for b in sorted(blocks, key=_natural)] or [""] * dims["layers"]
    layers = sum(_layer(p, dims, T, c, r, decisions, fp8_saves, te_norms) for p in prefixes)
    items = [(f"{len(prefixes)} decoder layers", layers)]
    head = _module_name(model, model.get_output_embeddings()) if hasattr(model, "get_output_embeddings") else None
    items.append(("final norm + lm_head input", _norm(T, dims["h"], r, te_norms)
                  + _saved_inputs([head or "lm_head"], decisions, fp8_saves, T * dims["h"], r, c)))
    items.append(("logits (compute dtype) + fp32 log-softmax", (c + 4) * T * dims["V"]))
    if r != c and plan is not None:
        copies = sum(e.params for e in plan if e.module_type == "Linear" and e.precision != "fp8")
        items.append((f"autocast's copies of the Linear weights ({_NAMES.get(c, c)})", copies * c))
    if fp8_saves and plan is not None:
        copies = sum(e.params for e in plan.fp8) * _FP8_WEIGHT_COPY[backend]
        items.append(("FP8 weight copies kept for backward", copies))
    if cfg.parallel.strategy in ("fsdp", "fsdp1") and not cfg.parallel.reshard_after_forward:
        total = sum(p.numel() for p in model.parameters())
        items.append(("unsharded weights kept (reshard_after_forward=False)", total * c))
    elif cfg.parallel.strategy == "fsdp" and blocks:  # FSDP2's root keeps its gathered weights for backward
        root = sum(p.numel() for n, p in model.named_parameters() if not any(n.startswith(f"{b}.") for b in blocks))
        items.append(("root module's gathered weights, kept for backward", root * c))
    notes = ["activations assume no activation checkpointing and flash-style attention (no seq x seq scores)",
             f"the forward's peak also holds an fp32 copy of the logits ({_mib(4 * T * dims['V'])}) while the "
             "loss is computed"]
    return items, notes


def _natural(name: str) -> list:
    """Sort "model.layers.10" after "model.layers.9"."""
    return [int(part) if part.isdigit() else part for part in name.split(".")]


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"
