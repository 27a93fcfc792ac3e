"""Train a small Llama with the Hugging Face Trainer on a model from fp8dist.wrap_model (FSDP2 + torchao FP8).

Launch (from the repository root):

    torchrun --standalone --nproc-per-node 2 examples/hf_trainer.py             # 2 CPU processes, or 2 GPUs
    torchrun --standalone --nproc-per-node 2 examples/hf_trainer.py --strategy ddp
"""

import argparse

import torch
from transformers import TrainingArguments

import fp8dist
from fp8dist.integrations.transformers import FP8DistTrainer
from fp8dist.train.data import Batches
from fp8dist.train.models import build_llama

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--strategy", default="fsdp", choices=["fsdp", "ddp"])
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--output-dir", default="hf_trainer_out")
args = parser.parse_args()


class Rows(torch.utils.data.Dataset):
    """Byte sequences; any dataset of input_ids/labels rows does."""

    def __init__(self, steps: int):
        self.rows = torch.cat([Batches(batch_size=8, seq_len=128)[step] for step in range(steps)])

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


# wrap_model joins the process group torchrun started; Trainer (through Accelerate) takes the model as it is
model = fp8dist.wrap_model(build_llama("tiny", seed=0), strategy=args.strategy, fp8="torchao")
training = TrainingArguments(output_dir=args.output_dir, max_steps=args.steps, per_device_train_batch_size=4,
                             learning_rate=3e-3, logging_steps=5, save_steps=10, report_to="none",
                             use_cpu=not torch.cuda.is_available())
# FP8DistTrainer is transformers.Trainer whose save_model and checkpoints go through fp8dist, on every rank
trainer = FP8DistTrainer(model=model, args=training, train_dataset=Rows(args.steps))
result = trainer.train()  # train(resume_from_checkpoint=True) continues from the last checkpoint-N exactly
trainer.save_model(f"{args.output_dir}/final")  # every rank; AutoModelForCausalLM.from_pretrained reads it
if trainer.is_world_process_zero():
    print(f"Trainer trained the model wrap_model returned: {trainer.model_wrapped is model}; "
          f"{len(fp8dist.get_plan(model).fp8)} Linear layers in FP8; mean loss {result.training_loss:.4f}")
fp8dist.shutdown()
