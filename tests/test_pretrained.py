"""Meta-device models, ``pretrained=`` and ``fp8dist.save_pretrained``: 2 real gloo ranks, checkpoints written into
tmp_path by ``save_pretrained`` (no download). Each multi-rank test runs its cases in one spawn."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from dist_harness import run_ranks
from helpers import train_losses

STEPS = 2


def _tiny(tied: bool = False):
    from fp8dist.train.models import build_llama

    model = build_llama("tiny", seed=1)
    if tied:
        model.config.tie_word_embeddings = True
        model.lm_head.weight = model.model.embed_tokens.weight
    return model


def _write(model, path, **kwargs) -> str:
    """A pretrained directory written by fp8dist.save_pretrained of an unwrapped model (fp32 keeps it exact)."""
    import fp8dist

    fp8dist.save_pretrained(model, path, dtype=torch.float32, **kwargs)
    return str(path)


def _meta_from(path):
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))


def _held_fraction(model) -> float:
    """Bytes of parameter storage this rank holds, as a fraction of the full parameters."""
    from fp8dist.strategies.local_shards import local_params

    params = local_params(model)
    held = sum(p.local.numel() * p.local.element_size() for p in params)
    full = sum(torch.Size(p.shape).numel() * p.local.element_size() for p in params)
    return held / full


def _load_cases(rank: int, world: int, single: str, sharded: str, tied: str) -> dict:
    from transformers import AutoModelForCausalLM

    import fp8dist

    warnings.simplefilter("ignore")
    out = {}
    eager_losses = {}  # single and sharded hold the same weights (_tiny()): one eager run serves both
    for key, path, strategy, fp8, extra in (
            ("fsdp", single, "fsdp", None, {}), ("fsdp+torchao", single, "fsdp", "torchao", {}),
            ("fsdp1", single, "fsdp1", None, {}), ("ddp", single, "ddp", None, {}),
            ("fsdp sharded files", sharded, "fsdp", None, {}), ("fsdp1 sharded files", sharded, "fsdp1", None, {}),
            ("fsdp tied", tied, "fsdp", None, {}), ("fsdp1 tied", tied, "fsdp1", None, {}),
            ("fsdp+torchao activation checkpointing", single, "fsdp", "torchao", {"activation_checkpointing": "full"}),
            ("fsdp, a CPU model", single, "fsdp", None, {"cpu": True})):
        cpu = extra.pop("cpu", False)
        same = (path == tied, strategy, fp8, tuple(sorted(extra.items())))
        if same not in eager_losses:
            eager = fp8dist.wrap_model(AutoModelForCausalLM.from_pretrained(path), strategy=strategy, fp8=fp8,
                                       **extra)
            eager_losses[same] = train_losses(eager, rank, world, steps=STEPS)
        expected = eager_losses[same]
        model = _tiny() if cpu else _meta_from(path)  # pretrained= into real weights: a plain load
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            wrapped = fp8dist.wrap_model(model, strategy=strategy, fp8=fp8, pretrained=path, **extra)
        said = [str(w.message) for w in caught if "keeps the whole model on every rank" in str(w.message)]
        info = fp8dist.get_wrap_info(wrapped)
        read = info.pretrained.bytes_read / info.pretrained.checkpoint_bytes
        held = _held_fraction(wrapped)
        out[key] = (expected, train_losses(wrapped, rank, world, steps=STEPS), read, held, info.materialized, said)
    # a meta model larger than this machine's memory under ddp: refused before anything is allocated
    from fp8dist.train.models import llama_config

    huge = llama_config("1b")
    huge.num_hidden_layers = 2000  # ~0.4 T parameters
    with torch.device("meta"):
        big = AutoModelForCausalLM.from_config(huge)
    try:
        fp8dist.wrap_model(big, strategy="ddp")
        out["ddp too large"] = "no error"
    except MemoryError as err:
        out["ddp too large"] = str(err)
    return out


@pytest.mark.slow
def test_meta_model_with_pretrained_trains_like_eager_from_pretrained_reading_half_per_rank(tmp_path):
    """Meta init + pretrained= gives exactly the eager from_pretrained + wrap_model losses (fsdp with and without
    torchao, fsdp1, ddp; one file, sharded files, tied embeddings, activation-checkpointed blocks; and pretrained=
    into a CPU model); under fsdp and fsdp1 each rank reads half the checkpoint's bytes and holds half the
    parameters, never the whole."""
    single = _write(_tiny(), tmp_path / "single")
    sharded = _write(_tiny(), tmp_path / "sharded", max_shard_size=400_000)
    tied = _write(_tiny(tied=True), tmp_path / "tied")
    assert len(json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())["weight_map"]) == 21
    assert len(list((tmp_path / "sharded").glob("model-*-of-*.safetensors"))) >= 3
    results = run_ranks(_load_cases, single, sharded, tied)
    for rank, result in enumerate(results):
        assert "materializes the whole meta-device model on every rank" in result.pop("ddp too large")
        for key, (expected, losses, read, held, how, said) in result.items():
            assert losses == expected, (rank, key)
            assert len(said) == (key == "ddp"), (rank, key, said)  # said once, and only where it is so
            if key == "ddp":
                assert read == 1.0 and held == 1.0 and "the whole model on every rank" in how
            else:  # 0.5 exactly for the tiny Llama (every dim 0 even); FSDP1 reads a row more at shard edges
                assert abs(read - 0.5) < 0.01 and abs(held - 0.5) < 0.01, (rank, key, read, held)
                assert "this rank's shards only" in how or key == "fsdp, a CPU model" and how == ""


def _full_weights(model) -> dict[str, torch.Tensor]:
    """Every parameter's full value by its first plain name (on every rank)."""
    from fp8dist.strategies.local_shards import gather_full

    return {names[0]: full for names, full in gather_full(model, to_rank0=False)}


