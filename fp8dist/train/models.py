"""Small Llama models built from a config (no download), and the model of ``fp8dist train`` from a preset, a
config.json or a pretrained directory. Dimensions are multiples of 16 so every Linear is FP8-eligible; embeddings
are untied so the output projection is its own Linear, as in Llama."""

from __future__ import annotations

import contextlib
import copy
import difflib
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ..config.files import no_duplicate_keys
from .config import LLAMA_SIZES
from .data import VOCAB_SIZE, check_fits_corpus, check_vocab_fits

__all__ = ["JOB_POSITIONS", "llama_config", "build_llama", "read_model_config", "pretrained_config",
           "causal_lm", "job_model_config", "build_job_model"]

JOB_POSITIONS = 8192
"""Positions of the presets in ``fp8dist train`` (Llama 3's pretraining context): rotary positions take any length,
but a longer ``--seq-len`` is a typo more often than a plan; a config.json with more positions takes more."""


def llama_config(size: str = "tiny", *, max_seq_len: int = 512, vocab_size: int = VOCAB_SIZE):
    """A ``transformers.LlamaConfig`` for one of :data:`LLAMA_SIZES`."""
    from transformers import LlamaConfig

    if size not in LLAMA_SIZES:
        raise ValueError(f"model_size={size!r} is not valid; choose one of: {', '.join(LLAMA_SIZES)}.")
    hidden, inter, layers, heads, kv = LLAMA_SIZES[size]
    return LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=max_seq_len,
                       tie_word_embeddings=False, attn_implementation="sdpa", use_cache=False)  # training: no KV cache


def build_llama(size: str = "tiny", *, seed: int = 0, max_seq_len: int = 512, vocab_size: int = VOCAB_SIZE):
    """A freshly initialized ``LlamaForCausalLM``, identical on every rank for the same ``seed`` (fp32, CPU)."""
    from transformers import LlamaForCausalLM

    config = llama_config(size, max_seq_len=max_seq_len, vocab_size=vocab_size)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LlamaForCausalLM(config)


def read_model_config(path: str):
    """``--model-config``: a Hugging Face config.json (with ``model_type``) as a transformers config; ValueError
    naming the file, what is wrong and the way out otherwise."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    try:
        with open(path) as f:
            data = json.load(f, object_pairs_hook=no_duplicate_keys("model config", Path(path)))
    except OSError as err:
        raise ValueError(f"{path} is not a readable file ({err.strerror}): pass a Hugging Face config.json.") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON (line {err.lineno}, column {err.colno}: {err.msg}): pass a "
                         "Hugging Face config.json.") from None
    if not isinstance(data, dict) or "model_type" not in data:
        raise ValueError(f"{path}: a Hugging Face config needs 'model_type' (e.g. \"llama\").")
    family = data["model_type"]
    if not isinstance(family, str) or family not in CONFIG_MAPPING:
        close = difflib.get_close_matches(str(family), list(CONFIG_MAPPING.keys()), n=1)
        raise ValueError(f"{path}: model_type={family!r} is not a model family this transformers knows"
                         + (f" (did you mean {close[0]!r}?)" if close else "") + ". Fix model_type (e.g. \"llama\"), "
                         "or upgrade transformers for a newer family.")
    try:
        return AutoConfig.for_model(**data)
    except Exception as err:  # transformers' own checks (ValueError, TypeError, hub validation): about the values
        raise ValueError(f"{path}: transformers rejects this {family} config: {_reason(err)}. Fix that value in the "
                         "file.") from None


def _reason(err: BaseException) -> str:
    """The last line of a library's error, without the exception's class name."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return re.sub(r"^\w+(Error|Exception): ", "", lines[-1]).rstrip(".") if lines else type(err).__name__


