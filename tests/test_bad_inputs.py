"""Every kind of bad input a new user gives, in one table: a clear error naming the value, the choices and the way
out (or, where the input is harmless, exactly one warning that says so), never a silent no-op, never a traceback
on the command line.

Each row is (id, what the user does, the exception or warning class, texts the message must hold). The command
line rows run ``fp8dist.cli.main`` in this process: exit code 2 and the message on stderr, no traceback.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from fp8dist import (estimate_memory, get_plan, load_checkpoint, no_sync, report, resolve_config, save_checkpoint,
                     save_pretrained, wrap_model)
from fp8dist.cli import main
from fp8dist.train.data import Batches
from fp8dist.runtime.env import LaunchError, detect_launch_env, resolve_device
from fp8dist.train.models import build_llama, pretrained_config
from fp8dist.pipeline.pretrained import PretrainedError, SafetensorsDir
from fp8dist.runtime.rendezvous import rendezvous_timeout
from fp8dist.runtime.optim import build_optimizer
from fp8dist.plan.precision import FP8UnavailableError
from fp8dist.train.job import TrainConfig


@dataclass(frozen=True)
class Bad:
    """One bad input: ``call(tmp_path)`` must raise (or, for a Warning class, warn once with) ``expected``."""

    id: str
    call: Callable[[Path], Any]
    expected: type[BaseException] | type[Warning]
    texts: tuple[str, ...]


def _llama() -> nn.Module:
    return build_llama("tiny", seed=0)


class _ListLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = [nn.Linear(4, 4)]  # a plain list: not registered, a classic mistake


class _Frozen(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 16).requires_grad_(False)


class _Empty(nn.Module):
    """A block class with no parameters of its own or below."""


class _WithEmpty(nn.Module):
    def __init__(self):
        super().__init__()
        self.empty = _Empty()
        self.proj = nn.Linear(16, 16)


def _meta_llama() -> nn.Module:
    with torch.device("meta"):
        return _llama()


def _partly_meta_llama() -> nn.Module:
    """A whole meta-device model is materialized after sharding (tests/test_pretrained.py); half of one is not."""
    model = _llama()
    model.lm_head.to("meta")
    return model


def _write(tmp: Path, name: str, text: str) -> str:
    path = tmp / name
    path.write_text(text)
    return str(path)


def _wrap(**kwargs) -> Callable[[Path], Any]:
    model = kwargs.pop("model", _llama)
    return lambda tmp: wrap_model(model(), **kwargs)


WRAP = [
    Bad("not a module", lambda tmp: wrap_model({"weight": torch.zeros(2)}), TypeError,
        ("expects a torch.nn.Module, got dict",)),
    Bad("layers in a python list", _wrap(model=_ListLayers, strategy="fsdp"), ValueError,
        ("_ListLayers has no parameters", "nn.ModuleList, not a Python list")),
    Bad("every parameter frozen", _wrap(model=_Frozen, strategy="fsdp"), ValueError,
        ("all 2 parameters have requires_grad=False", "requires_grad_(True)")),
    Bad("a model partly on the meta device", _wrap(model=_partly_meta_llama, strategy="fsdp"), ValueError,
        ("partly on the meta device", "'model.embed_tokens.weight' is not", "torch.device('meta')")),
    Bad("strategy misspelt", _wrap(strategy="fdsp"), ValueError,
        ("strategy='fdsp' is not valid", "'ddp', 'fsdp', 'fsdp1', 'deepspeed'", "Did you mean 'fsdp'?")),
    Bad("strategy not a string", _wrap(strategy=5), ValueError, ("strategy=5 is not valid", "'fsdp'")),
    Bad("fp8 backend unknown", _wrap(fp8="fp8e4"), ValueError, ("fp8='fp8e4' is not valid", "'te', 'torchao'")),
    Bad("param_dtype unknown", _wrap(param_dtype="int8"), ValueError,
        ("param_dtype='int8' is not valid", "'fp32', 'bf16', 'fp16'")),
    Bad("fp16 compute without loss scaling", _wrap(strategy="fsdp", param_dtype="fp16"), ValueError,
        ("param_dtype='fp16' with strategy='fsdp'", "underflow", "param_dtype='bf16'", "strategy='deepspeed'")),
    Bad("reduce_dtype unknown", _wrap(reduce_dtype="fp64"), ValueError, ("reduce_dtype='fp64'", "'bf16'")),
    Bad("buffer_dtype a number", _wrap(buffer_dtype=3), ValueError, ("buffer_dtype=3", "'fp32'")),
    Bad("device unknown", _wrap(device="tpu"), ValueError, ("device='tpu' is not valid", "'auto', 'cpu', 'cuda'")),
    Bad("unknown option, close to one", _wrap(reduce_dtpye="bf16"), ValueError,
        ("option 'reduce_dtpye'", "Did you mean 'reduce_dtype'?", "never ignored")),
    Bad("unknown option, close to none", _wrap(colour="red"), ValueError,
        ("option 'colour'", "'block_classes'", "remove it or fix its spelling")),
    Bad("zero_stage out of range", _wrap(strategy="deepspeed", zero_stage=4), ValueError,
        ("zero_stage=4 is not valid", "1, 2, 3")),
    Bad("zero_stage text out of range", _wrap(strategy="deepspeed", zero_stage="0"), ValueError,
        ("zero_stage='0' is not valid", "1, 2, 3")),
    Bad("micro_batch_size zero", _wrap(strategy="deepspeed", micro_batch_size=0), ValueError,
        ("micro_batch_size=0 must be at least 1",)),
    Bad("micro_batch_size text", _wrap(strategy="deepspeed", micro_batch_size="two"), ValueError,
        ("micro_batch_size='two' must be an integer",)),
    Bad("grad_accum zero", _wrap(strategy="deepspeed", grad_accum=0), ValueError, ("grad_accum=0 must be at least 1",)),
    Bad("gradient_clipping negative", _wrap(strategy="deepspeed", gradient_clipping=-1.0), ValueError,
        ("gradient_clipping=-1.0 must be a finite number >= 0", "0 turns clipping off")),
    Bad("gradient_clipping nan", _wrap(strategy="deepspeed", gradient_clipping=float("nan")), ValueError,
        ("gradient_clipping=nan must be a finite number >= 0",)),
    Bad("gradient_clipping inf", _wrap(strategy="deepspeed", gradient_clipping="inf"), ValueError,
        ("gradient_clipping=inf must be a finite number >= 0",)),
    Bad("fp8_select_margin zero", _wrap(fp8="torchao", fp8_select_margin=0), ValueError,
        ("fp8_select_margin=0 must be a finite number > 0", "1.0: any predicted gain")),
    Bad("fp8_select_margin negative", _wrap(fp8="torchao", fp8_select_margin=-1.5), ValueError,
        ("fp8_select_margin=-1.5 must be a finite number > 0",)),
    Bad("fp8_select_margin nan", _wrap(fp8="torchao", fp8_select_margin=float("nan")), ValueError,
        ("fp8_select_margin=nan must be a finite number > 0",)),
    Bad("fp8_select_margin inf", _wrap(fp8="torchao", fp8_select_margin="inf"), ValueError,
        ("fp8_select_margin=inf must be a finite number > 0",)),
    Bad("fp8_select_margin text", _wrap(fp8="torchao", fp8_select_margin="fast"), ValueError,
        ("fp8_select_margin='fast' must be a number",)),
    Bad("fp8_select unknown", _wrap(fp8="torchao", fp8_select="fastest"), ValueError,
        ("fp8_select='fastest' is not valid; choose one of: 'auto', 'all'", "or none (auto on a GPU, all on a CPU)")),
    Bad("fp8 typo: None among the choices, then the close match", _wrap(fp8="tea"), ValueError,
        ("fp8='tea' is not valid; choose one of: 'te', 'torchao', 'msamp', or none. Did you mean 'te'?",)),
    Bad("seq_len zero", _wrap(fp8="torchao", seq_len=0), ValueError,
        ("seq_len=0 must be a positive integer (tokens per sequence), or none (2048 assumed)",)),
    Bad("compile auto", _wrap(compile="auto"), ValueError,
        ("compile='auto' must be true or false (also yes/no, 1/0), or none (auto, the default)",)),
    Bad("nonfinite_step typo", _wrap(nonfinite_step="skipp"), ValueError,
        ("nonfinite_step='skipp' is not valid; choose one of: 'skip', 'error', 'off'.", "Did you mean 'skip'?")),
    Bad("max_skipped_steps negative", _wrap(max_skipped_steps=-1), ValueError,
        ("max_skipped_steps=-1 must be 0 (never stop) or more.",)),
    Bad("nonfinite error under DeepSpeed", _wrap(strategy="deepspeed", nonfinite_step="error"), ValueError,
        ("nonfinite_step='error' with strategy='deepspeed': DeepSpeed's engine checks the gradients inside its own "
         "step", "Use nonfinite_step='skip'")),
    Bad("check_ranks typo", _wrap(check_ranks="everything"), ValueError,
        ("check_ranks='everything' is not valid; choose one of: 'all', 'settings', 'off'.",)),
    Bad("lean lr as text", _wrap(strategy="none", memory="lean", optimizer={"type": "AdamW", "lr": "1e-3"}),
        ValueError, ("memory='lean': optimizer lr='1e-3' is a str: torch.optim.AdamW takes a number",)),
    Bad("lean one beta", _wrap(strategy="none", memory="lean", optimizer={"type": "AdamW", "lr": 1e-3,
                                                                           "betas": (0.9,)}),
        ValueError, ("memory='lean': optimizer betas=(0.9,) is a tuple of 1: torch.optim.AdamW takes a list of 2",)),
    Bad("lean beta out of range", _wrap(strategy="none", memory="lean", optimizer={"type": "AdamW", "lr": 1e-3,
                                                                                    "betas": (0.9, 1.5)}),
        ValueError, ("memory='lean': optimizer betas=(0.9, 1.5): torch.optim.AdamW refuses it",)),
    Bad("offload_param below ZeRO-3", _wrap(strategy="deepspeed", zero_stage=2, offload_param=True), ValueError,
        ("offload_param=True with zero_stage=2", "zero_stage=3 or offload_optimizer=True")),
    Bad("reshard_after_forward not a bool", _wrap(reshard_after_forward="maybe"), ValueError,
        ("reshard_after_forward='maybe' must be true or false (also yes/no, 1/0)",)),
    Bad("block class not in the model", _wrap(block_classes=["GPT2Block"]), ValueError,
        ("['GPT2Block'] not found in LlamaForCausalLM", "'LlamaDecoderLayer'", "leave block_classes empty")),
    Bad("block class without parameters", _wrap(model=_WithEmpty, block_classes=["_Empty"]), ValueError,
        ("['_Empty'] hold no parameters in _WithEmpty", "nothing to shard per block", "'Linear'")),
    Bad("block_classes a number", _wrap(block_classes=5), ValueError,
        ("block_classes=5 must be a list of names", "not int")),
    Bad("fp8_exclude a number", _wrap(fp8="torchao", fp8_exclude=5), ValueError,
        ("fp8_exclude=5 must be a list of names", "['lm_head', '*.mlp.*']")),
    Bad("fp8_exclude a dict", _wrap(fp8="torchao", fp8_exclude={"lm_head": True}), ValueError,
        ("fp8_exclude={'lm_head': True} must be a list of names", "not dict")),
    Bad("fp8_filter not callable", _wrap(strategy="none", fp8="torchao", fp8_filter="lm_head"), TypeError,
        ("fp8_filter='lm_head' is not callable", "fp8_exclude=[patterns]")),
    Bad("fp8_filter returns a non-bool", _wrap(strategy="none", fp8="torchao", fp8_filter=lambda m, fqn: fqn),
        TypeError, ("fp8_filter returned 'model.layers.0.self_attn.q_proj' (str)", "must return True")),
    Bad("fp8_format E5M2", _wrap(fp8="te", fp8_format="E5M2"), ValueError,
        ("fp8_format='E5M2' is not supported", "'HYBRID'", "'E4M3'")),
    Bad("fp8_format unknown", _wrap(fp8="te", fp8_format="E3M4"), ValueError,
        ("fp8_format='E3M4' is not valid", "'E4M3', 'HYBRID'")),
    Bad("margin negative", _wrap(fp8="te", margin=-1), ValueError, ("margin=-1 must be at least 0",)),
    Bad("amax_history_len zero", _wrap(fp8="te", amax_history_len=0), ValueError,
        ("amax_history_len=0 must be at least 1",)),
    Bad("interval zero", _wrap(fp8="te", interval=0), ValueError, ("interval=0 must be at least 1",)),
    Bad("amax_compute_algo unknown", _wrap(fp8="te", amax_compute_algo="mean"), ValueError,
        ("amax_compute_algo='mean' is not valid", "'max', 'most_recent'")),
    Bad("te_recipe unknown", _wrap(fp8="te", te_recipe="mxfp4"), ValueError,
        ("te_recipe='mxfp4' is not valid", "'delayed', 'current', 'mxfp8', 'blockwise', 'nvfp4'")),
    Bad("override_linear_precision too short", _wrap(fp8="te", override_linear_precision=(True,)), ValueError,
        ("override_linear_precision=(True,) must be a list of 3 booleans, got 1",)),
    Bad("override_linear_precision a string", _wrap(fp8="te", override_linear_precision="yes"), ValueError,
        ("override_linear_precision='yes' must be a list of 3 booleans",)),
    Bad("torchao_recipe unknown", _wrap(fp8="torchao", torchao_recipe="row"), ValueError,
        ("torchao_recipe='row' is not valid", "'rowwise'")),
    Bad("FP8 all-gather with rowwise", _wrap(fp8="torchao", torchao_recipe="rowwise", fp8_all_gather=True),
        ValueError, ("fp8_all_gather=True with torchao_recipe='rowwise'", "torchao_recipe='tensorwise'")),
    Bad("on_unsupported unknown", _wrap(fp8="torchao", on_unsupported="ignore"), ValueError,
        ("on_unsupported='ignore' is not valid", "'error', 'fallback'")),
    Bad("rowwise_with_gw_hp under autocast", _wrap(strategy="ddp", fp8="torchao", torchao_recipe="rowwise_with_gw_hp"),
        ValueError, ("mixes the autocast dtype with fp32", "strategy='fsdp'")),
    Bad("msamp under fsdp", _wrap(strategy="fsdp", fp8="msamp"), ValueError,
        ("fp8='msamp' with strategy='fsdp'", "with fp8='msamp' use strategy='none', 'ddp' or 'deepspeed'")),
    Bad("msamp O3 without deepspeed", _wrap(strategy="ddp", fp8="msamp", opt_level="O3"), ValueError,
        ("opt_level='O3' with strategy='ddp'", "'O1' or 'O2'")),
    Bad("TE not installed", _wrap(strategy="fsdp", fp8="te"), FP8UnavailableError,
        ("fp8='te' cannot run here", "on_unsupported='fallback'", "fp8='torchao'")),
    Bad("MS-AMP not installed", _wrap(strategy="ddp", fp8="msamp"), FP8UnavailableError,
        ("fp8='msamp' cannot run here", "MS-AMP is not installed")),
    Bad("bf16 reduce under DDP on CPU", _wrap(strategy="ddp", reduce_dtype="bf16"), ValueError,
        ("reduce_dtype='bf16' with strategy='ddp' on cpu", "strategy='fsdp'")),
    Bad("wrapped twice", lambda tmp: wrap_model(wrap_model(nn.Linear(16, 16), strategy="ddp"), strategy="ddp"),
        ValueError, ("already wrapped", "wrap the original model once")),
    Bad("deepspeed without an optimizer", _wrap(strategy="deepspeed"), ValueError,
        ("builds the optimizer inside deepspeed.initialize", "optimizer={'type': 'AdamW'")),
    Bad("deepspeed config missing", _wrap(strategy="deepspeed", ds_config="/nonexistent/ds.json",
                                          optimizer={"type": "AdamW", "lr": 1e-3}), FileNotFoundError,
        ("DeepSpeed config '/nonexistent/ds.json' does not exist",)),
    Bad("optimizer type unknown", lambda tmp: build_optimizer({"type": "Adamm", "lr": 1e-3}, [nn.Parameter(
        torch.zeros(2))]), ValueError, ("optimizer type='Adamm' is not valid", "'AdamW'", "Did you mean 'Adam'")),
    Bad("optimizer spec a number", _wrap(strategy="none", optimizer=5), TypeError,
        ("optimizer must be a callable params -> Optimizer or a mapping with 'type', got int",)),
    Bad("optimizer callable returns something else", _wrap(strategy="none", optimizer=lambda params: list(params)),
        TypeError, ("the optimizer callable returned list, not a torch.optim.Optimizer",)),
    Bad("config of the wrong type", _wrap(config=5), TypeError,
        ("config must be a Config, a dict or a path to a YAML/JSON file, got int",)),
    Bad("config file missing", _wrap(config="/nonexistent/fp8dist.yaml"), FileNotFoundError,
        ("config file '/nonexistent/fp8dist.yaml' does not exist",)),
    Bad("config file not a mapping", lambda tmp: wrap_model(_llama(), config=_write(tmp, "c.yaml", "- fsdp\n")),
        ValueError, ("c.yaml' must hold a mapping of keys to values, got list",)),
    Bad("config file unknown key", lambda tmp: wrap_model(_llama(), config=_write(tmp, "c.yaml", "stratgy: fsdp\n")),
        ValueError, ("option 'stratgy' in", "c.yaml", "Did you mean 'strategy'?")),
    Bad("config file bad value", lambda tmp: wrap_model(_llama(), config=_write(tmp, "c.yaml", "zero_stage: 5\n")),
        ValueError, ("zero_stage=5 is not valid",)),
]

WARN = [
    Bad("fp8_exclude pattern that matches nothing", _wrap(strategy="none", fp8="torchao", fp8_exclude=["lm_hed"]),
        UserWarning, ("fp8_exclude pattern 'lm_hed' matches no module", "did you mean 'lm_head'?")),
    Bad("fp8_exclude naming a container", _wrap(strategy="none", fp8="torchao", fp8_exclude=["model.layers.0.mlp"]),
        UserWarning, ("'model.layers.0.mlp' matches no module that holds parameters", "'model.layers.0.mlp.*'")),
    Bad("fp8_filter without an FP8 backend", _wrap(strategy="none", fp8_filter=lambda m, fqn: True), UserWarning,
        ("fp8_filter has no effect: no FP8 backend is chosen",)),
    Bad("fp8_group with torchao", _wrap(strategy="none", fp8="torchao", fp8_group=object()), UserWarning,
        ("fp8_group has no effect with fp8='torchao'", "it takes no amax group (fp8=te reduces its amax over a process group")),
    Bad("an option the strategy does not read", _wrap(strategy="ddp", block_classes=["LlamaDecoderLayer"]),
        UserWarning, ("block_classes=['LlamaDecoderLayer'] has no effect here", "strategy='ddp'")),
    Bad("a knob of another backend", _wrap(strategy="none", fp8="torchao", amax_history_len=16), UserWarning,
        ("amax_history_len=16 has no effect here", "fp8 in ['te']")),
    Bad("a guard knob with the guard off", _wrap(strategy="none", nonfinite_step="off", max_skipped_steps=3),
        UserWarning, ("max_skipped_steps=3 has no effect here (read only when nonfinite_step in ['skip']; "
                      "nonfinite_step='off')",)),
    Bad("a model with no blocks under fsdp", _wrap(model=lambda: nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16)),
                                                   strategy="fsdp"), UserWarning,
        ("root only", "block_classes=[...]")),
    Bad("FP8 fallback asked for", _wrap(strategy="none", fp8="te", on_unsupported="fallback"), UserWarning,
        ("fp8='te': fallback: Transformer Engine is not installed", "every layer trains in the strategy's bf16")),
]


def _checkpoint_dir(tmp: Path) -> Path:
    model = wrap_model(nn.Linear(16, 16), strategy="none")
    return save_checkpoint(tmp / "ckpt", model, torch.optim.SGD(model.parameters(), lr=0.1), step=1)


def _save(tmp: Path, **kwargs) -> Any:
    model = wrap_model(nn.Linear(16, 16), strategy="none")
    return save_checkpoint(tmp / "ckpt", model, torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)


OTHER = [
    Bad("RANK without a rendezvous address", lambda tmp: detect_launch_env({"RANK": "0", "WORLD_SIZE": "2"}),
        LaunchError, ("no rendezvous address: set MASTER_ADDR and MASTER_PORT",)),
    Bad("RANK not a number", lambda tmp: detect_launch_env({"RANK": "one", "WORLD_SIZE": "2"}), LaunchError,
        ("RANK='one' must be an integer",)),
    Bad("rank outside the world", lambda tmp: detect_launch_env({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "a",
                                                                  "MASTER_PORT": "1"}), LaunchError,
        ("rank 2 is outside world size 2",)),
    Bad("device cuda without CUDA", lambda tmp: resolve_device("cuda", 0), LaunchError,
        ("device='cuda' but torch sees no CUDA device", "device='auto' or 'cpu'")),
    Bad("batch that does not split", lambda tmp: Batches(batch_size=5, seq_len=8, rank=0, world_size=2), ValueError,
        ("batch_size=5 does not split over world size 2", "e.g. 4 or 6")),
    Bad("train steps zero", lambda tmp: TrainConfig(steps=0), ValueError, ("steps=0 must be at least 1",)),
    Bad("train model size unknown", lambda tmp: TrainConfig(model_size="huge"), ValueError,
        ("model_size='huge' is not valid", "'tiny', 'small', 'medium', '1b'")),
    Bad("train resume without a directory", lambda tmp: TrainConfig(resume=True), ValueError,
        ("resume needs checkpoint_dir", "--checkpoint-dir DIR")),
    Bad("get_plan of an unwrapped model", lambda tmp: get_plan(nn.Linear(4, 4)), ValueError,
        ("Linear was not returned by fp8dist.wrap_model",)),
    Bad("report of an unwrapped model", lambda tmp: report(nn.Linear(4, 4)), ValueError,
        ("Linear was not returned by fp8dist.wrap_model",)),
    Bad("estimate with world size zero", lambda tmp: estimate_memory(_meta_llama(), world_size=0), ValueError,
        ("world_size=0 must be a positive integer", "data-parallel ranks")),
    Bad("estimate with an unknown optimizer", lambda tmp: estimate_memory(_meta_llama(), optimizer="lion"), ValueError,
        ("optimizer='lion' is not valid", "'adamw'")),
    Bad("estimate of a rank outside the world", lambda tmp: estimate_memory(_meta_llama(), world_size=2, rank=2),
        ValueError, ("rank=2 is outside 0..1",)),
    Bad("checkpoint step negative", lambda tmp: _save(tmp, step=-1), ValueError,
        ("step=-1 must be a non-negative int",)),
    Bad("checkpoint keep_last zero", lambda tmp: _save(tmp, step=1, keep_last=0), ValueError,
        ("keep_last=0 must be a positive int, or None",)),
    Bad("checkpoint extra not JSON", lambda tmp: _save(tmp, step=1, extra={"f": print}), ValueError,
        ("must hold JSON values only", "never pickle")),
    Bad("checkpoint path missing", lambda tmp: load_checkpoint(tmp / "none", wrap_model(nn.Linear(16, 16),
                                                                                         strategy="none"), None),
        FileNotFoundError, ("does not exist",)),
    Bad("checkpoint into an unwrapped model", lambda tmp: load_checkpoint(_checkpoint_dir(tmp), nn.Linear(16, 16),
                                                                          None), ValueError,
        ("Linear was not returned by fp8dist.wrap_model",)),
]


def _on_two_gpus(call: Callable[[], Any]) -> Any:
    """``call()`` as on a node whose torch sees 2 CUDA devices."""
    from unittest import mock

    with mock.patch.object(torch.cuda, "is_available", return_value=True), \
            mock.patch.object(torch.cuda, "device_count", return_value=2):
        return call()


def _safetensors(tmp: Path, damage: Callable[[bytes], bytes]) -> str:
    """A pretrained directory whose model.safetensors is ``damage`` of a good one."""
    from safetensors.torch import save_file

    save_file({"weight": torch.zeros(64, 64)}, tmp / "good.safetensors")
    (tmp / "model.safetensors").write_bytes(damage((tmp / "good.safetensors").read_bytes()))
    return str(tmp)


TRIALS = [  # issue 24: tried as a new user would
    Bad("RANK without WORLD_SIZE", lambda tmp: detect_launch_env({"RANK": "1"}), LaunchError,
        ("RANK=1 is set but WORLD_SIZE is not", "Set WORLD_SIZE too, or unset RANK to run as one process")),
    Bad("LOCAL_RANK beyond the GPUs", lambda tmp: _on_two_gpus(lambda: resolve_device("auto", 3)), LaunchError,
        ("LOCAL_RANK=3 but torch sees 2 CUDA devices", "torchrun --nproc-per-node 2")),
    Bad("rendezvous timeout not a number", lambda tmp: rendezvous_timeout({"FP8DIST_RENDEZVOUS_TIMEOUT": "soon"}),
        LaunchError, ("FP8DIST_RENDEZVOUS_TIMEOUT='soon' must be a positive number of seconds (default 600)",)),
    Bad("no_sync last not a bool", lambda tmp: no_sync(wrap_model(nn.Linear(16, 16), strategy="none"),
                                                       last="no").__enter__(), TypeError,
        ("last='no' must be True or False, not str",)),
    Bad("checkpoint overwrite not a bool", lambda tmp: _save(tmp, step=1, overwrite="yes"), TypeError,
        ("overwrite='yes' must be True or False",)),
    Bad("train lr NaN", lambda tmp: TrainConfig(lr=float("nan")), ValueError, ("lr=nan must be positive and finite",)),
    Bad("train lr infinite", lambda tmp: TrainConfig(lr=float("inf")), ValueError,
        ("lr=inf must be positive and finite",)),
    Bad("save_pretrained dtype int8", lambda tmp: save_pretrained(nn.Linear(4, 4), tmp / "out", dtype="int8"),
        ValueError, ("dtype='int8' is not an export dtype", "torch.bfloat16", "'bf16'")),
    Bad("safetensors truncated", lambda tmp: SafetensorsDir(_safetensors(tmp, lambda b: b[:len(b) // 2])),
        PretrainedError, ("model.safetensors is not a readable safetensors file", "truncated or damaged")),
    Bad("safetensors garbage header", lambda tmp: SafetensorsDir(_safetensors(tmp, lambda b: b"\xff" * 8 + b[8:])),
        PretrainedError, ("model.safetensors is not a readable safetensors file", "header")),
    Bad("pretrained directory missing", lambda tmp: pretrained_config(str(tmp / "missing")), ValueError,
        ("the directory does not exist", "fp8dist never downloads")),
]


def _check(case: Bad, tmp_path: Path) -> None:
    if issubclass(case.expected, Warning):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            case.call(tmp_path)
        ours = [str(w.message) for w in caught if issubclass(w.category, case.expected)
                and all(t in str(w.message) for t in case.texts)]
        assert len(ours) == 1, f"expected one warning holding {case.texts}, got {[str(w.message) for w in caught]}"
        return
    with pytest.raises(case.expected) as err:
        case.call(tmp_path)
    for text in case.texts:
        assert text in str(err.value), f"{text!r} not in: {err.value}"


@pytest.mark.parametrize("case", WRAP + WARN + OTHER + TRIALS, ids=lambda c: c.id)
def test_bad_input_is_a_clear_error_or_one_warning(case, tmp_path, one_rank_group):
    _check(case, tmp_path)


def _cli(tmp: Path, *argv: str, files: dict[str, str] | None = None) -> list[str]:
    for name, text in (files or {}).items():
        (tmp / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp / name).write_text(text)
    return [a.replace("TMP", str(tmp)) for a in argv]


LLAMA_JSON = json.dumps({"model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
                         "num_hidden_layers": 1, "num_attention_heads": 4})
CLI = [
    ("train strategy misspelt", ["train", "--strategy", "fdsp"], {},
     ("argument --strategy: strategy='fdsp' is not valid", "Did you mean 'fsdp'?")),
    ("train steps zero", ["train", "--steps", "0"], {}, ("steps=0 must be at least 1",)),
    ("train fp8 te without Transformer Engine", ["train", "--fp8", "te"], {},
     ("fp8='te' cannot run here: Transformer Engine is not installed",)),
    ("train msamp under fsdp", ["train", "--fp8", "msamp", "--strategy", "fsdp"], {},
     ("fp8='msamp' with strategy='fsdp'",)),
    ("train zero stage 4", ["train", "--strategy", "deepspeed", "--zero-stage", "4"], {},
     ("zero_stage='4' is not valid; choose one of: 1, 2, 3",)),
    ("plan fp8 te without Transformer Engine", ["plan", "--model-config", "TMP/llama.json", "--fp8", "te"],
     {"llama.json": LLAMA_JSON}, ("Transformer Engine is not installed",)),
    ("train steps not a number", ["train", "--steps", "abc"], {}, ("argument --steps: steps='abc' must be an integer",)),
    ("train lr zero", ["train", "--lr", "0"], {}, ("lr=0.0 must be positive",)),
    ("train keep_last negative", ["train", "--keep-last", "-1"], {}, ("keep_last=-1 must be 0 (keep all) or more",)),
    ("train save_every without a directory", ["train", "--save-every", "5"], {},
     ("save_every needs checkpoint_dir", "--checkpoint-dir DIR")),
    ("train none on two processes", ["train", "--strategy", "none", "--nproc", "2"], {},
     ("nproc=2 with strategy='none'", "--nproc 1")),
    ("train batch that does not split", ["train", "--batch-size", "5", "--nproc", "2"], {},
     ("batch_size=5 does not split over world size 2",)),
    ("train TE not installed", ["train", "--fp8", "te"], {}, ("fp8='te' cannot run here", "on_unsupported='fallback'")),
    ("train bool flag not a bool", ["train", "--keep-first-last-linear", "perhaps"], {},
     ("keep_first_last_linear='perhaps' must be true or false",)),
    ("train model size unknown", ["train", "--model-size", "huge"], {},
     ("argument --model-size: model_size='huge' is not valid",)),
    ("plan block class not in the model", ["plan", "--block-classes", "NoSuchLayer"], {},
     ("['NoSuchLayer'] not found in LlamaForCausalLM", "'LlamaDecoderLayer'")),
    ("plan model config missing", ["plan", "--model-config", "TMP/missing.json"], {}, ("missing.json",)),
    ("plan model config truncated", ["plan", "--model-config", "TMP/cut.json"], {"cut.json": LLAMA_JSON[:40]},
     ("cut.json is not valid JSON (line 1", "Hugging Face config.json")),
    ("plan model config without model_type", ["plan", "--model-config", "TMP/nt.json"], {"nt.json": "{}"},
     ("nt.json: a Hugging Face config needs 'model_type'",)),
    ("plan config file unknown key", ["plan", "--config", "TMP/c.yaml"], {"c.yaml": "stratgy: fsdp\n"},
     ("option 'stratgy' in", "Did you mean 'strategy'?")),
    ("plan config file missing", ["plan", "--config", "TMP/none.yaml"], {}, ("none.yaml' does not exist",)),
    ("plan target unknown", ["plan", "--target", "v100"], {},
     ("target 'v100' is not a known machine", "h100", "sm_90", "or cpu")),
    ("plan target and device", ["plan", "--target", "h100", "--device", "cpu"], {},
     ("--target h100 and --device cpu both name the machine", "--target alone")),
    ("plan target and ignore-hardware", ["plan", "--target", "h100", "--ignore-hardware"], {},
     ("argument --ignore-hardware: not allowed with argument --target",)),
    ("plan te on a target without FP8", ["plan", "--fp8", "te", "--target", "a100"], {},
     ("fp8='te' cannot run on the target: A100 (sm_80) has no FP8 tensor cores: FP8 needs sm_89+",)),
    ("plan config is a directory", ["plan", "--config", "TMP"], {}, ("does not exist",)),
    ("plan margin zero", ["plan", "--fp8-select-margin", "0"], {},
     ("fp8_select_margin=0.0 must be a finite number > 0",)),
    ("plan numerics not a report", ["plan", "--numerics", "TMP/r.json"], {"r.json": "[1, 2]"},
     ("--numerics", "r.json: not a numerics report (no 'layers')", "fp8dist probe --json FILE")),
    ("plan numerics of another model", ["plan", "--numerics", "TMP/r.json"],
     {"r.json": json.dumps({"backend": "torchao", "layers": [{"name": "encoder.fc", "calls": 1, "problems": []}]})},
     ("the numerics report names 1 module this model does not have ('encoder.fc')", "measured on another model")),
    ("estimate world size zero", ["estimate", "--world-size", "0"], {}, ("world_size=0 must be a positive integer",)),
    ("estimate seq_len negative", ["estimate", "--seq-len", "-1"], {}, ("seq_len=-1 must be a positive integer",)),
    ("estimate rank outside the world", ["estimate", "--world-size", "2", "--rank", "2"], {},
     ("rank=2 is outside 0..1",)),
    ("estimate with strategy none on two ranks", ["estimate", "--strategy", "none", "--world-size", "2"], {},
     ("world_size=2 with strategy='none'",)),
    ("ds-config stage 4", ["ds-config", "--stage", "4"], {}, ("argument --stage: invalid choice: 4",)),
    ("ds-config micro batch zero", ["ds-config", "--micro-batch-size", "0"], {},
     ("micro_batch_size=0 must be a positive integer",)),
    ("ds-config model config truncated", ["ds-config", "--model-config", "TMP/cut.json"],
     {"cut.json": LLAMA_JSON[:40]}, ("cut.json is not valid JSON",)),
    ("ds-config offload_param below ZeRO-3", ["ds-config", "--stage", "2", "--offload-param"], {},
     ("offload_param=True needs stage 3",)),
    ("unknown command", ["trian"], {}, ("invalid choice: 'trian'",)),
    ("train lr NaN", ["train", "--lr", "nan"], {}, ("lr=nan must be positive and finite",)),
    ("train lr infinite", ["train", "--lr", "inf"], {}, ("lr=inf must be positive and finite",)),
    ("train pretrained directory missing", ["train", "--pretrained", "TMP/missing_dir"], {},
     ("pretrained='", "missing_dir': the directory does not exist", "fp8dist never downloads")),
    ("train seq-len beyond the positions", ["train", "--seq-len", "100000"], {},
     ("seq_len=100,000 and llama-tiny holds 8,192 positions: pass --seq-len 8192 or less",
      "activations 5.36 GiB (micro-batch 4 x 100,000 tokens) per rank, estimated")),
    ("train checkpoint dir of another run", ["train", "--checkpoint-dir", "TMP/ckpt"],
     {"ckpt/latest": "step_00000005\n", "ckpt/step_00000005/meta.json": "{}"},
     ("already holds checkpoints (newest step_00000005): pass --resume to continue from it",)),
]


@pytest.mark.parametrize("case_id,argv,files,texts", CLI, ids=[c[0] for c in CLI])
def test_bad_command_line_exits_2_with_the_message_and_no_traceback(case_id, argv, files, texts, tmp_path, capsys):
    try:
        code = main(_cli(tmp_path, *argv, files=files))
    except SystemExit as exit_:  # argparse's own errors
        code = exit_.code
    out, err = capsys.readouterr()
    assert code == 2
    assert "Traceback" not in err
    assert "starting" not in out, "rejected before any process starts"
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"fp8dist {argv[0]}: error: ") or last.startswith("fp8dist: error: "), err
    for text in texts:
        assert text in last, f"{text!r} not in: {last}"


def test_python_and_the_command_line_accept_the_same_spellings():
    """"FSDP", "bfloat16", "3" and "no" mean the same in Python as on the command line."""
    cfg = resolve_config(strategy="FSDP", param_dtype="bfloat16", zero_stage="3", reshard_after_forward="no")
    assert (cfg.parallel.strategy, cfg.parallel.param_dtype, cfg.parallel.zero_stage,
            cfg.parallel.reshard_after_forward) == ("fsdp", "bf16", 3, False)
