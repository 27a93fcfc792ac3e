"""The GPU check's step part, in a process of its own (check.py starts it, and ends it at its allotment): the
``1b`` preset on one GPU through ``fp8dist.wrap_model``, bf16 then each FP8 recipe asked for; per cell the median
step of ``TIMED`` steps and a torch.profiler split of ``PROFILED`` more (split.py), beside ``fp8dist.predict_step``'s
parts. Results are rewritten to ``--out`` after every cell, so a cell stopped at the allotment keeps the earlier
ones. ``--dry-run``: the ``tiny`` preset on the CPU, 1 + 2 + 1 steps, eager (its figures are a CPU's)."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from split import split, step_row  # noqa: E402

GPU_JOB = {"size": "1b", "batch": 4, "seq": 2048, "warmup": 3, "timed": 10, "profiled": 2, "compile": True}
"""The bench's GPU settings for the 1b preset (4 x 2,048 tokens, ~53 TFLOP a step): 3 warm-up steps (the compile),
10 timed, 2 profiled."""
DRY_JOB = {"size": "tiny", "batch": 1, "seq": 16, "warmup": 1, "timed": 2, "profiled": 1, "compile": False}


def _single_strategy() -> str:
    from fp8dist.strategies import STRATEGIES

    return next(name for name, strategy in STRATEGIES.items() if not strategy.process_group)


def predicted_parts(job: dict[str, Any], target: str | None, fp8: str | None, recipe: str | None,
                    compiled: bool) -> tuple[dict[str, Any] | None, str]:
    """(the predicted parts of this cell's precision as a dict, or None, and why none). bf16 cells take the bf16
    side of the default FP8 recipe's prediction (the model's bf16 step does not depend on the recipe)."""
    import fp8dist
    from fp8dist.train.job import default_fp8
    from fp8dist.train.models import llama_config

    backend = fp8 or default_fp8()
    if target is None or backend is None:
        return None, "no target GPU record or no FP8 backend to predict with"
    try:
        step = fp8dist.predict_step(llama_config(job["size"], max_seq_len=job["seq"]), target=target, world_size=1,
                                    micro_batch_size=job["batch"], seq_len=job["seq"], fp8=backend, recipe=recipe,
                                    compile=compiled, activation_checkpointing="none", strategy=_single_strategy())
    except Exception as error:  # noqa: BLE001 (a predictor's failure must not cost the measurement beside it)
        return None, f"{type(error).__name__}: {error}"
    return asdict(step.fp8 if fp8 else step.bf16), ""


def run_cell(job: dict[str, Any], device: torch.device, fp8: str | None, recipe: str | None) -> dict[str, Any]:
    """Build, wrap and train one cell; the step times (s) and the profiled split (s per step)."""
    from fp8dist import wrap_model
    from fp8dist.config.resolve import resolve_config
    from fp8dist.fp8 import get_backend
    from fp8dist.train.models import build_llama

    model = build_llama(job["size"], max_seq_len=job["seq"]).to(device)
    option = get_backend(fp8).variant_option if fp8 else None
    config = resolve_config(strategy=_single_strategy(), fp8=fp8, compile=job["compile"], micro_batch_size=job["batch"],
                            seq_len=job["seq"], fp8_select="all", **({option: recipe} if option and recipe else {}))
    model, optimizer = wrap_model(model, config=config, optimizer={"type": "AdamW", "lr": 1e-4})
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (job["batch"], job["seq"]), device=device)

    def step() -> None:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(job["warmup"]):
        step()
    times = []
    for _ in range(job["timed"]):
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    activities = [torch.profiler.ProfilerActivity.CPU] + \
        ([torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(job["profiled"]):
            step()
        sync()
    return {"step_s": statistics.median(times), "times": times,
            "split": split(prof, steps=job["profiled"], device=device.type)}


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f} ms"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True, help="the JSON file to write")
    parser.add_argument("--fp8", help="the FP8 backend of the FP8 cells")
    parser.add_argument("--recipes", default="", help="comma-separated recipes, one FP8 cell each")
    parser.add_argument("--target", help="the GPU record predict_step uses")
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    job = DRY_JOB if args.dry_run else GPU_JOB
    device = torch.device("cpu") if args.dry_run else torch.device("cuda", 0)
    cells = [("bf16", None, None)] + [(f"{args.fp8} {r}", args.fp8, r) for r in args.recipes.split(",") if r]
    doc: dict[str, Any] = {"job": job, "dry_run": args.dry_run, "rows": []}
    for name, fp8, recipe in cells:
        t0 = time.time()
        measured = run_cell(job, device, fp8, recipe)
        predicted, why = predicted_parts(job, args.target, fp8, recipe, job["compile"])
        row = step_row(name, measured["step_s"], measured["split"], predicted)
        row.update(seconds=round(time.time() - t0, 1), times=measured["times"], why_not_predicted=why or None,
                   tokens_per_s=job["batch"] * job["seq"] / measured["step_s"])
        doc["rows"].append(row)
        Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
        print(f"  {name}: {measured['step_s'] * 1e3:.1f} ms/step, took {row['seconds']:.0f} s; measured/predicted "
              + ", ".join(f"{kind} {_ms(part['measured_s'])}/{_ms(part['predicted_s'])}"
                          for kind, part in row["parts"].items()), flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
