"""Which PEFT models ``wrap_model`` plans, and in which order: real PEFT, real torchao, FSDP2/DDP on 2 gloo ranks.

- ``modules_to_save``: PEFT keeps a frozen ``original_module`` beside the trainable copy and runs only the copy while
  the adapter is active. The original is planned as not running (not converted, not in the FP8 share, its reason
  recorded); the head stays in high precision in both copies (first/last rule).
- PEFT types other than LoRA (IA3, AdaLoRA, LoHa, LoKr) are refused at ``wrap_model``, naming the supported ones.
- Adapters added after ``wrap_model`` (``get_peft_model`` on the model it returned) are refused in the first forward,
  before anything trains, naming the order; the normal order never meets the check.
"""

from __future__ import annotations

import copy
import json
import warnings

import pytest
import torch
from dist_harness import run_ranks
from helpers import BATCH, hand_wired_fsdp2, linear_dtypes, one_thread, optimizer_losses  # noqa: F401  (a fixture)
from torch import nn

pytest.importorskip("torchao", reason="torchao is not installed (pip install torchao)")
pytest.importorskip("peft", reason="peft is not installed (pip install peft)")

from fp8dist import get_plan, plan_precision, resolve_config, wrap_model  # noqa: E402
from fp8dist.pipeline.planned_tree import UnplannedParametersError  # noqa: E402
from fp8dist.train.data import Batches  # noqa: E402
from fp8dist.train.models import build_llama  # noqa: E402

TARGETS = ["q_proj", "v_proj"]
HEAD = "base_model.model.lm_head"
SEQ = 32


