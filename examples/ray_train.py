"""Train a small Llama with FSDP2 and torchao FP8 on Ray Train workers: checkpoints through Ray, and a run started
again with the same --name resumes from its last checkpoint.

Run (pip install 'fp8dist[ray]'; from the repository root):

    python examples/ray_train.py --num-workers 2 --fp8 torchao              # a local Ray cluster of 2 CPU workers
    python examples/ray_train.py --num-workers 2 --steps 40                 # again: resumes where the first stopped
    RAY_ADDRESS=auto python examples/ray_train.py --num-workers 8 --gpu --storage /shared/ray   # a running cluster
"""

import argparse
import os
import tempfile

import ray
import torch
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

import fp8dist
from fp8dist.integrations.ray import report_checkpoint, resume
from fp8dist.train.data import Batches
from fp8dist.train.models import build_llama


def train_func(config: dict) -> None:
    """Every worker: Ray has started the process group; wrap_model shards over it as under torchrun."""
    model = fp8dist.wrap_model(build_llama("tiny", seed=0), strategy="fsdp", fp8=config["fp8"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    state = resume(model, optimizer)  # None on a first start; else the checkpoint Ray hands this run
    env = fp8dist.get_wrap_info(model).env
    batches = Batches(batch_size=8, seq_len=128, rank=env.rank, world_size=env.world_size)
    for step in range(state.step if state else 0, config["steps"]):
        ids = batches[step].to(env.device)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if env.rank == 0:
            print(f"step {step:3d} loss {loss.item():.4f}", flush=True)
        if (step + 1) % config["save_every"] == 0 or step + 1 == config["steps"]:  # on every worker
            report_checkpoint({"loss": loss.item(), "step": step + 1}, model, optimizer, step=step + 1)


parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--num-workers", type=int, default=2)
parser.add_argument("--gpu", action="store_true", help="one GPU per worker")
parser.add_argument("--fp8", default="torchao", choices=["none", "torchao", "te"])
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--save-every", type=int, default=5)
parser.add_argument("--name", default="fp8dist-ray-example", help="the run; the same name resumes it")
parser.add_argument("--storage", default=os.path.join(tempfile.gettempdir(), "fp8dist-ray"),
                    help="where Ray keeps the run's checkpoints (on a cluster: a path every node sees)")
args = parser.parse_args()

if not ray.is_initialized():
    ray.init(include_dashboard=False)  # RAY_ADDRESS's cluster, or one `ray start` started here; else a new one
loop_config = {"fp8": args.fp8, "steps": args.steps, "save_every": args.save_every}
trainer = TorchTrainer(train_func, train_loop_config=loop_config,
                       scaling_config=ScalingConfig(num_workers=args.num_workers, use_gpu=args.gpu),
                       run_config=RunConfig(name=args.name, storage_path=args.storage))
result = trainer.fit()
print(f"last checkpoint: {result.checkpoint.path} (step {result.metrics['step']}, loss {result.metrics['loss']:.4f})")
