"""fp8dist estimate: per-rank model-state bytes predicted from shapes alone, checked three ways -- against bytes
computed by hand, against fp8dist.report on real CPU runs of every strategy that runs here (to the byte), and
through the CLI. Plus each family's activation formula against the tensors autograd really saves, and the
DeepSpeed config read from wrap_model's own builder."""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys

import pytest
import torch
from dist_harness import run_ranks
from transformers import LlamaConfig, LlamaForCausalLM

from fp8dist import cli
from fp8dist import estimate_memory
from helpers import deepspeed_report

# h=32, i=96, 2 layers, 2 heads of 16, 1 kv head. Per layer: q 32x32=1024, k 16x32=512, v 512, o 1024,
# gate/up 96x32=3072 each, down 32x96=3072, two norms of 32: 12352; embed and lm_head vocab x 32, final norm 32.
DIMS = dict(hidden_size=32, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            tie_word_embeddings=False, max_position_embeddings=64)
STEP = 4  # torch AdamW's fp32 step tensor, one per parameter (21 parameters)


def _llama(vocab: int, *, meta: bool = True) -> LlamaForCausalLM:
    torch.manual_seed(0)
    with torch.device("meta" if meta else "cpu"):
        return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, **DIMS))


def _bytes(**kw) -> dict[str, int]:
    est = estimate_memory(_llama(40), **kw)
    return {k: v for k, v in est.bytes.items() if v}


def test_hand_computed_fsdp2_pads_every_rank_to_the_first_chunk():
    # 3 ranks, torch.chunk on dim 0, storage padded to ceil(dim0/3) rows: embed/lm_head 40 -> 14 rows, q/o 32 -> 11,
    # k/v 16 -> 6, gate/up 96 -> 32, down 32 -> 11 rows of 96, norms 32 -> 11
    layer = 11 * 32 + 6 * 32 * 2 + 11 * 32 + 32 * 32 * 2 + 11 * 96 + 11 * 2
    padded = 2 * layer + 2 * 14 * 32 + 11
    assert padded == 9335
    # optimizer states follow the unpadded rows: rank 2 holds 12 of embed's 40 rows, 10 of q's 32, 4 of k's 16...
    rank2 = 2 * (10 * 32 + 4 * 32 * 2 + 10 * 32 + 32 * 32 * 2 + 10 * 96 + 10 * 2) + 2 * 12 * 32 + 10
    assert _bytes(strategy="fsdp", world_size=3, rank=0) == {
        "parameters": 4 * padded, "gradients": 4 * padded, "optimizer_states": 8 * padded + 21 * STEP}
    assert _bytes(strategy="fsdp", world_size=3, rank=2) == {
        "parameters": 4 * padded, "gradients": 4 * padded, "optimizer_states": 8 * rank2 + 21 * STEP}


def test_hand_computed_fsdp1_flat_shards_padded_to_the_world_size():
    # units: each layer (12352 -> padded to 12354, shards of 4118) and the root (embed, norm, lm_head: 2592 / 3 = 864)
    shards = 2 * 4118 + 864
    # states: real elements in each rank's shard range; a step per parameter that has elements there
    states = {0: (2 * 4118 + 864, 2 * 5 + 1), 1: (2 * 4118 + 864, 2 * 2 + 3), 2: (2 * 4116 + 864, 2 * 4 + 1)}
    for rank, (elements, params) in states.items():
        assert _bytes(strategy="fsdp1", world_size=3, rank=rank) == {
            "parameters": 4 * shards, "gradients": 4 * shards, "optimizer_states": 8 * elements + params * STEP}


