"""The recipes the speed model predicts: those the registered FP8 backends declare
(:attr:`fp8dist.fp8.FP8Backend.speed_recipes`, in the vocabulary of :mod:`fp8dist.fp8.speed_recipe`). A backend
registered later (``register_backend``) adds its own; the model keeps no table of its own."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from ...fp8 import BACKENDS, get_backend
from ...fp8.speed_recipe import AO_KERNELS, BLOCK_KERNELS, TE_KERNELS, CastKernels, Kernel, Recipe

__all__ = ["Kernel", "Recipe", "CastKernels", "RECIPES", "recipe_named", "AO_KERNELS", "TE_KERNELS", "BLOCK_KERNELS"]


class _Declared(Mapping[str, Recipe]):
    """Every registered backend's recipes by name, read afresh on each look-up (a backend registered later is in)."""

    def _table(self) -> dict[str, Recipe]:
        table: dict[str, Recipe] = {}
        for backend in BACKENDS:
            for recipe in get_backend(backend).speed_recipes:
                if table.setdefault(recipe.name, recipe) is not recipe:
                    raise ValueError(f"fp8={backend!r} declares speed recipe {recipe.name!r}, which another backend "
                                     "declares too: give it a name of its own.")
        return table

    def __getitem__(self, name: str) -> Recipe:
        return self._table()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._table())

    def __len__(self) -> int:
        return len(self._table())


RECIPES: Mapping[str, Recipe] = _Declared()
"""The speed model's recipes by name, as the registered backends declare them."""


def recipe_named(name: str) -> Recipe:
    """The recipe called ``name``; ValueError naming the choices (and the backend declaring each) for an unknown one."""
    table = dict(RECIPES)
    if name not in table:
        owners = {r.name: b for b in BACKENDS for r in get_backend(b).speed_recipes}
        listed = ", ".join(f"{r} ({owners[r]})" for r in table)
        raise ValueError(f"recipe {name!r} is not one the speed model knows: choose one of {listed} (each FP8 "
                         "backend declares its own in speed_recipes).")
    return table[name]
