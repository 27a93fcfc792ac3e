"""Train a small Llama on one device (CPU or one GPU) with bf16 autocast, then let it write a sentence.

Launch (from the repository root):

    python examples/single_device.py
    python examples/single_device.py --fp8 torchao      # real FP8 GEMMs on CPU too (torch's _scaled_mm)
"""

import argparse

import torch

import fp8dist
from fp8dist.train.data import Batches
from fp8dist.train.models import build_llama

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--fp8", default="none", choices=["none", "torchao", "te", "msamp"], help="FP8 backend")
parser.add_argument("--steps", type=int, default=40)
args = parser.parse_args()

model = build_llama("tiny", seed=0)
if args.fp8 == "msamp":  # MS-AMP owns the optimizer: wrap_model builds it and hands it back
    model, optimizer = fp8dist.wrap_model(model, strategy="none", fp8="msamp", optimizer={"type": "AdamW", "lr": 3e-3})
else:
    model = fp8dist.wrap_model(model, strategy="none", fp8=args.fp8)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)  # built after wrap_model, always
device = fp8dist.get_wrap_info(model).env.device

batches = Batches(batch_size=8, seq_len=128)
for step in range(args.steps):
    ids = batches[step].to(device)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    print(f"step {step:3d} loss {loss.item():.4f}", flush=True)

model.eval()
prompt = torch.tensor([list(b"The cat ")], device=device)
with torch.no_grad():
    out = model.generate(prompt, max_new_tokens=40, do_sample=False)
print("sample:", bytes(out[0].tolist()).decode("utf-8", errors="replace"))
print(fp8dist.sharding_summary(model))
