"""The numerics probe (fp8dist.measure_fp8_numerics, fp8dist probe): its numbers equal a hand computation with
torch's float8 dtypes, it names a planted bad layer (an outlier channel that tensorwise e4m3 makes flush the
layer's ordinary values) and little else, it measures MoE experts through their grouped GEMMs, and the command
prints the table for the built-in model, a Mixtral and a GPT-2 config."""

from __future__ import annotations

import json
import math

import pytest
import torch

import fp8dist
from fp8dist.train.data import Batches
from fp8dist.train.models import build_llama
from fp8dist.fp8.casts import CastSpec
from fp8dist.numerics.casts import Cast
from helpers import one_thread  # noqa: F401  (the fixture, for pytestmark)

pytestmark = pytest.mark.usefixtures("one_thread")

pytest.importorskip("torchao", reason="torchao is not installed")

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
BAD = "model.layers.1.mlp.down_proj"




def _batches(n: int = 1, batch: int = 4, seq: int = 64) -> list[torch.Tensor]:
    corpus = Batches(batch_size=batch, seq_len=seq, seed=0)
    return [corpus[i] for i in range(n)]


def _hand_tensorwise(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """FP8 round trip by hand: scale = fp8 max / amax (in float64, then fp32, as torchao), clamp, cast, back."""
    fmax = torch.finfo(dtype).max
    scale = (fmax / x.abs().max().double()).float()
    return (x.float() * scale).clamp(-fmax, fmax).to(dtype).float() / scale


def _sqnr(x: torch.Tensor, back: torch.Tensor) -> float:
    x, back = x.double(), back.double()
    return 20 * math.log10(float(torch.linalg.vector_norm(x) / torch.linalg.vector_norm(x - back)))


def _flushed(x: torch.Tensor, back: torch.Tensor) -> float:
    return int(((x != 0) & (back == 0)).sum()) / int((x != 0).sum())


def test_each_cast_equals_a_hand_computation_on_a_known_tensor():
    torch.manual_seed(0)
    x = torch.randn(64, 96) * torch.logspace(-6, 1, 96)  # columns from 1e-6 to 10: some flush
    stats = fp8dist.numerics.CastStats("input", "output", "")
    back, saturated = Cast(CastSpec(E4M3, "tensorwise"))(x, -1)
    stats.add(x, back, saturated)
    hand = _hand_tensorwise(x, E4M3)
    assert torch.equal(back, hand)
    assert stats.sqnr_db == pytest.approx(_sqnr(x, hand), abs=1e-9)
    assert stats.flushed_share == _flushed(x, hand) > 0.01  # 0.089 measured
    assert stats.saturated == 0 and stats.amax == float(x.abs().max())

    # MX: one power-of-2 scale per 32 values along the contraction dim, 2^ceil(log2(amax / 448)) (RCEIL)
    back, saturated = Cast(CastSpec(E4M3, "mx"))(x, -1)
    blocks = x.reshape(64, 3, 32)
    block_scale = torch.exp2(torch.ceil(torch.log2(blocks.abs().amax(-1, keepdim=True) / 448)))
    assert torch.equal(back, ((blocks / block_scale).to(E4M3).float() * block_scale).reshape(64, 96))
    assert not saturated.any()

    # delayed scaling: the second tensor is cast with the first one's amax (history), so values past it saturate
    cast = Cast(CastSpec(E4M3, "delayed", history_len=16))
    cast(torch.full((4, 4), 2.0), -1)
    spike = torch.tensor([[1.0, 2.0, 2.1, 3.0]])
    back, saturated = cast(spike, -1)
    assert saturated.tolist() == [[False, False, True, True]]  # beyond 2 x 464/448: rounds past e4m3's max
    assert back.tolist() == [[1.0, 2.0, 2.0, 2.0]]


def _plant_outlier(model, name: str = BAD):
    """Input channel 5 of ``name`` holds 1e5: tensorwise e4m3's scale (448/1e5) flushes its ordinary values."""
    def hook(module, args):
        x = args[0].clone()
        x[..., 5] = 1e5
        return (x,)

    return model.get_submodule(name).register_forward_pre_hook(hook)


def test_probe_names_the_planted_bad_layer_with_numbers_equal_to_a_hand_computation():
    model = build_llama("tiny")
    _plant_outlier(model)
    batches = _batches()
    seen = {}
    handle = model.get_submodule(BAD).register_forward_hook(lambda m, args, out: seen.update(x=args[0].detach()))
    report = fp8dist.measure_fp8_numerics(model, batches, fp8="torchao")
    handle.remove()

    assert report.recommended_exclude == [BAD]
    assert [l.name for l in report.layers] == [e.name for e in fp8dist.plan_precision(
        model, fp8dist.resolve_config(fp8="torchao"), device=torch.device("cpu")).fp8]
    bad = next(l for l in report.layers if l.name == BAD)
    assert any("input (output+grad_weight)" in p and "flushed to zero" in p for p in bad.problems)
    x = seen["x"].reshape(-1, seen["x"].shape[-1])
    hand = _hand_tensorwise(x, E4M3)
    cast = bad.worst("input")
    assert cast.cast == "e4m3 tensorwise" and cast.elements == x.numel()
    assert cast.flushed_share == _flushed(x, hand) > 0.9  # 0.997 measured
    assert cast.sqnr_db == pytest.approx(_sqnr(x, hand), abs=1e-6)  # high: the outlier is the signal
    w_t = model.get_submodule(BAD).weight.detach().t()
    exact, fp8 = x @ w_t, hand @ _hand_tensorwise(w_t, E4M3)
    assert bad.output.sqnr_db == pytest.approx(_sqnr(exact, fp8), abs=1e-3)
    assert json.loads(json.dumps(report.to_dict()))["recommended_exclude"] == [BAD]
    table = str(report)
    assert f"recommended_exclude (1 of {len(report.layers)} modules): {BAD}" in table
    assert table.count("EXCLUDE") == 1
    # Transformer Engine's delayed scaling, emulated: per-tensor scales too, so the same layer, and only it
    te = fp8dist.measure_fp8_numerics(model, batches, fp8="te")
    assert te.recommended_exclude == [BAD] and "emulated" in te.notes[0]
    assert {c.cast for l in te.layers for c in l.casts} == {"e4m3 delayed (history 1024, max)",
                                                           "e5m2 delayed (history 1024, max)"}


def test_moe_experts_are_measured_through_their_grouped_gemms():
    from test_fp8_families import mixtral_tiny

    model = mixtral_tiny()
    ids = _batches(seq=32)
    report = fp8dist.measure_fp8_numerics(model, ids, fp8="torchao", target="h100")
    experts = [l for l in report.layers if l.name.endswith("mlp.experts")]
    assert [l.gemm for l in experts] == ["gate_up_proj", "down_proj"] * 2
    top_k, hidden = model.config.num_experts_per_tok, model.config.hidden_size
    for layer in experts:
        casts = {c.role: c for c in layer.casts}
        assert casts["input"].cast == "e4m3 rowwise pow2"  # torchao's FP8 rowwise grouped GEMM on an H100
        assert casts["grad_output"].elements > 0
        if layer.gemm == "gate_up_proj":  # every token goes to top_k experts: its row is cast top_k times
            assert casts["input"].elements == top_k * ids[0].numel() * hidden
    assert report.recommended_exclude == []
    cpu = fp8dist.measure_fp8_numerics(model, ids, fp8="torchao")  # no FP8 grouped GEMM on a CPU: said
    assert not any(l.name.endswith("experts") for l in cpu.layers)
    assert any("MoE experts" in n and "target='h100'" in n for n in cpu.notes)


def _write_config(tmp_path, name: str, **config) -> str:
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(config))
    return str(path)


