"""The training job's own options (``fp8dist train``'s flags under "training job"): :class:`TrainConfig`."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Literal

from ..config.schema import cli_flag, normalize_fields

__all__ = ["TrainConfig", "LLAMA_SIZES", "ModelSize", "DEFAULT_TEXT_FIELD"]

ModelSize = Literal["tiny", "small", "medium", "1b", "3b"]
"""The ``model_size`` values: the Llama presets of :data:`LLAMA_SIZES`."""

# name: (hidden, intermediate, layers, heads, kv_heads)
LLAMA_SIZES: dict[str, tuple[int, int, int, int, int]] = {
    "tiny": (128, 384, 2, 4, 2),
    "small": (256, 768, 4, 8, 4),
    "medium": (512, 1536, 8, 8, 4),
    "1b": (2048, 5632, 24, 16, 4),  # 1.08B parameters (TinyLlama's widths): fp8dist bench's GPU preset
    "3b": (3072, 8192, 28, 24, 8),  # 2.82B (Llama 3.2 3B's widths, byte vocab): one 80 GB GPU with full AC
}
"""The Llama presets of ``model_size`` (built by :func:`fp8dist.train.models.build_llama`)."""

DEFAULT_TEXT_FIELD = "text"
"""The JSON field of a document's text when none is named."""


