"""The noise floor of a convergence study: how far a bf16 run's held-out loss moves under a change that keeps the
arithmetic and only reorders its rounding (torch.compile's fused kernels against eager), paired by seed like the FP8
gaps. An FP8 gap no wider than this floor is as small as any rounding change can be measured at that length.

    python benchmarks/real_text/control.py STUDY.json runs/compile-s*/*.json --out benchmarks/results/NAME.json

STUDY.json: combine.py's merged study; the control files: `fp8dist bench` (or run_cells.py) runs of the same text,
size, steps, batch and schedule, one seed each or several, whose bf16 cells differ from the study's bf16 cells only
by --compile on.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from fp8dist.bench.results import _counterpart, _spread, late_spread

SAME = ("text", "sizes", "steps", "batch_size", "seq_len", "nproc", "lr", "lr_schedule")


def control(study: dict, runs: list[dict]) -> dict:
    """Each control bf16 cell minus the study's bf16 cell of its seed, at every evaluated step."""
    for run in runs:
        differ = [k for k in SAME if run["settings"].get(k) != study["settings"].get(k)]
        if differ:
            raise ValueError(f"a control run differs from the study in {', '.join(differ)}: run it with the study's "
                             "--data, --sizes, --steps, --batch-size, --seq-len, --lr and --lr-schedule.")
    pairs = []
    for cell in (c for run in runs for c in run["cells"] if c["fp8"] is None and c["compile"]):
        twin = _counterpart(study["cells"], cell, compile=False)  # the same cell, eager
        if twin is None or not twin.get("eval_losses"):
            raise ValueError(f"control cell {cell['name']} (seed {cell['seed']}) has no bf16 cell of its seed in "
                             "the study: run the control with the study's seeds.")
        pairs.append((cell, twin))
    if len(pairs) < 2:
        raise ValueError(f"{len(pairs)} control cell(s) with --compile on and --fp8 none: the spread needs two seeds.")
    steps = [s for s, _ in pairs[0][1]["eval_losses"]]
    delta = [_spread([c["eval_losses"][i][1] - b["eval_losses"][i][1] for c, b in pairs]) for i in range(len(steps))]
    return {"control": "bf16 + torch.compile minus bf16 eager, paired by seed", "seeds": [c["seed"] for c, _ in pairs],
            "steps": steps, "delta": delta, "late_steps": steps[len(steps) // 2:], "late": late_spread(delta),
            "device": runs[0]["device"], "versions": runs[0]["versions"], "dates": [r["date"] for r in runs],
            "commands": [r["command"] for r in runs]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("study", type=Path, help="combine.py's merged JSON of the study")
    parser.add_argument("runs", nargs="+", type=Path, help="bench JSON files of the --compile on bf16 cells")
    parser.add_argument("--out", type=Path, required=True, help="the JSON to write")
    args = parser.parse_args(argv)
    try:
        doc = control(json.loads(args.study.read_text()), [json.loads(p.read_text()) for p in args.runs])
    except (OSError, ValueError, KeyError) as err:
        print(f"control: error: {err}", file=sys.stderr)
        return 2
    from fp8dist.runtime.files import atomic_write

    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(args.out, lambda tmp: Path(tmp).write_text(json.dumps(doc, indent=1) + "\n"))
    last, late = doc["delta"][-1], doc["late"]
    print(f"{doc['control']}, {len(doc['seeds'])} seeds: at step {doc['steps'][-1]} {last['mean']:+.4f} ± "
          f"{last['std']:.4f}; mean of steps {doc['late_steps'][0]}-{doc['steps'][-1]} {late['mean']:+.4f} ± "
          f"{late['std']:.4f}\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
