"""fp8dist estimate with a target GPU says whether a rank fits its memory (the capacity from fp8dist.runtime.gpus), and
when it does not, the ways out -- more ranks, activation checkpointing, the lean level, ZeRO-3 offload, and
activation checkpointing with each -- each with the figure the estimate itself computes for it. And the estimate
says each thing it was given that the chosen strategy / backend / level does not read (issue 40, items 11, 13)."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from fp8dist import cli, estimate_memory
from fp8dist.runtime.gpus import gpu_by_key
from fp8dist.accounting.fit import device_bytes

H100 = 80 * 2**30
PLAN = int(0.9 * H100)  # what a rank may plan on: fp8dist.accounting.fit.MEMORY_FRACTION of it


@pytest.fixture(scope="module")
def llama_70b():
    """Llama-3-70B's shape on the meta device: nothing is allocated."""
    config = LlamaConfig(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                         num_attention_heads=64, num_key_value_heads=8, tie_word_embeddings=False)
    with torch.device("meta"):
        return LlamaForCausalLM(config)


def _rerun(model, way, **given):
    change = dict(way.change)
    world = change.pop("world_size", given.pop("world_size"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return device_bytes(estimate_memory(model, world_size=world, **given, **change))


def test_gpu_memory_is_in_the_one_gpu_table_and_the_bench_plans_on_the_same_share():
    from fp8dist.bench.fits import MEMORY_FRACTION
    from fp8dist.accounting import fit

    assert gpu_by_key("h100").memory_gib == 80 and gpu_by_key("h200").memory_gib == 141
    assert MEMORY_FRACTION is fit.MEMORY_FRACTION == 0.9


def test_70b_on_8_ranks_does_not_fit_an_h100_and_every_way_out_is_the_estimate_s_own_figure(llama_70b):
    est = estimate_memory(llama_70b, world_size=8, seq_len=4096, target="h100")
    fit = est.fit
    assert not fit.fits and fit.capacity_bytes == H100 and fit.budget_bytes == PLAN and fit.gpu == "H100"
    assert fit.device_bytes == est.model_state_bytes + est.activation_bytes > 2.5 * H100  # 257.9 GiB measured
    # the activations alone (126.5 GiB) exceed it: no rank count fits without checkpointing, and it says so
    assert est.activation_bytes > PLAN and "activations of one micro-batch alone exceed it" in fit.no_rank_count
    changes = [dict(w.change) for w in fit.ways_out]
    assert {"activation_checkpointing": "full"} in changes and {"memory": "lean"} in changes
    assert any(c.get("offload_param") and c.get("strategy") == "deepspeed" for c in changes)
    assert any(w.fits for w in fit.ways_out)
    for way in fit.ways_out:  # each figure is what the estimate says of that run, and fits says so rightly
        assert way.device_bytes == _rerun(llama_70b, way, world_size=8, seq_len=4096), way
        assert way.fits == (way.device_bytes <= PLAN), way
    ranks = next(w for w in fit.ways_out if "world_size" in w.change)  # checkpointing and the fewest ranks
    assert ranks.fits and ranks.change["activation_checkpointing"] == "full"
    fewer = ranks.change["world_size"] - 1
    assert _rerun(llama_70b, type(ranks)({**ranks.change, "world_size": fewer}, "", 0, False), world_size=8,
                  seq_len=4096) > PLAN  # one rank fewer does not fit
    printed = str(est)
    assert f"does NOT fit the H100: {fit.device_bytes / 2**30:,.2f} GiB per rank; a rank may plan on 72.00 GiB, 90% " \
        "of its 80 GiB (the rest: transient buffers, the CUDA context, fragmentation). Ways out" in printed
    assert f"world_size={ranks.change['world_size']}): " in printed
    assert json.loads(json.dumps(est.to_dict()))["fit"]["fits"] is False


def test_more_ranks_alone_is_the_fewest_that_fit(llama_70b):
    est = estimate_memory(llama_70b, world_size=8, seq_len=512, target="h100")
    ranks = next(w for w in est.fit.ways_out if set(w.change) == {"world_size"})
    n = ranks.change["world_size"]
    assert ranks.fits and n > 8 and ranks.device_bytes == _rerun(llama_70b, ranks, world_size=8, seq_len=512)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert device_bytes(estimate_memory(llama_70b, world_size=n - 1, seq_len=512)) > PLAN


def test_a_rank_that_fits_says_so_with_what_is_left(llama_70b):
    est = estimate_memory(llama_70b, world_size=64, seq_len=1024, target="h100")
    assert est.fit.fits and est.fit.ways_out == ()
    assert f"fits the H100: {est.fit.device_bytes / 2**30:,.2f} GiB per rank; a rank may plan on 72.00 GiB" in str(est)
    assert estimate_memory(llama_70b, world_size=64, seq_len=1024).fit is None  # no target, no verdict


def test_a_capability_alone_has_no_memory_to_judge_and_says_so(llama_70b):
    est = estimate_memory(llama_70b, world_size=64, seq_len=1024, target="sm_90")
    assert est.fit is None and any("whether a rank fits is not judged: sm_90" in n for n in est.notes)


def test_the_cli_prints_the_verdict_and_the_ways_out(capsys):
    assert cli.main(["estimate", "--model-size", "3b", "--target", "l4", "--seq-len", "1024"]) == 0
    out = capsys.readouterr().out.splitlines()
    verdict = next(i for i, line in enumerate(out) if line.startswith("does NOT fit the L4: "))
    assert out[verdict].endswith("Ways out, each computed by this estimate:")
    assert any(line.startswith("  more ranks (world_size=") and line.endswith(" per rank, fits")
               for line in out[verdict + 1:]), out


@pytest.mark.parametrize("argv, note", [
    (["--offload-param"], "offload_param=True has no effect here (read only when strategy in ['deepspeed'] and "
                          "zero_stage in [3]; strategy='fsdp', zero_stage=2)."),
    (["--strategy", "fsdp1", "--replicate-degree", "2", "--world-size", "2"],
     "replicate_degree=2 has no effect here (read only when strategy in ['fsdp']; strategy='fsdp1')."),
    (["--memory", "lean", "--optimizer", "sgd"], "optimizer='sgd' has no effect here (memory='lean' builds its own "
                                                 "optimizer"),
    (["--strategy", "deepspeed", "--model-dtype", "bf16"], "model_dtype='bf16' has no effect here "
                                                           "(strategy='deepspeed': the engine casts the module"),
], ids=["offload under fsdp", "hsdp under fsdp1", "optimizer under lean", "model dtype under deepspeed"])
def test_an_estimate_flag_the_chosen_axes_do_not_read_is_one_note(capsys, argv, note):
    assert cli.main(["estimate", "--fp8", "none", *argv]) == 0
    err = capsys.readouterr().err
    assert err.count(note) == 1 and f"fp8dist estimate: note: {note}" in err, err


def test_estimate_memory_warns_as_wrap_model_does():
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                             num_hidden_layers=1, num_attention_heads=2))
    with pytest.warns(UserWarning, match=r"offload_optimizer=True has no effect here \(read only when strategy in "
                                         r"\['deepspeed'\]; strategy='fsdp'\)"):
        est = estimate_memory(model, strategy="fsdp", offload_optimizer=True)
    assert est.offloaded == ()  # and nothing was offloaded


