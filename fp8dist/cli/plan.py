"""``fp8dist plan``: the per-layer FP8 plan of a model built on the meta device."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ..config.options import DEFAULT_SEQ_LEN
from ..config.resolve import FP8Config, StrategyConfig
from ..config.schema import add_arguments
from ..config.text import plural
from ..strategies import get_strategy
from .common import FP8_DEFAULT_HELP, add_model_source, config_from_args, meta_model

__all__ = ["HELP", "add_parser", "run"]


HELP = "print the per-layer FP8 precision plan without training"
"""The command's line in ``fp8dist --help``."""


def add_parser(sub: Any) -> None:
    """Add ``fp8dist plan`` and its flags to ``sub`` (the top-level parser's subparsers); called only when the
    command line names plan (the other commands are a line of ``fp8dist --help``)."""
    p = sub.add_parser("plan", help=HELP,
                       description="Build the model on the meta device (nothing allocated) and print which layers "
                                   "run in FP8 and why the others fall back.")
    add_model_source(p)
    machine = p.add_mutually_exclusive_group()
    machine.add_argument("--target", metavar="GPU",
                         help="plan for this machine instead of the one you are on, its FP8 library assumed "
                              "installed: a GPU (h100, h200, b200, l40s, a100, ...), a CUDA capability (sm_90, "
                              "sm_100) or cpu")
    machine.add_argument("--ignore-hardware", action="store_true",
                         help="plan as if the backend and FP8 hardware were present, whatever they are")
    p.add_argument("--world-size", type=int, default=1, metavar="N",
                   help="ranks to shard over: how evenly FP8 weights and MoE experts shard, and with --strategy "
                        "fsdp a note when FSDP2's dim-0 padding is large (default: 1)")
    p.add_argument("--compare-recipes", action="store_true",
                   help="also print, for this model, batch and --world-size on the GPU planned for, each FP8 recipe "
                        "of the backend's predicted step speedup and tokens/s per GPU (the header names the fastest) "
                        "and its GEMM time per micro-batch (predictions)")
    p.add_argument("--nvlink-domain", type=int, metavar="N",
                   help="with --compare-recipes: GPUs one NVLink domain joins, whose collectives run at NVLink "
                        "bandwidth (default: the GPU record's, e.g. 72 for GB200/GB300 NVL72, 8 for an H100 node)")
    p.add_argument("--network-gbps", type=float, metavar="GB/S",
                   help="with --compare-recipes: network bandwidth between NVLink domains, GB/s per GPU per "
                        "direction (a 400 Gb/s NIC is 50; default: the GPU record's)")
    p.add_argument("--json", action="store_true",
                   help="print the plan (and with --compare-recipes the predicted steps) as JSON")
    p.add_argument("--numerics", metavar="FILE",
                   help="a numerics report of this model (fp8dist probe --json FILE): layers past its thresholds "
                        "stay out of FP8")
    add_arguments(p, StrategyConfig, title="strategy")
    add_arguments(p, FP8Config, title="fp8", shown_defaults={"fp8": FP8_DEFAULT_HELP})


def run(args: argparse.Namespace) -> int:
    """Run ``fp8dist plan`` with its parsed flags; returns the exit code (0: done). Raises what the library raises for
    bad values: :func:`fp8dist.cli.main` turns the errors fp8dist explains into one line and exit code 2."""
    from ..runtime.env import resolve_device
    from ..runtime.hardware import parse_target
    from ..plan.precision import plan_precision
    from ..strategies.common import find_blocks

    config, _ = config_from_args(args)
    for note in config.unread_notes():
        print(f"fp8dist plan: note: {note}", file=sys.stderr)
    topology = {key: value for key, value in (("nvlink_domain", args.nvlink_domain),
                                              ("network_gbps", args.network_gbps)) if value is not None}
    if topology and not args.compare_recipes:
        print(f"fp8dist plan: note: {', '.join('--' + k.replace('_', '-') for k in topology)} has no effect without "
              "--compare-recipes (only the predicted step reads the topology)", file=sys.stderr)
    if args.target is not None and config.parallel.device != "auto":
        raise ValueError(f"--target {args.target} and --device {config.parallel.device} both name the machine to plan "
                         "for: give --target alone to plan for another machine, --device alone for this one.")
    model = meta_model(args)
    device = parse_target(args.target) if args.target is not None else resolve_device(config.parallel.device, 0)
    plan = plan_precision(model, config, device=device, world_size=args.world_size,
                          check_hardware=not args.ignore_hardware, check_installed=args.target is None,
                          numerics=_read_report(args.numerics) if args.numerics is not None else None)
    # FSDP shards block by block; a bad block_classes is an error here too
    blocks = find_blocks(model, config.parallel.block_classes) if plan.facts.shards_params else None
    # a bad --world-size is an error here
    notes = get_strategy(config.parallel.strategy).layout_notes(model, config, args.world_size)
    gemms = compare_text(plan) if args.compare_recipes else None  # raises first where nothing can be predicted
    steps, checkpointing = fitted_steps(model, config, plan.selection, args.world_size,
                                        _fit(model, config, plan.hardware, args.world_size), topology) \
        if args.compare_recipes else ((), None)
    if args.json:
        data = {**_plan_json(plan, steps), **checkpointing_json(checkpointing)}
        print(json.dumps(data, indent=1), file=args.data_out)
        return 0
    if args.target is not None:
        print(f"planned for {device} (--target; its FP8 library assumed installed)")
    if steps:
        print(fastest_line(steps))
        print(fp8_gradients_pay_line(model, steps[0][0], config))
    print(plan)
    if blocks is not None:
        print(f"sharded per block: {plural(len(blocks[0]), 'block')} ({blocks[1]}), then the root")
    for note in notes:
        print(f"note: {note}")
    if checkpointing is not None:
        print(f"{step_text(steps, checkpointing) if steps else unfit_text(checkpointing)}\n{gemms}")
    return 0


