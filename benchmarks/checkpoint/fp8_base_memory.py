"""Peak memory of a LoRA fine-tune on an FP8 checkpoint (issue 55): ``fp8dist train --pretrained DIR --lora-rank 4``
(strategy none, torchao, 2 steps of 1 x 32 tokens) on one Llama exported twice by ``fp8dist.save_pretrained``: in
FP8 (``dtype="fp8"``: the frozen base is held as the file's e4m3 bits) and in bf16 (the base loaded into fp32
parameters). Each job runs in a fresh process; its peak RSS is the kernel's high-water mark of that process
(``ru_maxrss`` of the job, read by a small wrapper process that started it: the figure ``VmHWM`` holds at exit, read
with no code in the job). The same
command on the tiny preset's FP8 export is the baseline subtracted (the interpreter, torch, the job's fixed costs).

The peak falls while the checkpoint loads: the parameters as the job holds them plus the file's pages, which
safetensors memory-maps and which count in RSS until the file is closed. So the expected increment is, from the
checkpoint's own header: 1 byte per FP8 weight held + 4 per scale and per other parameter (fp32), or 4 per parameter
for the bf16 base, plus the file's bytes (:func:`expected_bytes`).

``--allocator fixed`` (the default, what tests/test_fp8_base_memory.py asserts) runs the jobs with
``MALLOC_MMAP_THRESHOLD_=131072``: glibc then returns every freed block of 128 KiB or more at once, so the peak RSS
is what the process held at its fullest moment. ``default`` leaves glibc's dynamic threshold, which keeps freed
multi-MB temporaries (torch's CPU ``_scaled_mm`` widens each weight to fp32 per call) in its heap: what a user of a
CPU sees, tens of MB noisier from run to run. Results: fp8_base_memory.md beside this file.

    PYTHONPATH=. python benchmarks/checkpoint/fp8_base_memory.py --sizes small medium --repeats 3
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

MIB = 2**20
BASELINE = "tiny"
"""The preset whose FP8 export's job is the baseline subtracted."""
FIXED_THRESHOLD = {"MALLOC_MMAP_THRESHOLD_": "131072"}
"""glibc: every block of 128 KiB or more its own mapping, returned when freed (no dynamic threshold)."""
JOB = ["--lora-rank", "4", "--strategy", "none", "--fp8", "torchao", "--steps", "2", "--batch-size", "1", "--seq-len",
       "32"]
"""The LoRA job's flags after ``--pretrained DIR`` (step 1 also samples the FP8 health telemetry)."""


