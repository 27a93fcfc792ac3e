"""Train a small Llama with FSDP1 (FullyShardedDataParallel): flat-parameter shards, bf16 compute, fp32 reduce;
FSDP1's own gradient clipping, then a full state dict gathered to rank 0.

Launch (from the repository root):

    torchrun --standalone --nproc-per-node 2 examples/fsdp1.py          # 2 CPU processes, or 2 GPUs
    torchrun --standalone --nproc-per-node 2 examples/fsdp1.py --fp8 torchao
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint "$HEAD:29500" examples/fsdp1.py
"""

import argparse

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

import fp8dist
from fp8dist.train.data import Batches
from fp8dist.train.models import build_llama

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--fp8", default="none", choices=["none", "torchao", "te"],
                    help="FP8 backend (MS-AMP has no FSDP integration: use examples/ddp.py for it)")
parser.add_argument("--steps", type=int, default=20)
args = parser.parse_args()

model = fp8dist.wrap_model(build_llama("tiny", seed=0), strategy="fsdp1", fp8=args.fp8)  # the FSDP1 root wrapper
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
env = fp8dist.get_wrap_info(model).env

batches = Batches(batch_size=8, seq_len=128, rank=env.rank, world_size=env.world_size)
for step in range(args.steps):
    ids = batches[step].to(env.device)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grad_norm = model.clip_grad_norm_(max_norm=1.0)  # FSDP1 computes the norm over all shards
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if env.rank == 0:
        print(f"step {step:3d} loss {loss.item():.4f}", flush=True)

# cpu_offload only on GPUs: FSDP1 + offload of tensors already on CPU segfaults in torch 2.13 (gloo)
offload = env.device.type == "cuda"
full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=offload))
if env.rank == 0:
    print(fp8dist.sharding_summary(model))
    print(f"full state dict on rank 0: {sum(t.numel() for t in full.values()):,} elements; "
          f"last grad norm {grad_norm.item():.3f}")

fp8dist.shutdown()  # barrier, destroy the process group, let gloo/nccl threads finish before exit
