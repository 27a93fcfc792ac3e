"""Which modules compute a plain Linear, ``F.linear(x, weight, bias)`` of their own weight and bias: the only ones an
FP8 Linear may replace. An ``nn.Linear`` subclass that overrides ``forward`` (Falcon's) is judged by running its
forward on a small random copy (on the CPU for a meta module) holding nothing but ``weight`` and ``bias``."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .conv1d import is_conv1d

__all__ = ["plain_linear_reason", "plain_linear_like", "own_output"]

_PROBE_ROWS = (2, 3)  # the check's (batch, sequence): a forward that reshapes as a transformer's does runs
_DIMS = (24, 40)  # (in, out) of the small copy


def plain_linear_reason(module: nn.Module) -> str | None:
    """None when ``module`` computes a plain Linear of its own weight and bias; else why not, in a line."""
    cls = type(module)
    if not isinstance(module, nn.Linear):
        return f"{cls.__name__} is not an nn.Linear"
    if cls.forward is nn.Linear.forward:
        return None
    extra = [n for n, _ in module.named_parameters() if n not in ("weight", "bias")]
    extra += [n for n, _ in module.named_buffers()] + [n for n, _ in module.named_children()]
    if extra:
        return (f"{cls.__name__} overrides nn.Linear.forward and holds {', '.join(extra[:3])} besides weight and "
                "bias: its output is not a plain linear of its weight, which an FP8 Linear would replace")
    differs = _forward_differs(module)
    return differs and (f"{cls.__name__} overrides nn.Linear.forward and does not compute F.linear(x, weight, bias) "
                        f"({differs}): an FP8 Linear would replace what it computes")


def _forward_differs(module: nn.Linear) -> str | None:
    subject = _small_copy(module)
    weight = subject.weight
    generator = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(*_PROBE_ROWS, weight.shape[1], generator=generator).to(weight.device, weight.dtype)
    try:
        with torch.no_grad():
            got = subject.forward(x)
            want = F.linear(x, weight, subject.bias)
    except Exception as err:  # any code may refuse a plain input: that is itself the answer
        return f"its forward raised {type(err).__name__} on an input of shape {tuple(x.shape)}"
    if not isinstance(got, torch.Tensor):
        return f"its forward returns a {type(got).__name__}, not a tensor"
    if got.shape != want.shape:
        return f"its output has shape {tuple(got.shape)}, F.linear's {tuple(want.shape)}"
    tol = 1e-2 if weight.dtype in (torch.bfloat16, torch.float16) else 1e-5  # GEMMs round differently, not more
    if not torch.allclose(got.float(), want.float(), rtol=tol, atol=tol):
        return f"its output differs from F.linear's by up to {(got.float() - want.float()).abs().max().item():.3g}"
    return None


def _small_copy(module: nn.Linear, dims: tuple[int, int] = _DIMS) -> nn.Linear:
    """A shallow copy of ``module`` (attributes, forward) holding small random weight and bias of ``dims`` (in,
    out)."""
    stand_in = copy.copy(module)
    stand_in._parameters = dict(module._parameters)  # the copy's own dict: the module keeps its parameters
    device = torch.device("cpu") if module.weight.device.type == "meta" else module.weight.device
    held = module.weight.element_size() == 1  # FP8 bits (a LoRA base held in FP8): the class is probed in fp32
    dtype = module.weight.dtype if module.weight.is_floating_point() and not held else torch.float32
    generator = torch.Generator(device="cpu").manual_seed(1)
    n_in, n_out = dims
    stand_in.in_features, stand_in.out_features = n_in, n_out
    stand_in._parameters["weight"] = nn.Parameter(torch.randn(n_out, n_in, generator=generator).to(device, dtype))
    if module.bias is not None:
        stand_in._parameters["bias"] = nn.Parameter(torch.randn(n_out, generator=generator).to(device, dtype))
    return stand_in


def plain_linear_like(module: nn.Module) -> bool:
    """A Linear-like module that computes a plain Linear: the FP8 candidates first/last are counted among."""
    return is_conv1d(module) or plain_linear_reason(module) is None


def own_output(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
    """A forward hook for a swapped Linear without bias: Float8Linear returns a view made inside its autograd
    Function, which models then modify in place (Falcon's ``mlp_output += attention_output``) and autograd forbids.
    ``_unsafe_view`` (what aten's matmul returns) makes it a tensor of its own without a copy; no ``_is_view()``
    test, where torch.compile would break its graph."""
    return torch.ops.aten._unsafe_view(output, output.shape)
