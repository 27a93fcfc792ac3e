"""Train a small Llama with DDP (fp32 parameters replicated, bf16 autocast) and gradient accumulation.

Launch (from the repository root):

    torchrun --standalone --nproc-per-node 2 examples/ddp.py            # 2 CPU processes, or 2 GPUs
    torchrun --standalone --nproc-per-node 2 examples/ddp.py --fp8 torchao
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint "$HEAD:29500" examples/ddp.py
"""

import argparse
import contextlib

import torch

import fp8dist
from fp8dist.train.data import Batches
from fp8dist.train.models import build_llama

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--fp8", default="none", choices=["none", "torchao", "te", "msamp"], help="FP8 backend")
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--accum", type=int, default=2, help="micro-batches per optimizer step")
args = parser.parse_args()

model = build_llama("tiny", seed=0)
if args.fp8 == "msamp":  # MS-AMP owns the optimizer: msamp.initialize runs before DDP, wrap_model returns both
    model, optimizer = fp8dist.wrap_model(model, strategy="ddp", fp8="msamp", optimizer={"type": "AdamW", "lr": 3e-3})
else:
    model = fp8dist.wrap_model(model, strategy="ddp", fp8=args.fp8)  # returns the DDP wrapper
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
env = fp8dist.get_wrap_info(model).env

batches = Batches(batch_size=8, seq_len=128, rank=env.rank, world_size=env.world_size)
for step in range(args.steps):
    for micro in range(args.accum):
        ids = batches[step * args.accum + micro].to(env.device)
        # all-reduce gradients only on the last micro-batch
        sync = contextlib.nullcontext() if micro == args.accum - 1 else model.no_sync()
        with sync:
            loss = model(input_ids=ids, labels=ids).loss / args.accum
            loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if env.rank == 0:
        print(f"step {step:3d} loss {loss.item() * args.accum:.4f}", flush=True)
if env.rank == 0:
    print(fp8dist.sharding_summary(model))

fp8dist.shutdown()  # barrier, destroy the process group, let gloo/nccl threads finish before exit