def causal_lm(model_config: Any, source: str, *, dtype: torch.dtype | None = None) -> Any:
    """``AutoModelForCausalLM.from_config(model_config)`` on the current device, or ValueError naming ``source`` when
    transformers has no causal LM for its family, cannot build one from its values, or builds one whose attention
    is not causal (an encoder such as BERT without ``is_decoder``)."""
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    family = getattr(model_config, "model_type", None)
    if family not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        examples = ", ".join(f for f in CAUSAL_LM_EXAMPLES if f in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
        raise ValueError(f"{source}: model_type {family!r} has no causal-LM model in transformers, and fp8dist trains "
                         f"causal LMs (next-token prediction): pass the config of one of the "
                         f"{len(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)} families AutoModelForCausalLM builds, e.g. "
                         f"{examples} (transformers' MODEL_FOR_CAUSAL_LM_MAPPING_NAMES lists them).")
    try:
        model = AutoModelForCausalLM.from_config(model_config, **({} if dtype is None else {"dtype": dtype}))
    except Exception as err:  # the config passed transformers' checks, its model's own do not hold
        raise ValueError(f"{source}: transformers cannot build a {family} model from it: {_reason(err)}. Fix that "
                         "value in the config.") from None
    if _bidirectional(model, model_config):
        raise ValueError(f"{source}: {type(model).__name__} ({family}) with \"is_decoder\": false attends both ways "
                         "(none of its attention layers is causal), so each token would see the one it is trained to "
                         "predict. Set \"is_decoder\": true in the config (the family's decoder mode), or pass a "
                         "decoder's config (e.g. llama, gpt2).")
    return model


def _causal_flags(model: Any) -> list[bool]:
    return [m.is_causal for m in model.modules() if isinstance(getattr(m, "is_causal", None), bool)]


def _bidirectional(model: Any, model_config: Any) -> bool:
    """A causal-LM class left in its encoder mode: no attention layer causal, and ``is_decoder`` (off) would make them
    so; families that mask causally in other ways (GIT, BigBird-Pegasus) keep their flags, and pass."""
    from transformers import AutoModelForCausalLM

    flags = _causal_flags(model)
    if not flags or any(flags) or getattr(model_config, "is_decoder", True):
        return False
    trial = copy.deepcopy(model_config)
    trial.is_decoder = True
    with torch.device("meta"):
        return any(_causal_flags(AutoModelForCausalLM.from_config(trial)))


CAUSAL_LM_EXAMPLES = ("llama", "mistral", "qwen2", "gemma2", "gpt2", "gpt_neox", "mixtral", "falcon")  # in errors


def pretrained_config(path: str):
    """The transformers config of the model directory ``path`` (``pretrained=``), never from the Hub; ValueError
    naming it otherwise."""
    from transformers import AutoConfig

    if not Path(path).is_dir():
        raise ValueError(f"pretrained={path!r}: the directory does not exist. Pass a local model directory (written "
                         "by save_pretrained, or downloaded with `hf download NAME --local-dir DIR`); fp8dist never "
                         "downloads.")
    try:
        return AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as err:  # whatever transformers raises reading a user's directory is about its config.json
        raise ValueError(f"pretrained={path!r}: transformers cannot read its config.json ({_reason(err)}). Fix the "
                         "file, or pass a model directory written by save_pretrained.") from None


def job_model_config(config: Any, train: Any, tokenizer: Any = None) -> tuple[Any, str]:
    """(The transformers config of the job's model, its name): the Llama preset, ``--model-config`` or
    ``pretrained``'s. ``tokenizer``: the job's TokenCorpus (None: bytes), whose vocabulary the preset takes and a
    config must hold. ValueError: both a config and ``pretrained``, or a vocabulary too small for the corpus."""
    path = config.parallel.pretrained
    if path is None and train.model_config is None:
        vocab = VOCAB_SIZE if tokenizer is None else tokenizer.vocab_size
        name = f"llama-{train.model_size}" + ("" if tokenizer is None else f" (vocabulary {vocab:,}: the tokenizer's)")
        return llama_config(train.model_size, max_seq_len=JOB_POSITIONS, vocab_size=vocab), name
    if path is not None and train.model_config is not None:
        raise ValueError(f"model_config={train.model_config!r} and pretrained={path!r}: pass one (pretrained= "
                         "builds the model from that directory's config.json).")
    if path is None:
        model_config = read_model_config(train.model_config)
        path = train.model_config
    else:
        model_config = pretrained_config(path)
    with torch.device("meta"), _quiet_transformers():  # refused here, before any rank builds it (and logs)
        causal_lm(model_config, path)
    if tokenizer is None:
        check_fits_corpus(model_config, None, repr(path))  # positions: checks.check_positions
    else:
        check_vocab_fits(tokenizer.vocab_size, model_config.vocab_size,
                         tokenizer=f"tokenizer {tokenizer.tokenizer_dir}", model=f"the model of {path}")
    return model_config, f"{type(model_config).__name__} from {path}"


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """transformers' log lines off: a model built only to check it says them again when it is built."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def build_job_model(config: Any, train: Any, model_config: Any) -> Any:
    """``fp8dist train``'s model: the Llama preset, or ``model_config``'s, on the meta device with ``pretrained``
    (each rank then allocates only what its strategy keeps)."""
    if config.parallel.pretrained is None and train.model_config is None:
        return build_llama(train.model_size, seed=train.seed, max_seq_len=train.seq_len,
                           vocab_size=model_config.vocab_size)
    # LoRA (lora_rank): a real model, loaded whole before PEFT adds its adapters (fp8dist.train.lora), but for a base
    # held in FP8, allocated as it is read
    from .lora import holds_fp8_base

    whole = train.lora_rank and not holds_fp8_base(config)
    device = "cpu" if config.parallel.pretrained is None or whole else "meta"
    with torch.random.fork_rng(devices=[]):  # a fresh model: its own initialization, the same on every rank
        torch.manual_seed(train.seed)
        with torch.device(device):
            # fp32 parameters (the master weights) whatever dtype the checkpoint was saved in
            return causal_lm(model_config, config.parallel.pretrained or train.model_config, dtype=torch.float32)