def export(size: str, root: Path) -> dict[str, Path]:
    """The Llama preset ``size`` (seed 1, wrapped under torchao on strategy none) saved in ``root`` as
    ``{size}-fp8`` (``dtype="fp8"``) and ``{size}-bf16``: {"fp8": dir, "bf16": dir}."""
    import torch

    import fp8dist
    from fp8dist.train.models import build_llama

    torch.set_num_threads(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = fp8dist.wrap_model(build_llama(size, seed=1), strategy="none", fp8="torchao")
        paths = {"fp8": root / f"{size}-fp8", "bf16": root / f"{size}-bf16"}
        fp8dist.save_pretrained(model, paths["fp8"], dtype="fp8")
        fp8dist.save_pretrained(model, paths["bf16"])
    return paths


def expected_bytes(path: Path) -> int:
    """What the job on checkpoint ``path`` holds at its peak, from the file's header: 1 byte per e4m3 weight (held
    as its bits), 4 per other tensor element (its scales, and the parameters in fp32), plus the file's own bytes
    (memory-mapped while the load reads it)."""
    from safetensors import safe_open

    file = path / "model.safetensors"
    held = 0
    with safe_open(str(file), framework="pt") as f:
        for name in f.keys():
            piece = f.get_slice(name)
            numel = 1
            for n in piece.get_shape():
                numel *= n
            held += numel * (1 if piece.get_dtype() == "F8_E4M3" else 4)
    return held + file.stat().st_size


_WRAPPER = ("import resource, subprocess, sys; code = subprocess.call(sys.argv[1:]); "
            "print(f'peak_rss_kib {resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}', flush=True); "
            "sys.exit(code)")
"""A small process that runs the job as its child and prints the job's peak RSS: a child's ``ru_maxrss`` also holds
what its spawner had mapped when it forked (Linux keeps the replaced memory's high-water mark at exec), so the job is
spawned by this wrapper (~10 MB), not by the caller (a test process holding torch and a model)."""


def peak_rss(paths: dict[str, Path], *, fixed_threshold: bool = True) -> dict[str, tuple[float, str]]:
    """Run the LoRA job on each checkpoint of ``paths`` (name -> dir), all at once, each in its own process with
    one thread, started by :data:`_WRAPPER`; {name: (its peak RSS in MiB, its output)}. RuntimeError with the
    output's tail when a job fails."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(FIXED_THRESHOLD if fixed_threshold else
                                                                              {})}
    started, results = {}, {}
    with tempfile.TemporaryDirectory() as logs:  # files, not pipes: no job waits on a full pipe while others run
        for name, path in paths.items():
            cmd = [sys.executable, "-c", _WRAPPER, sys.executable, "-m", "fp8dist", "train", "--pretrained",
                   str(path), *JOB]
            out = open(Path(logs) / f"{name}.log", "w+")
            started[name] = (subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env), out)
        for name, (process, out) in started.items():
            process.wait()
            out.seek(0)
            text = out.read()
            out.close()
            last = text.rstrip().rsplit("\n", 1)[-1]
            if process.returncode or not last.startswith("peak_rss_kib "):
                raise RuntimeError(f"the job on {paths[name]} exited {process.returncode}:\n{text[-3000:]}")
            results[name] = (int(last.split()[1]) * 1024 / MIB, text)  # ru_maxrss: KiB on Linux
    return results


def measure(paths: dict[str, Path], baseline: Path, *, fixed_threshold: bool = True) -> dict[str, float]:
    """Run the jobs on the exports ``paths`` (:func:`export`) and on ``baseline`` (the tiny preset's FP8 export):
    MiB of each job's peak over the baseline's ("fp8", "bf16"), their expected MiB ("fp8 expected", "bf16
    expected"), the baseline's peak ("baseline"); the FP8 job's output under "log fp8"."""
    peaks = peak_rss({"baseline": baseline, **paths}, fixed_threshold=fixed_threshold)
    out = {"baseline": peaks["baseline"][0], "log fp8": peaks["fp8"][1]}
    for kind, path in paths.items():
        out[kind] = peaks[kind][0] - peaks["baseline"][0]
        out[f"{kind} expected"] = (expected_bytes(path) - expected_bytes(baseline)) / MIB
    return out


def main() -> None:
    """Measure each ``--sizes`` preset ``--repeats`` times under each allocator setting; print a Markdown table."""
    import torch
    import transformers

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", default=["small", "medium"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None, help="where the exports go (default: a temporary folder)")
    args = parser.parse_args()
    print(f"date {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; python {platform.python_version()}, torch "
          f"{torch.__version__}, transformers {transformers.__version__}; CPU peak RSS (MiB) over the tiny preset's job")
    print("| preset | allocator | FP8 base: measured / expected | bf16 base (fp32): measured / expected | ratio |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        root = args.dir or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        baseline = export(BASELINE, root)["fp8"]
        for size in args.sizes:
            paths = export(size, root)
            for fixed in (True, False):
                for _ in range(args.repeats):
                    m = measure(paths, baseline, fixed_threshold=fixed)
                    print(f"| {size} | {'fixed' if fixed else 'default'} | {m['fp8']:.1f} / {m['fp8 expected']:.1f} | "
                          f"{m['bf16']:.1f} / {m['bf16 expected']:.1f} | {m['fp8'] / m['bf16']:.3f} |", flush=True)

if __name__ == "__main__":
    main()