def _logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def _export_cases(rank: int, world: int, root: str) -> dict:
    from transformers import AutoModelForCausalLM

    import fp8dist
    from fp8dist.train.data import Batches
    from fp8dist.train.models import llama_config

    warnings.simplefilter("ignore")
    ids = Batches(batch_size=4, seq_len=32, rank=rank, world_size=world, seed=3)[0]
    out = {}
    for key, strategy, fp8, meta, dtype in (("fsdp bf16", "fsdp", None, False, torch.bfloat16),
                                            ("fsdp torchao fp32", "fsdp", "torchao", False, torch.float32),
                                            ("fsdp torchao bf16", "fsdp", "torchao", False, torch.bfloat16),
                                            ("fsdp meta-init bf16", "fsdp", None, True, torch.bfloat16),
                                            ("fsdp1 fp32", "fsdp1", None, False, torch.float32),
                                            ("fsdp tied fp32", "fsdp", None, False, torch.float32),
                                            ("ddp fp32", "ddp", None, False, torch.float32)):
        torch.manual_seed(0)
        if meta:
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(llama_config("tiny"))
        else:
            model = _tiny(tied="tied" in key)
        wrapped = fp8dist.wrap_model(model, strategy=strategy, fp8=fp8)
        train_losses(wrapped, rank, world, steps=STEPS)
        trained, logits = _full_weights(wrapped), _logits(wrapped, ids)
        path = f"{root}/{key.replace(' ', '-')}"
        fp8dist.save_pretrained(wrapped, path, dtype=dtype)
        reloaded = AutoModelForCausalLM.from_pretrained(path)
        weights, loaded_dtype = reloaded.state_dict(), reloaded.dtype
        # a tied weight is written once (under its first name) and reloaded tied: the other name is an alias
        aliases = {n for n in weights if n not in trained and any(
            weights[n].data_ptr() == weights[t].data_ptr() for t in trained)}
        same = sorted(set(weights) - aliases) == sorted(trained) and all(
            weights[n].dtype == dtype and torch.equal(weights[n], trained[n].to(dtype)) for n in trained)
        same = same and bool(aliases) == ("tied" in key)
        # trained on in fp32, as wrap_model asks of a bf16 export (no fp32 master otherwise); computes in bf16 alike
        rewrapped = fp8dist.wrap_model(reloaded.float(), strategy=strategy, fp8=fp8)
        out[key] = (same, torch.equal(_logits(rewrapped, ids), logits), loaded_dtype)
    return out