def _fit(model: Any, config: Any, hardware: Any, world_size: int) -> Any:
    """Whether a rank of this run fits the GPU planned for, as ``fp8dist estimate --target`` judges it (its notes are
    estimate's to say); None where the GPU's memory is unknown."""
    import warnings

    from ..accounting.estimate import estimate_memory

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return estimate_memory(model, config, world_size=world_size, target=hardware).fit


def fitted_steps(model: Any, config: Any, selection: Any, world_size: int, fit: Any,
                 topology: dict[str, Any] | None = None) -> tuple[tuple[Any, ...], Any]:
    """(the predicted steps, the :class:`~fp8dist.accounting.fit.StepCheckpointing` they assume): with the activation
    checkpointing a rank needs to fit (``fit``: the estimate's), and no steps where nothing makes it fit.
    ``topology``: ``nvlink_domain`` / ``network_gbps`` overrides for :func:`predict_step` (None: the GPU record's)."""
    from ..accounting.fit import step_checkpointing
    from ..config.text import byte_size

    checkpointing = step_checkpointing(fit, config.parallel.activation_checkpointing, byte_size)
    if checkpointing.mode is None:
        return (), checkpointing
    return predicted_steps(model, config, selection, world_size, checkpointing.mode, topology), checkpointing


def unfit_text(checkpointing: Any) -> str:
    """Why no step is predicted, then the estimate's own 'does NOT fit' line and its ways out, from
    ``checkpointing`` (the step-checkpointing answer whose ``fit`` does not fit)."""
    from ..config.text import byte_size

    return "\n".join([checkpointing.why, *checkpointing.fit.lines(byte_size)])


def checkpointing_json(checkpointing: Any) -> dict[str, Any]:
    """The checkpointing the predicted steps assume, as ``--json`` gives it (with the fit where none fits)."""
    if checkpointing is None:
        return {}
    unfit = checkpointing.mode is None
    return {"step_checkpointing": checkpointing.to_dict(), **({"fit": checkpointing.fit.to_dict()} if unfit else {})}


def predicted_steps(model: Any, config: Any, selection: Any, world_size: int,
                    activation_checkpointing: str | None = None,
                    topology: dict[str, Any] | None = None) -> tuple[tuple[Any, Any], ...]:
    """Per recipe the plan's GPU runs, the predicted step (:func:`~fp8dist.plan.speed.step_time.predict_step`) with
    every Linear but the head in FP8 and with FP8 where the plan says it pays. ``selection`` has a predicted step;
    ``activation_checkpointing``: None, the config's (:func:`fitted_steps` passes the one a rank needs);
    ``topology``: ``nvlink_domain`` / ``network_gbps`` overrides (None: the GPU record's)."""
    from ..plan.speed.step_time import predict_step
    from ..strategies import STRATEGIES

    p, backend = config.parallel, config.precision.fp8
    hsdp = p.replicate_degree if "replicate_degree" in STRATEGIES[p.strategy].options else 1  # else: noted unread
    options = dict(target=selection.step.gpu, fp8=backend, world_size=world_size,
                   micro_batch_size=p.micro_batch_size, seq_len=p.seq_len or DEFAULT_SEQ_LEN,
                   compile=selection.step.compile, strategy=p.strategy, replicate_degree=hsdp,
                   reduce_dtype=p.reduce_dtype,
                   activation_checkpointing=activation_checkpointing or p.activation_checkpointing, **(topology or {}))
    steps = []
    for gemms in _recipe_gemms(selection, backend)[1]:
        paid = [c.name for c in gemms.layers if c.fp8]
        every_fp8 = predict_step(model, recipe=gemms.recipe, **options)
        steps.append((every_fp8, predict_step(model, recipe=gemms.recipe, fp8_layers=paid, **options)))
    return tuple(steps)


