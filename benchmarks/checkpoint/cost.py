"""What checkpoint checksums cost (fp8dist/checkpoint/manifest.py): the throughput of the hashes one could use,
then save_checkpoint and load_checkpoint of a >= 1 GB checkpoint with and without them, on 1 rank (strategy
"none") and 2 gloo ranks (FSDP2), on this machine's CPU. The model: a Llama of 134M parameters in fp32 with
AdamW's two states (1.6 GB on disk). "Without" saves with the checksum replaced by nothing (the sizes and fsyncs
stay) and loads with verify=False. The figures are in benchmarks/checkpoint/results.md.

    PYTHONPATH=. python benchmarks/checkpoint/cost.py --repeats 3 --dir /tmp/ckpt-cost
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import shutil
import statistics
import sys
import time
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

# hidden, intermediate, layers, heads, vocabulary: 134M parameters, untied embeddings
SHAPE = dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
             num_key_value_heads=12, vocab_size=32000)


def hash_throughput(mib: int = 256, repeats: int = 3) -> dict[str, float]:
    """GB/s of each hash over ``mib`` MiB in memory, best of ``repeats``."""
    data = os.urandom(mib * 2**20)
    hashes = {"crc32 (zlib)": lambda: zlib.crc32(data), "adler32 (zlib)": lambda: zlib.adler32(data),
              "sha256": lambda: hashlib.sha256(data).digest(), "blake2b": lambda: hashlib.blake2b(data).digest(),
              "md5": lambda: hashlib.md5(data).digest()}
    out = {}
    for name, run in hashes.items():
        best = min(_timed(run) for _ in range(repeats))
        out[name] = len(data) / best / 1e9
    return out


def _timed(run) -> float:
    t0 = time.perf_counter()
    run()
    return time.perf_counter() - t0


def _model(world: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import fp8dist

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SHAPE, tie_word_embeddings=False, use_cache=False))
    model = fp8dist.wrap_model(model, strategy="fsdp" if world > 1 else "none")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():  # AdamW's exp_avg and exp_avg_sq exist after a step
        p.grad = torch.zeros_like(p)
    opt.step()
    return model, opt


def _rank(rank: int, world: int, root: str, repeats: int) -> dict:
    import warnings

    import torch
    import torch.distributed as dist

    import fp8dist.checkpoint.manifest as manifest
    from fp8dist import load_checkpoint, save_checkpoint

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    model, opt = _model(world)
    barrier = dist.barrier if world > 1 else (lambda: None)
    checksum = manifest.file_checksum
    times: dict[str, list[float]] = {k: [] for k in ("save with", "save without", "load with", "load without")}

    def timed(key, run):  # wall seconds (the slowest rank: up to the barrier), and this process's CPU seconds
        barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        result = run()
        cpu = time.process_time() - c0
        barrier()
        times[key].append(time.perf_counter() - t0)
        times.setdefault(f"{key} cpu", []).append(cpu)
        return result

    size = 0
    for i in range(repeats):
        manifest.file_checksum = lambda path: ""  # sizes and fsyncs as always, no checksum
        timed("save without", lambda: save_checkpoint(Path(root) / f"without{i}", model, opt, step=i))
        manifest.file_checksum = checksum
        path = timed("save with", lambda: save_checkpoint(Path(root) / f"with{i}", model, opt, step=i))
        size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        if rank == 0:  # the checksum alone, over every file just written (in the page cache), one process
            t0 = time.perf_counter()
            for f in sorted(p for p in path.rglob("*") if p.is_file()):
                checksum(f)
            times.setdefault("crc32 of the files", []).append(size / 1e9 / (time.perf_counter() - t0))
        timed("load with", lambda: load_checkpoint(path, model, opt))
        timed("load without", lambda: load_checkpoint(path, model, opt, verify=False))
        barrier()
        if rank == 0:
            shutil.rmtree(Path(root) / f"without{i}"), shutil.rmtree(Path(root) / f"with{i}")
    return {"size_gb": size / 1e9, "params": sum(p.numel() for p in model.parameters()) * (world if world > 1 else 1),
            **{k: statistics.median(v) for k, v in times.items() if v}}


def main() -> None:
    from dist_harness import run_ranks

    import torch

    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default="/tmp/fp8dist-checkpoint-cost")
    args = parser.parse_args()
    print(f"date {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; python {platform.python_version()}, torch "
          f"{torch.__version__}")
    for name, gbs in hash_throughput().items():
        print(f"hash {name:15s} {gbs:5.2f} GB/s")
    for world in (1, 2):
        Path(args.dir).mkdir(parents=True, exist_ok=True)
        r = run_ranks(_rank, args.dir, args.repeats, world_size=world, timeout=3600)[0]
        print(f"{world} rank(s), CPU seconds of rank 0: save {r['save without cpu']:.2f} -> {r['save with cpu']:.2f}, "
              f"load {r['load without cpu']:.2f} -> {r['load with cpu']:.2f}")
        print(f"{world} rank(s), {r['size_gb']:.2f} GB checkpoint: save {r['save without']:.2f} s -> "
              f"{r['save with']:.2f} s with checksums (+{100 * (r['save with'] / r['save without'] - 1):.0f}%), load "
              f"{r['load without']:.2f} s -> {r['load with']:.2f} s verified "
              f"(+{100 * (r['load with'] / r['load without'] - 1):.0f}%); crc32 of its files on one process "
              f"{r['crc32 of the files']:.2f} GB/s; median of {args.repeats}, load average {os.getloadavg()[0]:.1f}")
    print(f"load average after {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