def test_hand_computed_ddp_and_deepspeed_zero_1_and_3():
    n = 2 * 12352 + 2 * 40 * 32 + 32
    assert n == 27296
    assert _bytes(strategy="ddp", world_size=3) == {"parameters": 4 * n, "gradients": 4 * n,
                                                   "optimizer_states": 8 * n + 21 * STEP}
    # ZeRO-1: bf16 flat buffer padded to a multiple of 2W=6 (27300), fp32 master/states on 1/3 of it (9100);
    # bf16 gradients of every parameter overlapping the rank's range: rank 1 holds the straddling up_proj and gate_proj
    zero1 = estimate_memory(_llama(40), strategy="deepspeed", zero_stage=1, world_size=3)
    assert zero1.rank == 1, "the rank with the most bytes is described by default"
    grads = {0: 1280 + 1024 + 512 + 512 + 1024 + 3072 + 3072, 1: 3072 * 3 + 64 + 1024 + 512 + 512 + 1024,
             2: 3072 * 3 + 64 + 32 + 1280}
    for rank, elements in grads.items():
        assert _bytes(strategy="deepspeed", zero_stage=1, world_size=3, rank=rank) == {
            "parameters": 2 * 27300, "master_weights": 4 * 9100, "gradients": 2 * elements,
            "optimizer_states": 8 * 9100 + STEP}  # on a CPU the engine's Adam is torch's: a step for the partition
    # for a GPU the engine's Adam is FusedAdam, whose step lives in the param group
    on_h100 = estimate_memory(_llama(40), strategy="deepspeed", zero_stage=1, world_size=3, target="h100")
    assert on_h100.bytes["optimizer_states"] == 8 * 9100
    # ZeRO-3: every parameter cut to ceil(numel/3); the five norms (32 <= 10h) also stay whole in bf16
    part = 2 * (342 + 171 * 2 + 342 + 1024 * 3 + 11 * 2) + 2 * 427 + 11
    assert _bytes(strategy="deepspeed", zero_stage=3, world_size=3) == {
        "parameters": 2 * part + 2 * 5 * 32, "master_weights": 4 * part, "gradients": 2 * part,
        "optimizer_states": 8 * part + STEP}


def test_te_and_msamp_rows_are_derived_from_their_documented_behaviour():
    te = estimate_memory(_llama(40), strategy="fsdp", fp8="te", world_size=2)
    # 14 te.Linear (lm_head's 40 outputs are not a multiple of 16), 5 FP8 tensors each: a scale + 1024 amaxes
    assert te.bytes["fp8_buffers"] == 14 * 5 * 4 * (1 + 1024)
    assert te.derived and "derived" in str(te)
    assert estimate_memory(_llama(40), strategy="fsdp", fp8="te", te_recipe="current").bytes["fp8_buffers"] == 0
    with pytest.raises(ValueError, match="converts every nn.Linear"):  # what wrap_model refuses, refused here
        estimate_memory(_llama(40), strategy="ddp", fp8="msamp")
    model = _llama(48)  # every Linear FP8-eligible
    linear = 2 * (12352 - 64) + 48 * 32  # converted weights
    other = 48 * 32 + 5 * 32
    o1 = estimate_memory(model, strategy="ddp", fp8="msamp", opt_level="O1", world_size=2).bytes
    o2 = estimate_memory(model, strategy="ddp", fp8="msamp", opt_level="O2", world_size=2).bytes
    assert o1["parameters"] == 2 * linear + 4 * other and o1["gradients"] == linear + 4 * other  # FP16 / FP8
    assert o1["optimizer_states"] == 8 * (linear + other) + 21 * STEP  # FP32 + FP32
    assert o2["optimizer_states"] == 3 * (linear + other) + 21 * STEP  # FP8 + FP16


# --- against fp8dist.report on real runs ------------------------------------------------------------------------

def _equal(measured: dict[str, int], estimated: dict[str, int], what: str) -> None:
    """Both sides are exact for every strategy compared here (no TE / MS-AMP, whose rows are derived): the
    estimate follows each engine's layout to the byte, so any difference is a bug."""
    assert estimated == measured, f"{what}: measured {measured} estimated {estimated}"


def _measure_cases(rank: int, world: int, cases: list[dict]) -> list[tuple[dict, dict]]:
    """Each case: one optimizer step on a fresh copy, then fp8dist.report vs estimate_memory for this rank."""
    import logging

    import fp8dist

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    base = _llama(41, meta=False)  # 41 rows: embed/lm_head shard unevenly, FSDP1 pads its root unit
    ids = torch.randint(0, 41, (2, 16), generator=torch.Generator().manual_seed(rank))
    out = []
    for kw in cases:
        if kw["strategy"] == "deepspeed":
            measured = deepspeed_report(copy.deepcopy(base), ids, **kw)
        else:
            model = fp8dist.wrap_model(copy.deepcopy(base), **kw)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            measured = fp8dist.report(model, optimizer)
        estimated = estimate_memory(_llama(41), world_size=world, rank=rank, micro_batch_size=2, **kw)
        out.append((dict(measured.bytes), dict(estimated.bytes), {r.part: r for r in measured.rows}))
    return out