def test_save_pretrained_reloads_with_from_pretrained_exactly(tmp_path):
    """Train 2 steps, export, AutoModelForCausalLM.from_pretrained: the same names and weights in the dtype asked
    (bf16 or fp32), and wrapped again the same logits; FP8 layers are written as their high-precision weights;
    also a meta-initialized model, tied embeddings (written once, reloaded tied) and each strategy's way of
    gathering (FSDP2, FSDP1, DDP)."""
    results = run_ranks(_export_cases, str(tmp_path))
    for rank, result in enumerate(results):
        for key, (same, logits, dtype) in result.items():
            assert same, (rank, key)
            assert dtype == (torch.float32 if "fp32" in key else torch.bfloat16), (rank, key)
            # FP8 scales come from the weights: bf16 weights give other scales than the fp32 masters trained
            assert logits or key == "fsdp torchao bf16", (rank, key)
    files = sorted(p.name for p in (tmp_path / "fsdp-bf16").iterdir())
    assert files == ["config.json", "generation_config.json", "model.safetensors"]
    config = json.loads((tmp_path / "fsdp-bf16" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["dtype"] == "bfloat16"


def test_bad_pretrained_directories_are_errors_naming_what_differs_and_the_way_out(tmp_path):
    """No safetensors, another model's checkpoint (shapes, names), a damaged index: errors listing the first
    mismatches, before any weight is copied (strategy 'none': no process group needed)."""
    import fp8dist
    from fp8dist.train.models import build_llama, llama_config
    from fp8dist.pipeline.pretrained import PretrainedError

    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(PretrainedError, match=r"holds no safetensors weights .*pytorch_model\.bin.*save_pretrained"):
        fp8dist.wrap_model(build_llama("tiny"), strategy="none", pretrained=tmp_path / "empty")
    with pytest.raises(PretrainedError, match="is not a directory"):
        fp8dist.wrap_model(build_llama("tiny"), strategy="none", pretrained=tmp_path / "nowhere")
    wider = _write(build_llama("small"), tmp_path / "small")
    with pytest.raises(PretrainedError, match=r"shape mismatches: model\.embed_tokens\.weight \[256, 256\] in "
                                              r"the checkpoint, \[256, 128\] in the model.* and \d+ more.*"
                                              r"AutoConfig\.from_pretrained"):
        fp8dist.wrap_model(build_llama("tiny"), strategy="none", pretrained=wider)
    config = llama_config("tiny")
    config.num_hidden_layers = 3
    from transformers import LlamaForCausalLM

    deeper = _write(LlamaForCausalLM(config), tmp_path / "deeper")
    with pytest.raises(PretrainedError, match=r"9 checkpoint tensors the model does not have: "
                                              r"model\.layers\.2\.input_layernorm\.weight"):
        fp8dist.wrap_model(build_llama("tiny"), strategy="none", pretrained=deeper)
    with pytest.raises(PretrainedError, match=r"9 parameters missing from the checkpoint: model\.layers\.2\."):
        fp8dist.wrap_model(LlamaForCausalLM(config), strategy="none",
                           pretrained=_write(build_llama("tiny"), tmp_path / "tiny"))
    (tmp_path / "tiny" / "model.safetensors.index.json").write_text('{"weight_map": {"x": "gone.safetensors"}}')
    with pytest.raises(PretrainedError, match=r"names 1 file that is not in .*gone\.safetensors"):
        fp8dist.wrap_model(build_llama("tiny"), strategy="none", pretrained=tmp_path / "tiny")


def test_save_pretrained_bad_arguments_and_a_failed_write_leave_nothing(tmp_path):
    import fp8dist
    from fp8dist.train.models import build_llama

    model = build_llama("tiny")
    with pytest.raises(ValueError, match=r"max_shard_size='lots' is not a size.*'2GB'"):
        fp8dist.save_pretrained(model, tmp_path / "a", max_shard_size="lots")
    with pytest.raises(ValueError, match=r"dtype=torch.int8 is not an export dtype; choose torch.bfloat16"):
        fp8dist.save_pretrained(model, tmp_path / "a", dtype=torch.int8)
    out = tmp_path / "b"
    out.mkdir()
    (out / "tokenizer.json").write_text("{}")
    fp8dist.save_pretrained(model, out, max_shard_size=400_000)  # sharded, then one file: the shards go
    assert (out / "model.safetensors.index.json").is_file()
    fp8dist.save_pretrained(model, out)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors",
                                                     "tokenizer.json"]
    # the second of several files cannot be written (a directory holds its name): the first is removed again
    sharded = tmp_path / "c"
    fp8dist.save_pretrained(model, sharded, max_shard_size=400_000)
    second = sorted(p.name for p in sharded.glob("model-*.safetensors"))[1]
    failing = tmp_path / "d"
    (failing / second).mkdir(parents=True)
    with pytest.raises(OSError, match=rf"writing .*{second} failed: .*Nothing of this export was kept"):
        fp8dist.save_pretrained(model, failing, max_shard_size=400_000)
    assert [p.name for p in failing.iterdir()] == [second]


def _init_cases(rank: int, world: int) -> dict:
    from transformers import LlamaForCausalLM

    import fp8dist
    from fp8dist.train.models import llama_config

    warnings.simplefilter("ignore")
    weights, buffers = {}, {}
    for key, strategy in (("fsdp", "fsdp"), ("fsdp again", "fsdp"), ("fsdp1", "fsdp1"), ("ddp", "ddp")):
        torch.manual_seed(5)
        with torch.device("meta"):
            model = LlamaForCausalLM(llama_config("tiny"))
        wrapped = fp8dist.wrap_model(model, strategy=strategy)
        weights[key] = _full_weights(wrapped)
        buffers[key] = {n: b.clone() for n, b in fp8dist.unwrap_model(wrapped).named_buffers()}
    torch.manual_seed(5)
    eager = LlamaForCausalLM(llama_config("tiny"))
    reference = weights["fsdp"]
    return {
        "same for every strategy and run": all(
            all(torch.equal(w[n], reference[n]) for n in reference) for w in weights.values()),
        "buffers as eager": all(all(torch.equal(b[n], dict(eager.named_buffers())[n]) for n in b)
                                for b in buffers.values()),
        "std of q_proj": reference["model.layers.0.self_attn.q_proj.weight"].std().item(),
        "norms are ones": bool((reference["model.norm.weight"] == 1).all()),
        "equals eager init": all(torch.equal(reference[n], p) for n, p in eager.named_parameters()),
    }


def test_meta_model_without_pretrained_gets_its_own_init_the_same_on_every_strategy():
    """No pretrained=: Hugging Face's _init_weights, module by module at full size: identical weights under fsdp,
    fsdp1 and ddp and on a second run with the seed, buffers (rotary frequencies) as an eager model's; the weights
    follow the config (std 0.02, norms 1) but are not an eager construction's (its module constructors draw
    random numbers first)."""
    for result in run_ranks(_init_cases):
        assert result["same for every strategy and run"] and result["buffers as eager"] and result["norms are ones"]
        assert abs(result["std of q_proj"] - 0.02) < 0.002
        assert not result["equals eager init"]


def _train_job(rank: int, world: int, source: str, out: str) -> list[float]:
    from fp8dist.config.resolve import Config
    from fp8dist.train.job import TrainConfig, run_training

    warnings.simplefilter("ignore")
    config = Config.from_dict({"strategy": "fsdp", "fp8": "torchao", "pretrained": source})
    job = TrainConfig(steps=2, batch_size=4, seq_len=32, save_pretrained=out)
    result = run_training(config, job, log=lambda line: None)
    losses = result.losses
    # the first step's loss, by hand: the eager model of the same directory, wrapped the same way
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    import fp8dist
    from fp8dist.train.data import Batches

    eager = fp8dist.wrap_model(AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32),
                               config=config.to_dict() | {"pretrained": None})
    ids = Batches(batch_size=4, seq_len=32, rank=rank, world_size=world, seed=job.seed)[0]
    with torch.no_grad():
        first = eager(input_ids=ids, labels=ids).loss.detach().float()
    dist.all_reduce(first)
    return losses + [(first / world).item()], result.sharding[rank]


