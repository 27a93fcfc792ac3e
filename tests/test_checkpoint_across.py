"""Checkpoints across strategies and FP8 on/off, on real gloo ranks: what loads into what (fsdp, fsdp1, ddp and
none in every direction, torchao dropped or added, Transformer Engine's FP8 state into TE modules) loads every
parameter and optimizer state exactly and trains on like the original run; what cannot load soundly (TE's FP8
state into a model without TE, DeepSpeed <-> torch.distributed.checkpoint) is refused with the way out.

One 2-rank spawn runs every source and every case (spawning costs about 10 s here); the strategy="none" side runs
in the test's own process, since "none" refuses a multi-process launch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_ranks
from helpers import BATCH, SEQ
from standin import use_standins

from fp8dist import CheckpointError, load_checkpoint, save_checkpoint, wrap_model
from fp8dist.train.data import Batches
from fp8dist.train.models import build_llama

N = 3  # steps before the checkpoint
AFTER = 2  # steps after it on each side: the loss of the loaded weights, then after a step with the loaded optimizer
# Loss tolerances, about 1.5 x the largest gap measured (tiny Llama, 2 gloo ranks, the 2 steps after loading):
# FSDP2 and FSDP1 share the numerics (bf16 parameters, fp32 reduction): equal losses. DDP and none share theirs
# (fp32 weights, bf16 autocast); 2 ranks vs 1 sum the gradients in another order: 1.6e-5 measured on one CPU of this
# machine pool (2026-11-23), 1.3e-4 on another (AMD EPYC, AVX2 only: other bf16 GEMM kernels; 2026-11-24, the same
# on main before and after that day's changes). Across the two: 2.1e-3.
# FP8 on vs off, same strategy: torchao 1.5e-3 (TE's stand-in 2.5e-4); with a strategy change too: 3.0e-3.
NUMERICS = {"fsdp": "bf16 parameters", "fsdp1": "bf16 parameters", "ddp": "autocast", "none": "autocast"}
WORLD_TOL = 2e-4
STRATEGY_TOL = 3e-3
FP8_TOL = 2e-3

# (source, target, drop_fp8_state); a source/target is (strategy, fp8)
ALLOWED = [
    (("fsdp", None), ("ddp", None), False),
    (("fsdp", None), ("fsdp1", None), False),
    (("fsdp1", None), ("fsdp", None), False),
    (("fsdp1", None), ("ddp", None), False),
    (("ddp", None), ("fsdp", None), False),
    (("ddp", None), ("fsdp1", None), False),
    (("none", None), ("fsdp1", None), False),
    (("none", None), ("ddp", None), False),
    (("fsdp", "torchao"), ("fsdp", None), False),
    (("fsdp", None), ("fsdp", "torchao"), False),
    (("ddp", "torchao"), ("fsdp1", None), False),
    (("fsdp", "te"), ("ddp", "te"), False),
    (("fsdp", "te"), ("fsdp", None), True),
    (("fsdp", None), ("fsdp", "te"), False),
]
TO_NONE = [(("fsdp", None), ("none", None), False), (("fsdp", "torchao"), ("none", None), False)]
SOURCES = sorted({src for src, _, _ in ALLOWED + TO_NONE if src[0] != "none"}, key=str)


def _key(src, dst=None) -> str:
    return "-".join(f"{s}+{f}" if f else s for s, f in (src, dst) if s) if dst else f"src-{src[0]}-{src[1]}"


def _te_with_fp8_state() -> None:
    """The TE stand-in (NOT Transformer Engine) plus what TE's modules keep in ``_extra_state``: per-rank FP8
    state that grows with every forward (here an amax history of the inputs)."""
    use_standins()
    import transformer_engine.pytorch as te

    forward = te.Linear.forward

    def recording_forward(self, inp):
        self.amax_history = getattr(self, "amax_history", []) + [float(inp.detach().abs().max())]
        return forward(self, inp)

    te.Linear.forward = recording_forward
    te.Linear.get_extra_state = lambda self: torch.tensor(getattr(self, "amax_history", []), dtype=torch.float64)
    te.Linear.set_extra_state = lambda self, state: setattr(self, "amax_history", state.tolist())


def _build(strategy: str, fp8: str | None):
    model = wrap_model(build_llama("tiny", seed=0), strategy=strategy, fp8=fp8)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _train(model, optimizer, steps: range, rank: int, world: int) -> list[float]:
    """Per step: the loss averaged over ranks (the loss of the whole global batch)."""
    batches = Batches(batch_size=BATCH, seq_len=SEQ, rank=rank, world_size=world, seed=0)
    losses = []
    for step in steps:
        loss = model(input_ids=batches[step], labels=batches[step]).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        mean = loss.detach().clone()
        if world > 1:
            dist.all_reduce(mean)
            mean /= world
        losses.append(mean.item())
    return losses


def _plain(value):
    """A detached plain-tensor copy (state dicts alias live parameters and AdamW's step counters)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    if isinstance(value, torch.Tensor):
        value = value.detach()
        inner = getattr(value, "_tensor", None)  # torchao's FP8 all-gather weight wraps the plain one
        return (inner if isinstance(inner, torch.Tensor) else value).clone()
    return value


def _full_state(model, optimizer) -> dict:
    """The whole model and optimizer state by parameter name, as every strategy's get_state_dict reports it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
    return {"model": _plain({k: v for k, v in model_sd.items() if not k.endswith("_extra_state")}),
            "optim": _plain(optim_sd), "fp8_state": _fp8_state(model)}


def _fp8_state(model) -> dict[str, list[float]]:
    return {n.replace("_fsdp_wrapped_module.", "").removeprefix("module."): list(m.amax_history)
            for n, m in model.named_modules() if hasattr(m, "amax_history")}


def _differences(saved: dict, loaded: dict) -> list[str]:
    """Every model tensor and optimizer state that is not bit-identical (names, dtypes and values)."""
    out = [k for k in saved["model"].keys() | loaded["model"].keys()
           if k not in saved["model"] or k not in loaded["model"] or saved["model"][k].dtype != loaded["model"][k].dtype
           or not torch.equal(saved["model"][k], loaded["model"][k])]
    a, b = saved["optim"]["state"], loaded["optim"]["state"]
    out += [f"optimizer {k}" for k in a.keys() | b.keys() if k not in a or k not in b or a[k].keys() != b[k].keys()
            or not all(torch.equal(v, b[k][s]) for s, v in a[k].items())]
    out += ["optimizer param_groups"] if saved["optim"]["param_groups"] != loaded["optim"]["param_groups"] else []
    return out


def _save_source(src, root: Path, rank: int, world: int) -> dict:
    """Train ``src`` N steps, save, and note its state and the losses of the steps after (the original run)."""
    model, opt = _build(*src)
    _train(model, opt, range(N), rank, world)
    save_checkpoint(root / _key(src), model, opt, step=N)
    saved = _full_state(model, opt)
    return dict(state=saved, losses=_train(model, opt, range(N, N + AFTER), rank, world))


def _load_case(src, dst, drop: bool, root: Path, rank: int, world: int) -> dict:
    model, opt = _build(*dst)
    state = load_checkpoint(root / _key(src), model, opt, drop_fp8_state=drop)
    loaded = _full_state(model, opt)
    return dict(state=loaded, differences=state.differences, step=state.step,
                losses=_train(model, opt, range(N, N + AFTER), rank, world))


def _grid(rank: int, world: int, root: str, none_source: dict) -> dict:
    _te_with_fp8_state()
    root = Path(root)
    sources = {src: _save_source(src, root, rank, world) for src in SOURCES}
    sources[("none", None)] = none_source
    cases = {}
    for src, dst, drop in ALLOWED:
        case = _load_case(src, dst, drop, root, rank, world)
        saved = sources[src]
        cases[_key(src, dst)] = dict(
            not_equal=_differences(saved["state"], case["state"]), step=case["step"],
            differences=case["differences"], losses=case["losses"], original=saved["losses"],
            fp8_state=(saved["state"]["fp8_state"], case["state"]["fp8_state"]))
    try:  # TE's FP8 state into a model without TE, not asked to drop it
        load_checkpoint(root / _key(("fsdp", "te")), *_build("fsdp", None))
        refused = None
    except CheckpointError as err:
        refused = str(err)
    return dict(cases=cases, refused=refused, to_none={src: sources[src] for src, _, _ in TO_NONE})


def _gap(losses: list[float], original: list[float]) -> float:
    return max(abs(a - b) for a, b in zip(losses, original, strict=True))


def _tolerance(src, dst) -> float:
    if NUMERICS[src[0]] != NUMERICS[dst[0]]:
        strategy = STRATEGY_TOL
    else:  # all 2-rank runs here but "none"
        strategy = WORLD_TOL if "none" in (src[0], dst[0]) else 0.0
    return strategy + (FP8_TOL if src[1] != dst[1] else 0.0)


@pytest.mark.slow
def test_fsdp_fsdp1_ddp_none_and_fp8_on_off_load_into_each_other(tmp_path, subtests, monkeypatch):
    torch.set_num_threads(1)
    model, opt = _build("none", None)  # the "none" source, in this process
    _train(model, opt, range(N), 0, 1)
    save_checkpoint(tmp_path / _key(("none", None)), model, opt, step=N)
    saved = _full_state(model, opt)
    none_source = dict(state=saved, losses=_train(model, opt, range(N, N + AFTER), 0, 1))

    results = run_ranks(_grid, str(tmp_path), none_source, timeout=600)
    for src, dst, drop in ALLOWED:
        key, tol = _key(src, dst), _tolerance(src, dst)
        for rank, result in enumerate(results):
            case = result["cases"][key]
            with subtests.test(msg=f"{key} rank {rank}"):
                assert case["not_equal"] == [], "these differ from the saved state"
                assert case["step"] == N
                assert _gap(case["losses"], case["original"]) <= tol, (case["losses"], case["original"], tol)
                if src[0] != dst[0]:
                    assert f"strategy {src[0]!r} -> {dst[0]!r}" in case["differences"]
                if src[1] != dst[1]:
                    assert f"fp8 {src[1]!r} -> {dst[1]!r}" in case["differences"]
    with subtests.test(msg="TE FP8 state: loaded into TE modules of another strategy, dropped or started afresh"):
        for rank, result in enumerate(results):
            saved_state, loaded = result["cases"]["fsdp+te-ddp+te"]["fp8_state"]
            assert len(saved_state) == 15 and all(len(h) == N for h in saved_state.values())
            assert loaded == saved_state, f"rank {rank}: each rank's own FP8 state"
            dropped = result["cases"]["fsdp+te-fsdp"]
            assert dropped["differences"] == ("fp8 'te' -> None", "the checkpoint's FP8 state of 15 modules "
                                              "dropped (drop_fp8_state=True)")
            fresh = result["cases"]["fsdp-fsdp+te"]
            assert len(fresh["fp8_state"][1]) == 15 and all(h == [] for h in fresh["fp8_state"][1].values())
            assert "this model's FP8 state of 15 modules starts afresh (none in the checkpoint)" in \
                fresh["differences"]
    with subtests.test(msg="TE FP8 state into a model without TE is refused"):
        refused = results[0]["refused"]
        assert refused is not None and "holds Transformer Engine FP8 state (scales and amax history, in " \
            "`_extra_state`) of 15 modules (lm_head, model.layers.0.mlp.down_proj, " \
            "model.layers.0.mlp.gate_proj and 12 more) that this model (strategy 'fsdp', fp8 None) has no place " \
            "for: loading would drop it silently. Way out: load it into a model with fp8='te' (strategy 'none', " \
            "'ddp', 'fsdp' or 'fsdp1', any world size), or pass drop_fp8_state=True" in refused, refused
    with subtests.test(msg="meta.json records the engine data the decision is based on"):
        meta = json.loads((tmp_path / _key(("fsdp", "te")) / "step_00000003" / "meta.json").read_text())
        assert (meta["engine"], meta["strategy"], meta["fp8"], meta["world_size"]) == ("dcp", "fsdp", "te", 2)
        assert len(meta["fp8_state"]) == 15 and "model.layers.0.mlp.up_proj._extra_state" in meta["fp8_state"]
        assert meta["parameters"]["model.layers.0.mlp.up_proj.weight"] == [384, 128]
    for src, dst, _ in TO_NONE:  # 2 ranks -> one process
        with subtests.test(msg=_key(src, dst)):
            model, opt = _build(*dst)
            state = load_checkpoint(tmp_path / _key(src), model, opt)
            source = results[0]["to_none"][src]
            assert _differences(source["state"], _full_state(model, opt)) == []
            assert "world_size 2 -> 1" in state.differences and "strategy 'fsdp' -> 'none'" in state.differences
            losses = _train(model, opt, range(N, N + AFTER), 0, 1)
            assert _gap(losses, source["losses"]) <= _tolerance(src, dst), (losses, source["losses"])


def _deepspeed_and_dcp(rank: int, world: int, root: str) -> dict:
    root = Path(root)
    engine, engine_opt = wrap_model(build_llama("tiny", seed=0), strategy="deepspeed", zero_stage=1,
                                    micro_batch_size=BATCH, optimizer={"type": "AdamW", "lr": 1e-3})
    save_checkpoint(root / "ds", engine, engine_opt, step=0)
    model, opt = _build("fsdp", None)
    save_checkpoint(root / "dcp", model, opt, step=0)
    errors = {}
    optim_states = next((root / "ds" / "step_00000000" / "deepspeed").glob("*optim_states.pt"))
    data = bytearray(optim_states.read_bytes())
    data[len(data) // 2] ^= 0x01  # DeepSpeed's own file damaged: refused as DCP's shards are
    optim_states.write_bytes(bytes(data))
    for name, source, target in (("ds->fsdp", "ds", (model, opt)), ("fsdp->ds", "dcp", (engine, engine_opt)),
                                 ("flipped", "ds", (engine, engine_opt))):
        try:
            load_checkpoint(root / source, *target)
        except CheckpointError as err:
            errors[name] = str(err)
    errors["optim_states"] = str(optim_states)
    return errors


def test_deepspeed_and_dcp_checkpoints_refuse_each_other_and_a_damaged_file_with_the_way_out(tmp_path):
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install 'fp8dist[deepspeed]')")
    errors = run_ranks(_deepspeed_and_dcp, str(tmp_path), world_size=1, timeout=600)[0]
    ds, dcp = tmp_path / "ds" / "step_00000000", tmp_path / "dcp" / "step_00000000"
    assert errors["ds->fsdp"] == (
        f"{ds} was saved with strategy 'deepspeed', in DeepSpeed's own checkpoint format; this model uses strategy "
        "'fsdp' (torch.distributed.checkpoint), and fp8dist does not convert between the two. Way out: load it into "
        "strategy='deepspeed' with zero_stage=1 on 1 rank, or turn it into a full fp32 state dict with "
        f"DeepSpeed's script (python {ds}/zero_to_fp32.py {ds} OUT_DIR --tag deepspeed), load that into the model "
        "before wrap_model and start a new optimizer.")
    assert (ds / "zero_to_fp32.py").is_file(), "the script the message names is there"
    assert errors["fsdp->ds"] == (
        f"{dcp} was saved with strategy 'fsdp' (torch.distributed.checkpoint); this model is a DeepSpeed engine, "
        "which loads only DeepSpeed's own checkpoint format, and fp8dist does not convert between the two. Way out: "
        "load it into strategy 'none', 'ddp', 'fsdp' or 'fsdp1', or turn it into one file with torch's converter "
        f"(python -m torch.distributed.checkpoint.format_utils dcp_to_torch {dcp} OUT.pt), load its 'model' entries "
        "into the model before wrap_model and start a new optimizer; or save from the strategy you load into.")
    assert errors["flipped"].startswith(f"{errors['optim_states']} is damaged: its crc32 is "), errors["flipped"]
