"""fp8dist.report on live wrapped models (2 real gloo ranks): the dtypes read from the engines match the
configuration, each module lands in the part it computes in (a Mixtral's experts and router, GPT-2's Conv1D are
GEMMs), and the bytes per parameter are exactly what a hand count of the tensors gives. DeepSpeed's report (dtypes
and bytes) is checked in test_estimate.py's ZeRO-1/2/3 spawn, to start DeepSpeed once."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from dist_harness import run_ranks
from helpers import BATCH, SEQ
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel, MixtralConfig, MixtralForCausalLM

import fp8dist
from fp8dist.train.data import Batches
from fp8dist.train.models import build_llama
from fp8dist.accounting import Part
from fp8dist.config.text import byte_size

# (strategy, fp8, extra options) run on the tiny Llama
CASES = [("fsdp", None, {}), ("fsdp", "torchao", {}), ("fsdp", None, {"reduce_dtype": "bf16"}),
         ("fsdp1", None, {}), ("fsdp1", "torchao", {}), ("ddp", None, {}), ("ddp", "torchao", {})]
HIDDEN, LAYERS = 64, 4  # the hand-countable model: LAYERS bias-free Linear(HIDDEN, HIDDEN)
# a tiny Mixtral (fused 3-D expert weights, a router that is no nn.Linear) and a tiny GPT-2 (Conv1D, tied lm_head)
MIXTRAL = MixtralConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)
GPT2 = GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=SEQ, bos_token_id=0, eos_token_id=0)


class Stack(nn.Module):
    """Four square Linears: every parameter count and shard size is easy to compute by hand. One FSDP group
    (no ModuleList): a group of FP8 weights alone would all-gather float8 tensors, which gloo cannot carry."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*(nn.Linear(HIDDEN, HIDDEN, bias=False) for _ in range(LAYERS)))

    def forward(self, x):
        return self.layers(x)


def _one_step(model, optimizer, rank, world):
    ids = Batches(batch_size=BATCH, seq_len=SEQ, rank=rank, world_size=world)[0]
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()


def _rows(rep) -> dict:
    return {r.part: r for r in rep.rows}


def _report_case(rank: int, world: int) -> dict:
    out: dict = {}
    for strategy, fp8, options in CASES:
        model, opt = fp8dist.wrap_model(build_llama("tiny", seed=0), strategy=strategy, fp8=fp8,
                                        optimizer={"type": "AdamW", "lr": 1e-3}, **options)
        _one_step(model, opt, rank, world)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # every planned FP8 module found under its wrapped name
            rep = fp8dist.report(model, opt)
        out[(strategy, fp8, tuple(options.items()))] = dict(
            rows=_rows(rep), bytes_per_param=rep.bytes_per_param, text=str(rep),
            plan_fp8=sum(e.params for e in fp8dist.get_plan(model) if e.precision == "fp8"))
    for strategy, fp8 in (("fsdp", None), ("fsdp", "torchao"), ("ddp", None)):
        torch.manual_seed(0)
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")  # "no blocks found: all parameters are gathered at once", as meant
            model = fp8dist.wrap_model(Stack(), strategy=strategy, fp8=fp8)
        out[("stack notes", strategy, fp8)] = [str(w.message) for w in said if "no blocks found" in str(w.message)]
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model(torch.randn(8, HIDDEN)).sum().backward()
        opt.step()
        rep = fp8dist.report(model, opt)
        out[("stack", strategy, fp8)] = dict(bytes=dict(rep.bytes), total=rep.total_params,
                                             per_param=rep.bytes_per_param, rows=_rows(rep))
    out["ddp fp16 hook reduce"] = _ddp_with_fp16_hook_reduce()
    return {**out, **_mixtral_gpt2_cases(rank, world)}