def test_fp8dist_train_pretrained_and_save_pretrained(tmp_path):
    """`fp8dist train --pretrained DIR --save-pretrained OUT`: the flags land in the one config, the job starts
    from DIR's weights on a meta model and writes OUT, which from_pretrained reads back as bf16."""
    import argparse

    from transformers import AutoModelForCausalLM

    import fp8dist
    from fp8dist.cli import train as train_cli

    parser = argparse.ArgumentParser()
    train_cli.add_parser(parser.add_subparsers())
    args = parser.parse_args(["train", "--pretrained", "src", "--save-pretrained", "out", "--fp8", "none"])
    config, job = train_cli._config_and_job(args)
    assert config.parallel.pretrained == "src" and job.save_pretrained == "out"
    source = str(tmp_path / "src")
    fp8dist.save_pretrained(_tiny(), source)  # bf16, as checkpoints usually are: the job still trains fp32 weights
    (*losses, by_hand), stored = run_ranks(_train_job, source, str(tmp_path / "out"))[0]
    assert len(losses) == 2 and losses[1] < losses[0]
    assert losses[0] == by_hand, "the job starts from the pretrained weights"
    assert "elements (50.0%) in fp32; compute in bf16" in stored, stored
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert reloaded.dtype == torch.bfloat16
    assert not torch.equal(reloaded.lm_head.weight, _tiny().lm_head.weight.to(torch.bfloat16)), "trained, not copied"