def _recipe_gemms(selection: Any, backend: str) -> tuple[list[Any], tuple[Any, ...]]:
    """The plan's Linear GEMMs (MoE experts left out) and their prediction under each recipe the plan's GPU runs."""
    from ..plan.speed import Gemm, compare_recipes

    step = selection.step
    gemms = [Gemm(c.name, c.prediction.m, c.prediction.k, c.prediction.n) for c in step.layers
             if c.prediction.groups == 1]
    return gemms, compare_recipes(gemms, target=step.gpu, backend=backend, compile=step.compile,
                                  margin=selection.margin)


def _best(steps: tuple[tuple[Any, Any], ...]) -> tuple[Any, str] | None:
    """The fastest predicted step and its conversion; None: bf16."""
    from ..plan.speed.step_time import fastest

    best = fastest(tuple(step for pair in steps for step in pair))
    if best is None:
        return None
    return best, ("every Linear but the head in FP8" if any(best is pair[0] for pair in steps) else
                  "FP8 where it pays, as planned")


def fp8_gradients_pay_line(model: Any, step: Any, config: Any) -> str:
    """Whether FP8 gradients on the wire pay for this run: the predicted step's collectives with the gradients
    reduced in bf16 and in fp8 (``step``'s settings otherwise), and what of them the compute leaves exposed."""
    from ..plan.speed.step_time import predict_step

    p = config.parallel
    if step.world_size == 1 or "reduce_fp8_block" not in get_strategy(p.strategy).options:  # no FP8 reduction
        return f"gradient reduction: {p.reduce_dtype} (strategy {p.strategy} on {step.world_size} ranks sends no FP8 " \
               "gradients)"
    same = dict(target=step.gpu, fp8=config.precision.fp8, world_size=step.world_size, recipe=step.recipe,
                micro_batch_size=step.micro_batch_size, seq_len=step.seq_len, compile=step.compile,
                strategy=p.strategy, activation_checkpointing=step.activation_checkpointing,
                nvlink_domain=step.nvlink_domain, network_gbps=step.network_gbps)
    bf16, fp8 = (predict_step(model, reduce_dtype=r, **same).fp8 for r in ("bf16", "fp8"))
    gain = (bf16.step_s - fp8.step_s) / bf16.step_s
    where = (f"pay: the collectives are exposed (bandwidth-bound), step {gain:.1%} shorter" if gain >= 0.01 else
             f"do not pay here: the compute hides the collectives (step {gain:.1%} shorter)")
    return (f"gradient reduction: {p.reduce_dtype}; predicted collectives per step with bf16 gradients "
            f"{bf16.collective_s * 1e3:,.1f} ms ({bf16.exposed_s * 1e3:,.1f} exposed), with reduce_dtype='fp8' "
            f"{fp8.collective_s * 1e3:,.1f} ms ({fp8.exposed_s * 1e3:,.1f} exposed): FP8 gradients {where} "
            "(a prediction)")


def fastest_line(steps: tuple[tuple[Any, Any], ...]) -> str:
    """Which recipe is predicted fastest for this run, or that none beats bf16, from ``steps``: per recipe, the
    predicted step with every Linear in FP8 and with FP8 where the plan says it pays."""
    first, best = steps[0][0], _best(steps)
    run = f"{first.world_size}x {first.gpu_label}, {first.micro_batch_size} x {first.seq_len:,} tokens per rank"
    if best is None:
        return f"predicted fastest for this run: bf16 (no FP8 recipe predicted faster; {run}; a prediction)"
    step, how = best
    return (f"predicted fastest for this run: {step.recipe} ({how}), step {step.speedup:.2f}x, "
            f"{step.tokens_per_s:,.0f} tokens/s per GPU against {step.bf16_tokens_per_s:,.0f} in bf16 ({run}; a "
            "prediction)")