def _ddp_with_fp16_hook_reduce() -> str:
    """DDP's fp16 compression hook (fp8dist registers it for reduce_dtype="fp16" on CUDA; the bf16 one refuses to
    register without NCCL), registered by hand: the report reads the hook DDP holds. It never runs here."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no blocks found"
        model = fp8dist.wrap_model(Stack(), strategy="ddp")
    model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    return _rows(fp8dist.report(model))[Part.GEMM].reduce


def _mixtral_gpt2_cases(rank: int, world: int) -> dict:
    """One FSDP2 step each: the tiny Mixtral in bf16, with torchao (experts: no FP8 grouped GEMM on CPU) and with
    torchao's emulated MXFP8 experts, the tiny GPT-2 in bf16; each with the estimate for this rank."""
    out: dict = {}
    moe = {"torchao_moe_recipe": "mxfp8_emulated"}
    for name, build, fp8, options in (("mixtral", lambda: MixtralForCausalLM(MIXTRAL), None, {}),
                                      ("mixtral", lambda: MixtralForCausalLM(MIXTRAL), "torchao", {}),
                                      ("mixtral", lambda: MixtralForCausalLM(MIXTRAL), "torchao-moe", moe),
                                      ("gpt2", lambda: GPT2LMHeadModel(GPT2), None, {})):
        torch.manual_seed(0)
        backend = fp8 and fp8.removesuffix("-moe")
        model = fp8dist.wrap_model(build(), strategy="fsdp", fp8=backend, **options)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        _one_step(model, opt, rank, world)
        rep = fp8dist.report(model, opt)
        with torch.device("meta"):
            meta = build()
        estimate = fp8dist.estimate_memory(meta, strategy="fsdp", fp8=backend, world_size=world, rank=rank,
                                           micro_batch_size=BATCH, seq_len=SEQ, **options)
        out[(name, fp8)] = dict(rows=_rows(rep), bytes=dict(rep.bytes), total=rep.total_params,
                                plan_fp8=sum(e.params for e in fp8dist.get_plan(model).fp8),
                                estimate=dict(estimate.bytes))
    return out


def test_report_on_live_models_reads_the_engines_and_counts_bytes_exactly():
    """One spawn for every case (start-up dominates on CPU); each check below is a function of its own."""
    reports = run_ranks(_report_case, timeout=300)
    _fsdp_reads_bf16_compute_fp32_reduce_and_fp8_only_where_planned(reports)
    _fsdp1_ddp_read_their_policies_and_hooks(reports)
    _bytes_per_param_exact_for_a_hand_counted_model(reports)
    _report_prints_both_tables(reports)
    _notes_are_said_by_rank_0_only(reports)
    _mixtral_experts_and_router_are_bf16_gemms(reports)
    _gpt2_conv1d_and_tied_head_are_gemms(reports)


def _fsdp_reads_bf16_compute_fp32_reduce_and_fp8_only_where_planned(reports):
    for r in reports:
        bf16 = r[("fsdp", None, ())]["rows"]
        assert Part.FP8_GEMM not in bf16, "no FP8 GEMM without an FP8 backend"
        linear = bf16[Part.GEMM]
        assert (linear.gemm, linear.all_gather, linear.reduce, linear.weight) == ("bf16", "bf16", "fp32", "fp32")
        assert (linear.weight_grad, linear.optimizer_states, linear.master_weight) == \
            ("fp32", "fp32+fp32", "n/a (the stored weight)")
        case = r[("fsdp", "torchao", ())]
        fp8 = case["rows"][Part.FP8_GEMM]
        assert fp8.gemm == "fp8 e4m3 fwd, e5m2 grads (tensorwise)"
        assert fp8.all_gather == "fp8 e4m3 (FP8 all-gather)", "torchao's FP8 all-gather is visible on the weights"
        assert fp8.params == case["plan_fp8"] == 376_832 and fp8.modules == 13, "FP8 exactly where the plan says"
        kept = case["rows"][Part.GEMM]
        assert (kept.gemm, kept.all_gather, kept.modules) == ("bf16", "bf16", 2), "first/last Linear stay bf16"
        assert r[("fsdp", None, (("reduce_dtype", "bf16"),))]["rows"][Part.GEMM].reduce == "bf16"
        assert case["bytes_per_param"]["parameters"] == pytest.approx(2.0, abs=0.01), "fp32 sharded over 2 ranks"


