"""FP8 gradients on the wire, convergence: the real-text job (benchmarks/real_text: the small Llama on the Python
documentation, FSDP2 on 2 gloo processes, bf16 compute, no FP8 GEMMs) trained with ``--reduce-dtype fp32`` and
``--reduce-dtype fp8`` for each seed, and each run's held-out loss compared, paired by seed.

    python benchmarks/real_text/prepare.py --out data/python-docs
    python benchmarks/grad_comm/convergence.py --data data/python-docs --seeds 0,1,2 --steps 500 \\
        --runs runs/grad_comm --out benchmarks/results/grad_comm_convergence.json

Each run is one ``fp8dist train`` command (written into the JSON); a run whose metrics file already holds its last
step is not run again, so the study resumes where it stopped. ``--summarize`` only reads the metrics files.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

REDUCES = ("fp32", "fp8")


def command(data: Path, seed: int, reduce: str, steps: int, metrics: Path) -> list[str]:
    return [sys.executable, "-m", "fp8dist", "train", "--strategy", "fsdp", "--fp8", "none", "--model-size", "small",
            "--data", str(data / "corpus.jsonl"), "--tokenizer", str(data / "tokenizer"), "--steps", str(steps),
            "--batch-size", "8", "--seq-len", "128", "--lr", "1e-3", "--eval-every", "50", "--eval-batches", "10",
            "--seed", str(seed), "--nproc", "2", "--reduce-dtype", reduce, "--metrics-file", str(metrics)]


def read_run(metrics: Path) -> dict:
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    evals = {r["step"]: r["val_loss"] for r in rows if r.get("val_loss") is not None}
    times = [r["step_time_s"] for r in rows if r.get("step_time_s") is not None]
    return {"steps": rows[-1]["step"] if rows else 0, "final_train_loss": rows[-1]["loss"] if rows else None,
            "val_loss": evals, "median_step_s": statistics.median(times) if times else None,
            "grad_wire": {k: rows[-1].get(k) for k in ("grad_wire_bytes", "grad_wire_ratio")} if rows else {}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", type=Path, required=True, help="prepare.py's output directory")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--runs", type=Path, default=Path("runs/grad_comm"), help="metrics files and logs")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/grad_comm_convergence.json"))
    p.add_argument("--summarize", action="store_true", help="read the runs' metrics only, run nothing")
    args = p.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    args.runs.mkdir(parents=True, exist_ok=True)
    commands, started = {}, time.time()
    for seed in seeds:
        for reduce in REDUCES:
            metrics = args.runs / f"s{seed}_{reduce}.jsonl"
            cmd = command(args.data, seed, reduce, args.steps, metrics)
            commands[f"s{seed}_{reduce}"] = " ".join(cmd[1:])
            done = metrics.exists() and read_run(metrics)["steps"] >= args.steps
            if args.summarize or done:
                continue
            with open(args.runs / f"s{seed}_{reduce}.log", "w") as log:
                subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, check=True)
    runs = {name: read_run(args.runs / f"{name}.jsonl") for name in commands
            if (args.runs / f"{name}.jsonl").exists()}
    gaps = {}
    for seed in seeds:
        a, b = runs.get(f"s{seed}_fp32"), runs.get(f"s{seed}_fp8")
        if a and b:
            last = max(set(a["val_loss"]) & set(b["val_loss"]), default=None)
            if last is not None:
                gaps[seed] = {"step": last, "fp32": a["val_loss"][last], "fp8": b["val_loss"][last],
                              "gap": b["val_loss"][last] - a["val_loss"][last],
                              "train_gap": b["final_train_loss"] - a["final_train_loss"]}
    doc = {"what": __doc__.splitlines()[0], "date": time.strftime("%Y-%m-%d"), "host": platform.processor() or
           platform.machine(), "cpus": os.cpu_count(), "steps_asked": args.steps,
           "commands": commands, "runs": runs, "held_out_gap_by_seed": gaps,
           "max_abs_gap": max((abs(g["gap"]) for g in gaps.values()), default=None)}
    if not args.summarize:  # what a summary of earlier runs cannot know
        doc.update(load_average=os.getloadavg(), wall_s=time.time() - started)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    for seed, g in gaps.items():
        print(f"seed {seed}: held-out loss at step {g['step']}: fp32 {g['fp32']:.4f}, fp8 {g['fp8']:.4f}, "
              f"gap {g['gap']:+.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
