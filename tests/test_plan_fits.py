"""``fp8dist plan --compare-recipes`` and ``estimate --target`` predict the step of a run that fits: with the
activation checkpointing a rank needs (and say which and why), or no step at all, with ``estimate``'s own "does NOT
fit" verdict and ways out (issue 52 item 5)."""

from __future__ import annotations

import json
import warnings

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from fp8dist import estimate_memory
from fp8dist.cli import main

# Meta's config.json of Llama-3-8B and Llama-3-70B (the shapes; nothing downloaded)
LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=8192)
LLAMA3_70B = {**LLAMA3_8B, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
              "num_attention_heads": 64}
RUN = ["--target", "h100", "--world-size", "8", "--strategy", "fsdp", "--seq-len", "8192"]


def _config(tmp_path, shape):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**shape, "model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    return str(path)


def test_70b_on_8_h100s_is_said_not_to_fit_with_estimate_s_ways_out_and_no_tokens_per_s(tmp_path, capsys):
    """It used to print 1,700 tokens/s at 82.7% MFU for a rank that needs 382 GiB of an 80 GiB H100."""
    argv = ["--model-config", _config(tmp_path, LLAMA3_70B), *RUN]
    assert main(["estimate", *argv]) == 0
    estimated = capsys.readouterr().out.splitlines()
    verdict = next(i for i, line in enumerate(estimated) if line.startswith("does NOT fit the H100: 382.41 GiB"))
    ways = [line for line in estimated[verdict + 1:] if line.startswith("  ")]
    assert len(ways) == 7, estimated  # more ranks (none), 3 levers, checkpointing with each of 3
    assert "no step predicted: a rank does not fit the H100 at this rank count, with or without activation " \
           "checkpointing" in estimated
    assert not any("tokens/s" in line for line in estimated)

    assert main(["plan", *argv, "--compare-recipes"]) == 0
    planned = capsys.readouterr().out.splitlines()
    at = planned.index(estimated[verdict])  # estimate's own words, then its ways out, in its order
    assert planned[at - 1] == ("no step predicted: a rank does not fit the H100 at this rank count, with or without "
                               "activation checkpointing")
    assert planned[at + 1:at + 1 + len(ways)] == ways
    assert not any("tokens/s" in line or line.startswith("predicted fastest") for line in planned)

    assert main(["plan", *argv, "--compare-recipes", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert (record["steps"], record["fastest"]) == ([], None)
    assert record["step_checkpointing"] == {"mode": None, "configured": "none", "fits": False,
                                            "why": planned[at - 1]}
    assert record["fit"]["fits"] is False and len(record["fit"]["ways_out"]) == 6  # and no rank count


def test_8b_on_h100s_names_the_checkpointing_its_step_assumes(tmp_path, capsys):
    argv = ["--model-config", _config(tmp_path, LLAMA3_8B), *RUN, "--compare-recipes"]
    assert main(["plan", *argv]) == 0
    out = capsys.readouterr().out.splitlines()
    head = next(i for i, line in enumerate(out) if line.startswith("predicted training step on 8x H100"))
    assert ("(batch 1 x 8,192 tokens per rank, activation checkpointing none, compiled, NVLink domain 8 GPUs, "
            "network 50 GB/s per GPU between domains;") in out[head]  # the H100 record's topology
    # the estimate's verdict: it fits, by 0.9 GiB
    assert out[head].endswith("; activation checkpointing assumed: as configured: a rank fits the H100 with it "
                              "(71.09 GiB of 72.00 GiB)")


def test_a_run_that_fits_only_with_checkpointing_is_predicted_with_it_and_says_so(tmp_path, capsys):
    """Two sequences per rank need 126 GiB without checkpointing: the step is the one with full checkpointing."""
    argv = ["--model-config", _config(tmp_path, LLAMA3_8B), *RUN, "--micro-batch-size", "2", "--compare-recipes"]
    assert main(["plan", *argv]) == 0
    out = capsys.readouterr().out.splitlines()
    head = next(i for i, line in enumerate(out) if line.startswith("predicted training step on 8x H100"))
    assert "activation checkpointing full, compiled, NVLink domain 8 GPUs" in out[head]
    assert out[head].endswith(
        "; activation checkpointing assumed: full, not the configured none: a rank does not fit the H100 without it "
        "(126.24 GiB per rank; 35.24 GiB with activation checkpointing; a rank may plan on 72.00 GiB)")
    assert main(["plan", *argv, "--json"]) == 0
    assumed = json.loads(capsys.readouterr().out)
    fp8 = [layer for layer in assumed["layers"] if layer["precision"] == "fp8"]
    assert fp8 and all(layer["converted_to"] == "Float8Linear" and layer["runs"] for layer in fp8)
    assert all(layer["speedup"] > 1 for layer in fp8), "each FP8 layer's predicted speedup on the H100, as the table"
    assert main(["plan", *argv, "--activation-checkpointing", "full", "--json"]) == 0
    asked = json.loads(capsys.readouterr().out)
    assert assumed["steps"] == asked["steps"] and assumed["steps"]  # the same prediction as asking for it
    assert assumed["step_checkpointing"]["mode"] == "full" and asked["step_checkpointing"]["configured"] == "full"
    assert main(["estimate", *argv[:-1], "--micro-batch-size", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["steps"] == assumed["steps"], "estimate --target: the same steps"


def test_the_planner_runs_the_model_wide_first_last_rule_once_per_model(monkeypatch):
    """The fit search re-plans the model per way out and rank count; torchao's first/last Linear rule
    (a meta-device forward) ran in each: now once per model structure, again once the model changes."""
    from fp8dist.fp8.torchao import TorchaoBackend

    calls = []
    original = TorchaoBackend.model_exclusions
    monkeypatch.setattr(TorchaoBackend, "model_exclusions",
                        lambda self, model, cfg: calls.append(id(model)) or original(self, model, cfg))
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**{**LLAMA3_70B, "num_hidden_layers": 2}))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        est = estimate_memory(model, strategy="fsdp", fp8="torchao", world_size=1, seq_len=65536, target="h100")
        assert not est.fit.fits and len(est.fit.ways_out) >= 2, "the search re-planned the model"
        assert calls == [id(model)]
        model.lm_head = torch.nn.Linear(8192, 128256, bias=False, device="meta")  # a changed model: planned afresh
        estimate_memory(model, strategy="fsdp", fp8="torchao", world_size=1, seq_len=8192, target="h100")
    assert len(calls) == 2


def test_the_topology_of_the_predicted_step_is_the_users_where_given_and_said(tmp_path, capsys):
    """``--nvlink-domain`` / ``--network-gbps`` reach the step model and its header; a bad one is one line naming
    it; without ``--compare-recipes`` (nothing reads them) they are a note."""
    argv = ["--model-config", _config(tmp_path, LLAMA3_8B), *RUN, "--compare-recipes"]
    assert main(["plan", *argv, "--json"]) == 0
    own = json.loads(capsys.readouterr().out)["steps"]
    assert main(["plan", *argv, "--nvlink-domain", "2", "--network-gbps", "5"]) == 0
    out = capsys.readouterr().out.splitlines()
    head = next(line for line in out if line.startswith("predicted training step on 8x H100"))
    assert "NVLink domain 2 GPUs, network 5 GB/s per GPU between domains;" in head
    assert main(["plan", *argv, "--nvlink-domain", "2", "--network-gbps", "5", "--json"]) == 0
    slow = json.loads(capsys.readouterr().out)["steps"]
    assert slow != own  # 8 ranks over 4 domains at 5 GB/s: the collectives cost more than on one 8-GPU NVLink node
    assert main(["plan", *argv, "--nvlink-domain", "0"]) == 2
    err = capsys.readouterr().err
    assert "nvlink_domain=0" in err and len(err.strip().splitlines()) == 1, err
    assert main(["plan", "--model-config", _config(tmp_path, LLAMA3_8B), *RUN, "--network-gbps", "5"]) == 0
    assert ("fp8dist plan: note: --network-gbps has no effect without --compare-recipes"
            in capsys.readouterr().err)
