"""The GPU check's preflight (check.sh runs it first, in about a second: no torch import): the node's torch,
transformers and torchao against the ranges pyproject.toml allows, and the device's clocks and power limit and the
commit for the record. Exit 4 with what is out of range and the way out; nothing is installed or downloaded."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[2]
CHECKED = ("torch", "transformers", "torchao")
"""The packages a GPU run's figures depend on (fp8dist's own requirements)."""
SMI_FIELDS = ("name", "clocks.sm", "clocks.max.sm", "clocks.mem", "clocks.max.mem", "power.limit",
              "power.default_limit", "power.max_limit", "enforced.power.limit", "temperature.gpu", "driver_version")
"""What ``nvidia-smi --query-gpu`` reports beside the measurements: a power-capped or down-clocked GPU is slower
than its datasheet (MHz, W, degrees C)."""


def allowed_ranges(pyproject: Path = REPO / "pyproject.toml") -> dict[str, Requirement]:
    """``{package: requirement}`` of :data:`CHECKED` from ``[project].dependencies``."""
    found = {}
    for line in tomllib.loads(pyproject.read_text())["project"]["dependencies"]:
        requirement = Requirement(line)
        if requirement.name in CHECKED:
            found[requirement.name] = requirement
    return found


def _installed(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def version_problems(ranges: dict[str, Requirement], installed: Callable[[str], str | None] = _installed,
                     pins: dict[str, str] | None = None) -> tuple[list[str], list[str]]:
    """(problems, notes): a problem per package absent or out of its range, each naming the found version, the range
    and the way out; a note per in-range version that differs from constraints.txt's pin (``pins``)."""
    problems, notes = [], []
    for name, requirement in ranges.items():
        found = installed(name)
        wanted = str(requirement.specifier) or "any version"
        if found is None:
            way = ("put its wheel in .whl/ (benchmarks/gpu/README.md says how to fetch it on a connected machine)"
                   if name == "torchao" else "run with a Python that has it (PYTHON=...)")
            problems.append(f"{name} is not installed; fp8dist needs {name}{wanted}: {way}")
        elif not requirement.specifier.contains(found, prereleases=True):
            problems.append(f"{name} {found} is outside the range fp8dist allows ({name}{wanted}, pyproject.toml): "
                            f"its figures would not be fp8dist's; use a {name} in range (PYTHON=..., or a wheel in "
                            ".whl/ for torchao)")
        elif pins and name in pins and pins[name] != found.split("+")[0]:
            notes.append(f"{name} {found}: in range, not constraints.txt's tested {pins[name]}")
    return problems, notes


def constraint_pins(path: Path = REPO / "constraints.txt") -> dict[str, str]:
    """``{package: version}`` of the ``name==version`` lines of constraints.txt."""
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if "==" in line:
            name, version = line.split("==", 1)
            pins[name.strip().lower()] = version.strip()
    return pins


def parse_smi(csv_line: str) -> dict[str, Any]:
    """One GPU's ``nvidia-smi --query-gpu=<SMI_FIELDS> --format=csv,noheader,nounits`` line as a dict (numbers as
    floats; "[N/A]" and the like as None)."""
    values = [v.strip() for v in csv_line.split(",")]
    if len(values) != len(SMI_FIELDS):
        raise ValueError(f"nvidia-smi gave {len(values)} fields, not the {len(SMI_FIELDS)} asked for: {csv_line!r}")
    out: dict[str, Any] = {}
    for field, value in zip(SMI_FIELDS, values):
        try:
            out[field] = float(value)
        except ValueError:
            out[field] = None if value.startswith("[") or value in ("N/A", "") else value
    return out


def device_clocks(run: Callable[..., Any] = subprocess.run) -> dict[str, Any]:
    """GPU 0's clocks, power limits and temperature from nvidia-smi, or ``{"error": why}`` where it cannot say."""
    try:
        done = run(["nvidia-smi", f"--query-gpu={','.join(SMI_FIELDS)}", "--format=csv,noheader,nounits", "-i", "0"],
                   capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as error:
        return {"error": f"nvidia-smi: {type(error).__name__}: {error}"}
    if done.returncode != 0:
        return {"error": f"nvidia-smi exited {done.returncode}: {done.stderr.strip()[:200]}"}
    try:
        return parse_smi(done.stdout.strip().splitlines()[0])
    except (ValueError, IndexError) as error:
        return {"error": str(error)}


def commit(repo: Path = REPO) -> dict[str, Any]:
    """The checkout's commit and whether its tracked files differ from it; ``{"error": why}`` outside git."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo,
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as error:
        return {"error": f"git: {type(error).__name__}: {error}"}
    if head.returncode != 0:
        return {"error": f"not a git checkout ({head.stderr.strip()[:200]})"}
    return {"commit": head.stdout.strip(), "modified": bool(dirty.stdout.strip())}


def main(argv: list[str] | None = None) -> int:
    """Print the versions' verdict; write ``node.json`` (versions, clocks, commit) into the folder ``argv[0]`` when
    given. 0: in range; 4: a problem (printed to stderr with its way out)."""
    args = sys.argv[1:] if argv is None else argv
    ranges = allowed_ranges()
    problems, notes = version_problems(ranges, pins=constraint_pins())
    record = {"versions": {name: _installed(name) for name in ranges},
              "allowed": {name: str(requirement) for name, requirement in ranges.items()}, "notes": notes,
              "problems": problems, "clocks": device_clocks(), "commit": commit()}
    if args:
        Path(args[0]).mkdir(parents=True, exist_ok=True)
        (Path(args[0]) / "node.json").write_text(json.dumps(record, indent=1) + "\n")
    for note in notes:
        print(f"preflight: {note}")
    if problems:
        for problem in problems:
            print(f"preflight: {problem}", file=sys.stderr)
        print("preflight: stopping before any GPU time is spent.", file=sys.stderr)
        return 4
    print("preflight: " + ", ".join(f"{n} {v}" for n, v in record["versions"].items()) + " in range")
    return 0


if __name__ == "__main__":
    sys.exit(main())
