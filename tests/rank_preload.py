"""Imported once by the fork server of tests/dist_harness.py, so that every rank it starts begins with what ranks
import anyway already imported: torch, transformers' Llama, torchao's float8, fp8dist and DeepSpeed. A spawned
rank spent most of its CPU time on these imports. Nothing here starts a thread, a process group or a collective."""

import importlib.util

import torch  # noqa: F401
import torch.distributed  # noqa: F401
import torchao.float8  # noqa: F401
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: F401  (the lazy top-level names build_llama uses)

import fp8dist  # noqa: F401
import fp8dist.models  # noqa: F401

if importlib.util.find_spec("deepspeed") is not None:
    import deepspeed  # noqa: F401

    # DeepSpeed imports this (and torch.compile's machinery with it) at every ZeRO engine's first initialize
    import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401