def test_probe_command_prints_the_table_for_mixtral_and_gpt2_and_refuses_bad_input(tmp_path, capsys):
    from fp8dist.cli import main

    mixtral = _write_config(tmp_path, "mixtral", model_type="mixtral", vocab_size=256, hidden_size=64,
                            intermediate_size=128, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                            num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False)
    gpt2 = _write_config(tmp_path, "gpt2", model_type="gpt2", vocab_size=256, n_embd=64, n_layer=2, n_head=4,
                         n_positions=64)
    small = ["--batches", "1", "--batch-size", "2", "--seq-len", "32"]
    assert main(["probe", "--model-config", mixtral, "--target", "h100", *small]) == 0
    out = capsys.readouterr().out
    assert "planned for H100 (sm_90)" in out
    assert "model.layers.0.mlp.experts[gate_up_proj]" in out and "model.layers.0.mlp.experts[down_proj]" in out
    assert main(["probe", "--model-config", gpt2, *small]) == 0
    out = capsys.readouterr().out
    assert "transformer.h.1.mlp.c_fc" in out and "recommended_exclude (0 of" in out
    assert main(["probe", "--batches", "0"]) == 2
    err = capsys.readouterr().err
    assert err == "fp8dist probe: error: batches=0 must be at least 1.\n"
    tiny_vocab = _write_config(tmp_path, "small_vocab", model_type="gpt2", vocab_size=100, n_embd=64, n_layer=1,
                               n_head=4)
    assert main(["probe", "--model-config", tiny_vocab]) == 2
    assert "vocab_size=100" in capsys.readouterr().err


