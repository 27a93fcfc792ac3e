"""Train a small Llama on one device (CPU or one GPU), bf16 autocast.

Launch (from the repository root):

    python examples/single_device.py
    python examples/single_device.py --fp8 torchao --steps 50
"""

import argparse

import torch

import fp8dist
from fp8dist.data import Batches
from fp8dist.models import build_llama

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--fp8", default="none", choices=["none", "torchao", "te", "msamp"], help="FP8 backend")
parser.add_argument("--steps", type=int, default=20)
args = parser.parse_args()

model = build_llama("tiny", seed=0)  # same seed, same weights on every rank
model = fp8dist.wrap_model(model, strategy="none", fp8=args.fp8)
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)  # built after wrap_model: it replaces the parameters

env = fp8dist.get_wrap_info(model).env
batches = Batches(batch_size=8, seq_len=128, rank=env.rank, world_size=env.world_size)
for step in range(args.steps):
    ids = batches[step].to(env.device)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if env.rank == 0:
        print(f"step {step:3d} loss {loss.item():.4f}", flush=True)
if env.rank == 0:
    print(fp8dist.sharding_summary(model))
