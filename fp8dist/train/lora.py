"""``fp8dist train --lora-rank R``: the job's model as a PEFT LoRA model, built before :func:`fp8dist.wrap_model`:
the base frozen, only the adapters train; checkpoints hold only them, and ``--save-pretrained`` writes them in
PEFT's format (:mod:`fp8dist.checkpoint.lora`)."""

from __future__ import annotations

import difflib
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["apply_lora", "lora_alpha", "import_peft", "lora_job_model", "export_lora", "holds_fp8_base"]


def import_peft() -> Any:
    """``peft``, or ImportError saying how to install it (only LoRA jobs need it)."""
    try:
        import peft
    except ImportError:
        raise ImportError("--lora-rank needs the peft package (Hugging Face PEFT), which is not installed: "
                          "pip install peft. Or leave --lora-rank out to train every weight.") from None
    return peft


def lora_alpha(train: Any) -> float:
    """The adapters' alpha: ``lora_alpha``, or twice the rank."""
    return train.lora_alpha if train.lora_alpha is not None else 2.0 * train.lora_rank


def _targets(model: nn.Module, train: Any) -> tuple[list[str] | None, list[tuple[str, nn.Module]]]:
    """(``lora_targets`` for PEFT, or None: PEFT's default of the model's family; the layers they name), each target
    checked to end the name of a layer an adapter may sit on (:data:`~fp8dist.plan.adapter_rules.ADAPTABLE_KINDS`):
    ValueError naming the target, the model's such names and the way out."""
    from ..plan.adapter_rules import KINDS_TEXT, adaptable_kind

    peft = import_peft()
    layers = [(name, m) for name, m in model.named_modules() if name and adaptable_kind(m) is not None]
    names = sorted({name.rsplit(".", 1)[-1] for name, _ in layers})
    choices = ", ".join(names)
    targets = list(train.lora_targets)
    if not targets:
        family = getattr(getattr(model, "config", None), "model_type", None)
        defaults = peft.utils.constants.TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING
        if family not in defaults:
            raise ValueError(f"lora_targets: PEFT has no default target modules for model_type {family!r}; pass "
                             f"--lora-targets NAME,... naming some of the model's layers: {choices}.")
        targets = list(defaults[family])
    for target in train.lora_targets:
        if not any(n == target or n.endswith("." + target) for n, _ in layers):
            close = difflib.get_close_matches(target.rsplit(".", 1)[-1], names, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"lora_targets: {target!r} names no {KINDS_TEXT} layer of {type(model).__name__}; choose "
                             f"among its names: {choices}.{hint} Fix --lora-targets, or leave it out for PEFT's "
                             "default of the model's family.")
    matched = [(n, m) for n, m in layers if any(n == t or n.endswith("." + t) for t in targets)]
    return (list(train.lora_targets) or None), matched


def _check_rank(model: nn.Module, train: Any, layers: list[tuple[str, nn.Module]]) -> None:
    """ValueError, before PEFT allocates anything, when ``lora_rank`` exceeds the rank a target's weight can use
    (:func:`~fp8dist.plan.adapter_rules.rank_refusal`: the rule ``wrap_model`` applies to a PEFT model)."""
    from ..plan.adapter_rules import lowest_rank_limit, rank_refusal

    lowest = lowest_rank_limit(layers)
    refusal = rank_refusal(train.lora_rank, *lowest[:2]) if lowest is not None else None
    if not refusal:
        return
    short = lowest[0].rsplit(".", 1)[-1]
    if train.lora_targets:
        which, other = f"--lora-targets {','.join(train.lora_targets)}", f"leave {short} out of --lora-targets"
    else:
        defaults = ",".join(sorted({name.rsplit(".", 1)[-1] for name, _ in layers}))
        which, other = f"PEFT's default targets {defaults}", f"name --lora-targets without {short}"
    raise ValueError(f"lora_rank={train.lora_rank}: {refusal} (the smallest over {which} of {type(model).__name__}). "
                     f"Pass --lora-rank {lowest[2]} or less (8-64 is usual), or {other}.")


