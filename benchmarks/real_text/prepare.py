"""Real English text that installs offline: the Python documentation from Debian's ``python3.X-doc`` package, as a
JSON-lines corpus, with a byte-level BPE tokenizer trained on it (no Hub tokenizer can be downloaded here).

    python benchmarks/real_text/prepare.py --out data/python-docs
    # -> data/python-docs/corpus.jsonl     one document per documentation page: {"text": ..., "source": ...}
    #    data/python-docs/tokenizer/       a fast tokenizer (save_pretrained), 8,192 ids, EOS <|endoftext|>
    #    data/python-docs/SOURCE.json      package, version, licence, counts, sha256 of the corpus

The text is the documentation's reStructuredText sources as the package ships them
(``/usr/share/doc/python3.X/html/_sources/**/*.rst.txt``: the pages' English prose with its markup), read as they are.
Where the package is not installed, its .deb is fetched with ``apt-get download`` and unpacked with ``dpkg -x`` into
a temporary directory: nothing is installed system-wide. ``--source DIR`` reads another ``_sources`` directory.
Licence: the Python documentation is under the PSF License Agreement (its examples also under the Zero-Clause BSD
licence); see the pages license.rst and copyright.rst in the corpus itself.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import re
import subprocess
import sys
import tempfile
from datetime import date
from pathlib import Path

from fp8dist.runtime.files import atomic_write_text
from fp8dist.train.data import train_tokenizer

LICENCE = ("PSF License Agreement (the Python documentation; code examples also Zero-Clause BSD): "
           "https://docs.python.org/3/license.html")


def _run(*command: str, cwd: str | None = None) -> str:
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"prepare: {' '.join(command)} failed: {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout


def _doc_package() -> str:
    """The versioned documentation package python3-doc depends on (python3.11-doc on Debian 12)."""
    depends = _run("apt-cache", "depends", "python3-doc")
    match = re.search(r"Depends:\s*(python3\.\d+-doc)", depends)
    if not match:
        sys.exit("prepare: apt-cache knows no python3-doc; run apt-get update, or pass --source DIR.")
    return match.group(1)


def find_sources(work: Path) -> tuple[Path, str]:
    """The ``_sources`` directory and a description of where it came from (package and version)."""
    installed = sorted(glob.glob("/usr/share/doc/python3.*/html/_sources"), key=_minor)
    if installed:
        source = Path(installed[-1])
        package = f"{source.parts[4]}-doc"  # /usr/share/doc/python3.X/... is python3.X-doc's
        version = _run("dpkg-query", "-W", "-f=${Version}", package).strip() if _installed(package) else "unknown"
        return source, f"{package} {version} (installed)"
    package = _doc_package()
    _run("apt-get", "download", package, cwd=str(work))
    deb = next(work.glob(f"{package}_*.deb"))
    _run("dpkg", "-x", str(deb), str(work / "root"))
    version = _run("dpkg-deb", "-f", str(deb), "Version").strip()
    found = sorted(map(str, (work / "root").glob("usr/share/doc/python3.*/html/_sources")), key=_minor)
    if not found:
        sys.exit(f"prepare: {deb.name} holds no html/_sources directory.")
    return Path(found[-1]), f"{package} {version} ({deb.name}, unpacked with dpkg -x)"


def _minor(path: str) -> int:
    return int(re.search(r"python3\.(\d+)", path).group(1))


def _installed(package: str) -> bool:
    return subprocess.run(["dpkg-query", "-W", package], capture_output=True).returncode == 0


def read_pages(source: Path) -> list[dict[str, str]]:
    """Every page's text, in path order: ``{"text": ..., "source": "library/os.rst"}``."""
    pages = []
    for path in sorted(source.rglob("*.rst.txt")):
        text = path.read_text(encoding="utf-8").strip()
        if text:
            pages.append({"text": text, "source": str(path.relative_to(source))[:-len(".txt")]})
    if not pages:
        sys.exit(f"prepare: no *.rst.txt pages under {source}.")
    return pages


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="directory for corpus.jsonl, tokenizer/ and SOURCE.json")
    parser.add_argument("--source", help="a documentation _sources directory (default: the installed package's, "
                                         "else Debian's package fetched and unpacked in a temporary directory)")
    parser.add_argument("--vocab-size", type=int, default=8192, help="BPE vocabulary (default 8192)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as work:
        if args.source:
            source, origin = Path(args.source), f"--source {args.source}"
        else:
            source, origin = find_sources(Path(work))
        pages = read_pages(source)
    corpus = "".join(json.dumps(page, ensure_ascii=False) + "\n" for page in pages)
    atomic_write_text(out / "corpus.jsonl", corpus)
    train_tokenizer((page["text"] for page in pages), out / "tokenizer", vocab_size=args.vocab_size)
    record = {"text": "the Python documentation's reStructuredText sources, one page per JSON line",
              "origin": origin, "licence": LICENCE, "pages": len(pages), "bytes": len(corpus.encode()),
              "words": sum(len(p["text"].split()) for p in pages), "vocab_size": args.vocab_size,
              "corpus_sha256": hashlib.sha256(corpus.encode()).hexdigest(), "date": date.today().isoformat()}
    atomic_write_text(out / "SOURCE.json", json.dumps(record, indent=1) + "\n")
    print(f"prepare: {len(pages)} pages, {record['bytes']:,} bytes, {record['words']:,} words from {origin}\n"
          f"  -> {out / 'corpus.jsonl'}, {out / 'tokenizer'} ({args.vocab_size} ids), {out / 'SOURCE.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
