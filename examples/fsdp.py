"""Train a small Llama with FSDP2 (fully_shard): parameters sharded, gathered in bf16, gradients reduced in fp32;
gradient clipping on the sharded parameters, then a full state dict gathered to rank 0.

Launch (from the repository root):

    torchrun --standalone --nproc-per-node 2 examples/fsdp.py           # 2 CPU processes, or 2 GPUs
    torchrun --standalone --nproc-per-node 2 examples/fsdp.py --fp8 torchao
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint "$HEAD:29500" examples/fsdp.py
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
parser.add_argument("--save", help="write the full (unsharded) weights to this .pt file from rank 0")
args = parser.parse_args()

model = fp8dist.wrap_model(build_llama("tiny", seed=0), strategy="fsdp", fp8=args.fp8)  # sharded in place
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)  # sees the DTensor shards: build it after wrap_model
env = fp8dist.get_wrap_info(model).env

batches = Batches(batch_size=8, seq_len=128, rank=env.rank, world_size=env.world_size)
for step in range(args.steps):
    ids = batches[step].to(env.device)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)  # a DTensor: global norm
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if env.rank == 0:
        print(f"step {step:3d} loss {loss.item():.4f}", flush=True)

full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
if env.rank == 0:
    print(fp8dist.sharding_summary(model))
    print(f"full state dict on rank 0: {sum(t.numel() for t in full.values()):,} elements; "
          f"last grad norm {grad_norm.full_tensor().item():.3f}")
    if args.save:
        torch.save(full, args.save)

fp8dist.shutdown()  # barrier, destroy the process group, let gloo/nccl threads finish before exit