def _zero3_cases(rank: int, world: int, path: str, out: str) -> dict:
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    import fp8dist
    from fp8dist.train.models import llama_config
    from helpers import engine_losses

    warnings.simplefilter("ignore")
    zero3 = dict(strategy="deepspeed", zero_stage=3, micro_batch_size=2, optimizer={"type": "AdamW", "lr": 1e-3})
    result = {}
    # ZeRO-3 + meta + pretrained= is this fresh process's first distributed call, as in a user's script: zero.Init
    # once read DeepSpeed's world size (1) before deepspeed.comm was set up, and refused the batch size
    for stage, fp8 in ((3, None), (2, None), (3, "torchao")):  # ZeRO-2 keeps whole parameters: materialized whole
        kwargs = {**zero3, "zero_stage": stage}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            engine, _ = fp8dist.wrap_model(_meta_from(path), pretrained=path, fp8=fp8, **kwargs)
        rounded = sum("holds fp32 weights and DeepSpeed's bf16 mode holds the parameters in bf16" in str(w.message)
                      for w in caught)
        warnings.simplefilter("ignore")
        loaded = fp8dist.get_wrap_info(engine).pretrained
        losses = engine_losses(engine, rank, world, steps=STEPS)
        eager, _ = fp8dist.wrap_model(AutoModelForCausalLM.from_pretrained(path), fp8=fp8, **kwargs)
        expected = engine_losses(eager, rank, world, steps=STEPS)
        result[f"ZeRO-{stage} fp8={fp8}"] = (expected, losses, loaded.bytes_read / loaded.checkpoint_bytes,
                                            _held_fraction(engine), rounded)
    trained = _full_weights(engine)  # the optimizer's fp32 master weights
    fp8dist.save_pretrained(engine, out, dtype=torch.float32)
    reloaded = AutoModelForCausalLM.from_pretrained(out).state_dict()
    result["export"] = sorted(reloaded) == sorted(trained) and all(
        torch.equal(reloaded[n], trained[n]) for n in trained)
    inits = []
    for kwargs in (zero3, {"strategy": "fsdp"}):
        torch.manual_seed(5)
        with torch.device("meta"):
            model = LlamaForCausalLM(llama_config("tiny"))
        wrapped = fp8dist.wrap_model(model, **kwargs)
        inits.append(_full_weights(wrapped[0] if isinstance(wrapped, tuple) else wrapped))
    bf16 = {n: w.to(torch.bfloat16) for n, w in inits[1].items()}  # ZeRO-3 holds bf16 module weights
    result["init as fsdp's"] = all(torch.equal(inits[0][n].to(torch.bfloat16), bf16[n]) for n in bf16)
    return result


