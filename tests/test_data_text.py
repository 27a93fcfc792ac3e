"""Real-text data: tokenization and its cache, packing, the held-out split, per-rank slices, exact resume, and the
error of every bad input (with nothing left half-written in the cache)."""

from __future__ import annotations

import json
import os
import warnings
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from fp8dist.train.data import TextBatches, check_vocab_fits, load_text_corpus, train_tokenizer
from fp8dist.train.data import cache as cache_module
from fp8dist.train.data import sources
from text_corpus import write_text_corpus


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    return write_text_corpus(tmp_path_factory.mktemp("text"))


def _ids(tokenizer_dir: Path, text: str) -> list[int]:
    """The tokenizer's ids of ``text``, straight from transformers (not through fp8dist)."""
    return AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)(
        text, add_special_tokens=False)["input_ids"]


def _load(made, tmp_path, *paths, **kw):
    return load_text_corpus(list(paths) or [made.jsonl], tokenizer=made.tokenizer, cache_dir=tmp_path / "cache",
                            progress=False, **kw)


def test_documents_are_tokenized_whole_and_joined_with_eos(made, tmp_path, monkeypatch):
    pieces = []
    original = sources._text_pieces

    def spy(path, digest):
        for piece in original(path, digest):
            pieces.append(piece[0])
            yield piece

    monkeypatch.setattr(sources, "_text_pieces", spy)
    monkeypatch.setattr(sources, "PIECE_BYTES", 200)  # the plain-text file in many pieces
    corpus = _load(made, tmp_path, made.jsonl, made.text)
    eos = AutoTokenizer.from_pretrained(str(made.tokenizer), local_files_only=True).eos_token_id
    per_doc = [ids + [eos] for ids in (_ids(made.tokenizer, d) for d in made.docs)]
    whole_file = _ids(made.tokenizer, made.text.read_text()) + [eos]
    jsonl, text = corpus.files
    assert jsonl.tokens.dtype == np.uint16 and corpus.vocab_size == 320
    assert jsonl.tokens.tolist() == [t for ids in per_doc for t in ids]
    assert jsonl.documents == len(made.docs) and int((jsonl.tokens == eos).sum()) == len(made.docs)
    assert len(pieces) > 10 and "".join(pieces) == made.text.read_text()
    assert text.tokens.tolist() == whole_file  # the cuts between pieces change no token
    assert corpus.tokens(0, corpus.num_tokens).tolist() == jsonl.tokens.tolist() + whole_file


def test_cache_is_reused_and_rebuilt_when_the_file_or_tokenizer_changes(made, tmp_path, monkeypatch):
    builds = []
    original = cache_module._build
    monkeypatch.setattr(cache_module, "_build", lambda *a: builds.append(a[0].name) or original(*a))
    data = tmp_path / "docs.jsonl"
    data.write_bytes(made.jsonl.read_bytes())
    first = _load(made, tmp_path, data).files[0]
    again = _load(made, tmp_path, data).files[0]
    assert builds == ["docs.jsonl"] and again.reused and not first.reused
    assert again.tokens.tolist() == first.tokens.tolist()
    os.utime(data, ns=(data.stat().st_atime_ns, data.stat().st_mtime_ns + 10**9))  # touched, content unchanged
    assert _load(made, tmp_path, data).files[0].reused and len(builds) == 1
    edited = data.read_text().replace("sees", "saws", 1)
    assert len(edited) == len(data.read_text()) and edited != data.read_text()
    data.write_text(edited)  # same size, other text
    changed = _load(made, tmp_path, data).files[0]
    assert builds == ["docs.jsonl"] * 2 and not changed.reused
    assert changed.tokens.tolist() != first.tokens.tolist()
    assert changed.tokens.tolist() == [t for line in edited.splitlines()
                                       for t in _ids(made.tokenizer, json.loads(line)["text"]) + [first.tokens[-1]]]
    other = tmp_path / "other-tokenizer"
    train_tokenizer(made.docs, other, vocab_size=300)
    retokenized = load_text_corpus([data], tokenizer=other, cache_dir=tmp_path / "cache", progress=False)
    assert len(builds) == 3 and retokenized.vocab_size == 300
    assert _load(made, tmp_path, data).files[0].reused and len(builds) == 3  # the first tokenizer's entry stays
    bodies = tmp_path / "bodies.jsonl"
    bodies.write_text("".join(json.dumps({"body": d}) + "\n" for d in made.docs))
    assert _load(made, tmp_path, bodies, text_field="body").files[0].tokens.tolist() == first.tokens.tolist()