@pytest.mark.slow
def test_estimate_matches_the_measured_report_fsdp_fsdp1_ddp():
    cases = [dict(strategy="fsdp"), dict(strategy="fsdp", fp8="torchao"), dict(strategy="fsdp1"),
             dict(strategy="ddp")]
    for rank, results in enumerate(run_ranks(_measure_cases, cases, timeout=300)):
        for kw, (measured, estimated, _) in zip(cases, results):
            _equal(measured, estimated, f"rank {rank} {kw}")


def test_estimate_matches_the_measured_report_single_process():
    cases = [dict(strategy="none"), dict(strategy="none", fp8="torchao")]
    for kw, (measured, estimated, _) in zip(cases, _measure_cases(0, 1, cases)):
        _equal(measured, estimated, f"{kw}")


@pytest.mark.slow
def test_estimate_matches_the_measured_report_deepspeed_zero_1_2_3():
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install 'fp8dist[deepspeed]')")
    cases = [dict(strategy="deepspeed", zero_stage=1), dict(strategy="deepspeed", zero_stage=2),
             dict(strategy="deepspeed", zero_stage=3, fp8="torchao")]
    for rank, results in enumerate(run_ranks(_measure_cases, cases, timeout=400)):
        for kw, (measured, estimated, rows) in zip(cases, results):
            _equal(measured, estimated, f"rank {rank} {kw}")
            # and the report's dtypes, read from the engine: bf16 weights and gradients, fp32 master and states
            row = rows["gemm"]
            assert (row.weight, row.master_weight, row.weight_grad, row.optimizer_states, row.reduce) == \
                ("bf16", "fp32 (ZeRO partition)", "bf16", "fp32+fp32", "fp32"), kw
            gather = "bf16" if kw["zero_stage"] == 3 else "bf16 (updated weights, after the step)"
            assert row.all_gather == gather, kw
        assert results[2][2]["fp8_gemm"].gemm == "fp8 e4m3 fwd, e5m2 grads (tensorwise)", "ZeRO-3 + torchao"