def test_deepspeed_zero3_meta_model_loads_its_partitions_and_exports(tmp_path):
    """ZeRO-3: a meta model partitioned through DeepSpeed's zero.Init module by module, each rank writing its
    slice of pretrained= (half the bytes) into its partitions: the eager from_pretrained losses exactly, with and
    without torchao (ZeRO-2: materialized whole, the same losses), and one warning that the fp32 checkpoint is
    rounded to ZeRO-3's bf16 parameters; the export writes the optimizer's fp32 master
    weights; the model's own init matches fsdp's."""
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install 'fp8dist[deepspeed]')")
    path = _write(_tiny(), tmp_path / "src")
    for result in run_ranks(_zero3_cases, path, str(tmp_path / "out"), timeout=480):
        assert result.pop("export") and result.pop("init as fsdp's")
        for key, (expected, losses, read, held, rounded) in result.items():
            assert losses == expected, key
            share = 1.0 if key.startswith("ZeRO-2") else 0.5
            assert abs(read - share) < 0.01 and abs(held - share) < 0.01, (key, read, held)
            # the fp32 checkpoint rounded into ZeRO-3's bf16 partitions is said once
            assert rounded == (0 if key.startswith("ZeRO-2") else 1), (key, rounded)


def test_fp8dist_plan_and_estimate_read_the_model_of_pretrained(tmp_path, capsys):
    """`fp8dist plan --pretrained DIR` plans DIR's model (its config.json, on the meta device), not the built-in one."""
    from fp8dist.cli import main
    from fp8dist.train.models import build_llama

    path = _write(build_llama("small"), tmp_path / "small")
    assert main(["plan", "--pretrained", path, "--fp8", "none"]) == 0
    assert "model.layers.3.mlp.down_proj" in capsys.readouterr().out  # 4 layers: the small preset, not tiny's 2
    assert main(["estimate", "--pretrained", path, "--world-size", "2"]) == 0
    assert "3,279,104 parameters" in capsys.readouterr().out
    assert main(["plan", "--pretrained", str(tmp_path / "nowhere")]) == 2
    assert "nowhere': the directory does not exist" in capsys.readouterr().err  # never asks the Hub