def _fsdp1_ddp_read_their_policies_and_hooks(reports):
    for r in reports:
        fsdp1 = r[("fsdp1", "torchao", ())]["rows"]
        assert fsdp1[Part.FP8_GEMM].all_gather == "bf16", "FSDP1 has no FP8 all-gather: weights gather in bf16"
        assert fsdp1[Part.FP8_GEMM].params == 376_832, "full sizes, not FSDP1's per-rank views"
        assert fsdp1[Part.GEMM].reduce == "fp32"
        for strategy in ("fsdp1", "ddp"):
            rows = r[(strategy, None, ())]["rows"]
            assert Part.FP8_GEMM not in rows and rows[Part.GEMM].gemm == "bf16", strategy
            assert (rows[Part.GEMM].weight, rows[Part.GEMM].weight_grad) == \
                ("fp32", "fp32"), strategy
        ddp = r[("ddp", "torchao", ())]
        rows = ddp["rows"]
        assert rows[Part.FP8_GEMM].gemm.startswith("fp8 e4m3 fwd")
        assert (rows[Part.GEMM].gemm, rows[Part.GEMM].all_gather) == \
            ("bf16", "none (replicated)"), "DDP: bf16 autocast, nothing gathered"
        assert rows[Part.GEMM].weight == "fp32"
        assert ddp["bytes_per_param"]["gradients"] == pytest.approx(4.0, abs=0.01), \
            "fp32 gradients as views of DDP's buckets: one copy"
        assert rows[Part.GEMM].reduce == "fp32", "no comm hook: DDP reduces the fp32 gradients as they are"
        assert r["ddp fp16 hook reduce"] == "fp16", "the reduce dtype of DDP's registered compression hook"


