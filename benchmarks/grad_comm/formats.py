"""Which FP8 format and block size for gradients on the wire: the signal each keeps (SQNR of the real gradients of the
small Llama after a few steps) and the loss each keeps (the tiny Llama trained with two simulated ranks whose
gradients are quantized and summed as reduce_dtype='fp8' does, against the exact fp32 sum). One process, no
collectives: the arithmetic of :func:`fp8dist.strategies.grad_fp8.quantize_blocks` with the format swapped.

    python benchmarks/grad_comm/formats.py --out benchmarks/results/grad_comm_formats.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
BLOCKS = (32, 128, 256, 1024)


def roundtrip(x: torch.Tensor, fmt: torch.dtype, block: int) -> torch.Tensor:
    """``x`` (1-D) quantized per block to ``fmt`` with an fp32 scale (amax to the format's largest value), back."""
    n = x.numel()
    blocks = torch.nn.functional.pad(x.float(), (0, -n % block)).reshape(-1, block)
    top = torch.finfo(fmt).max
    amax = blocks.abs().amax(-1, keepdim=True)
    scale = torch.where(amax == 0, torch.ones_like(amax), amax / top)
    return ((blocks / scale).clamp(-top, top).to(fmt).float() * scale).reshape(-1)[:n]


def sqnr_db(x: torch.Tensor, y: torch.Tensor) -> float:
    return float(10 * torch.log10(x.pow(2).sum() / (x - y).pow(2).sum()))


def gradients(size: str, steps: int) -> torch.Tensor:
    """Every gradient of the Llama ``size`` after ``steps`` AdamW steps on the built-in corpus, flattened."""
    from fp8dist.train.data import Batches
    from fp8dist.train.models import build_llama

    model = build_llama(size, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = Batches(batch_size=4, seq_len=128, rank=0, world_size=1, seed=0)
    for step in range(steps + 1):
        ids = batches[step]
        model(input_ids=ids, labels=ids).loss.backward()
        if step < steps:
            opt.step()
            opt.zero_grad(set_to_none=True)
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def losses(fmt: torch.dtype | None, block: int, steps: int) -> list[float]:
    """The tiny Llama trained ``steps`` steps, each step's gradient the mean of two half-batches' (two simulated
    ranks), each half's quantized to ``fmt`` before the sum (None: exact)."""
    from fp8dist.train.data import Batches
    from fp8dist.train.models import build_llama

    model = build_llama("tiny", seed=0)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-3)
    batches = Batches(batch_size=4, seq_len=64, rank=0, world_size=1, seed=0)
    out = []
    for step in range(steps):
        halves, total = batches[step].chunk(2), 0.0
        summed = [torch.zeros_like(p) for p in params]
        for ids in halves:
            loss = model(input_ids=ids, labels=ids).loss
            grads = torch.autograd.grad(loss, params)
            for acc, g in zip(summed, grads):
                acc += (g if fmt is None else roundtrip(g.reshape(-1), fmt, block).view_as(g)) / 2
            total += loss.item() / 2
        for p, g in zip(params, summed):
            p.grad = g
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append(total)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/grad_comm_formats.json"))
    args = p.parse_args(argv)
    torch.manual_seed(0)
    start = time.time()
    g = gradients("small", 5)
    sqnr = {name: {b: round(sqnr_db(g, roundtrip(g, fmt, b)), 2) for b in BLOCKS} for name, fmt in FORMATS.items()}
    exact = losses(None, 128, args.steps)
    trained = {name: losses(fmt, 128, args.steps) for name, fmt in FORMATS.items()}
    doc = {"what": __doc__.splitlines()[0], "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
           "sqnr_db_small_llama_gradients": sqnr, "gradient_elements": g.numel(),
           "bytes_vs_bf16": {b: round((1 + 4 / b) / 2, 4) for b in BLOCKS},
           "tiny_llama_final_loss": {"fp32": exact[-1], **{k: v[-1] for k, v in trained.items()}},
           "tiny_llama_mean_abs_loss_gap": {k: sum(abs(a - b) for a, b in zip(v, exact)) / len(v)
                                            for k, v in trained.items()},
           "steps": args.steps, "block_for_losses": 128, "wall_s": round(time.time() - start, 1)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