def _saved_activation_bytes(model: torch.nn.Module, ids: torch.Tensor, autocast: bool) -> int:
    """Bytes of the tensors autograd saves for backward in one training forward (each storage once, weights
    excluded), plus the logits the output keeps."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    model.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = model(input_ids=ids, labels=ids).logits
    seen[logits.untyped_storage().data_ptr()] = logits.untyped_storage().nbytes()
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return sum(n for ptr, n in seen.items() if ptr not in weights)


def _family_model(model_type: str, **extra) -> torch.nn.Module:
    """A small real model of each family, from a config. GPT-2's dropouts are off: on CPU dropout saves its noise
    in the input's dtype and SDPA with dropout falls back to seq x seq scores, where the estimate counts CUDA's
    1-byte masks and dropout inside the kernel (dropout's own count is tested below)."""
    from transformers import (GPT2Config, GPT2LMHeadModel, GPTNeoXConfig, GPTNeoXForCausalLM, MixtralConfig,
                              MixtralForCausalLM)

    layers = dict(num_hidden_layers=2, num_attention_heads=4, vocab_size=256)
    kinds = {
        "llama": (LlamaConfig, LlamaForCausalLM, dict(hidden_size=64, intermediate_size=176,
                                                      num_key_value_heads=2)),
        "mixtral": (MixtralConfig, MixtralForCausalLM, dict(hidden_size=64, intermediate_size=128,
                                                            num_key_value_heads=2, num_local_experts=4,
                                                            num_experts_per_tok=2)),
        "gpt2": (GPT2Config, GPT2LMHeadModel, dict(hidden_size=64, n_positions=256, resid_pdrop=0.0,
                                                   embd_pdrop=0.0, attn_pdrop=0.0)),
        "gpt_neox": (GPTNeoXConfig, GPTNeoXForCausalLM, dict(hidden_size=64, intermediate_size=256,
                                                             max_position_embeddings=256)),
    }
    config_class, model_class, dims = kinds[model_type]
    torch.manual_seed(0)
    return model_class(config_class(**{**layers, **dims, **extra}))


def _estimated_over_saved(model: torch.nn.Module, strategy: str) -> float:
    """FSDP computes with bf16 weights and no autocast; DDP with fp32 weights under bf16 autocast."""
    from fp8dist.accounting.estimate_activations import ROOT_WEIGHTS_ITEM

    ids = torch.randint(0, 256, (2, 128), generator=torch.Generator().manual_seed(0))
    bf16 = strategy in ("fsdp", "fsdp1", "deepspeed")
    saved = _saved_activation_bytes(copy.deepcopy(model).to(torch.bfloat16) if bf16 else model, ids, not bf16)
    est = estimate_memory(model, strategy=strategy, world_size=2, micro_batch_size=2, seq_len=128)
    assert est.activations_modelled
    return sum(b for item, b in est.activations if item != ROOT_WEIGHTS_ITEM) / saved  # FSDP's, not autograd's


# not modelled: the input ids, rotary cos/sin and the loss's targets, a few KiB: 0.1-0.8% at these sizes
_FORMULA_ERROR = 0.02


@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
@pytest.mark.parametrize("model_type", ["llama", "mixtral", "gpt2", "gpt_neox"])
def test_each_familys_activations_are_what_autograd_saves(model_type, strategy):
    ratio = _estimated_over_saved(_family_model(model_type), strategy)
    assert abs(ratio - 1) <= _FORMULA_ERROR, f"{model_type} under {strategy}: estimate / saved = {ratio:.4f}"


@pytest.mark.parametrize("model_type,extra", [
    ("mixtral", dict(num_local_experts=8, num_experts_per_tok=1)),  # top-1 of 8: pairs = tokens
    ("gpt2", dict(use_cache=False)),  # k, v stay views of c_attn's output
    ("gpt2", dict(activation_function="gelu")),  # saves its input once, not gelu_new's four tensors
    ("gpt_neox", dict(use_cache=False)),  # v a view of the fused query_key_value output
    ("gpt_neox", dict(use_parallel_residual=False)),  # the second norm reads a new residual
], ids=["mixtral-top1-of-8", "gpt2-no-cache", "gpt2-gelu", "gpt_neox-no-cache", "gpt_neox-serial-residual"])
def test_family_variants_are_what_autograd_saves(model_type, extra):
    ratio = _estimated_over_saved(_family_model(model_type, **extra), "fsdp")
    assert abs(ratio - 1) <= _FORMULA_ERROR, f"{model_type} {extra}: estimate / saved = {ratio:.4f}"


@pytest.mark.parametrize("model_type", ["llama", "gpt2", "gpt_neox"])
def test_selective_checkpointing_keeps_what_the_estimate_counts(model_type):
    """What a selectively checkpointed forward leaves alive (block inputs, attention outputs, every other GEMM
    output, the head's saves) against the estimate without its recompute transient."""
    import warnings

    import fp8dist
    from fp8dist.accounting.estimate_activations import RECOMPUTE_ITEM
    from test_blocks import _Storages

    model = _family_model(model_type)
    est = estimate_memory(model, strategy="none", fp8="none", param_dtype="fp32", micro_batch_size=2, seq_len=128,
                          activation_checkpointing="selective")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # use_cache turned off
        model = fp8dist.wrap_model(model, strategy="none", fp8="none", param_dtype="fp32",
                                   activation_checkpointing="selective")
    ids = torch.randint(0, 256, (2, 128), generator=torch.Generator().manual_seed(0))
    with _Storages(model) as storages:
        out = model(input_ids=ids, labels=ids)  # holds the graph and what it keeps
    kept = sum(n for item, n in est.activations if item != RECOMPUTE_ITEM)
    # measured: llama 0.9885, gpt2 0.9972, gpt_neox 0.9961
    ratio = kept / storages.alive()
    assert out.loss.isfinite() and 0.985 <= ratio <= 1.0, f"{model_type}: estimate / kept = {ratio:.4f}"


def test_compiled_blocks_are_counted_without_the_kv_cache_wrap_model_turns_off():
    kw = dict(strategy="fsdp", world_size=2, micro_batch_size=2, seq_len=128)
    compiled = estimate_memory(_family_model("gpt2"), compile=True, **kw)
    assert compiled.activations == estimate_memory(_family_model("gpt2", use_cache=False), **kw).activations
    assert compiled.activations != estimate_memory(_family_model("gpt2"), compile=False, **kw).activations
    assert any(note.startswith("compile=True: counted as the eager forward") for note in compiled.notes)


def test_dropout_masks_count_every_dropped_element():
    """GPT-2's embedding, attention-residual and MLP dropouts: CPU saves a noise tensor in the input's dtype (bf16
    here) where CUDA keeps a 1-byte mask: the same elements, which is what the estimate counts."""
    counts = {}
    for p in (0.0, 0.1):
        model = _family_model("gpt2", resid_pdrop=p, embd_pdrop=p)
        ids = torch.randint(0, 256, (2, 128), generator=torch.Generator().manual_seed(0))
        saved = _saved_activation_bytes(copy.deepcopy(model).to(torch.bfloat16), ids, autocast=False)
        est = estimate_memory(model, strategy="fsdp", world_size=2, micro_batch_size=2, seq_len=128)
        counts[p] = saved, est.activation_bytes
    elements = (2 * 2 + 1) * 256 * 64  # two per layer and one after the embeddings, tokens x hidden each
    assert counts[0.1][0] - counts[0.0][0] == 2 * elements  # CPU: bf16 noise
    assert counts[0.1][1] - counts[0.0][1] == elements  # the estimate: CUDA's bool mask


def test_activation_table_is_what_each_function_saves():
    from transformers.activations import ACT2FN

    from fp8dist.accounting.activation_families import ACTIVATION_SAVES

    for name, count in ACTIVATION_SAVES.items():
        x = torch.randn(16, 8, requires_grad=True)
        seen: set[int] = set()
        with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.add(t.untyped_storage().data_ptr()) or t,
                                                      lambda t: t):
            y = ACT2FN[name](x)
        assert len(seen - {y.untyped_storage().data_ptr()}) == count, name