def _bytes_per_param_exact_for_a_hand_counted_model(reports):
    n = LAYERS * HIDDEN * HIDDEN  # 16,384 parameters
    step_tensors = LAYERS * 4  # AdamW keeps one fp32 `step` scalar per parameter
    for rank, r in enumerate(reports):
        for fp8, scales in ((None, 0), ("torchao", 2 * 4)):  # one fp32 scale per FP8 weight (2 of 4 convert),
            fsdp = r[("stack", "fsdp", fp8)]                    # precomputed after the step for the FP8 all-gather
            assert fsdp["total"] == n
            assert fsdp["bytes"] == {"parameters": 4 * n // 2, "master_weights": 0, "gradients": 4 * n // 2,
                                     "optimizer_states": 2 * 4 * n // 2 + step_tensors, "fp8_buffers": scales}, rank
            assert fsdp["per_param"]["total"] == ((4 + 4 + 8) / 2 * n + step_tensors + scales) / n
        ddp = r[("stack", "ddp", None)]
        assert ddp["bytes"] == {"parameters": 4 * n, "master_weights": 0, "gradients": 4 * n,
                                "optimizer_states": 2 * 4 * n + step_tensors, "fp8_buffers": 0}
    assert reports[0][("stack", "fsdp", "torchao")]["rows"][Part.FP8_GEMM].modules == LAYERS - 2


def _report_prints_both_tables(reports):
    text = reports[0][("fsdp", "torchao", ())]["text"]
    assert text.startswith("fp8dist report: strategy fsdp, fp8 torchao, rank 0 of 2, 459,392 parameters")
    for header in ("part", "GEMM", "all-gather", "reduce", "master weight", "weight grad", "optimizer states",
                   "model state (this rank)", "bytes/param", "total model states"):
        assert header in text
    for label in ("\nFP8 GEMM ", "\nGEMM (high precision) ", "\nother (embeddings, norms) "):
        assert label in text, "each part printed under its label"


def _mixtral_params() -> dict[str, int]:
    """Parameters of the tiny Mixtral's module kinds, from its config. Only the attention projections and lm_head
    are nn.Linear; the experts and the router multiply matrices too."""
    c, h = MIXTRAL, MIXTRAL.hidden_size
    kv = c.num_key_value_heads * h // c.num_attention_heads  # k_proj and v_proj rows
    layers = c.num_hidden_layers
    return {"experts": layers * 3 * c.num_local_experts * c.intermediate_size * h,  # (E, 2I, H) + (E, H, I)
            "router": layers * c.num_local_experts * h, "attention": layers * (2 * h * h + 2 * h * kv),
            "first q_proj": h * h, "lm_head": c.vocab_size * h, "embedding": c.vocab_size * h,
            "norms": (2 * layers + 1) * h}


def _mixtral_experts_and_router_are_bf16_gemms(reports):
    p, layers = _mixtral_params(), MIXTRAL.num_hidden_layers
    gemm = p["experts"] + p["router"] + p["attention"] + p["lm_head"]
    n = gemm + p["embedding"] + p["norms"]
    for r in reports:
        case = r[("mixtral", None)]
        rows = case["rows"]
        assert set(rows) == {Part.GEMM, Part.OTHER} and case["total"] == n
        assert (rows[Part.GEMM].modules, rows[Part.GEMM].params) == (6 * layers + 1, gemm), "experts, router: GEMMs"
        assert (rows[Part.OTHER].modules, rows[Part.OTHER].params) == (2 * layers + 2, p["embedding"] + p["norms"])
        assert (rows[Part.GEMM].gemm, rows[Part.GEMM].all_gather, rows[Part.OTHER].gemm) == ("bf16", "bf16", "no GEMM")
        tensors = 9 * layers + 3  # per layer q, k, v, o, router, gate_up, down, 2 norms; embedding, norm, lm_head
        assert case["bytes"] == {"parameters": 4 * n // 2, "master_weights": 0, "gradients": 4 * n // 2,
                                 "optimizer_states": 2 * 4 * n // 2 + 4 * tensors, "fp8_buffers": 0}, \
            "every dim 0 is even: fp32 shards without padding, AdamW's two moments and a step scalar each"
        fp8 = r[("mixtral", "torchao")]["rows"]
        # torchao converts nn.Linear only, and keeps the first (layer 0's q_proj) and the last (lm_head) in bf16
        assert (fp8[Part.FP8_GEMM].modules, fp8[Part.FP8_GEMM].params) == \
            (4 * layers - 1, p["attention"] - p["first q_proj"]) == \
            (4 * layers - 1, r[("mixtral", "torchao")]["plan_fp8"])
        assert (fp8[Part.GEMM].modules, fp8[Part.GEMM].params, fp8[Part.GEMM].gemm) == \
            (2 * layers + 2, p["experts"] + p["router"] + p["first q_proj"] + p["lm_head"], "bf16"), \
            "experts and router stay bf16 GEMMs"
        _mixtral_emulated_mxfp8_experts_row(r[("mixtral", "torchao-moe")], p, layers)
        for fp8 in (None, "torchao", "torchao-moe"):
            assert r[("mixtral", fp8)]["estimate"] == r[("mixtral", fp8)]["bytes"], f"estimate == measured, {fp8}"


def _mixtral_emulated_mxfp8_experts_row(case, p, layers):
    """torchao's MoE conversion: the experts get a row of their own, labelled from torchao's op config on their
    weights; they gather in bf16 and keep no scale, while the Float8Linears beside them keep the FP8 all-gather."""
    rows = case["rows"]
    assert set(rows) == {Part.FP8_GEMM, Part.FP8_GROUPED_GEMM, Part.GEMM, Part.OTHER}
    experts = rows[Part.FP8_GROUPED_GEMM]
    assert (experts.modules, experts.params) == (layers, p["experts"])
    assert experts.gemm == "mxfp8 e4m3 fwd+grads (32-element blocks, e8m0 scales, emulated)"
    assert experts.all_gather == "bf16", "torchao's MoE wrapper all-gathers in the mixed-precision dtype"
    linears = rows[Part.FP8_GEMM]
    assert (linears.modules, linears.gemm, linears.all_gather) == \
        (4 * layers - 1, "fp8 e4m3 fwd, e5m2 grads (tensorwise)", "fp8 e4m3 (FP8 all-gather)")
    assert case["plan_fp8"] == linears.params + experts.params
    assert (rows[Part.GEMM].modules, rows[Part.GEMM].params) == (layers + 2, p["router"] + p["first q_proj"] +
                                                                 p["lm_head"]), "router, first q_proj, lm_head"
    assert case["bytes"]["fp8_buffers"] == 4 * linears.modules, "one fp32 scale per Float8Linear, none per expert"


def _gpt2_conv1d_and_tied_head_are_gemms(reports):
    h, layers, vocab = GPT2.n_embd, GPT2.n_layer, GPT2.vocab_size
    conv1d = (h * 3 * h + 3 * h) + (h * h + h) + (h * 4 * h + 4 * h) + (4 * h * h + h)  # c_attn, c_proj, c_fc, c_proj
    other = GPT2.n_positions * h + (2 * layers + 1) * 2 * h  # wpe; LayerNorm weights and biases
    for r in reports:
        case = r[("gpt2", None)]
        rows = case["rows"]
        assert (rows[Part.GEMM].modules, rows[Part.GEMM].params, rows[Part.GEMM].gemm) == \
            (4 * layers + 1, layers * conv1d + vocab * h, "bf16"), "Conv1D biases with their GEMM; lm_head tied"
        assert (rows[Part.OTHER].modules, rows[Part.OTHER].params) == (2 * layers + 3, other), \
            "wte, wpe, norms; wte's weight counted once, with lm_head's GEMM"
        assert case["total"] == layers * conv1d + vocab * h + other


def test_report_without_distribution_and_before_any_step():
    plain = _rows(fp8dist.report(fp8dist.wrap_model(build_llama("tiny", seed=0), strategy="none")))
    assert Part.FP8_GEMM not in plain and plain[Part.GEMM].gemm == "bf16", "bf16 autocast, no FP8"
    model = fp8dist.wrap_model(build_llama("tiny", seed=0), strategy="none", fp8="torchao")
    rep = fp8dist.report(model)
    rows = _rows(rep)
    assert rows[Part.GEMM].gemm == "bf16" and rows[Part.GEMM].reduce == "none"
    assert rows[Part.FP8_GEMM].weight_grad == "none held now (report after backward)"
    assert rows[Part.FP8_GEMM].optimizer_states == "none yet (after the first step)"
    assert rep.bytes["parameters"] == 4 * 459_392 and rep.bytes["gradients"] == rep.bytes["optimizer_states"] == 0
    as_json = json.loads(json.dumps(rep.to_dict()))
    assert [row["part"] for row in as_json["rows"]] == ["fp8_gemm", "gemm", "other"], "the parts' keys, in order"
    with pytest.raises(ValueError, match="was not returned by fp8dist.wrap_model"):
        fp8dist.report(build_llama("tiny"))


def test_report_shows_frozen_and_trained_parameters_as_the_estimate_does():
    """A PEFT LoRA model on one process: the report's frozen / trained rows, measured, are the estimate's rows, printed
    by the same table, and in to_dict; a model where everything trains shows none."""
    peft = pytest.importorskip("peft", reason="peft is not installed (pip install peft)")

    def lora():
        torch.manual_seed(0)
        return peft.get_peft_model(build_llama("tiny", seed=0).to(torch.bfloat16),
                                   peft.LoraConfig(r=8, target_modules=["q_proj", "v_proj"]))

    model = fp8dist.wrap_model(lora(), strategy="none")
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    _one_step(model, opt, 0, 1)
    rep = fp8dist.report(model, opt)
    est = fp8dist.estimate_memory(lora(), strategy="none")
    assert rep.groups == est.groups and [g.label for g in rep.groups] == ["frozen", "trained"]
    frozen, trained = rep.groups
    assert frozen.bytes == 2 * frozen.params and frozen.holds == "bf16 weight"  # a bf16 base, nothing else
    assert trained.holds == "fp32 weight, fp32 grad, fp32 optimizer states"
    assert est.group_table(byte_size)[0] in str(rep) and not rep.groups_unmeasured
    as_json = json.loads(json.dumps(rep.to_dict()))
    assert [(g["label"], g["bytes"]) for g in as_json["groups"]] == [(g.label, g.bytes) for g in est.groups]
    full = fp8dist.wrap_model(build_llama("tiny", seed=0), strategy="none")
    plain = fp8dist.report(full)
    assert plain.groups == () and "parameters (this rank)" not in str(plain)


def _notes_are_said_by_rank_0_only(reports) -> None:
    """wrap_model's notes (here: the stack has no blocks) come once per job, not once per process."""
    notes = [{key[2]: said for key, said in rank.items() if key[:2] == ("stack notes", "fsdp")} for rank in reports]
    assert [len(said) for said in notes[0].values()] == [1, 1], notes[0]  # fp8 None and torchao; DDP has no blocks
    assert list(notes[1].values()) == [[], []], notes[1]
