"""Installing fp8dist keeps the user's torch: the package takes ranges, the exact tested versions live in
constraints.txt (inside those ranges), and ``fp8dist env`` says whether what is installed is in range."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
import venv
import zipfile

import pytest
from cli_helpers import ROOT
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from fp8dist.cli import main


def _requirements() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = [r for group in project["optional-dependencies"].values() for r in group]
    return [Requirement(r) for r in project["dependencies"] + extras]


def _pins() -> dict[str, Version]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            pins[canonicalize_name(name)] = Version(version)
    return pins


def test_dependencies_are_ranges_and_the_tested_versions_lie_inside_them():
    pins = _pins()
    for req in _requirements():
        assert not any(spec.operator in ("==", "===") for spec in req.specifier), f"{req} pins a version"
        pinned = pins.get(canonicalize_name(req.name))
        if req.name == "transformer_engine":  # CUDA only: not on the CPU machines, so not in constraints.txt
            assert pinned is None
            continue
        assert pinned is not None, f"{req.name} has no tested version in constraints.txt"
        assert req.specifier.contains(pinned, prereleases=True), f"constraints.txt's {pinned} is outside {req}"


def test_fp8dist_env_checks_installed_versions_against_the_ranges(capsys, monkeypatch):
    assert main(["env"]) == 0
    torch_line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("torch "))
    torch_range = str(next(r.specifier for r in _requirements() if r.name == "torch"))
    assert f"(in range {torch_range})" in torch_line
    monkeypatch.setattr("fp8dist.runtime.packages.package_version", lambda name: "2.9.0" if name == "torch" else None)
    assert main(["env"]) == 0
    torch_line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("torch "))
    assert f"2.9.0 (OUTSIDE the range fp8dist supports: install a version in range {torch_range})" in torch_line


@pytest.mark.slow
def test_pip_keeps_a_users_torch_of_another_supported_version(tmp_path):
    """A venv holding torch 2.11.0+cu130 (its metadata only: the resolver reads nothing else) installs fp8dist
    without touching it. With the old pin torch==2.13.0 the same resolve replaced it. This environment's pip resolves
    for the venv's interpreter (pip --python): no pip or build inside the venv."""
    env = tmp_path / "venv"
    venv.create(env, with_pip=False)
    (site,) = (env / "lib").glob("python3*/site-packages")
    (site / "torch-2.11.0+cu130.dist-info").mkdir()
    (site / "torch-2.11.0+cu130.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: torch\nVersion: 2.11.0+cu130\n")
    pip = [sys.executable, "-m", "pip", "--python", str(env / "bin" / "python"), "--disable-pip-version-check"]
    listed = subprocess.run(pip + ["list", "--format", "json"], capture_output=True, text=True, check=True).stdout
    assert {"name": "torch", "version": "2.11.0+cu130"} in json.loads(listed), "the venv holds torch 2.11.0+cu130"
    report = tmp_path / "report.json"
    proc = subprocess.run(pip + ["-q", "install", "--dry-run", "--report", str(report), str(ROOT)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    installs = {i["metadata"]["name"]: i["metadata"]["version"] for i in json.loads(report.read_text())["install"]}
    assert "fp8dist" in installs and "torchao" in installs
    assert "torch" not in installs, f"pip would replace the user's torch 2.11.0 with {installs.get('torch')}"


@pytest.mark.slow
def test_the_wheel_ships_the_launch_scripts_executable(tmp_path):
    """A pip install without a checkout gets launch/ too (fp8dist launch runs it), with the exec bits srun needs."""
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                           str(tmp_path), str(ROOT)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (wheel,) = tmp_path.glob("fp8dist-*.whl")
    with zipfile.ZipFile(wheel) as zipped:
        modes = {i.filename: i.external_attr >> 16 for i in zipped.infolist() if "/launch/" in i.filename}
    scripts = sorted(p.relative_to(ROOT / "launch").as_posix() for p in (ROOT / "launch").rglob("*") if p.is_file())
    assert sorted(name.removeprefix("fp8dist/launch/") for name in modes) == scripts
    for name, mode in modes.items():
        if name.endswith((".sbatch", "torchrun.sh", "deepspeed.sh")):
            assert mode & 0o111, f"{name} is not executable in the wheel"
