"""`fp8dist train --data`: training on real text as a user runs it. A resumed run trains on the very token ids an
uninterrupted one does, and the metrics file holds every logged step's figures (2 real ranks); an FP8 fine-tune of a
saved model writes a model and tokenizer that transformers reads; every bad input is one line, exit code 2, before
any process starts, with nothing written."""

from __future__ import annotations

import json
import math
import re
import shlex
from pathlib import Path

import pytest
import torch
from dist_harness import run_ranks
from text_corpus import write_text_corpus

from fp8dist.cli import main

# the keys, spelled out here so a renamed key fails
KEYS = {"step", "loss", "grad_norm", "lr", "tokens_per_s", "step_time_s", "mfu", "peak_memory_bytes",
        "skipped_steps"}


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    return write_text_corpus(tmp_path_factory.mktemp("text"))


def _job(made, directory: Path, **options):
    from fp8dist.train.job import TrainConfig

    return TrainConfig(data=(str(made.jsonl),), tokenizer=str(made.tokenizer), data_cache=str(directory / "cache"),
                       steps=4, batch_size=4, seq_len=32, eval_every=2, eval_batches=1, fp8_health_every=2,
                       checkpoint_dir=str(directory / "ckpt"), save_every=2, **options)


class _Stop(Exception):
    """Ends a run after its second step (and its checkpoint), as a crash would."""


def _resume_case(rank: int, world: int, made, directory: str) -> dict:
    """One rank: an uninterrupted 4-step run, then a run stopped after step 2 and resumed; the token ids this rank
    trained on at each step (recorded as the batches are taken), the losses, and rank 0's metrics files."""
    from fp8dist.config.resolve import resolve_config
    from fp8dist.train.data import TextBatches
    from fp8dist.train.job import run_training

    taken: list[torch.Tensor] = []
    original = TextBatches.next_batch
    TextBatches.next_batch = lambda self: taken.append(original(self)) or taken[-1]
    config, quiet = resolve_config(strategy="fsdp", fp8="torchao"), (lambda line: None)
    straight = run_training(config, _job(made, Path(directory) / "straight", metrics_file=f"{directory}/a.jsonl"),
                            log=quiet)
    uninterrupted, taken[:] = list(taken), []

    def crash(done: int) -> None:
        if done == 2:
            raise _Stop

    job = _job(made, Path(directory) / "resumed", metrics_file=f"{directory}/b.jsonl", resume=True)
    with pytest.raises(_Stop):
        run_training(config, job, log=quiet, progress=crash)
    resumed = run_training(config, job, log=quiet)
    files = {name: Path(directory, name).read_text() for name in ("a.jsonl", "b.jsonl", "b.fp8_health.jsonl")}
    return dict(uninterrupted=uninterrupted, resumed=taken, straight=straight, after=resumed,
                files=files if rank == 0 else None)


def test_resume_trains_on_the_uninterrupted_runs_token_ids_and_the_metrics_file_logs_every_step(made, tmp_path):
    ranks = run_ranks(_resume_case, made, str(tmp_path))
    for r in ranks:
        assert len(r["uninterrupted"]) == 4 and len(r["resumed"]) == 4  # steps 1-2, then 3-4 after the resume
        for a, b in zip(r["uninterrupted"], r["resumed"]):
            assert torch.equal(a, b)
        assert r["after"].start_step == 2 and r["after"].losses == r["straight"].losses[2:]
    assert not torch.equal(ranks[0]["uninterrupted"][0], ranks[1]["uninterrupted"][0]), "each rank its slice"
    straight, after = ranks[0]["straight"], ranks[0]["after"]
    assert [s for s, _ in straight.eval_losses] == [2, 4] and after.eval_losses == straight.eval_losses[1:]
    files = ranks[0]["files"]
    for name, losses in (("a.jsonl", straight.losses), ("b.jsonl", straight.losses)):
        rows = [json.loads(line) for line in files[name].splitlines()]
        assert [row["step"] for row in rows] == [1, 2, 3, 4], f"{name}: each step once, the resumed run's too"
        for row, loss in zip(rows, losses):
            assert KEYS <= set(row) and row["loss"] == pytest.approx(loss, abs=1e-6)
            assert row["mfu"] is None and row["skipped_steps"] == 0 and row["peak_memory_bytes"] > 2**20
            assert row["grad_norm"] > 0 and row["lr"] > 0 and row["tokens_per_s"] > 0
            assert row["tokens_per_s"] == pytest.approx(4 * 32 / row["step_time_s"])
        evals = {row["step"]: row["val_loss"] for row in rows if "val_loss" in row}
        assert evals == dict(straight.eval_losses)
        assert rows[1]["val_perplexity"] == pytest.approx(math.exp(rows[1]["val_loss"]))
    health = [json.loads(line) for line in files["b.fp8_health.jsonl"].splitlines()]
    assert [h["step"] for h in health] == [0, 2], "sampled every 2 steps, each once across the resume"


