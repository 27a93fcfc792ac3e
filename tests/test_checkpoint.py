"""Checkpoints on real gloo ranks: bit-exact resume in fresh processes for every strategy and FP8 setting,
resharding (2 -> 1 -> 2 ranks), the directory (latest, keep_last), FP8 extra state, and a clear error for every bad
checkpoint. Across strategies and FP8 on/off: test_checkpoint_across.py; crashes: test_checkpoint_crash.py."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch
from dist_harness import run_ranks
from helpers import BATCH, SEQ

from fp8dist import CheckpointError, load_checkpoint, save_checkpoint, wrap_model
from fp8dist.train.data import Batches
from fp8dist.checkpoint import latest_checkpoint
from fp8dist.checkpoint.manifest import file_checksum
from fp8dist.train.models import build_llama

N = 3  # steps before the checkpoint, and after it
FP8 = (None, "torchao")


def _build(strategy: str, fp8: str | None, **options):
    model = build_llama("tiny", seed=0)
    if strategy == "deepspeed":
        return wrap_model(model, strategy=strategy, fp8=fp8, micro_batch_size=BATCH // 2,
                          optimizer={"type": "AdamW", "lr": 1e-3}, **options)
    wrapped = wrap_model(model, strategy=strategy, fp8=fp8, **options)
    return wrapped, torch.optim.AdamW(wrapped.parameters(), lr=1e-3)


def _train(model, optimizer, steps: range, rank: int, world: int, engine: bool = False) -> list[float]:
    batches = Batches(batch_size=BATCH, seq_len=SEQ, rank=rank, world_size=world, seed=0)
    losses = []
    for step in steps:
        loss = model(input_ids=batches[step], labels=batches[step]).loss
        if engine:
            model.backward(loss)
            model.step()
        else:
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _local_params(model, engine: bool = False) -> dict[str, torch.Tensor]:
    """This rank's part of every parameter, in fp32 (DeepSpeed: the full fp32 master weights)."""
    if engine:
        from deepspeed.utils import safe_get_full_fp32_param

        return {n: safe_get_full_fp32_param(p).clone() for n, p in model.module.named_parameters()}
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    out = {}
    for name, value in get_model_state_dict(model).items():
        if hasattr(value, "to_local"):
            value = value.to_local()
        elif hasattr(value, "local_shards"):
            value = torch.cat([s.tensor.flatten() for s in value.local_shards()]) if value.local_shards() \
                else torch.empty(0)
        out[name] = value.detach().clone()
    return out


def _full_params(model) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: v.clone() for k, v in full.items()}


def _cases(strategies):
    for strategy in strategies:
        stages = (1, 2, 3) if strategy == "deepspeed" else (None,)
        for stage in stages:
            for fp8 in FP8:
                options = {"zero_stage": stage} if stage else {}
                yield f"{strategy}{stage or ''}-{fp8}", strategy, fp8, options


def _straight_and_first_half(rank: int, world: int, root: str, strategies: tuple[str, ...]) -> dict:
    """Each case trains N steps, saves, and goes on N steps more: the straight run the resumed one must repeat."""
    out = {}
    for key, strategy, fp8, options in _cases(strategies):
        engine = strategy == "deepspeed"
        model, opt = _build(strategy, fp8, **options)
        losses = _train(model, opt, range(N), rank, world, engine)
        save_checkpoint(Path(root) / key, model, opt, step=N, extra={"note": key})
        if strategy == "fsdp" and fp8 is None:
            out["full_at_N"] = _full_params(model)
        losses += _train(model, opt, range(N, 2 * N), rank, world, engine)
        out[key] = dict(losses=losses, params=_local_params(model, engine))
    return out


def _second_half(rank: int, world: int, root: str, strategies: tuple[str, ...]) -> dict:
    out = {}
    for key, strategy, fp8, options in _cases(strategies):
        engine = strategy == "deepspeed"
        model, opt = _build(strategy, fp8, **options)
        state = load_checkpoint(Path(root) / key, model, opt)
        losses = _train(model, opt, range(state.step, 2 * N), rank, world, engine)
        out[key] = dict(losses=losses, params=_local_params(model, engine), step=state.step, extra=state.extra)
    return out