@dataclass(kw_only=True, frozen=True)
class TrainConfig:
    """The training job's knobs (the strategy and FP8 knobs are in :class:`fp8dist.Config`)."""

    model_size: ModelSize = "tiny"
    """Llama preset: tiny (0.46M parameters), small (3.3M), medium (25M), 1b (1.08B, GPUs) or 3b (2.82B, one 80 GB
    GPU with activation checkpointing); byte vocabulary, or with --data the tokenizer's."""

    model_config: str | None = None
    """A Hugging Face config.json of a causal LM (vocab_size >= 256, or the tokenizer's with --data) to train from
    scratch instead of the Llama preset; no download."""

    data: tuple[str, ...] = ()
    """Text files to train on: plain text (a file is one document) or JSON lines (.jsonl/.ndjson/.json, a line is
    one); tokenized once with --tokenizer into a cache, packed into seq_len + 1 token windows, 5% held out. None:
    the built-in grammar corpus (byte tokens, offline)."""

    tokenizer: str | None = None
    """Directory of a fast tokenizer saved with save_pretrained, for --data; none: the --pretrained directory's."""

    text_field: str = DEFAULT_TEXT_FIELD
    """The JSON field holding a document's text in JSON-lines --data files."""

    data_cache: str | None = None
    """Directory of the token cache (on several nodes: one every node sees); none: ~/.cache/fp8dist/tokens."""

    eval_every: int = 0
    """Report the held-out loss and perplexity of --data every N steps and after the last; 0: after the last only."""

    eval_batches: int | None = None
    """Held-out global batches each evaluation reads (the same every time); none: every full one, at most 10."""

    steps: int = 30
    """Training steps, one global batch each; a step the guard skips (non-finite gradients, nonfinite_step) counts,
    but the learning-rate schedule does not advance on it (as DeepSpeed's)."""

    batch_size: int = 8
    """Global batch in sequences per step; split evenly over the processes."""

    seq_len: int = 128
    """Tokens per sequence (bytes on the built-in corpus)."""

    lr: float = 3e-3
    """Peak AdamW learning rate (linear warm-up over the first 10% of steps, at most 2000, then cosine decay to 10%)."""

    seed: int = 0
    """Seed of the model initialization and of the batch order."""

    nproc: int | None = None
    """Processes to spawn when not started by a launcher: default one per GPU, or 2 on CPU."""

    launcher: Literal["local", "ray"] = "local"
    """How the --nproc processes start when not started by a launcher: local (torch's elastic launch on this machine)
    or ray (Ray Train workers on the Ray cluster RAY_ADDRESS names or `ray start` started here, else a local one;
    pip install 'fp8dist[ray]')."""

    checkpoint_dir: str | None = None
    """Directory for checkpoints, on a filesystem every rank sees; with resume, also its newest step_* folder
    (resumed from it, saving into the directory above); none: no checkpoints."""

    save_every: int | None = None
    """Save a checkpoint every N steps and after the last; needs checkpoint_dir (none: after the last only)."""

    keep_last: int = 3
    """Newest checkpoints kept in checkpoint_dir; 0 keeps them all."""

    resume: bool = False
    """Continue from the newest checkpoint in checkpoint_dir (weights, optimizer, position in --data), else start at
    step 0: the same command starts a job and restarts it after a crash."""

    save_pretrained: str | None = None
    """Directory the trained model is written to after the last step, as Hugging Face safetensors in --save-dtype,
    with the --data tokenizer; none: not written."""

    save_dtype: Literal["as-loaded", "bf16", "fp32", "fp16", "fp8"] = "as-loaded"
    """dtype of the --save-pretrained weights: as-loaded writes the dtype of the --pretrained checkpoint (a fine-tune
    comes out as it went in), bf16 for a model trained from scratch; fp32 writes the master weights exactly; fp8
    writes the Linears the plan ran in FP8 as e4m3 weights with scales (--save-fp8-format), the rest bf16 (LoRA:
    with --merge-lora, merged then quantized)."""

    save_fp8_format: Literal["compressed-tensors", "fine-grained"] = "compressed-tensors"
    """Layout of a --save-dtype fp8 export: compressed-tensors (float-quantized, training's tensorwise/rowwise weight
    cast; vLLM serves it, transformers loads it with the compressed-tensors package) or fine-grained (transformers'
    FineGrainedFP8, 128x128 block scales; dequantized to bf16 when loaded on a CPU)."""

    lora_rank: int = 0
    """LoRA fine-tuning: the rank of the PEFT adapters (pip install peft) on the --lora-targets layers, at most the
    smaller dim of each target's weight; the base is frozen (FP8 where the plan says), only the adapters train and
    are checkpointed. 0: off, every weight trains."""

    lora_alpha: float | None = field(default=None, metadata={"none": "twice --lora-rank"})
    """LoRA alpha: the adapters' update is scaled by alpha / rank. None: twice the rank (a scale of 2 at any rank, as
    torchtune's recipes; PEFT's default 8 would scale a rank-64 adapter by 1/8)."""

    lora_targets: tuple[str, ...] = ()
    """Layers that get adapters (Linear, Conv1D or Embedding), by the end of their names (e.g. q_proj,v_proj or
    self_attn.o_proj); none: PEFT's default of the model's family (Llama: q_proj, v_proj)."""

    lora_dropout: float = 0.0
    """Dropout on the adapters' input, in [0, 1)."""

    merge_lora: bool = False
    """With --lora-rank and --save-pretrained: write the base model with the adapters merged (W + alpha/rank * B A,
    a model AutoModelForCausalLM.from_pretrained loads) instead of the adapters alone (PEFT's
    adapter_model.safetensors + adapter_config.json, for PeftModel.from_pretrained)."""

    metrics_file: str | None = None
    """JSON-lines file of every step's figures (loss, grad_norm, lr, tokens_per_s, mfu, ...; val_loss on evaluation
    steps), written by rank 0; a resumed run keeps the lines up to its checkpoint. None: not written."""

    tensorboard: str | None = None
    """TensorBoard directory for the same figures, scalars train/<key> (pip install 'fp8dist[tensorboard]'); none:
    not written."""

    fp8_health_every: int = 50
    """FP8 health every N steps with fp8=torchao: per FP8 layer the amax, scale and share flushed to zero of input,
    weight and output gradient, one line in the log, a warning past the probe's thresholds; 0: off."""

    fp8_health_file: str | None = None
    """JSON-lines file of the FP8 health records; none: beside --metrics-file (its name with .fp8_health.jsonl),
    else not written."""

    def __post_init__(self) -> None:
        normalize_fields(self)
        for name in ("steps", "batch_size", "seq_len", "nproc", "save_every", "eval_batches"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 1.")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr={self.lr} must be positive and finite (the peak learning rate, e.g. 3e-3).")
        for name, off in (("keep_last", "keep all"), ("eval_every", "at the end only"), ("fp8_health_every", "off")):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must be 0 ({off}) or more.")
        if self.checkpoint_dir is None and (self.resume or self.save_every is not None):
            flag = "resume" if self.resume else "save_every"
            raise ValueError(f"{flag} needs checkpoint_dir: pass --checkpoint-dir DIR (where checkpoints are written "
                             "and read).")
        if not self.data and (self.eval_every or self.eval_batches is not None):
            flag = "eval_every" if self.eval_every else "eval_batches"
            raise ValueError(f"{flag} needs data: the held-out split is of --data files (the built-in corpus has "
                             "none). Pass --data FILE [FILE ...], or leave it out.")
        if not self.text_field:
            raise ValueError("text_field='' must name the JSON field that holds the text, e.g. 'text'.")
        default_dtype = next(f.default for f in fields(self) if f.name == "save_dtype")
        if self.save_dtype != default_dtype and self.save_pretrained is None:
            raise ValueError(f"save_dtype={self.save_dtype!r} with no save_pretrained: pass --save-pretrained DIR "
                             "(the export it sets the dtype of), or leave --save-dtype out.")
        default_format = next(f.default for f in fields(self) if f.name == "save_fp8_format")
        if self.save_fp8_format != default_format and self.save_dtype != "fp8":
            raise ValueError(f"save_fp8_format={self.save_fp8_format!r} with save_dtype={self.save_dtype!r}: it is the "
                             "layout of an FP8 export; pass --save-dtype fp8, or leave --save-fp8-format out.")
        if self.fp8_health_file is not None and not self.fp8_health_every:
            raise ValueError(f"fp8_health_file={self.fp8_health_file!r} with fp8_health_every=0 (off): pass "
                             "--fp8-health-every N, or leave the file out.")
        self._check_lora()

    def _check_lora(self) -> None:
        names = tuple(t.strip() for item in self.lora_targets for t in item.split(","))
        if "" in names:  # else --lora-targets '' would silently mean PEFT's defaults
            raise ValueError(f"lora_targets={','.join(self.lora_targets)!r} holds an empty name: pass --lora-targets "
                             "NAME,... (layer names, e.g. q_proj,v_proj), or leave it out for PEFT's default of the "
                             "model's family.")
        object.__setattr__(self, "lora_targets", names)
        if self.lora_rank < 0:
            raise ValueError(f"lora_rank={self.lora_rank} must be 0 (off) or more (the adapters' rank, e.g. 8-64).")
        if self.lora_alpha is not None and not (math.isfinite(self.lora_alpha) and self.lora_alpha > 0):
            raise ValueError(f"lora_alpha={self.lora_alpha} must be positive and finite (e.g. 16), or none (twice "
                             "--lora-rank).")
        if not 0 <= self.lora_dropout < 1:  # nan fails this too
            raise ValueError(f"lora_dropout={self.lora_dropout} must be in [0, 1) (0: no dropout).")
        if self.lora_rank:
            if self.merge_lora and self.save_pretrained is None:
                raise ValueError("merge_lora with no save_pretrained: pass --save-pretrained DIR (where the merged "
                                 "model is written), or leave --merge-lora out.")
            if self.save_dtype == "fp8" and not self.merge_lora:
                raise ValueError("save_dtype='fp8' with lora_rank and no merge_lora: the adapters are written as they "
                                 "trained (fp32) and the FP8 base is not exported. Pass --merge-lora (the base with "
                                 "the adapters merged, then quantized), or another --save-dtype.")
            return
        defaults = {f.name: f.default for f in fields(self)}
        unread = [name for name in ("lora_alpha", "lora_targets", "lora_dropout", "merge_lora")
                  if getattr(self, name) != defaults[name]]
        if unread:
            name = unread[0]
            raise ValueError(f"{name}={getattr(self, name)!r} with lora_rank=0 (LoRA off) has no effect: pass "
                             f"--lora-rank R (e.g. 8) to fine-tune adapters, or leave {cli_flag(name)} out.")
