"""``keep_first_last_linear`` keeps the first and last GEMM the model *runs* (fp8dist.fp8.order): for every family
users name, the order traced on the meta device equals the order a real forward on the CPU calls them."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import fp8dist
from fp8dist.fp8.conv1d import is_conv1d
from fp8dist.fp8.order import gemm_order

pytest.importorskip("torchao", reason="torchao is not installed")

_COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, pad_token_id=0, bos_token_id=0, eos_token_id=0)
FAMILIES = {
    "llama": {}, "phi3": {}, "gemma3_text": {"head_dim": 16}, "gpt_neox": {"num_key_value_heads": None},
    "gpt2": {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 64},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64, "head_dim": 16},
    "deepseek_v3": {"n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                    "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "q_lora_rank": 32, "kv_lora_rank": 16,
                    "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16},
}


def _model(family: str) -> nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {**_COMMON, **FAMILIES[family]}
    if family == "gpt2":
        fields = {k: fields[k] for k in ("vocab_size", "n_embd", "n_layer", "n_head", "n_positions")}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = AutoConfig.for_model(family, **{k: v for k, v in fields.items() if v is not None})
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(config)


def _linear_like(module: nn.Module) -> bool:
    return type(module) is nn.Linear or is_conv1d(module)


def _run_on_cpu(model: nn.Module) -> list[str]:
    """The reference: a real forward (bf16: torch's grouped GEMM of MoE experts takes nothing else), hooks
    recording each GEMM module's calls."""
    calls: list[str] = []
    handles = [m.register_forward_pre_hook(lambda mod, args, name=name: calls.append(name))
               for name, m in model.named_modules() if _linear_like(m)]
    with torch.no_grad():
        model.to(torch.bfloat16)(input_ids=torch.randint(0, 256, (1, 6)))
    for handle in handles:
        handle.remove()
    return calls


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_first_and_last_gemm_are_those_a_real_forward_runs_first_and_last(family):
    model = _model(family)
    order = gemm_order(model, _linear_like)
    assert order.traced, order.why_declared
    calls = _run_on_cpu(model)
    assert (order.first, order.last) == (calls[0], calls[-1])
    assert list(order.names) == list(dict.fromkeys(calls))  # every GEMM module, by its first call


def test_phi3_keeps_qkv_proj_which_runs_first_not_o_proj_which_is_registered_first():
    model = _model("phi3")
    declared = [n for n, m in model.named_modules() if _linear_like(m)]
    assert declared[0] == "model.layers.0.self_attn.o_proj"  # what the plan kept before
    plan = fp8dist.plan_precision(model, fp8dist.resolve_config(strategy="none", fp8="torchao"),
                                  device=torch.device("cpu"))
    first = plan.by_name("model.layers.0.self_attn.qkv_proj")
    assert (first.precision, first.reason) == ("bf16", "first Linear, kept in high precision "
                                                       "(keep_first_last_linear=True)")
    assert plan.by_name("model.layers.0.self_attn.o_proj").precision == "fp8"
    assert plan.by_name("lm_head").reason.startswith("last Linear, kept in high precision")


def test_a_model_that_is_not_a_causal_lm_keeps_its_declared_order_and_says_why():
    order = gemm_order(nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16)), _linear_like)
    assert (order.first, order.last, order.traced) == ("0", "2", False)
    assert "not a Hugging Face causal LM" in order.why_declared