def _check_bit_exact(first: list[dict], second: list[dict], strategies: tuple[str, ...]) -> None:
    for rank, (a, b) in enumerate(zip(first, second)):
        for key, *_ in _cases(strategies):
            assert b[key]["step"] == N and b[key]["extra"] == {"note": key}
            assert b[key]["losses"] == a[key]["losses"][N:], f"{key} rank {rank}: losses after resuming differ"
            assert a[key]["params"].keys() == b[key]["params"].keys()
            for name, value in a[key]["params"].items():
                assert torch.equal(value, b[key]["params"][name]), f"{key} rank {rank}: {name} differs"
        assert a[key]["losses"][0] != a[key]["losses"][-1], "the model really trained"


@pytest.mark.slow
def test_resume_is_bit_exact_fsdp_fsdp1_ddp_and_reshards(tmp_path):
    strategies = ("fsdp", "fsdp1", "ddp")
    first = run_ranks(_straight_and_first_half, str(tmp_path), strategies)
    second = run_ranks(_second_half, str(tmp_path), strategies)
    _check_bit_exact(first, second, strategies)
    # 2 -> 1 rank: DCP reshards; 1 -> 2 ranks: back again
    single = run_ranks(_reshard_to_one, str(tmp_path), world_size=1)[0]
    for name, value in first[0]["full_at_N"].items():
        assert torch.equal(single["loaded"][name], value), name
    again = run_ranks(_reshard_to_two, str(tmp_path))
    for r in again:
        assert r["step"] == N + 1
        for name, value in single["saved"].items():
            assert torch.equal(r["loaded"][name], value), name


def _reshard_to_one(rank: int, world: int, root: str) -> dict:
    model, opt = _build("fsdp", None)
    state = load_checkpoint(Path(root) / "fsdp-None", model, opt)
    assert state.world_size == 2 and state.step == N
    loaded = _full_params(model)
    _train(model, opt, range(N, N + 1), rank, world)
    save_checkpoint(Path(root) / "fsdp-one-rank", model, opt, step=N + 1)
    return dict(loaded=loaded, saved=_full_params(model))


def _reshard_to_two(rank: int, world: int, root: str) -> dict:
    model, opt = _build("fsdp", None)
    state = load_checkpoint(Path(root) / "fsdp-one-rank", model, opt)
    loaded = _full_params(model)
    _train(model, opt, range(N + 1, N + 2), rank, world)  # the loaded optimizer state trains on
    return dict(step=state.step, loaded=loaded)


@pytest.mark.slow
def test_resume_is_bit_exact_deepspeed_zero_1_2_3(tmp_path):
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install 'fp8dist[deepspeed]')")
    strategies = ("deepspeed",)
    first = run_ranks(_straight_and_first_half, str(tmp_path), strategies, timeout=600)
    second = run_ranks(_second_half, str(tmp_path), strategies, timeout=600)
    _check_bit_exact(first, second, strategies)


# ---- one process, strategy "none": the directory, atomicity and every bad checkpoint

@pytest.fixture
def none_model():
    torch.set_num_threads(1)
    return lambda fp8=None, size="tiny": _wrap_none(fp8, size)


