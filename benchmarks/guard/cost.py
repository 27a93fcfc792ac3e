"""The cost of the non-finite step guard (fp8dist/runtime/guard.py) per optimizer step, on this machine's CPU: the check
itself (one fused norm per dtype over this rank's gradients, one MAX all-reduce of a flag per parameter) timed on
its own, beside the step it guards. Two gloo ranks, FSDP2 + torchao, one thread per rank (CPU figures, not a GPU's).

    PYTHONPATH=. python benchmarks/guard/cost.py --size small --steps 12
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))


def _rank(rank: int, world: int, size: str, steps: int) -> dict:
    import torch
    import warnings

    import fp8dist
    from fp8dist.train.data import Batches
    from fp8dist.runtime.guard import _nonfinite
    from fp8dist.train.models import build_llama

    warnings.simplefilter("ignore")
    model = fp8dist.wrap_model(build_llama(size, seed=0), strategy="fsdp", fp8="torchao", nonfinite_step="off")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = Batches(batch_size=4 * world, seq_len=128, rank=rank, world_size=world)
    params = [p for g in opt.param_groups for p in g["params"]]
    step_s, check_s = [], []
    for i in range(steps):
        t0 = time.perf_counter()
        ids = data[i]
        model(input_ids=ids, labels=ids).loss.backward()
        t1 = time.perf_counter()
        _nonfinite(params, torch.device("cpu"))  # what the guard does before each step
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        step_s.append(time.perf_counter() - t0 - (t2 - t1))
        check_s.append(t2 - t1)
    return {"step_ms": 1e3 * statistics.median(step_s[2:]), "check_ms": 1e3 * statistics.median(check_s[2:]),
            "params": sum(p.numel() for p in model.parameters())}


def main() -> None:
    from dist_harness import run_ranks

    parser = argparse.ArgumentParser()
    parser.add_argument("--size", default="small")
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    for rank, r in enumerate(run_ranks(_rank, args.size, args.steps, world_size=2, timeout=1200)):
        print(f"rank {rank}: {args.size} Llama, step {r['step_ms']:.1f} ms, guard {r['check_ms']:.2f} ms "
              f"({100 * r['check_ms'] / r['step_ms']:.2f}% of the step)")


if __name__ == "__main__":
    main()
