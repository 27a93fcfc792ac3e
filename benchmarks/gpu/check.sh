#!/usr/bin/env bash
# The prepared GPU check (issues 44, 52): a preflight of the versions (stops in seconds when out of range), the
# device's clocks and power limit and the commit, `pytest -m gpu`, bf16 vs FP8 Linear timings beside the speed
# model, and the 1b preset's training step split by a profiler beside predict_step's parts, in 6 minutes on one
# H100/H200, with nothing downloaded (pip runs --no-index only).
# Usage: bash benchmarks/gpu/check.sh [--dry-run] [--out DIR] [--budget-s S] [--wheels DIR]
#   --dry-run   on a CPU: every part's plumbing on tiny shapes, nothing timed (CI: tests/test_gpu_check.py)
#   --wheels    a folder of wheels the node lacks (torchao: its PyPI wheel), installed with --no-index into a
#               temporary site first (default: .whl/ at the repository root, where present)
#   --budget-s  seconds in all (default: check.py's BUDGET_S, 6 minutes)
# Results: JSON + PNG under --out DIR, else $OUT when set, else (a GPU run) benchmarks/gpu/results/<date>_<device>/
# to commit; a dry run without --out or $OUT writes a new temporary folder (its path printed), never the work tree.
set -euo pipefail
started=$(date +%s)
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$repo"
PYTHON=${PYTHON:-python3}
usage="use --dry-run, --out DIR, --budget-s S or --wheels DIR"
dry=0; wheels="$repo/.whl"; out=${OUT:-}; args=()
needs_value() {  # $1: the flag, $2: what follows it (absent: empty)
  if [ -z "$2" ] || [ "${2#--}" != "$2" ]; then
    echo "check.sh: $1 needs a value ($1 ${3}); $usage" >&2
    exit 2
  fi
}
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) dry=1; args+=("$1") ;;
    --wheels) needs_value "$1" "${2:-}" DIR; wheels="$2"; shift ;;
    --out) needs_value "$1" "${2:-}" DIR; out="$2"; shift ;;
    --budget-s) needs_value "$1" "${2:-}" S; args+=("$1" "$2"); shift ;;
    -h|--help) sed -n 2,12p "$0"; exit 0 ;;
    *) echo "check.sh: unknown argument '$1'; $usage" >&2; exit 2 ;;
  esac
  shift
done

# the node's own torch: a GPU check without CUDA would time nothing
if ! cuda=$("$PYTHON" -c 'import torch; print(int(torch.cuda.is_available()))' 2>/dev/null); then
  echo "check.sh: $PYTHON has no torch; run it with the Python that holds the node's CUDA torch (PYTHON=...)." >&2
  exit 3
fi
if [ "$cuda" != 1 ] && [ "$dry" = 0 ]; then
  echo "check.sh: this torch sees no CUDA GPU (CPU-only build or no device): nothing to measure. Run it on a GPU" \
       "node, or with --dry-run to check its plumbing here." >&2
  exit 3
fi

export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if [ -d "$wheels" ] && ls "$wheels"/*.whl >/dev/null 2>&1; then
  site=$(mktemp -d)
  if "$PYTHON" -m pip install -q --no-index --no-deps --target "$site" "$wheels"/*.whl; then
    export PYTHONPATH="$PYTHONPATH:$site"
    names=""
    for wheel in "$wheels"/*.whl; do names+="${wheel##*/} "; done
    echo "check.sh: installed ${names}into $site"
  else  # the parts that need them say so and are skipped; the others still run
    echo "check.sh: the wheels in $wheels did not install (above); going on without them"
  fi
fi
# torch, transformers and torchao in the ranges pyproject.toml allows, before any GPU time is spent (exit 4)
if ! "$PYTHON" benchmarks/gpu/preflight.py; then
  echo "check.sh: the preflight failed (above): nothing was run." >&2
  exit 4
fi
if [ "$dry" = 0 ]; then
  # the entry point and metadata as a user has them; PYTHONPATH above already runs it where pip cannot write
  "$PYTHON" -m pip install -q --no-index --no-deps --no-build-isolation -e . \
    || echo "check.sh: pip install -e . failed (above); running from the repository through PYTHONPATH"
fi
if [ -z "$out" ]; then
  exec "$PYTHON" benchmarks/gpu/check.py --started-at "$started" "${args[@]}"
fi
mkdir -p "$out"
set -o pipefail  # check.py's exit status, its output kept in check.log beside the results
"$PYTHON" benchmarks/gpu/check.py --started-at "$started" --out "$out" "${args[@]}" 2>&1 | tee "$out/check.log"