def _pretrained_dir(made, directory: Path) -> Path:
    """A tiny Llama over the corpus's 320-id vocabulary, saved with its tokenizer (what `hf download` gives)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                         tie_word_embeddings=False))
    model.save_pretrained(directory)
    AutoTokenizer.from_pretrained(str(made.tokenizer)).save_pretrained(directory)
    return directory


def _readme_fine_tune_command() -> list[str]:
    """The README's fine-tune command (`fp8dist train --pretrained ... --data ...`), split as a shell would."""
    from cli_helpers import ROOT

    blocks = re.findall(r"```bash\n(.*?)\n```", (ROOT / "README.md").read_text(), flags=re.S)
    command = next(b for b in blocks if "fp8dist train --pretrained" in b and "--data" in b)
    return shlex.split(command.replace("\\\n", " "))


def test_readmes_fp8_fine_tune_on_text_writes_a_model_and_its_tokenizer(made, tmp_path, capsys):
    """The README's command with this test's files in place of its paths, shortened (later flags win)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source, out = _pretrained_dir(made, tmp_path / "model"), tmp_path / "out"
    files = {"path/to/hf_dir": [str(source)], "notes.txt": [str(made.jsonl)], "docs.jsonl": [], "out_dir": [str(out)],
             "run/metrics.jsonl": [str(tmp_path / "m.jsonl")]}
    argv = [a for arg in _readme_fine_tune_command()[1:] for a in files.get(arg, [arg])]
    assert argv[:3] == ["train", "--pretrained", str(source)] and {"fsdp", "torchao", "--save-pretrained"} <= set(argv)
    code = main([*argv, "--nproc", "1", "--steps", "3", "--batch-size", "4", "--seq-len", "32", "--eval-every", "0",
                 "--data-cache", str(tmp_path / "cache")])
    stdout = capsys.readouterr().out
    assert code == 0
    assert "LlamaConfig from" in stdout and "fp8 torchao" in stdout and "Float8Linear" in stdout
    assert "data: 1 file, 120 documents" in stdout and "validation      loss" in stdout
    assert "MFU: null (no dense bf16 peak is known for cpu" in stdout
    trained = AutoModelForCausalLM.from_pretrained(out)
    before = AutoModelForCausalLM.from_pretrained(source)
    assert trained.dtype == before.dtype == torch.float32  # --save-dtype as-loaded (the default): the source's
    name = "model.layers.0.mlp.down_proj.weight"  # an FP8 layer: trained, not copied
    assert not torch.equal(trained.state_dict()[name], before.state_dict()[name])
    assert AutoTokenizer.from_pretrained(str(out)).get_vocab() == AutoTokenizer.from_pretrained(
        str(made.tokenizer)).get_vocab()
    rows = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and "val_loss" in rows[-1]


def test_a_window_is_predicted_once_as_transformers_shifts_a_whole_sequence():
    """lm_loss on a seq_len + 1 window (the model reads seq_len tokens) is transformers' own loss of the whole
    window: the same targets, each predicted once, none twice-shifted."""
    from fp8dist.train.data.job import lm_loss
    from fp8dist.train.models import build_llama

    model = build_llama("tiny", max_seq_len=33)
    window = torch.randint(0, 256, (3, 33), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = lm_loss(model, window, windows=True)
        theirs = model(input_ids=window, labels=window).loss
    assert ours.item() == pytest.approx(theirs.item(), abs=1e-5)


LLAMA_256 = json.dumps({"model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
                        "num_hidden_layers": 1, "num_attention_heads": 4})
BAD = [
    ("missing file", ["--data", "TMP/none.jsonl", "--tokenizer", "TOK"], {},
     ("data file 'TMP/none.jsonl' does not exist",)),
    ("empty file", ["--data", "TMP/empty.txt", "--tokenizer", "TOK"], {"empty.txt": ""}, ("empty.txt' is empty",)),
    ("JSON line without the field", ["--data", "TMP/d.jsonl", "--tokenizer", "TOK"],
     {"d.jsonl": '{"text": "a b"}\n{"body": "c"}\n'},
     ("d.jsonl:2: no 'text' field (this line's fields: 'body'). Pass text_field= (--text-field)",)),
    ("binary file", ["--data", "TMP/bin.txt", "--tokenizer", "TOK"], {"bin.txt": "ab\0cd"},
     ("looks binary (a NUL byte at byte 2",)),
    ("tokenizer directory without a tokenizer", ["--data", "CORPUS", "--tokenizer", "TMP/tok"], {"tok/x.txt": ""},
     ("holds no tokenizer: none of tokenizer.json",)),
    ("corpus shorter than one window", ["--data", "TMP/short.txt", "--tokenizer", "TOK", "--seq-len", "4000"],
     {"short.txt": "café au lait. " * 20}, ("fewer than one window of seq_len + 1 = 4,001",)),
    ("tokenizer larger than the embedding", ["--data", "CORPUS", "--tokenizer", "TOK", "--model-config", "TMP/c.json"],
     {"c.json": LLAMA_256}, ("has 320 token ids and the model of", "embedding has 256 rows")),
    ("data without a tokenizer", ["--data", "CORPUS"], {}, ("--data needs a tokenizer: pass --tokenizer DIR",)),
    ("too many held-out batches", ["--data", "CORPUS", "--tokenizer", "TOK", "--eval-batches", "9", "--seq-len", "16"],
     {}, ("--eval-batches 9 needs 72 held-out windows of 17 tokens", "(2 global batches of 8). Pass --eval-batches 2 "
                                                                     "or fewer")),
    ("evaluation without data", ["--eval-every", "5"], {}, ("eval_every needs data",)),
]

TOKENIZED = {"corpus shorter than one window", "tokenizer larger than the embedding", "too many held-out batches"}
"""Refused once the (readable) text was tokenized."""


@pytest.mark.parametrize("case_id,argv,files,texts", BAD, ids=[c[0] for c in BAD])
def test_bad_data_is_one_line_exit_2_before_any_process_and_writes_nothing(case_id, argv, files, texts, made,
                                                                          tmp_path, capsys):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    places = {"TMP": str(tmp_path), "CORPUS": str(made.jsonl), "TOK": str(made.tokenizer)}
    argv = [places.get(a.split("/")[0], a.split("/")[0]) + a[len(a.split("/")[0]):] for a in argv]
    outputs = ["--data-cache", str(tmp_path / "cache"), "--metrics-file", str(tmp_path / "out" / "m.jsonl"),
               "--checkpoint-dir", str(tmp_path / "ckpt"), "--save-pretrained", str(tmp_path / "model")]
    code = main(["train", "--steps", "2", "--batch-size", "8", *argv, *outputs])
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert code == 2 and "Traceback" not in err and "starting" not in out
    assert len(lines) == 1 and lines[0].startswith("fp8dist train: error: "), err
    for text in texts:
        assert text.replace("TMP", str(tmp_path)) in lines[0], lines[0]
    cache = tmp_path / "cache"
    left = [p.name for p in tmp_path.rglob("*") if p.is_file() and cache not in p.parents]
    assert sorted(left) == sorted(Path(name).name for name in files), "nothing written: metrics, checkpoint, model"
    entries = sorted(p.name for p in cache.glob("*")) if cache.exists() else []
    if case_id in TOKENIZED:  # the text was good: its complete cache entry (tokens + index) is kept for the next run
        assert [Path(e).suffix for e in entries] == [".json", ".tokens"], entries
    else:
        assert not cache.exists(), "a file that cannot be read leaves nothing, not even the cache folder"