def test_a_family_without_a_formula_gets_model_states_and_a_flag_not_another_familys_figure():
    from transformers import GPTJConfig, GPTJForCausalLM

    with torch.device("meta"):
        model = GPTJForCausalLM(GPTJConfig(n_embd=64, n_layer=2, n_head=4, vocab_size=100, rotary_dim=8))
    est = estimate_memory(model, strategy="ddp", world_size=2)
    n, tensors = sum(p.numel() for p in model.parameters()), len(list(model.parameters()))
    assert est.model_state_bytes == 16 * n + STEP * tensors  # fp32 weights, gradients, AdamW's two states
    assert est.activations_modelled is False and est.activations == () and est.activation_bytes == 0
    assert "activations not estimated: model_type 'gptj' has no formula (families modelled: llama, mixtral, " \
           "gpt2, gpt_neox)" in est.notes[-1]
    assert "activations not estimated" in str(est) and est.to_dict()["activations_modelled"] is False
    selective = estimate_memory(_family_model("mixtral"), strategy="fsdp", activation_checkpointing="selective")
    assert not selective.activations_modelled and "activation_checkpointing='selective' for model_type 'mixtral'" \
        in selective.notes[-1]


# --- DeepSpeed: the config wrap_model builds ------------------------------------------------------------------

