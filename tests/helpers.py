"""Shared by the tests: one tiny training loop, run identically on fp8dist-wrapped and hand-wired models."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import pytest
import torch
from torch import nn

from fp8dist.train.data import Batches

STEPS = 4
BATCH = 4  # global
SEQ = 64


def train_losses(model: nn.Module, rank: int, world: int, *, steps: int = STEPS,
                 autocast_dtype: torch.dtype | None = None, lr: float = 1e-3,
                 after_step: Callable[[], None] | None = None) -> list[float]:
    """Per-step losses of this rank: AdamW built after wrapping, byte batches from fp8dist.train.data.
    ``after_step`` runs after each optimizer step (what a hand-wired script must remember to call)."""
    batches = Batches(batch_size=BATCH, seq_len=SEQ, rank=rank, world_size=world, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        ids = batches[step]
        ctx = torch.autocast("cpu", dtype=autocast_dtype) if autocast_dtype else contextlib.nullcontext()
        with ctx:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        if after_step is not None:
            after_step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def optimizer_losses(model: nn.Module, opt: torch.optim.Optimizer, rank: int, world: int, steps: int, *,
                     start: int = 0, device: torch.device | str | None = None, seq_len: int = SEQ,
                     after_step: Callable[[], None] | None = None) -> list[float]:
    """Per-step losses of this rank training ``model`` with the caller's ``opt`` on the byte batches of steps
    ``start`` .. ``start + steps - 1`` (on ``device`` when given): the loop a resumed run continues.
    ``after_step``: called after each optimizer step (a hand wiring's scale precompute)."""
    batches = Batches(batch_size=BATCH, seq_len=seq_len, rank=rank, world_size=world, seed=0)
    losses = []
    for step in range(start, start + steps):
        ids = batches[step] if device is None else batches[step].to(device)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        if after_step is not None:
            after_step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def linear_dtypes(model: nn.Module, linear: nn.Module, rank: int, world: int) -> dict[str, str]:
    """Dtypes a Linear really sees in one forward: its input, its weight while computing, its output."""
    seen: dict[str, str] = {}

    def hook(module, inputs, output):
        seen.update(input=str(inputs[0].dtype), weight=str(module.weight.dtype), output=str(output.dtype))

    handle = linear.register_forward_hook(hook)
    ids = Batches(batch_size=BATCH, seq_len=SEQ, rank=rank, world_size=world, seed=0)[0]
    with torch.no_grad():
        model(input_ids=ids)
    handle.remove()
    return seen


def first_last_filter(model: nn.Module):
    """torchao module filter keeping the first and last nn.Linear in high precision, written by hand."""
    names = [n for n, m in model.named_modules() if type(m) is nn.Linear]
    return lambda module, fqn: fqn not in (names[0], names[-1])


def hand_wired_fsdp2(model: nn.Module, world: int, reduce_dtype: torch.dtype = torch.float32,
                     layers: nn.ModuleList | None = None) -> nn.Module:
    """The reference FSDP2 wiring, by hand: fully_shard each Llama decoder layer (``layers``, default
    ``model.model.layers``; a PEFT model's are ``model.base_model.model.model.layers``), then the root, bf16 params."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers if layers is None else layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def engine_losses(engine, rank: int, world: int, *, steps: int = STEPS) -> list[float]:
    """Per-step losses of a DeepSpeed engine (it scales, clips, steps and zeroes itself)."""
    batches = Batches(batch_size=BATCH, seq_len=SEQ, rank=rank, world_size=world, seed=0)
    losses = []
    for step in range(steps):
        ids = batches[step]
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def conv1d_as_linears(model: nn.Module, names: list[str] | None = None) -> nn.Module:
    """GPT-2's Conv1Ds ``names`` (default: all) swapped by hand for the nn.Linear each is (weight transposed, bias
    copied): the reference the FP8 Conv1D paths are compared with."""
    from fp8dist.fp8.conv1d import is_conv1d

    if names is None:
        names = [n for n, m in model.named_modules() if is_conv1d(m)]
    for name in names:
        conv = model.get_submodule(name)
        linear = nn.Linear(*conv.weight.shape)
        with torch.no_grad():
            linear.weight.copy_(conv.weight.t())
            linear.bias.copy_(conv.bias)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, linear)
    return model


@pytest.fixture
def one_thread():
    """Torch on one thread for the test (an autouse import of it does so for a module): the probe's many small
    GEMMs are several times faster on one thread than on torch's default when the cores are shared."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def gemms_per_module(model: nn.Module, ids: torch.Tensor, kind: str = "count") -> tuple[dict[str, int], object]:
    """torchao's FP8 GEMMs (``kind="count"``) or MX GEMMs (``"mx"``) each Linear's forward ran in one forward and
    backward of a causal LM on ``ids``, and the counter of the whole step (its ``count`` and ``mx`` totals)."""
    from fp8dist.fp8.weight_wrapper import FP8Gemms

    per_module: dict[str, int] = {}
    with FP8Gemms() as gemms:
        handles = []
        for name, module in model.named_modules():
            if isinstance(module, nn.Linear):
                handles.append(module.register_forward_pre_hook(
                    lambda m, a, name=name: per_module.__setitem__(name, -getattr(gemms, kind))))
                handles.append(module.register_forward_hook(
                    lambda m, a, o, name=name: per_module.__setitem__(name, per_module[name] + getattr(gemms, kind))))
        model(input_ids=ids, labels=ids).loss.backward()
        for h in handles:
            h.remove()
    model.zero_grad(set_to_none=True)
    return per_module, gemms


def deepspeed_report(model: nn.Module, ids: torch.Tensor, **options) -> object:
    """``fp8dist.report`` of ``model`` wrapped by DeepSpeed (``options``: wrap_model's) after one step and the next
    backward: its optimizer states exist after the first step, its gradients until the next."""
    import fp8dist

    engine, _ = fp8dist.wrap_model(model, micro_batch_size=2, optimizer={"type": "AdamW"}, **options)
    for step in range(2):
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        if step == 0:
            engine.step()
    return fp8dist.report(engine)
