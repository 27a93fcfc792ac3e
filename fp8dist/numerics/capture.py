"""The probe's hooks: each planned FP8 GEMM casts its operands as its recipe would while the model runs in high
precision, forward and (through a hook on the output) backward: a Linear or Conv1D by a forward hook, a MoE experts
module by a ``TorchFunctionMode`` that sees each ``torch._grouped_mm`` (one GEMM per expert, pooled per weight)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ..fp8.casts import USES, CastEmulation, CastEmulator
from ..fp8.conv1d import is_conv1d
from .casts import CONTRACTION_DIM
from .stats import CastStats, LayerNumerics

__all__ = ["GemmSite", "attach"]

Backward = Callable[[torch.Tensor], None]  # measures a forward GEMM's two backward GEMMs from its output gradient


class GemmSite:
    """One FP8 GEMM under measurement: its casts, each run by the emulator its backend's
    :class:`~fp8dist.fp8.casts.CastEmulation` gives (two uses of one dim-independent cast are measured once)."""

    def __init__(self, layer: LayerNumerics, specs: dict[tuple[str, str], CastEmulation | None]) -> None:
        self.layer = layer
        self.casts: list[tuple[str, tuple[str, ...], CastEmulator, CastStats]] = []
        for role in ("input", "weight", "grad_output"):
            uses = [(gemm, spec) for r, gemm in USES if r == role and (spec := specs[(r, gemm)]) is not None]
            if len(uses) == 2 and uses[0][1] == uses[1][1] and not uses[0][1].per_dim:
                uses = [("+".join(g for g, _ in uses), uses[0][1])]
            for gemm, spec in uses:
                stats = CastStats(role, gemm, spec.describe(), fp4=spec.fp4)
                layer.casts.append(stats)
                self.casts.append((role, tuple(gemm.split("+")), spec.emulator(), stats))
        self._weights_seen: set[object] = set()

    def _measure(self, role: str, x: torch.Tensor, record: bool) -> dict[str, torch.Tensor]:
        """``x``'s round trip per GEMM its role feeds (``x`` itself where that GEMM takes it in high precision)."""
        out = {gemm: x for r, gemm in USES if r == role}
        for r, gemms, cast, stats in self.casts:
            if r != role:
                continue
            dim = CONTRACTION_DIM[(role, gemms[0])]
            back, saturated = cast(x, dim)
            if record:
                stats.add(x, back, saturated, dim, cast.floored)
            out.update(dict.fromkeys(gemms, back))
        return out

    @torch.no_grad()
    def forward(self, x: torch.Tensor, w_t: torch.Tensor, weight_key: object = None) -> Backward | None:
        """Measure ``x (M, K) @ w_t (K, N)``, the weight's casts counted once per ``weight_key``; returns what
        measures its backward GEMMs from its output gradient (None: no GEMM)."""
        if x.numel() == 0:
            return None
        x, w_t = x.detach().float(), w_t.detach().float()
        new_weight = weight_key not in self._weights_seen
        self._weights_seen.add(weight_key)
        x_fp8 = self._measure("input", x, True)
        w_fp8 = self._measure("weight", w_t, new_weight)
        self.layer.output.add(x @ w_t, x_fp8["output"] @ w_fp8["output"])
        self.layer.calls += 1
        # the backward GEMMs read the operands as the recipe cast them for those GEMMs (rowwise: along other dims)
        x_wgrad, w_dgrad = x_fp8["grad_weight"], w_fp8["grad_input"]

        @torch.no_grad()
        def backward(g: torch.Tensor) -> None:
            if g.numel() == 0:
                return
            g = g.detach().float()
            g_fp8 = self._measure("grad_output", g, True)
            self.layer.grad_input.add(g @ w_t.t(), g_fp8["grad_input"] @ w_dgrad.t())
            self.layer.grad_weight.add(x.t() @ g, x_wgrad.t() @ g_fp8["grad_weight"])

        return backward


Handle = Callable[[], None]


def _attach_linear(module: nn.Module, site: GemmSite) -> list[Handle]:
    conv1d = is_conv1d(module)

    def hook(mod: nn.Module, args: tuple, kwargs: dict, out: torch.Tensor) -> None:
        x = args[0] if args else kwargs["input"]
        backward = site.forward(x.reshape(-1, x.shape[-1]), mod.weight if conv1d else mod.weight.t())
        if backward is not None and isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(lambda g: backward(g.reshape(-1, g.shape[-1])))

    return [module.register_forward_hook(hook, with_kwargs=True).remove]


class _GroupedGemms(TorchFunctionMode):
    """Active while an experts module's forward runs: each grouped GEMM on one of its weights is measured."""

    def __init__(self, sites: dict[int, GemmSite]) -> None:
        super().__init__()
        self.sites = sites  # by the weight's storage address: the GEMM gets a transposed view of it
        self.funcs = {torch._grouped_mm, getattr(torch.nn.functional, "grouped_mm", None)} - {None}
        self.seen = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in self.funcs:  # this mode is off inside the handler: nothing below re-enters it
            a, b = args[0], args[1]
            offs = kwargs.get("offs", args[2] if len(args) > 2 else None)
            site = self.sites.get(b.untyped_storage().data_ptr())
            if site is not None and offs is not None and a.dim() == 2 and b.dim() == 3:
                self.seen += 1
                self._record(site, a, b, offs.tolist(), out)
        return out

    @staticmethod
    def _record(site: GemmSite, a: torch.Tensor, b: torch.Tensor, ends: list[int], out: torch.Tensor) -> None:
        backwards = [(start, end, site.forward(a[start:end], b[expert], weight_key=expert))
                     for expert, (start, end) in enumerate(zip([0, *ends[:-1]], ends))]

        def grad(g: torch.Tensor) -> None:
            for start, end, backward in backwards:
                if backward is not None:
                    backward(g[start:end])

        if out.requires_grad:
            out.register_hook(grad)


def _attach_experts(module: nn.Module, sites: dict[int, GemmSite]) -> tuple[list[Handle], _GroupedGemms]:
    mode = _GroupedGemms(sites)
    active: list[_GroupedGemms] = []

    def enter(mod: nn.Module, args: tuple) -> None:
        mode.__enter__()
        active.append(mode)

    def leave(mod: nn.Module, args: tuple, out: object) -> None:  # always_call: after a forward that raised too
        if active:
            active.pop().__exit__(None, None, None)

    leaving = module.register_forward_hook(leave, always_call=True)
    return [module.register_forward_pre_hook(enter).remove, leaving.remove], mode


def attach(model: nn.Module, layers: dict[str, tuple[str, str, dict]]
           ) -> tuple[list[GemmSite], list[Handle], list[tuple[str, _GroupedGemms]]]:
    """Hook each ``{name: (module type, "linear" or "experts", casts per use)}``: the sites (one per GEMM, in model
    order), the hooks' removers and each experts module's mode (it counts the grouped GEMMs seen)."""
    sites = []
    handles = []
    modes = []
    for name, (module_type, kind, specs) in layers.items():
        module = model.get_submodule(name)
        if kind == "linear":
            site = GemmSite(LayerNumerics(name, "", module_type), specs)
            sites.append(site)
            handles += _attach_linear(module, site)
            continue
        by_storage = {}
        for param_name, param in module.named_parameters(recurse=False):
            site = GemmSite(LayerNumerics(name, param_name, module_type), specs)
            sites.append(site)
            by_storage[param.untyped_storage().data_ptr()] = site
        removers, mode = _attach_experts(module, by_storage)
        handles += removers
        modes.append((name, mode))
    return sites, handles, modes