def test_the_deepspeed_figures_come_from_the_config_wrap_model_builds(tmp_path):
    user = tmp_path / "ds.json"  # the user's values win, in the estimate as in wrap_model
    user.write_text(json.dumps({"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}))
    est = estimate_memory(_llama(40), strategy="deepspeed", zero_stage=3, world_size=3, ds_config=str(user))
    part = 2 * (342 + 171 * 2 + 342 + 1024 * 3 + 11 * 2) + 2 * 427 + 11  # as in the hand-computed ZeRO-3 test
    assert est.bytes["parameters"] == 2 * part, "threshold 0: no small parameter kept whole"
    both = tmp_path / "both.json"  # what wrap_model refuses, the estimate refuses with the same words
    both.write_text(json.dumps({"bf16": {"enabled": True}, "fp16": {"enabled": True}}))
    with pytest.raises(ValueError, match="enables both fp16 and bf16"):
        estimate_memory(_llama(40), strategy="deepspeed", world_size=3, ds_config=str(both))


# --- the command line and scale -------------------------------------------------------------------------------

def test_cli_prints_the_table_for_a_hugging_face_config(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "llama", "vocab_size": 40, **DIMS}))
    code = cli.main(["estimate", "--model-config", str(config), "--strategy", "deepspeed", "--zero-stage", "1",
                     "--fp8", "none", "--world-size", "3", "--micro-batch-size", "2", "--seq-len", "16"])
    out = capsys.readouterr().out
    assert code == 0
    assert "fp8dist estimate: strategy deepspeed (ZeRO-1), fp8 none, world size 3, rank 1, 27,296 parameters" in out
    for row in ("parameters", "master weights", "gradients", "optimizer states", "fp8 buffers", "total model states",
                "2 decoder layers", "total activations (estimate)"):
        assert row in out
    assert "53.32 KiB" in out, "ZeRO-1 parameters: 27300 bf16 elements"
    assert cli.main(["estimate", "--model-size", "tiny", "--world-size", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["bytes"]["parameters"] == 459392 * 4 // 2 and data["model_state_bytes"] > 0


def test_the_batch_shape_is_read_by_the_estimate_whatever_the_axes(capsys):
    """fp8 none under fsdp reads neither micro_batch_size nor seq_len in wrap_model, but the activations do: no "has
    no effect" note for them (an option nothing reads still gets one)."""
    argv = ["estimate", "--model-size", "tiny", "--fp8", "none", "--micro-batch-size", "4", "--seq-len", "512"]
    assert cli.main([*argv, "--torchao-api", "weight_wrapper"]) == 0
    out, err = capsys.readouterr()
    assert "activations (micro-batch 4 x seq 512)" in out
    assert [line for line in err.splitlines() if "no effect" in line] == [
        "fp8dist estimate: note: torchao_api='weight_wrapper' has no effect here (read only when fp8 in ['torchao']; "
        "fp8=None)."]


def test_json_on_stdout_is_only_the_json_when_deepspeed_logs_at_its_import():
    """DeepSpeed's logger writes its first-import line ("Setting accelerator to CPU") to stdout: in a fresh process,
    as a user pipes ``--json`` into jq, stdout must parse as JSON; the line goes to stderr."""
    argv = ["estimate", "--model-size", "tiny", "--strategy", "deepspeed", "--world-size", "2", "--json"]
    proc = subprocess.run([sys.executable, "-m", "fp8dist", *argv], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout)["strategy"] == "deepspeed"
    assert "Setting accelerator to CPU" in proc.stderr  # said, where logs go


@pytest.mark.parametrize("argv,message", [
    (["--world-size", "0"], "world_size=0 must be a positive integer (the number of data-parallel ranks"),
    (["--strategy", "none", "--world-size", "4"], "world_size=4 with strategy='none': 'none' trains in one process"),
    (["--strategy", "fsdp", "--fp8", "msamp"], "fp8='msamp' with strategy='fsdp'"),
    (["--seq-len", "-5"], "seq_len=-5 must be a positive integer"),
])
def test_cli_bad_values_are_clear_errors(argv, message, capsys):
    assert cli.main(["estimate", *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    (["--optimizer", "adam8bit"], ("invalid choice: 'adam8bit'", "sgd_momentum")),
    (["--strategy", "fsdp3"], ("strategy='fsdp3' is not valid", "'fsdp1'", "Did you mean 'fsdp'?")),
    (["--model-size", "small", "--model-config", "x.json"], ("not allowed with argument",)),
])
def test_cli_bad_flags_exit_2_naming_the_choices(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["estimate", *argv])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and all(m in err for m in message), err


def test_a_70b_config_on_the_meta_device_is_estimated_per_layout():
    """Nothing is allocated (meta device) and each layout gives 16 bytes/param over 64 ranks; how fast is for
    benchmarks/, not a timed test."""
    config = LlamaConfig(vocab_size=32000, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                         num_attention_heads=64, num_key_value_heads=8, tie_word_embeddings=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    n = sum(p.numel() for p in model.parameters())
    for kw in (dict(strategy="fsdp", fp8="torchao"), dict(strategy="fsdp1"), dict(strategy="deepspeed", zero_stage=3)):
        est = estimate_memory(model, world_size=64, seq_len=4096, **kw)
        assert est.total_params == n > 68e9
        assert est.model_state_bytes == pytest.approx(16 / 64 * n, rel=0.01), kw  # the few unpadded rows aside
        assert est.activations_modelled and est.activation_bytes > 0
        assert not any(note.startswith("FSDP2 pads") for note in est.notes), kw  # 32000 and 8192 split evenly


def test_readme_memory_estimate_example_is_what_the_cli_prints(tmp_path, capsys):
    from cli_helpers import ROOT

    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Memory estimate"):]
    command = re.search(r"```bash\n(fp8dist estimate .*?)\n```", section).group(1)
    shown = re.search(r"```\n(fp8dist estimate: .*?)```", section, flags=re.S).group(1)
    config = tmp_path / "config.json"  # Llama-2-70B's shape
    config.write_text(json.dumps({"model_type": "llama", "vocab_size": 32000, "hidden_size": 8192,
                                  "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64,
                                  "num_key_value_heads": 8, "tie_word_embeddings": False, "torch_dtype": "float16"}))
    argv = command.split()[1:]
    argv[argv.index("config.json")] = str(config)
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out.splitlines()
    for line in shown.splitlines():
        assert line == "..." or line in printed, f"README shows {line!r}; the CLI prints:\n" + "\n".join(printed)