def test_the_rank_search_guesses_from_two_estimates_and_keeps_searching_where_the_guess_is_wrong():
    """bytes = A + S / ranks: the fewest ranks in 3 estimates (two points, the guess, one fewer); a layout whose
    bytes jump (states padded to 8-rank multiples) is searched as before, to the same answer as trying every count."""
    from types import SimpleNamespace

    from fp8dist.accounting.fit import _ranks_that_fit

    def search(bytes_of, world, allowed):
        asked = []

        def rerun(n, **change):
            asked.append(n)
            return SimpleNamespace(bytes={"states": bytes_of(n)}, offloaded=(), activations_modelled=False,
                                   activation_bytes=0)

        found, why = _ranks_that_fit(rerun, world, 1, allowed, bytes_of(world), {})
        fewest = next(n for n in range(world + 1, 10_000) if bytes_of(n) <= allowed)
        assert why == "" and found == (fewest, bytes_of(fewest))
        return asked

    smooth = lambda n: 10_000 + 800_000 // n  # noqa: E731
    assert search(smooth, 8, 40_000) == [9, 27, 26]  # 800000 / 30000 = 26.7: 27 fits, 26 does not
    padded = lambda n: 10_000 + 800_000 // (-(-n // 8) * 8) + (500 if n % 8 else 0)  # noqa: E731
    asked = search(padded, 8, 40_000)
    assert len(asked) > 3  # the guess was not confirmed: doubling and bisecting found it