def test_windows_rank_slices_and_epochs(made, tmp_path):
    corpus = _load(made, tmp_path, made.jsonl, made.text)
    stream = corpus.tokens(0, corpus.num_tokens)
    whole = TextBatches(corpus, batch_size=8, seq_len=15, seed=5, eval_fraction=0.1)
    ranks = [TextBatches(corpus, batch_size=8, seq_len=15, rank=r, world_size=4, seed=5, eval_fraction=0.1)
             for r in range(4)]
    train_rows = Counter(tuple(stream[w * 16:(w + 1) * 16].tolist()) for w in whole.train_windows.tolist())
    epoch_steps = len(whole.train_windows) // 8
    seen = []
    for _ in range(epoch_steps + 3):
        batch = whole.next_batch()
        assert batch.shape == (8, 16) and batch.dtype == torch.int64
        assert torch.equal(torch.cat([r.next_batch() for r in ranks]), batch)  # the ranks' slices make it up
        seen += [tuple(row.tolist()) for row in batch]
    first_epoch = Counter(seen[:len(whole.train_windows)])
    assert first_epoch == train_rows  # an epoch visits every training window once, no held-out one
    assert whole.position == (1, (epoch_steps + 3) * 8 - len(whole.train_windows))
    second = seen[len(whole.train_windows):]
    assert second != seen[:len(second)]  # reshuffled per epoch
    other_seed = TextBatches(corpus, batch_size=8, seq_len=15, seed=6, eval_fraction=0.1)
    assert not torch.equal(other_seed.next_batch(), TextBatches(corpus, batch_size=8, seq_len=15, seed=5,
                                                                eval_fraction=0.1).next_batch())


def test_resumed_position_gives_the_uninterrupted_batches(made, tmp_path):
    corpus = _load(made, tmp_path, made.jsonl)
    kw = dict(batch_size=8, seq_len=31, seed=3, eval_fraction=0.05)
    uninterrupted = TextBatches(corpus, **kw)
    steps = 2 * len(uninterrupted.train_windows) // 8 + 2  # past two epoch borders
    expected = [uninterrupted.next_batch() for _ in range(steps)]
    first = TextBatches(corpus, **kw)
    for _ in range(5):
        first.next_batch()
    saved = json.loads(json.dumps(first.state_dict()))  # as a checkpoint's extra stores it
    resumed = [TextBatches(corpus, rank=r, world_size=2, **kw) for r in range(2)]  # on another world size
    for r in resumed:
        r.load_state_dict(saved)
    for step in range(5, steps):
        assert torch.equal(torch.cat([r.next_batch() for r in resumed]), expected[step]), step
    with pytest.raises(ValueError, match=r"another token stream \(seq_len 31 -> 63 changed"):
        TextBatches(corpus, **{**kw, "seq_len": 63}).load_state_dict(saved)
    with pytest.raises(ValueError, match=r"another token stream \(the files' contents changed"):
        TextBatches(_load(made, tmp_path, made.jsonl, made.text), **kw).load_state_dict(saved)