def _wrap_none(fp8, size):
    model = wrap_model(build_llama(size, seed=0), strategy="none", fp8=fp8)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def test_none_resumes_bit_exact_keeps_the_last_k_and_leaves_nothing_half_written(tmp_path, none_model):
    model, opt = none_model()
    straight = _train(model, opt, range(2 * N), 0, 1)
    model, opt = none_model()
    for step in range(N):
        _train(model, opt, range(step, step + 1), 0, 1)
        save_checkpoint(tmp_path, model, opt, step=step + 1, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000002", "step_00000003"]
    assert latest_checkpoint(tmp_path) == tmp_path / "step_00000003"
    assert sorted(p.name for p in (tmp_path / "step_00000003").iterdir()) == [
        ".metadata", "__0_0.distcp", "meta.json", "rng_rank0.pt"]
    draws = _random_draws()  # what the RNGs give right after the save
    torch.manual_seed(123), random.seed(123), np.random.seed(123)
    model, opt = none_model()
    state = load_checkpoint(tmp_path, model, opt)
    assert state.step == N and state.path == tmp_path / "step_00000003" and state.world_size == 1
    assert _random_draws() == draws, "torch, python and numpy RNG states are restored"
    assert _train(model, opt, range(N, 2 * N), 0, 1) == straight[N:]


def _random_draws() -> tuple:
    return torch.rand(3).tolist(), random.random(), np.random.rand(3).tolist()


def _snapshot(directory: Path) -> dict[str, bytes]:
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def _damage(ckpt: Path, how: str) -> None:
    import json
    import pickle

    step = ckpt / "step_00000001"
    if how == "truncated shard":
        data = (step / "__0_0.distcp").read_bytes()
        (step / "__0_0.distcp").write_bytes(data[: len(data) // 2])
    elif how == "missing rng":
        (step / "rng_rank0.pt").unlink()
    elif how == "truncated meta":
        (step / "meta.json").write_text((step / "meta.json").read_text()[:100])
    elif how == "missing meta":
        (step / "meta.json").unlink()
    elif how == "dangling latest":
        (ckpt / "latest").write_text("step_00000007\n")
    elif how == "forged metadata":  # a pickle that would run a command, with meta.json updated to match it
        (step / ".metadata").write_bytes(pickle.dumps(__import__("os").system))
        meta = json.loads((step / "meta.json").read_text())
        meta["files"][".metadata"] = (step / ".metadata").stat().st_size
        meta["checksums"][".metadata"] = file_checksum(step / ".metadata")
        (step / "meta.json").write_text(json.dumps(meta))


@pytest.mark.parametrize("how,fp8,size,error,message", [
    ("truncated shard", None, "tiny", CheckpointError, r"__0_0.distcp is \d+ bytes, expected \d+ bytes: the "
     r"checkpoint is truncated or damaged"),
    ("missing rng", None, "tiny", CheckpointError, r"rng_rank0.pt is missing, expected \d+ bytes"),
    ("truncated meta", None, "tiny", CheckpointError, r"meta.json is truncated or damaged"),
    ("missing meta", None, "tiny", CheckpointError, r"has no meta.json: it is not a complete fp8dist checkpoint"),
    ("dangling latest", None, "tiny", CheckpointError, r"latest names 'step_00000007', which is not in"),
    ("forged metadata", None, "tiny", CheckpointError, r"refers to posix.system, which a DCP checkpoint never "
     r"contains: refusing to unpickle it"),
    ("", None, "small", CheckpointError, r"does not match this model: model.embed_tokens.weight: shape "
     r"\(256, 128\) in the checkpoint, \(256, 256\) in this model; .*Load it into the model architecture and size "
     r"it was saved from"),
])
def test_bad_checkpoints_are_clear_errors_and_change_nothing(tmp_path, none_model, how, fp8, size, error,
                                                             message):
    model, opt = none_model()
    _train(model, opt, range(1), 0, 1)
    save_checkpoint(tmp_path, model, opt, step=1)
    _damage(tmp_path, how)
    before = _snapshot(tmp_path)
    model, opt = none_model(fp8, size)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(error, match=message):
        load_checkpoint(tmp_path, model, opt)
    assert _snapshot(tmp_path) == before, "a failed load writes nothing"
    assert all(torch.equal(p, params[n]) for n, p in model.named_parameters()), "the model is untouched"


def test_missing_checkpoints_and_bad_save_arguments(tmp_path, none_model):
    model, opt = none_model()
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_checkpoint(tmp_path / "nowhere", model, opt)
    with pytest.raises(FileNotFoundError, match="holds no checkpoint"):
        load_checkpoint(tmp_path, model, opt)
    with pytest.raises(ValueError, match="step=-1 must be a non-negative int"):
        save_checkpoint(tmp_path, model, opt, step=-1)
    with pytest.raises(ValueError, match="keep_last=0 must be a positive int"):
        save_checkpoint(tmp_path, model, opt, step=1, keep_last=0)
    with pytest.raises(ValueError, match="must hold JSON values only"):
        save_checkpoint(tmp_path, model, opt, step=1, extra={"model": model})
    with pytest.raises(ValueError, match="was not returned by fp8dist.wrap_model"):
        save_checkpoint(tmp_path, build_llama("tiny"), opt, step=1)
    assert list(tmp_path.iterdir()) == [], "bad arguments write nothing"


class _AmaxHistoryLinear(torch.nn.Linear):
    """Keeps FP8-style state in ``_extra_state`` as Transformer Engine's modules do: a tensor (TE: serialized
    scales and amax history) that grows once forwards have run. Not TE: only its state-dict behaviour."""

    def __init__(self):
        super().__init__(16, 16)
        self.amax_history: list[float] = []

    def forward(self, x):
        self.amax_history.append(float(x.abs().max()))
        return super().forward(x)

    def get_extra_state(self):
        return torch.tensor(self.amax_history, dtype=torch.float64)

    def set_extra_state(self, state):
        self.amax_history = state.tolist()


def test_module_extra_state_fp8_scales_and_amax_history_round_trip(tmp_path):
    torch.set_num_threads(1)

    def build():
        model = wrap_model(torch.nn.Sequential(_AmaxHistoryLinear(), _AmaxHistoryLinear()), strategy="none")
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    model, opt = build()
    for step in range(3):
        model(torch.randn(4, 16, generator=torch.Generator().manual_seed(step))).sum().backward()
        opt.step()
        opt.zero_grad()
    save_checkpoint(tmp_path, model, opt, step=3)
    fresh, fresh_opt = build()
    load_checkpoint(tmp_path, fresh, fresh_opt)
    assert [m.amax_history for m in fresh] == [m.amax_history for m in model]
    assert len(fresh[0].amax_history) == 3 and (tmp_path / "step_00000003" / "fp8_state_rank0.pt").is_file()


@pytest.mark.parametrize("meta_without_fp8_state", [False, True], ids=["meta.json", "older meta.json"])
def test_extra_state_into_a_model_without_it_is_refused_unless_dropped(tmp_path, meta_without_fp8_state):
    import json

    torch.set_num_threads(1)
    model = wrap_model(torch.nn.Sequential(_AmaxHistoryLinear(), _AmaxHistoryLinear()), strategy="none")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 16)).sum().backward()
    opt.step()
    path = save_checkpoint(tmp_path, model, opt, step=1)
    meta = json.loads((path / "meta.json").read_text())
    assert meta["fp8_state"] == ["0._extra_state", "1._extra_state"]
    if meta_without_fp8_state:  # written before meta.json recorded it: read from the rank-0 file
        del meta["fp8_state"]
        (path / "meta.json").write_text(json.dumps(meta))
    plain = wrap_model(torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)), strategy="none")
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    with pytest.raises(CheckpointError) as refused:
        load_checkpoint(tmp_path, plain, plain_opt)
    assert str(refused.value) == (
        f"{path} holds module extra state (`_extra_state`, e.g. FP8 scales) of 2 modules (0, 1) that this model "
        "(strategy 'none', fp8 None) has no place for: loading would drop it silently. Way out: load it into a "
        "model with those modules, or pass drop_fp8_state=True to load the weights and optimizer without it (FP8 "
        "scaling then starts afresh).")
    state = load_checkpoint(tmp_path, plain, plain_opt, drop_fp8_state=True)
    assert state.differences == ("the checkpoint's FP8 state of 2 modules dropped (drop_fp8_state=True)",)
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), model.parameters(), strict=True))
    with pytest.raises(TypeError, match="drop_fp8_state='yes' must be True or False"):
        load_checkpoint(tmp_path, plain, plain_opt, drop_fp8_state="yes")


@pytest.mark.parametrize("options,message", [
    (dict(resume=True), "resume needs checkpoint_dir: pass --checkpoint-dir DIR"),
    (dict(save_every=5), "save_every needs checkpoint_dir"),
    (dict(checkpoint_dir="d", save_every=0), "save_every=0 must be at least 1"),
    (dict(checkpoint_dir="d", keep_last=-1), "keep_last=-1 must be 0 .keep all. or more"),
])
def test_train_checkpoint_options_are_checked(options, message):
    from fp8dist.train.job import TrainConfig

    with pytest.raises(ValueError, match=message):
        TrainConfig(**options)