def apply_lora(model: nn.Module, train: Any) -> nn.Module:
    """``model`` as a PEFT LoRA model with ``train``'s options (lora_B zero: the first step has the base's loss),
    seeded from ``train.seed`` so that every rank builds the same adapters. Call it before wrap_model."""
    peft = import_peft()
    targets, layers = _targets(model, train)
    _check_rank(model, train, layers)
    config = peft.LoraConfig(r=train.lora_rank, lora_alpha=lora_alpha(train), lora_dropout=train.lora_dropout,
                             target_modules=targets, task_type="CAUSAL_LM")
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        # peft's own call of a transformers API being renamed: nothing the user can change
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
        torch.manual_seed(train.seed + 1)  # not the base's stream: adapters differ from what the base drew
        return peft.get_peft_model(model, config)


def lora_job_model(config: Any, train: Any, model: nn.Module) -> tuple[Any, nn.Module]:
    """(The config to wrap with, the LoRA job's model): ``model`` (real, not meta) loaded from ``pretrained`` here,
    before PEFT renames its parameters, so the config no longer names it; then :func:`apply_lora`."""
    from ..pipeline.fp8_base import load_fp8_base
    from ..pipeline.pretrained import load_pretrained

    import_peft()  # before any loading: the missing package is the first thing said
    _check_checkpoints(config, train)
    if config.parallel.pretrained is not None:
        fp8 = holds_fp8_base(config, say=True)  # the model was built on the meta device: its FP8 weights stay FP8
        (load_fp8_base if fp8 else load_pretrained)(model, config.parallel.pretrained)
        config = replace(config, parallel=replace(config.parallel, pretrained=None))
    return config, apply_lora(model, train)


def holds_fp8_base(config: Any, *, say: bool = False) -> bool:
    """Whether the LoRA job's base is loaded in FP8 (:mod:`fp8dist.pipeline.fp8_base`): ``pretrained`` an FP8
    checkpoint, on a strategy and backend that run it (else it is dequantized; ``say``: a warning says why)."""
    from ..config.rules import facts_of
    from ..pipeline.fp8_base import fp8_base_refusal, fp8_checkpoint

    path = config.parallel.pretrained
    if path is None or not fp8_checkpoint(path):
        return False
    refusal = fp8_base_refusal(config, facts_of(config))
    if refusal is not None and say:
        warnings.warn(f"pretrained={path!r} is an FP8 checkpoint, and its LoRA base is dequantized into high "
                      f"precision: {refusal}.", UserWarning, stacklevel=3)
    return refusal is None


def _check_checkpoints(config: Any, train: Any) -> None:
    """Refused before any step: LoRA checkpoints where they cannot leave the frozen base out."""
    from ..checkpoint.compat import trainable_only_refusal
    from ..config.rules import facts_of
    from ..strategies import get_strategy

    refusal = trainable_only_refusal(get_strategy(config.parallel.strategy), facts_of(config))
    if train.checkpoint_dir is not None and refusal:
        raise ValueError(f"checkpoint_dir with lora_rank={train.lora_rank}: {refusal}, or train without "
                         "--checkpoint-dir.")


def export_lora(train: Any, model: nn.Module, pretrained: str | None, dtype: str) -> tuple[Path, str]:
    """``--save-pretrained`` of a LoRA job: the adapters (fp32, what trained, unless --save-dtype names one) or with
    ``merge_lora`` the merged model in ``dtype``; (the directory, what it holds)."""
    from ..checkpoint.fp8_export import fp8_summary
    from ..checkpoint.lora import save_adapters, save_merged

    if train.merge_lora and dtype == "fp8":
        path = save_merged(model, train.save_pretrained, dtype=dtype, fp8_format=train.save_fp8_format)
        return path, fp8_summary(path)
    if train.merge_lora:
        return save_merged(model, train.save_pretrained, dtype=dtype), f"{dtype}, LoRA merged"
    dtype = "fp32" if train.save_dtype == "as-loaded" else dtype
    return save_adapters(model, train.save_pretrained, dtype=dtype, base_model=pretrained), f"{dtype}, LoRA adapters"
