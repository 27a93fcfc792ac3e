import copy
from dist_harness import run_ranks
from integration_helpers import accelerate_env
import test_integration_trainer as T

def case(rank, world, strategy, out):
    from fp8dist import wrap_model
    from fp8dist.train.models import build_llama
    accelerate_env(rank, world)
    ours = wrap_model(build_llama("tiny", seed=0), strategy=strategy, fp8="torchao")
    tr = T._trainer(ours, out, 1)
    tr.train()
    tr.save_model(out + "/final")
    import os
    if rank: return None
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_pretrained(out + "/final")
    import torch
    return sorted(os.listdir(out + "/final")), torch.equal(m.model.embed_tokens.weight, ours.module.model.embed_tokens.weight)

def test_dbg(tmp_path):
    for s in ("ddp",):
        print("RES", s, run_ranks(case, s, str(tmp_path / s), timeout=90))
    assert 0