class _Scaled(torch.nn.Module):
    """A parameter no initializer knows: a meta model of it cannot be initialized by fp8dist."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)
        self.scale = torch.nn.Parameter(torch.ones(16))

    def forward(self, x):
        return self.proj(x) * self.scale


def test_a_meta_model_without_pretrained_and_without_an_initializer_is_refused():
    import fp8dist

    with torch.device("meta"):
        model = _Scaled()
    with pytest.raises(ValueError, match=r"1 parameter has no initialization to run .*\['scale'\].*"
                                         r"pretrained=DIR"):
        fp8dist.wrap_model(model, strategy="none", param_dtype="fp32")
    with torch.device("meta"):
        plain = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.LayerNorm(16))
    torch.manual_seed(0)
    wrapped = fp8dist.wrap_model(plain, strategy="none", param_dtype="fp32")  # reset_parameters per module
    assert bool((wrapped[1].weight == 1).all()) and wrapped[0].weight.abs().max() <= 0.25  # kaiming bound 1/sqrt(16)


# ---- MoE checkpoints in the per-expert layout of the Hub (Mixtral's experts.N.w1/w2/w3, Qwen-MoE's experts.N.*)

def _moe_tiny(family: str):
    """A tiny MoE of ``family`` (transformers 5: fused 3-D experts), fp32, seed 0."""
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(0)
    common = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  num_experts_per_tok=2)
    if family == "mixtral":
        return MixtralForCausalLM(MixtralConfig(intermediate_size=96, num_local_experts=4, **common))
    return Qwen2MoeForCausalLM(Qwen2MoeConfig(intermediate_size=128, moe_intermediate_size=48, num_experts=4,
                                              shared_expert_intermediate_size=64, **common))


def _write_per_expert(model, path) -> dict[str, torch.Tensor]:
    """``model``'s weights in its family's per-expert Hub layout (Mixtral: ``block_sparse_moe.experts.N.w1`` gate,
    ``w3`` up, ``w2`` down, and the router under ``block_sparse_moe``; Qwen2-MoE: ``mlp.experts.N.gate_proj``,
    ``up_proj``, ``down_proj``), written by hand in two safetensors files + index; returns the fused state dict."""
    from safetensors.torch import save_file

    mixtral = model.config.model_type == "mixtral"
    names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    legacy = {}
    for key, value in state.items():
        module, _, attr = key.rpartition(".")
        old = module.replace(".mlp.", ".block_sparse_moe.") + "." if mixtral and ".mlp." in key else module + "."
        if attr == "gate_up_proj":
            half = value.shape[1] // 2
            for e in range(value.shape[0]):
                legacy[f"{old}{e}.{names[0]}.weight"] = value[e, :half].contiguous()
                legacy[f"{old}{e}.{names[1]}.weight"] = value[e, half:].contiguous()
        elif attr == "down_proj" and module.endswith(".experts"):
            for e in range(value.shape[0]):
                legacy[f"{old}{e}.{names[2]}.weight"] = value[e].contiguous()
        else:
            legacy[old + attr] = value
    if model.config.tie_word_embeddings:
        legacy.pop("lm_head.weight")
    first = {k: v for k, v in legacy.items() if ".layers.0." in k}
    files = {"model-00001-of-00002.safetensors": first,
             "model-00002-of-00002.safetensors": {k: v for k, v in legacy.items() if k not in first}}
    path.mkdir()
    for file, tensors in files.items():
        save_file(tensors, str(path / file), metadata={"format": "pt"})
    weight_map = {k: file for file, tensors in files.items() for k in tensors}
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    model.config.save_pretrained(path)
    return state


def _per_expert_cases(rank: int, world: int, dirs: dict[str, str]) -> dict:
    import fp8dist

    warnings.simplefilter("ignore")
    out = {}
    for family, path in dirs.items():
        for strategy in ("fsdp", "fsdp1"):
            wrapped = fp8dist.wrap_model(_meta_from(path), strategy=strategy, pretrained=path)
            info = fp8dist.get_wrap_info(wrapped)
            out[(family, strategy)] = (_full_weights(wrapped),
                                       info.pretrained.bytes_read / info.pretrained.checkpoint_bytes)
    return out


def test_per_expert_moe_checkpoints_load_as_transformers_loads_them(tmp_path):
    """Mixtral and Qwen2-MoE checkpoints as the Hub holds them (one tensor per expert) load into transformers 5's
    fused experts: transformers' own from_pretrained and fp8dist's pretrained= (a meta model, fsdp: whole experts
    per rank; fsdp1: flat ranges cutting through experts) give the weights they were written from, each rank
    reading half the checkpoint; any box of a fused tensor reads as the same box of the fused weights."""
    from transformers import AutoModelForCausalLM

    from fp8dist.pipeline.pretrained import SafetensorsDir
    from fp8dist.strategies.local_shards import Region

    dirs, states = {}, {}
    for family in ("mixtral", "qwen2_moe"):
        path = tmp_path / family
        states[family] = _write_per_expert(_moe_tiny(family), path)
        dirs[family] = str(path)
        theirs = AutoModelForCausalLM.from_pretrained(path).state_dict()
        assert theirs.keys() == states[family].keys()
        assert all(torch.equal(theirs[k], v) for k, v in states[family].items()), f"{family}: transformers' reading"
        source = SafetensorsDir(path)
        fused = [k for k in states[family] if k.endswith("gate_up_proj")]
        source.adopt_layout(list(states[family]), _meta_from(path).config.model_type)
        assert fused and all(k in source for k in fused) and "lm_head.weight" in source
        assert not [n for n in source.names() if ".experts.0." in n], "the per-expert names are answered for"
        gate_up = states[family][fused[1]]
        half = gate_up.shape[1] // 2
        box = ((1, 2), (half - 3, 7), (5, 9))  # experts 1-2, rows across gate | up, a column window
        assert torch.equal(source.read(fused[1], Region(box=box)), gate_up[1:3, half - 3: half + 4, 5:14])
        flat = (gate_up[0].numel() - 11, 2 * gate_up[0].numel() + 5)  # the end of expert 0 to into expert 2
        assert torch.equal(source.read(fused[1], Region(flat=flat)), gate_up.reshape(-1)[flat[0]: flat[1]])
    for rank, result in enumerate(run_ranks(_per_expert_cases, dirs)):
        for (family, strategy), (weights, read) in result.items():
            assert weights.keys() == states[family].keys() - ({"lm_head.weight"} if "lm_head.weight" not in
                                                              weights else set()), (family, strategy)
            for name, value in weights.items():
                assert torch.equal(value, states[family][name]), (rank, family, strategy, name)
            assert abs(read - 0.5) < 0.02, (rank, family, strategy, read)