def test_held_out_windows_are_disjoint_from_training_and_fixed(made, tmp_path):
    corpus = _load(made, tmp_path, made.jsonl, made.text)
    batches = TextBatches(corpus, batch_size=4, seq_len=15, seed=1, eval_fraction=0.1)
    count = corpus.num_tokens // 16
    held, train = set(batches.eval_windows.tolist()), set(batches.train_windows.tolist())
    assert not held & train and held | train == set(range(count)) and len(held) == -(-count // 10)
    assert batches.eval_windows.tolist() == TextBatches(corpus, batch_size=4, seq_len=15, seed=9,
                                                        eval_fraction=0.1).eval_windows.tolist()
    stream = corpus.tokens(0, corpus.num_tokens)
    rows = torch.cat(list(batches.eval_batches()))
    assert len(rows) == len(held) // 4 * 4 and batches.position == (0, 0)
    assert [row.tolist() for row in rows] == [stream[w * 16:(w + 1) * 16].tolist()
                                              for w in batches.eval_windows[:len(rows)]]
    rank1 = TextBatches(corpus, batch_size=4, seq_len=15, rank=1, world_size=2, seed=1, eval_fraction=0.1)
    assert torch.equal(next(rank1.eval_batches(1)), rows[2:4])
    with pytest.raises(ValueError, match=rf"{len(held) // 4 + 1} held-out batches of 4 windows need"):
        next(batches.eval_batches(len(held) // 4 + 1))


_BAD_FILES = {
    "missing": (None, "does not exist"),
    "empty.txt": (b"", "is empty: there is nothing to tokenize"),
    "image.txt": (b"Some text first\n" * 40 + b"\x89PNG\r\n\x1a\n\0\0", r"looks binary \(a NUL byte at byte 648\)"),
    "latin1.txt": ("caf\u00e9 au lait\n".encode("latin-1"), r"is not UTF-8 text: byte 0xe9 at byte 3"),
    "field.jsonl": (b'{"text": "a"}\n{"body": "b", "n": 1}\n', r"field.jsonl:2: no 'text' field \(this line's fields: "
                                                              r"'body', 'n'\)\. Pass text_field="),
    "broken.jsonl": (b'{"text": "a"}\n\n{"text": "b"\n', r"broken.jsonl:3: not valid JSON"),
    "list.jsonl": (b'["a"]\n', r"list.jsonl:1: a JSON list where an object with a 'text' field belongs"),
    "number.jsonl": (b'{"text": 5}\n', r"number.jsonl:1: field 'text' is a JSON int, not a string"),
    "blank.jsonl": (b"\n  \n", r"holds only blank lines"),
    "hollow.jsonl": (b'{"text": ""}\n{"text": ""}\n', r"yields no tokens: its 2 documents are empty"),
}


@pytest.mark.parametrize("name", list(_BAD_FILES))
def test_bad_data_file_is_refused_and_leaves_no_file(made, tmp_path, name):
    content, message = _BAD_FILES[name]
    path = tmp_path / name
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(ValueError, match=message):
        _load(made, tmp_path, path)
    assert not (tmp_path / "cache").exists(), "a refused file leaves no cache folder behind"


def test_bad_tokenizer_corpus_size_and_vocab_are_refused(made, tmp_path):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    def load(tokenizer):
        return load_text_corpus([made.jsonl], tokenizer=tokenizer, cache_dir=tmp_path / "cache", progress=False)

    with pytest.raises(ValueError, match=r"tokenizer '.*nowhere' does not exist"):
        load(tmp_path / "nowhere")
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"holds no tokenizer: .*\(found: config.json\)"):
        load(model_dir)
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE())).save_pretrained(str(tmp_path / "no-eos"))
    with pytest.raises(ValueError, match="has no EOS token"):
        load(tmp_path / "no-eos")
    assert not (tmp_path / "cache").exists()
    (tmp_path / "a-file").write_text("")
    with pytest.raises(ValueError, match=r"cache_dir='.*a-file/cache' is under '.*a-file', a file, not a directory: "
                                         "pass cache_dir= a directory"):
        load_text_corpus([made.jsonl], tokenizer=made.tokenizer, cache_dir=tmp_path / "a-file" / "cache")
    short = tmp_path / "short.jsonl"
    short.write_text('{"text": "The cat."}\n')
    corpus = _load(made, tmp_path, short)
    n = corpus.num_tokens
    with pytest.raises(ValueError, match=rf"the corpus has {n} tokens, fewer than one window of seq_len \+ 1 = 1,025"):
        TextBatches(corpus, batch_size=2, seq_len=1024)
    with pytest.raises(ValueError, match=rf"{n // 2} windows of 2, 1 of them held out, leaves {n // 2 - 1} for training"
                                         rf", fewer than a global batch of 64; that needs about {65 * 2} tokens"):
        TextBatches(corpus, batch_size=64, seq_len=1, eval_fraction=0.01)
    check_vocab_fits(320, 320)
    with pytest.raises(ValueError, match=r"the tokenizer has 32,000 token ids and the model's embedding has 256 rows"):
        check_vocab_fits(32000, 256)


def test_prepare_script_writes_a_corpus_its_tokenizer_reads(made, tmp_path):
    import importlib.util

    from cli_helpers import ROOT

    spec = importlib.util.spec_from_file_location("prepare", ROOT / "benchmarks" / "real_text" / "prepare.py")
    prepare = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(prepare)
    pages = tmp_path / "_sources"
    for i, doc in enumerate(made.docs[:30]):
        page = pages / ("library" if i % 2 else "howto") / f"page{i:02}.rst.txt"
        page.parent.mkdir(parents=True, exist_ok=True)
        page.write_text(f"Page {i}\n=======\n\n{doc}\n")
    assert prepare.main(["--out", str(tmp_path / "out"), "--source", str(pages), "--vocab-size", "300"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "out" / "corpus.jsonl").read_text().splitlines()]
    assert [r["source"] for r in rows] == sorted(str(p.relative_to(pages))[:-4] for p in pages.rglob("*.txt"))
    assert rows[0]["text"] == (pages / (rows[0]["source"] + ".txt")).read_text().strip()
    record = json.loads((tmp_path / "out" / "SOURCE.json").read_text())
    assert (record["pages"], record["vocab_size"]) == (30, 300) and "PSF License" in record["licence"]
    corpus = load_text_corpus([tmp_path / "out" / "corpus.jsonl"], tokenizer=tmp_path / "out" / "tokenizer",
                              cache_dir=tmp_path / "cache", progress=False)
    assert corpus.num_documents == 30 and corpus.vocab_size == 300


def test_text_field_over_plain_text_only_is_one_warning(made, tmp_path):
    with pytest.warns(UserWarning) as said:
        _load(made, tmp_path, made.text, text_field="body")
    assert [str(w.message) for w in said] == [
        "text_field='body' has no effect here (read only from JSON-lines files, .jsonl, .ndjson, .json; the data is "
        "plain text: corpus.txt)."]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # read from a JSON-lines file among them: no note
        _load(made, tmp_path, made.text, made.jsonl, text_field="text")
