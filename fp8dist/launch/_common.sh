# shellcheck shell=bash
# Helpers shared by the fp8dist launch scripts. Sourced, never run on its own.

die() {  # die MESSAGE: one clear line on stderr, exit status 2
  printf '%s: error: %s\n' "${0##*/}" "$*" >&2
  exit 2
}

need() {  # need TOOL HINT: stop with a clear message when TOOL is not on PATH
  command -v "$1" >/dev/null 2>&1 || die "'$1' is not on PATH. $2"
}

show() {  # show WORD...: print a command, each word shell-quoted, exactly as it runs
  local line
  printf -v line '%q ' "$@"
  printf '%s\n' "${line% }"
}

run() {  # run WORD...: run a command, or only print it when DRY_RUN=1
  if [[ "${DRY_RUN:-0}" == 1 ]]; then
    show "$@"
  else
    "$@"
  fi
}

check_count() {  # check_count NAME VALUE: a positive integer, or stop naming the variable
  [[ "$2" =~ ^[1-9][0-9]*$ ]] || die "$1='$2' must be a positive integer."
}

check_port() {  # check_port NAME VALUE: a TCP port, 1 to 65535, or stop naming the variable and the way out
  if [[ ! "$2" =~ ^[1-9][0-9]{0,4}$ ]] || (($2 > 65535)); then
    die "$1='$2' must be an integer from 1 to 65535: set it to a free port on the head node, the same on every node."
  fi
}

check_dry_run() {
  [[ "${DRY_RUN:-0}" == 0 || "${DRY_RUN}" == 1 ]] || die "DRY_RUN='${DRY_RUN}' must be 0 or 1."
}

default_nproc() {  # processes per node: this node's GPUs (SLURM, CUDA_VISIBLE_DEVICES, nvidia-smi), else 2 on CPU
  local n ids
  if [[ "${SLURM_GPUS_ON_NODE:-0}" =~ ^[1-9][0-9]*$ ]]; then
    echo "$SLURM_GPUS_ON_NODE"
    return
  fi
  if [[ -n "${CUDA_VISIBLE_DEVICES:-}" ]]; then
    IFS=, read -ra ids <<<"$CUDA_VISIBLE_DEVICES"
    echo "${#ids[@]}"
    return
  fi
  if command -v nvidia-smi >/dev/null 2>&1; then
    n=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
    if [[ "$n" =~ ^[1-9][0-9]*$ ]]; then
      echo "$n"
      return
    fi
  fi
  echo 2
}

# What to run, from the script's arguments. Sets TARGET_KIND (train | script | module) and TARGET_ARGS.
#   --dry-run first                             DRY_RUN=1, then as below
#   (nothing) / --flag ... / train --flag ...   fp8dist's training job with those flags
#   path/to/script.py ARGS...                   a user script
#   -m package.module ARGS...                   a user module
# shellcheck disable=SC2034  # the TARGET_* variables are read by the script that sources this file
parse_target() {
  TARGET_ARGS=()
  if [[ "${1:-}" == --dry-run ]]; then
    DRY_RUN=1
    shift
  fi
  check_dry_run
  if [[ $# -eq 0 || "$1" == train || ( "$1" == -* && "$1" != -m ) ]]; then
    TARGET_KIND=train
    [[ "${1:-}" == train ]] && shift
    TARGET_ARGS=("$@")
  elif [[ "$1" == -m ]]; then
    [[ $# -ge 2 && -n "$2" ]] || die "-m needs a module name, e.g. -m mypackage.train"
    TARGET_KIND=module
    TARGET_MODULE=$2
    TARGET_ARGS=("${@:3}")
  else
    [[ -f "$1" ]] || die "script '$1' not found. Give a training script (path/to/train.py), -m MODULE, or" \
      "fp8dist train's flags (e.g. --strategy fsdp --fp8 torchao)."
    TARGET_KIND=script
    TARGET_SCRIPT=$1
    TARGET_ARGS=("${@:2}")
  fi
}

# The head node's address for a SLURM job: the NodeAddr slurmctld knows for the first node of the allocation
# (an IP or a resolvable name on a real cluster; node names need not resolve through DNS), else its name.
slurm_head_addr() {
  local head addr
  head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
  [[ -n "$head" ]] || die "could not expand SLURM_JOB_NODELIST='$SLURM_JOB_NODELIST' with scontrol."
  addr=$(scontrol show node "$head" 2>/dev/null | tr ' ' '\n' | sed -n 's/^NodeAddr=//p' | head -n 1)
  printf '%s\n' "${addr:-$head}"
}