def step_text(steps: tuple[tuple[Any, Any], ...], checkpointing: Any = None) -> str:
    """Each recipe's predicted step, both conversions, as a table; with the activation checkpointing it assumes and
    why (a :class:`~fp8dist.accounting.fit.StepCheckpointing`) where given."""
    from ..accounting.rows import text_table

    first = steps[0][0]
    rows = [["bf16", f"{first.bf16_tokens_per_s:,.0f}", "1.00x", "-", "-", f"{first.bf16_mfu:.1%}",
             f"{first.bf16.exposed_s * 1e3:,.2f}", "-"]]
    for every, paid in steps:
        rows.append([every.recipe, f"{every.tokens_per_s:,.0f}", f"{every.speedup:.2f}x", f"{paid.tokens_per_s:,.0f}",
                     f"{paid.speedup:.2f}x", f"{every.mfu:.1%}", f"{every.fp8.exposed_s * 1e3:,.2f}",
                     "yes" if every.calibrated else "no"])
    head = (f"predicted training step on {first.world_size}x {first.gpu_label} ({first.setting}; GEMMs, attention, "
            "memory-bound work, recompute, optimizer and exposed collectives; a prediction, "
            "benchmarks/step_model/README.md): every "
            "Linear but the head in FP8 (as published runs convert), and FP8 where it pays (as planned)"
            + (f"; activation checkpointing assumed: {checkpointing.why}" if checkpointing is not None else ""))
    return f"{head}\n" + text_table(["recipe", "tokens/s per GPU", "vs bf16", "as planned: tokens/s", "vs bf16",
                                      "MFU", "exposed comm (ms)", "calibrated"], rows)


def _plan_json(plan: Any, steps: tuple[tuple[Any, Any], ...]) -> dict[str, Any]:
    return {"layers": [entry.to_dict() for entry in plan],
            "selection": plan.selection.to_dict() if plan.selection is not None else None, **steps_json(steps)}


def steps_json(steps: tuple[tuple[Any, Any], ...]) -> dict[str, Any]:
    """The predicted steps as ``--json`` gives them: each recipe both ways, and the fastest (None: bf16)."""
    best = _best(steps) if steps else None
    return {"steps": [{"every_linear": every.to_dict(), "as_planned": paid.to_dict()} for every, paid in steps],
            "fastest": {"recipe": best[0].recipe, "conversion": best[1]} if best else None}


def _read_report(path: str) -> dict[str, Any]:
    try:
        report = json.loads(Path(path).read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"--numerics {path}: not valid JSON (line {err.lineno}): pass the file fp8dist probe "
                         "--json FILE wrote.") from None
    if not isinstance(report, dict) or "layers" not in report:
        raise ValueError(f"--numerics {path}: not a numerics report (no 'layers'): pass the file fp8dist probe "
                         "--json FILE wrote.")
    return report


def compare_text(plan: Any) -> str:
    """The predicted GEMM time per micro-batch of the plan's eligible Linears under bf16 and each recipe, as a table;
    ValueError where nothing was predicted (no GPU planned for, a backend without a speed model)."""
    from ..accounting.rows import text_table

    selection = plan.selection
    if selection is None or selection.step is None:
        why = selection.unpredicted if selection is not None else "no FP8 backend runs in this plan"
        raise ValueError(f"--compare-recipes needs a GPU to predict for ({why}): pass --target h100 (or the GPU "
                         "you will run on) with --fp8 torchao or te.")
    step = selection.step
    gemms, steps = _recipe_gemms(selection, plan.backend)
    if step.recipe not in {s.recipe for s in steps} and len(gemms) == len(step.layers):  # a recipe per layer
        steps = (*steps, step)  # issue 42 item 6: the plan's own mix beside the one-recipe answers
    ms = lambda seconds: f"{seconds * 1e3:.3f}"  # noqa: E731
    bf16 = steps[0].bf16_s
    rows = [["bf16", ms(bf16), "1.00x", ms(bf16), "1.00x", "-"]]
    for s in steps:
        rows.append([s.recipe, ms(s.chosen_s), f"{bf16 / s.chosen_s:.2f}x", ms(s.all_fp8_s),
                     f"{bf16 / s.all_fp8_s:.2f}x", "yes" if s.calibrated else "no"])
    experts = len(step.layers) - len(gemms)
    head = (f"recipes compared on {step.gpu_label}: predicted GEMM time per micro-batch of the {len(gemms)} eligible "
            f"Linear layers at {selection.tokens:,} tokens per rank ({'compiled' if step.compile else 'eager'}; "
            "forward + backward, one rank; a prediction, GEMMs only)"
            + (f"; {experts} MoE grouped GEMMs not compared (their recipe is torchao_moe_recipe's)" if experts else ""))
    table = text_table(["recipe", "FP8 where it pays (ms)", "vs bf16", "every layer FP8 (ms)", "vs bf16",
                        "calibrated"], rows)
    return f"{head}\n{table}"
