"""Loaded by every Python process the test suite starts (tests/conftest.py puts this folder on PYTHONPATH).

On a CPU with AMX (amx_int8 / amx_fp16), torch 2.13 sends ``torch._scaled_mm`` -- torchao's FP8 GEMM on a CPU --
to oneDNN, which has only its reference kernel for FP8 there: a 256x128x384 GEMM took 592 ms on such a host
(Xeon with AMX, 2026-11-26) against 0.96 ms through ATen's own kernel with oneDNN off, with bit-identical results;
the suite's FP8 tests ran ~100x slower. So on such a host every test process runs with oneDNN off
(``torch.backends.mkldnn.enabled = False``), set as torch finishes importing. Elsewhere nothing changes.
"""

import importlib
import importlib.abc
import importlib.machinery
import sys


def _has_amx() -> bool:
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("flags"):
                    flags = set(line.split())
                    return bool(flags & {"amx_int8", "amx_fp16"})
    except OSError:
        pass
    return False


class _OneDNNOffAfterTorch(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when ``torch`` is imported, turns oneDNN off once its module has run."""

    def find_spec(self, fullname, path, target=None):
        if fullname != "torch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            importlib.import_module("torch.backends.mkldnn").enabled = False

        spec.loader.exec_module = exec_module
        return spec


if _has_amx() and "torch" not in sys.modules:
    sys.meta_path.insert(0, _OneDNNOffAfterTorch())