def test_probe_command_for_the_built_in_model_writes_the_json(tmp_path, capsys):
    from fp8dist.cli import main

    out = tmp_path / "probe.json"
    assert main(["probe", "--batches", "1", "--batch-size", "2", "--seq-len", "64", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "FP8 numerics probe: fp8=torchao (recipe tensorwise" in printed
    assert "model.layers.1.mlp.down_proj" in printed
    data = json.loads(out.read_text())
    assert data["recommended_exclude"] == [] and data["tokens"] == 128
    assert len(data["layers"]) == 13  # 14 Linears of the tiny Llama's 2 layers + lm_head, less the first and last


def test_telemetry_warns_once_per_layer_and_writes_one_line_per_sampled_step(tmp_path):
    from fp8dist.numerics.telemetry import FP8Telemetry

    model = fp8dist.wrap_model(build_llama("tiny"), strategy="none", fp8="torchao")
    _plant_outlier(fp8dist.unwrap_model(model))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    lines = []
    telemetry = FP8Telemetry(model, every=2, jsonl=tmp_path / "fp8.jsonl", optimizer=opt, log=lines.append)
    ids = _batches()[0]
    with pytest.warns(RuntimeWarning) as caught:
        for _ in range(3):  # steps 0 and 2 sampled, both past the threshold: one warning
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
    warned = [str(w.message) for w in caught if "FP8 telemetry" in str(w.message)]
    assert len(warned) == 1 and f"{BAD} input" in warned[0] and f"fp8_exclude=[{BAD!r}]" in warned[0]
    records = [json.loads(line) for line in (tmp_path / "fp8.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 2] and len(lines) == 2
    assert records[0]["layers"][BAD]["input"]["flushed_share"] > 0.9
    assert records[0]["layers"][BAD]["input"]["amax"] == 99840.0  # 1e5 in bf16: autocast made the input bf16
    assert "input flushed <= " in lines[0] and BAD in lines[0]
    telemetry.close()


def test_probe_command_reads_the_text_fp8dist_train_reads(tmp_path, capsys):
    """--data/--tokenizer as in fp8dist train: the built-in model takes the tokenizer's vocabulary, the batches are
    the job's first training windows (each token predicted once: the loss the probe differentiates is the job's)."""
    from text_corpus import write_text_corpus

    from fp8dist.cli import main
    from fp8dist.cli.probe import ProbeConfig, probe_batches
    from fp8dist.train.data import load_text_corpus
    from fp8dist.train.data.job import lm_loss

    made = write_text_corpus(tmp_path)
    data = ["--data", str(made.jsonl), "--tokenizer", str(made.tokenizer), "--data-cache", str(tmp_path / "cache")]
    out = tmp_path / "probe.json"
    assert main(["probe", *data, "--batches", "2", "--batch-size", "2", "--seq-len", "32", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["tokens"] == 2 * 2 * 32 and "lm_head" not in capsys.readouterr().out  # the last layer stays bf16
    corpus = load_text_corpus([str(made.jsonl)], tokenizer=str(made.tokenizer), cache_dir=str(tmp_path / "cache"))
    model = build_llama("tiny", vocab_size=corpus.vocab_size)
    batches = probe_batches(ProbeConfig(batches=1, batch_size=2, seq_len=32), corpus)
    window = torch.cat([batches[0]["input_ids"], batches[0]["labels"][:, -1:]], dim=1)
    assert torch.equal(model(**batches[0]).loss, lm_loss(model, window, windows=True))
    assert main(["probe", "--data", str(made.jsonl)]) == 2
    assert "--data needs a tokenizer: pass --tokenizer DIR" in capsys.readouterr().err
