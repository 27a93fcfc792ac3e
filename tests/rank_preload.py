"""Imported once by the fork server of tests/dist_harness.py, so that every rank it starts begins with what ranks
import anyway already imported: torch, transformers' Llama, torchao's float8, fp8dist and DeepSpeed. A spawned
rank spent most of its CPU time on these imports. Nothing here starts a thread, a process group or a collective.
Also the harness and pytest, which a rank imports first of all to unpickle its entry point (dist_harness imports
pytest: ~0.1 s of CPU in each of the suite's ~150 ranks)."""

import importlib.util

import dist_harness  # noqa: F401  (the ranks' entry point; it imports pytest)
import helpers  # noqa: F401  (most rank functions train through it)
import torch  # noqa: F401
import torch.distributed  # noqa: F401
import torchao.float8  # noqa: F401
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: F401  (the lazy top-level names build_llama uses)

import fp8dist  # noqa: F401
import fp8dist.train.models  # noqa: F401

if importlib.util.find_spec("deepspeed") is not None:
    import deepspeed  # noqa: F401

    # DeepSpeed imports this (and torch.compile's machinery with it) at every ZeRO engine's first initialize
    import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401

