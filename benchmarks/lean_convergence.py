"""memory="lean" against the fp32-master run (issue 17): the same Llama, FP8 backend, seed, batches and learning
rate schedule (fp8dist train's job: AdamW, warm-up then cosine), trained twice on 2 gloo ranks (FSDP2) or one
process per GPU; writes ``results/lean_convergence_<date>_<device>.json`` (losses, last-20 means, their relative
gap, bytes/param measured by fp8dist.report, versions, date) and a PNG of both curves when matplotlib is there.

    python benchmarks/lean_convergence.py                     # small Llama, 300 steps, torchao (CPU: ~15 min)
    python benchmarks/lean_convergence.py --steps 400 --model-size tiny --fp8 none
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = Path(__file__).resolve().parent


def _rank(rank: int, world: int, rendezvous: str, flat: dict, job: dict, out: str) -> None:
    from fp8dist.config import Config
    from fp8dist.train import TrainConfig, run_training

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(rank)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    dist.init_process_group(backend, init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    lines: list[str] = []  # rank 0 logs fp8dist.report's tables once, after the first step
    result = run_training(Config.from_dict(flat), TrainConfig(**job), log=lines.append)
    totals = [float(line.split()[3]) for text in lines for line in text.splitlines()
              if line.startswith("total model states")]
    if rank == 0:
        Path(out).write_text(json.dumps({"losses": result.losses, "tokens_per_s": result.tokens_per_s,
                                         "bytes_per_param_x_world": totals[0] * world if totals else None,
                                         "device": result.device}))
    dist.destroy_process_group()


def _run(memory: str, args: argparse.Namespace, world: int) -> dict:
    flat = {"strategy": "fsdp", "fp8": None if args.fp8 == "none" else args.fp8, "memory": memory}
    job = {"model_size": args.model_size, "steps": args.steps, "seed": args.seed, "lr": args.lr,
           "batch_size": args.batch_size}
    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/result.json"
        mp.start_processes(_rank, args=(world, f"{tmp}/rendezvous", flat, job, out), nprocs=world,
                           start_method="spawn")
        return json.loads(Path(out).read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-size", default="small")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--fp8", default="torchao")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args()
    world = torch.cuda.device_count() if torch.cuda.is_available() else 2
    runs = {memory: _run(memory, args, world) for memory in ("standard", "lean")}
    last = {m: sum(r["losses"][-20:]) / 20 for m, r in runs.items()}
    gap = (last["lean"] - last["standard"]) / last["standard"]
    import importlib.metadata as md

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"cpu ({platform.processor() or 'x86'})"
    record = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "device": device,
              "processes": world, "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
              "versions": {p: md.version(p) for p in ("torch", "torchao", "transformers")},
              "args": vars(args), "last20_mean": last, "relative_gap": gap, "runs": runs}
    stem = f"lean_convergence_{record['date'][:10]}_{'cuda' if torch.cuda.is_available() else 'cpu'}-x{world}"
    (HERE / "results" / f"{stem}.json").write_text(json.dumps(record, indent=1))
    print(f"last-20 mean loss: standard {last['standard']:.4f}, lean {last['lean']:.4f}, gap {100 * gap:+.2f}%; "
          f"bytes/param x world: standard {runs['standard']['bytes_per_param_x_world']}, "
          f"lean {runs['lean']['bytes_per_param_x_world']}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for memory, r in runs.items():
        ax.plot(r["losses"], label=f"{memory} (last 20: {last[memory]:.3f})", linewidth=1)
    ax.set(xlabel="step", ylabel="loss", title=f"llama-{args.model_size}, fsdp, fp8 {args.fp8}: lean vs fp32 master")
    ax.legend()
    fig.savefig(HERE / "results" / f"{stem}.png", dpi=100, bbox_inches="tight")


if __name__ == "__main__":
    main()
