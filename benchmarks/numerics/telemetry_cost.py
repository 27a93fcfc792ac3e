"""What FP8Telemetry costs per training step: 2 gloo ranks, fsdp + torchao, the tiny and small Llama on the
built-in corpus, each rank on one CPU thread. Per size, two runs from the same seed: without telemetry, and with
telemetry sampling every other step (every=2), whose sampled and non-sampled steps alternate (so a slow spell of a
shared machine hits both alike). Each step's rank-0 CPU time (process time: what the step computed, whatever else
the machine runs) and wall time; medians over the steps after warm-up. CPU timings: they show the telemetry's cost
relative to a CPU step, not a GPU's.

    python benchmarks/numerics/telemetry_cost.py            # ~3 min on 2 cores
    python benchmarks/numerics/telemetry_cost.py --steps 20 --sizes tiny
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WARMUP = 2
MODES = {"off": None, "every=2": 2}


def _steps(rank: int, world: int, size: str, every: int | None, steps: int) -> list[tuple[float, float]]:
    import fp8dist
    from fp8dist.train.data import Batches
    from fp8dist.train.models import build_llama
    from fp8dist.numerics.telemetry import FP8Telemetry

    model = fp8dist.wrap_model(build_llama(size, seed=0), strategy="fsdp", fp8="torchao")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    telemetry = None
    batches = Batches(batch_size=8, seq_len=128, rank=rank, world_size=world, seed=0)
    times = []
    for step in range(WARMUP + steps):
        if step == WARMUP and every is not None:  # step WARMUP is its first sampled step
            telemetry = FP8Telemetry(model, every=every, optimizer=opt)
        dist.barrier()
        wall, cpu = time.perf_counter(), time.process_time()
        loss = model(input_ids=batches[step], labels=batches[step]).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        cpu = time.process_time() - cpu
        dist.barrier()
        times.append((cpu, time.perf_counter() - wall))
    if telemetry is not None:
        telemetry.close()
    return times[WARMUP:]


def _rank(rank: int, world: int, init: str, sizes: list[str], steps: int, out: dict) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    for size in sizes:
        for mode, every in MODES.items():
            times = _steps(rank, world, size, every, steps)
            if rank == 0:
                out[(size, mode)] = times
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="tiny,small")
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_rank, args=(2, f"file://{tmp}/rendezvous", args.sizes.split(","), args.steps, out), nprocs=2)
        results = dict(out)
    print(f"FP8Telemetry cost, 2 gloo ranks x 1 CPU thread, fsdp + torchao, global batch 8 x 128, medians of "
          f"{args.steps} steps after {WARMUP} warm-up (load average at the end {os.getloadavg()[0]:.1f})")
    print("| model | steps | CPU time per step (ms) | vs off | wall time per step (ms) | vs off |")
    print("|---|---|---|---|---|---|")
    for size in args.sizes.split(","):
        off = results[(size, "off")]
        sampled = results[(size, "every=2")][0::2]  # the first measured step is sampled, then every other one
        rows = {"telemetry off": off, "telemetry on, sampled step": sampled,
                "telemetry on, step not sampled": results[(size, "every=2")][1::2]}
        base = [statistics.median(t[i] for t in off) for i in (0, 1)]
        for name, times in rows.items():
            cpu, wall = (statistics.median(t[i] for t in times) for i in (0, 1))
            print(f"| llama-{size} | {name} | {1000 * cpu:.1f} | {100 * (cpu / base[0] - 1):+.1f}% | "
                  f"{1000 * wall:.1f} | {100 * (wall / base[1] - 1):+.1f}% |")


if __name__ == "__main__":
    main()
