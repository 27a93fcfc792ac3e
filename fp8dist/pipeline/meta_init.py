"""A meta-device model after sharding: its own initialization (``_init_weights`` or ``reset_parameters``), run at full
size one module at a time, each rank keeping its part: the same weights for any strategy and world size under one
seed (not those of an eager construction, whose constructors draw random numbers)."""

from __future__ import annotations

import torch
from torch import nn

from ..config.text import plural
from ..config.args import require_bool
from ..strategies import unwrap_model
from ..runtime.names import plain_name
from ..strategies.local_shards import LocalParam, Region, local_params, original_class

__all__ = ["is_meta_model", "init_weights"]


def is_meta_model(model: nn.Module) -> bool:
    """True when any parameter or buffer of ``model`` is on the meta device."""
    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))


def _full_size_copy(module: nn.Module, device: torch.device, shapes: dict[str, tuple[int, ...]],
                    param_device: torch.device | str) -> nn.Module:
    """A childless copy of ``module`` at full size: buffers on ``device``, parameters on ``param_device``."""
    shadow = object.__new__(original_class(module))
    shadow.__dict__ = dict(module.__dict__)
    shadow._modules = {}
    params: dict[str, nn.Parameter | None] = {}
    for n, p in module._parameters.items():
        if p is None:
            params[n] = None
            continue
        empty = torch.empty(shapes.get(n, p.shape), dtype=p.dtype, device=param_device)
        params[n] = nn.Parameter(empty, requires_grad=p.requires_grad)
    shadow._parameters = params
    shadow._buffers = {n: None if b is None else torch.empty(b.shape, dtype=b.dtype, device=device)
                       for n, b in module._buffers.items()}
    return shadow


def _post_order(module: nn.Module, prefix: str = ""):
    """Modules children first, as Hugging Face's ``initialize_weights`` visits them."""
    for name, child in module._modules.items():
        if child is not None:
            yield from _post_order(child, f"{prefix}.{name}" if prefix else name)
    yield prefix, module


def init_weights(model: nn.Module, device: torch.device, *, params: list[LocalParam] | None = None,
                 buffers_only: bool = False) -> None:
    """Run the model's own initialization one module at a time at full size on ``device`` and keep this rank's part
    of each parameter; buffers are set whole. ``model``: the wrapped model whose shards the strategy allocated;
    ``params``: this rank's parts (default :func:`~fp8dist.strategies.local_shards.local_params`);
    ``buffers_only``: the parameters come from a checkpoint. Call it on every rank after sharding, before filling
    from a checkpoint.

    Raises:
        ValueError: without ``buffers_only``, a parameter whose module has no ``reset_parameters`` (and the model no
            ``_init_weights``): it would hold uninitialized memory.
        TypeError: ``buffers_only`` is not a bool.
    """
    require_bool("buffers_only", buffers_only)
    inner = unwrap_model(model)
    params = local_params(model) if params is None else params
    by_name = {n: p for p in params for n in p.names}
    init = getattr(inner, "_init_weights", None)  # Hugging Face's per-module initializer
    if not callable(init):  # else each module's reset_parameters
        init = lambda module: module.reset_parameters() if hasattr(module, "reset_parameters") else None
        if not buffers_only:
            _check_initializable(inner, by_name)
    with torch.no_grad():
        for prefix, module in _post_order(inner):
            if not module._buffers and (buffers_only or not module._parameters):
                continue
            names = {n: plain_name(f"{prefix}.{n}" if prefix else n) for n in module._parameters}
            shapes = {n: by_name[q].shape for n, q in names.items() if q in by_name}
            shadow = _full_size_copy(module, device, shapes, "meta" if buffers_only else device)
            init(shadow)
            for n, buf in module._buffers.items():
                if buf is not None:
                    buf.copy_(shadow._buffers[n])
            if buffers_only:
                continue
            for n, full in shadow._parameters.items():
                piece = by_name.get(names[n])
                if full is not None and piece is not None and piece.region.numel:  # tied: the last module wins
                    piece.local.copy_(_cut(full.data, piece.region).view(piece.local.shape))


def _check_initializable(inner: nn.Module, by_name: dict[str, LocalParam]) -> None:
    """Refuse parameters no ``reset_parameters`` sets (without ``_init_weights``): they would stay uninitialized."""
    bare = [name for prefix, module in _post_order(inner) if not hasattr(module, "reset_parameters")
            for n in module._parameters if (name := plain_name(f"{prefix}.{n}" if prefix else n)) in by_name]
    if bare:
        raise ValueError(f"{type(inner).__name__} was built on the meta device and {plural(len(bare), 'parameter')} "
                         f"{'has' if len(bare) == 1 else 'have'} no initialization to run (their module has no "
                         f"reset_parameters), e.g. {bare[:5]}: they "
                         "would hold uninitialized memory. Pass pretrained=DIR, give those modules a "
                         "reset_parameters(), or build the model on the CPU.")


def _cut(full: torch.Tensor, region: Region) -> torch.Tensor:
    if region.flat is not None:
        return full.reshape(-1)[region.flat[0]: region.flat[1]]
    return full[tuple(slice(start, start + length) for start, length in region.box)]