def _saved_head_llama(dtype: torch.dtype = torch.float32):
    """The tiny Llama with LoRA on q/v and the output head trained whole (``modules_to_save``)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    return get_peft_model(build_llama("tiny", seed=0).to(dtype),
                          LoraConfig(r=8, target_modules=TARGETS, modules_to_save=["lm_head"]))


def _ran(model: nn.Module) -> set[str]:
    """The modules holding parameters that one real forward of ``model`` runs."""
    ran: set[str] = set()
    handles = [m.register_forward_pre_hook(lambda mod, args, name=n: ran.add(name)) for n, m in model.named_modules()
               if any(True for _ in m.parameters(recurse=False))]
    ids = Batches(batch_size=2, seq_len=SEQ, rank=0, world_size=1, seed=0)[0]
    with torch.no_grad():
        model(input_ids=ids)
    for h in handles:
        h.remove()
    return ran


def test_the_fp8_share_counts_only_the_layers_that_run(one_thread):
    model = _saved_head_llama()
    plan = plan_precision(model, resolve_config(strategy="fsdp", fp8="torchao"), device=torch.device("cpu"))
    original, saved = plan.by_name(f"{HEAD}.original_module"), plan.by_name(f"{HEAD}.modules_to_save.default")
    assert (original.runs, original.precision, original.converted_to) == (False, "bf16", None), original
    assert original.reason.startswith(f"PEFT's frozen original of {HEAD} (modules_to_save): adapter 'default' runs "
                                      f"its copy {HEAD}.modules_to_save.default"), original.reason
    assert (saved.runs, saved.precision) == (True, "bf16") and saved.reason.startswith("last Linear, kept"), saved
    as_json = json.loads(json.dumps(original.to_dict()))  # what `fp8dist plan --json` prints per layer
    assert (as_json["runs"], as_json["precision"], as_json["reason"]) == (False, "bf16", original.reason)
    ran = _ran(model)
    assert {e.name for e in plan if e.runs} == ran, "the plan's running modules are those a forward runs"
    gemm = [e for e in plan if e.gemm_flops and e.name in ran]
    c = plan.coverage
    assert (c.gemm_modules, c.gemm_params) == (len(gemm), sum(e.params for e in gemm))
    fp8 = [e for e in gemm if e.precision == "fp8"]
    assert (c.fp8_modules, c.fp8_params) == (len(fp8), sum(e.params for e in fp8)) == (13, 376_832)
    assert plan.counts() == ("FP8 13 layers / 376,832 params (80.8%), fallback 16 layers / 89,728 params, "
                             "not run 1 layer / 32,768 params")


def test_an_inactive_adapter_is_planned_as_not_running():
    from peft import LoraConfig

    model = _saved_head_llama()
    model.add_adapter("other", LoraConfig(r=4, target_modules=TARGETS, modules_to_save=["lm_head"]))
    plan = plan_precision(model, resolve_config(strategy="fsdp", fp8="torchao"), device=torch.device("cpu"))
    idle = {e.name for e in plan if not e.runs}
    assert f"{HEAD}.modules_to_save.other" in idle and f"{HEAD}.original_module" in idle
    assert "base_model.model.model.layers.1.self_attn.q_proj.lora_A.other" in idle
    assert not any(".default" in name for name in idle), idle
    assert {e.name for e in plan if e.runs} == _ran(model)


def _head_case(rank: int, world: int) -> dict:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.float8.float8_linear import Float8Linear

    base = _saved_head_llama()
    ours, opt = wrap_model(copy.deepcopy(base), strategy="fsdp", fp8="torchao",
                           optimizer={"type": "AdamW", "lr": 1e-2})
    # by hand: torchao on the base Linears but the first one and the output head (both copies), FSDP2 per block
    first = "base_model.model.model.layers.0.self_attn.q_proj.base_layer"
    ref = copy.deepcopy(base)
    convert_to_float8_training(ref, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True),
                               module_filter_fn=lambda m, fqn: ".lora_" not in fqn and "lm_head" not in fqn
                               and fqn != first)
    hand_wired_fsdp2(ref, world, layers=ref.base_model.model.model.layers)
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
    head = ours.base_model.model.lm_head
    out = dict(fp8=len(get_plan(ours).fp8),
               float8={n: isinstance(m, Float8Linear) for n, m in (("original", head.original_module),
                                                                   ("copy", head.modules_to_save.default))})
    out["copy"] = linear_dtypes(ours, head.modules_to_save.default, rank, world)
    with ours.disable_adapter():  # the original runs only with the adapters off: in bf16 too
        out["original"] = linear_dtypes(ours, head.original_module, rank, world)
    out["ours"] = optimizer_losses(ours, opt, rank, world, 3, seq_len=SEQ)
    out["ref"] = optimizer_losses(ref, ref_opt, rank, world, 3, seq_len=SEQ)
    return out


def test_both_copies_of_a_saved_head_stay_in_high_precision_and_train_as_by_hand():
    bf16 = dict(input="torch.bfloat16", weight="torch.bfloat16", output="torch.bfloat16")
    for rank, r in enumerate(run_ranks(_head_case)):
        assert r["float8"] == dict(original=False, copy=False), r["float8"]
        assert r["copy"] == bf16 and r["original"] == bf16, (r["copy"], r["original"])
        assert r["fp8"] == 13, "the 15 base Linears but the first and the head; the head's original not converted"
        assert r["ours"] == r["ref"], f"rank {rank}: {r['ours']} != {r['ref']}"
        assert r["ours"][-1] < r["ours"][0]


def _configs() -> dict:
    import peft

    return dict(ia3=peft.IA3Config(target_modules=TARGETS, feedforward_modules=[]),
                adalora=peft.AdaLoraConfig(r=8, target_modules=TARGETS, total_step=10),
                loha=peft.LoHaConfig(r=8, target_modules=TARGETS), lokr=peft.LoKrConfig(r=8, target_modules=TARGETS))


@pytest.mark.parametrize("kind", ["ia3", "adalora", "loha", "lokr"])
def test_other_peft_types_are_refused_naming_the_supported_one(kind):
    from peft import get_peft_model

    model = get_peft_model(build_llama("tiny", seed=0), _configs()[kind])
    with pytest.raises(ValueError, match=rf"wrap_model: PeftModel holds PEFT adapters of peft_type "
                                         rf"'{kind.upper()}' \(adapter 'default'\); wrap_model plans and trains only "
                                         r"peft_type 'LORA' \(LoRA, with DoRA.*Use peft.LoraConfig"):
        wrap_model(model, strategy="none", fp8="torchao")


def test_adapters_injected_into_a_plain_model_are_refused_too():
    from peft import inject_adapter_in_model

    model = inject_adapter_in_model(_configs()["ia3"], build_llama("tiny", seed=0))
    with pytest.raises(ValueError, match=r"LlamaForCausalLM holds PEFT adapters of peft_type 'IA3' \(adapter "
                                         r"'default'\); .* 'LORA'"):
        wrap_model(model, strategy="none", fp8="torchao")


def _order_case(rank: int, world: int) -> dict:
    from peft import LoraConfig, get_peft_model

    out = {}
    ids = Batches(batch_size=BATCH, seq_len=SEQ, rank=rank, world_size=world, seed=0)[0]
    for strategy in ("fsdp", "ddp"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            wrapped = wrap_model(build_llama("tiny", seed=0), strategy=strategy, fp8="torchao")
            late = get_peft_model(wrapped, LoraConfig(r=8, target_modules=TARGETS))  # the wrong order
            try:
                late(input_ids=ids, labels=ids)
                out[f"{strategy} late"] = "trained"
            except UnplannedParametersError as err:
                out[f"{strategy} late"] = str(err)
            torch.manual_seed(0)
            peft_model = get_peft_model(build_llama("tiny", seed=0), LoraConfig(r=8, target_modules=TARGETS))
            model, opt = wrap_model(peft_model, strategy=strategy, fp8="torchao",
                                    optimizer={"type": "AdamW", "lr": 1e-2})
            hooks = len(model._forward_pre_hooks)
            out[f"{strategy} first"] = optimizer_losses(model, opt, rank, world, 2, seq_len=SEQ)
            out[f"{strategy} hooks"] = (hooks, len(model._forward_pre_hooks))
    return out


def test_adapters_added_after_wrap_model_are_refused_in_the_first_forward():
    for r in run_ranks(_order_case):
        for strategy, root, prefix in (("fsdp", "FSDPLlamaForCausalLM", "model."),
                                       ("ddp", "DistributedDataParallel", "module.model.")):
            said = r[f"{strategy} late"]
            assert said.startswith(f"{root} holds 8 parameters added after fp8dist.wrap_model planned and sharded it "
                                   f"('{prefix}layers.0.self_attn.q_proj.lora_A.default.weight'"), said
            assert "apply PEFT first, then wrap_model, e.g. model = wrap_model(get_peft_model(model, lora_config)" \
                in said, said
            losses = r[f"{strategy} first"]
            assert len(losses) == 2 and losses[1] < losses[0], (strategy, losses)
            before, after = r[f"{strategy} hooks"]
            assert after == before - 1, f"{strategy}: the check removes itself after the first forward"
