"""Train a small Llama with FSDP2 (fully_shard): parameters sharded, gathered in bf16, gradients reduced in fp32.

Launch (from the repository root):

    torchrun --standalone --nproc-per-node 2 examples/fsdp.py           # 2 CPU processes, or 2 GPUs
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint "$HEAD:29500" examples/fsdp.py
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
model = fp8dist.wrap_model(model, strategy="fsdp", fp8=args.fp8)
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
