"""fp8dist estimate: per-rank model-state bytes predicted from shapes alone, checked three ways -- against bytes
computed by hand, against fp8dist.report on real 2-rank CPU runs of every strategy that runs here, and through
the CLI. Plus the activation formula against the tensors autograd really saves."""

from __future__ import annotations

import copy
import json
import re
import time

import pytest
import torch
from dist_harness import run_ranks
from transformers import LlamaConfig, LlamaForCausalLM

from fp8dist import cli
from fp8dist import estimate_memory

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
            "optimizer_states": 8 * 9100}
    # ZeRO-3: every parameter cut to ceil(numel/3); the five norms (32 <= 10h) also stay whole in bf16
    part = 2 * (342 + 171 * 2 + 342 + 1024 * 3 + 11 * 2) + 2 * 427 + 11
    assert _bytes(strategy="deepspeed", zero_stage=3, world_size=3) == {
        "parameters": 2 * part + 2 * 5 * 32, "master_weights": 4 * part, "gradients": 2 * part,
        "optimizer_states": 8 * part}


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

def _within(measured: dict[str, int], estimated: dict[str, int], what: str) -> None:
    total_m, total_e = sum(measured.values()), sum(estimated.values())
    assert abs(total_e - total_m) <= 0.10 * total_m, f"{what}: measured {measured} estimated {estimated}"
    for category, value in measured.items():  # and no category far off (tiny ones within 1% of the total)
        assert abs(estimated[category] - value) <= max(0.10 * value, 0.01 * total_m), \
            f"{what}, {category}: measured {measured} estimated {estimated}"


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
            engine, _ = fp8dist.wrap_model(copy.deepcopy(base), micro_batch_size=2, optimizer={"type": "AdamW"}, **kw)
            for step in range(2):  # optimizer states exist after the first step; measure after the next backward
                engine.backward(engine(input_ids=ids, labels=ids).loss)
                if step == 0:
                    engine.step()
            measured = fp8dist.report(engine)
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
            _within(measured, estimated, f"rank {rank} {kw}")


@pytest.mark.slow
def test_estimate_matches_the_measured_report_deepspeed_zero_1_2_3():
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install 'fp8dist[deepspeed]')")
    cases = [dict(strategy="deepspeed", zero_stage=1), dict(strategy="deepspeed", zero_stage=2),
             dict(strategy="deepspeed", zero_stage=3, fp8="torchao")]
    for rank, results in enumerate(run_ranks(_measure_cases, cases, timeout=400)):
        for kw, (measured, estimated, rows) in zip(cases, results):
            _within(measured, estimated, f"rank {rank} {kw}")
            # and the report's dtypes, read from the engine: bf16 weights and gradients, fp32 master and states
            row = rows["gemm"]
            assert (row.weight, row.master_weight, row.weight_grad, row.optimizer_states, row.reduce) == \
                ("bf16", "fp32 (ZeRO partition)", "bf16", "fp32+fp32", "fp32"), kw
            gather = "bf16" if kw["zero_stage"] == 3 else "bf16 (updated weights, after the step)"
            assert row.all_gather == gather, kw
        assert results[2][2]["fp8_gemm"].gemm == "fp8 e4m3 fwd, e5m2 grads (tensorwise)", "ZeRO-3 + torchao"


def _saved_activation_bytes(model: torch.nn.Module, ids: torch.Tensor, autocast: bool) -> int:
    """Bytes of the tensors autograd saves for backward in one forward (each storage once), plus the logits."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = model(input_ids=ids, labels=ids).logits
    seen[logits.untyped_storage().data_ptr()] = logits.untyped_storage().nbytes()
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return sum(n for ptr, n in seen.items() if ptr not in weights)


@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_activation_formula_matches_the_tensors_autograd_saves(strategy):
    from fp8dist.models import build_llama

    model = build_llama("tiny")
    ids = torch.randint(0, 256, (2, 128))
    if strategy == "fsdp":  # FSDP computes with bf16 weights and no autocast; DDP: fp32 weights under autocast
        measured = _saved_activation_bytes(copy.deepcopy(model).to(torch.bfloat16), ids, autocast=False)
    else:
        measured = _saved_activation_bytes(model, ids, autocast=True)
    est = estimate_memory(model, strategy=strategy, world_size=2, micro_batch_size=2, seq_len=128)
    assert abs(est.activation_bytes - measured) <= 0.10 * measured, (est.activations, measured)


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


def test_a_70b_config_on_the_meta_device_estimates_in_well_under_a_second_per_layout():
    config = LlamaConfig(vocab_size=32000, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                         num_attention_heads=64, num_key_value_heads=8, tie_word_embeddings=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    n = sum(p.numel() for p in model.parameters())
    for kw, per_param in [(dict(strategy="fsdp", fp8="torchao"), 16 / 64), (dict(strategy="fsdp1"), 16 / 64),
                          (dict(strategy="deepspeed", zero_stage=3), 16 / 64)]:
        start = time.monotonic()
        est = estimate_memory(model, world_size=64, seq_len=4096, **kw)
        assert time.monotonic() - start < 2.0, f"{kw} took {time.monotonic() - start:.1f}s"
        assert est.total_params == n > 68e9
        assert est.model_state_bytes == pytest.approx(per_param * n, rel=0.01)  # 16 bytes/param over 64 ranks
        assert est.activation_bytes > 0


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
