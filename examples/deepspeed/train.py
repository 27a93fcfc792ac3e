"""Train a small Llama with DeepSpeed ZeRO (config from `fp8dist ds-config`), optionally with FP8 layers.

Launch (from the repository root; the same command on GPUs, with --num_accelerators per node):

    deepspeed --num_accelerators 2 examples/deepspeed/train.py --deepspeed_config examples/deepspeed/ds_zero3.json
    deepspeed --num_accelerators 2 examples/deepspeed/train.py --deepspeed_config examples/deepspeed/ds_zero2.json \
        --fp8 torchao
    torchrun --standalone --nproc-per-node 2 examples/deepspeed/train.py \
        --deepspeed_config examples/deepspeed/ds_zero1.json

Regenerate a config: fp8dist ds-config --stage 3 --model llama-tiny --micro-batch-size 4 --optimizer AdamW \
    --lr 3e-3 -o examples/deepspeed/ds_zero3.json
"""

import argparse

import fp8dist
from fp8dist.train.data import Batches
from fp8dist.train.models import build_llama

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--deepspeed_config", required=True, help="DeepSpeed json (e.g. from fp8dist ds-config)")
parser.add_argument("--fp8", default="none", choices=["none", "torchao", "te"], help="FP8 backend")
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher; LOCAL_RANK is used")
args = parser.parse_args()

# FP8 layers are converted before deepspeed.initialize (ZeRO-3 would otherwise hide the full weights);
# the json's optimizer block builds the optimizer, so the engine comes back alone.
engine = fp8dist.wrap_model(build_llama("tiny", seed=0), strategy="deepspeed", fp8=args.fp8,
                            ds_config=args.deepspeed_config)
env = fp8dist.get_wrap_info(engine).env
micro = engine.train_micro_batch_size_per_gpu()
batches = Batches(batch_size=micro * env.world_size, seq_len=128, rank=env.rank, world_size=env.world_size)
for step in range(args.steps):
    ids = batches[step].to(env.device)
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    if env.rank == 0:
        print(f"step {step:3d} loss {loss.item():.4f}", flush=True)
if env.rank == 0:
    print(fp8dist.sharding_summary(engine))

fp8dist.shutdown()  # barrier, destroy the process group, let gloo/nccl threads finish before exit
