#!/usr/bin/env bash
# Run fp8dist's training job, or your own script, under torchrun: on one node, or on several (run it once on
# each node with the same NNODES, MASTER_ADDR and RDZV_ID; launch/slurm/torchrun.sbatch does that under SLURM).
#
#   launch/torchrun.sh [--dry-run] [--strategy fsdp --fp8 torchao ...]   fp8dist train with these flags
#   launch/torchrun.sh [--dry-run] path/to/train.py [ARGS...]            your script
#   launch/torchrun.sh [--dry-run] -m package.module [ARGS...]           your module
#
# Environment (default):
#   NNODES (1)              nodes in the job, or MIN:MAX for an elastic job
#   NPROC_PER_NODE (auto)   processes per node: the node's GPUs (SLURM_GPUS_ON_NODE, CUDA_VISIBLE_DEVICES,
#                           nvidia-smi), else 2 processes on CPU
#   MASTER_ADDR             head node address; needed with several nodes. Unset on one node: --standalone
#   MASTER_PORT (29500)     c10d rendezvous port on the head node
#   RDZV_ID (fp8dist)       rendezvous id, identical on every node of one job (SLURM: the job id)
#   MAX_RESTARTS (0)        times torchrun restarts the group after a process fails
#   TORCHRUN (torchrun)     the torchrun executable (from the environment where fp8dist is installed)
#   DRY_RUN (0)             1, or --dry-run: print the exact command instead of running it
# CPU nodes use gloo and GPU nodes nccl, chosen by fp8dist at start-up: the script is the same for both.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=launch/_common.sh
source "$here/_common.sh"

NNODES=${NNODES:-1}
NPROC_PER_NODE=${NPROC_PER_NODE:-$(default_nproc)}
MASTER_PORT=${MASTER_PORT:-29500}
RDZV_ID=${RDZV_ID:-fp8dist}
MAX_RESTARTS=${MAX_RESTARTS:-0}
TORCHRUN=${TORCHRUN:-torchrun}

[[ "$NNODES" =~ ^[1-9][0-9]*(:[1-9][0-9]*)?$ ]] || die "NNODES='$NNODES' must be a node count (2) or a range (1:4)."
check_count NPROC_PER_NODE "$NPROC_PER_NODE"
check_port MASTER_PORT "$MASTER_PORT"
[[ "$MAX_RESTARTS" =~ ^[0-9]+$ ]] || die "MAX_RESTARTS='$MAX_RESTARTS' must be 0 or a positive integer."
parse_target "$@"

cmd=("$TORCHRUN" --nnodes "$NNODES" --nproc-per-node "$NPROC_PER_NODE" --max-restarts "$MAX_RESTARTS")
if [[ "$NNODES" == 1 && -z "${MASTER_ADDR:-}" ]]; then
  cmd+=(--standalone)  # one node: torchrun picks a free local port
elif [[ -z "${MASTER_ADDR:-}" ]]; then
  die "NNODES=$NNODES but MASTER_ADDR is not set: set it to the head node's address (the same on every node)," \
    "or submit launch/slurm/torchrun.sbatch, which sets it."
else
  cmd+=(--rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "$RDZV_ID")
fi
case "$TARGET_KIND" in
  train) cmd+=(-m fp8dist.cli train "${TARGET_ARGS[@]}") ;;
  module) cmd+=(-m "$TARGET_MODULE" "${TARGET_ARGS[@]}") ;;
  script) cmd+=("$TARGET_SCRIPT" "${TARGET_ARGS[@]}") ;;
esac
[[ "${DRY_RUN:-0}" == 1 ]] || need "$TORCHRUN" \
  "Activate the environment where fp8dist is installed (pip install -e .), or set TORCHRUN=/path/to/torchrun."
run "${cmd[@]}"
