#!/usr/bin/env bash
# Run fp8dist's training job (strategy deepspeed), or your own DeepSpeed script, with the `deepspeed` launcher.
#
#   launch/deepspeed.sh [--dry-run] [--zero-stage 3 --fp8 torchao ...]   fp8dist train --strategy deepspeed
#   launch/deepspeed.sh [--dry-run] path/to/train.py [ARGS...]           your script (it gets --local_rank=N,
#                                                                        as under the deepspeed launcher)
#   launch/deepspeed.sh [--dry-run] -m package.module [ARGS...]          your module
#
# Hosts: NODELIST="node1,node2" (commas or spaces) writes a hostfile with one "host slots=NPROC_PER_NODE" line
# per node; HOSTFILE=path uses yours (or is where the NODELIST one is written); neither: this node alone.
# With several hosts every node runs its own launcher (--no_ssh, node rank NODE_RANK): start this script once
# per node, as launch/slurm/deepspeed.sbatch does with srun. SSH=1 instead lets DeepSpeed's pdsh runner start
# all nodes from this one (needs passwordless ssh).
#
# Environment (default):
#   NPROC_PER_NODE (auto)   processes per node: the node's GPUs (SLURM_GPUS_ON_NODE, CUDA_VISIBLE_DEVICES,
#                           nvidia-smi), else 2 processes on CPU
#   NODE_RANK (SLURM_NODEID, else 0)   this node's index in the host list
#   MASTER_ADDR             head node address (several hosts: the first host's name; alone: 127.0.0.1)
#   MASTER_PORT (29500)     rendezvous port on the head node
#   DEEPSPEED (deepspeed)   the deepspeed launcher executable
#   DRY_RUN (0)             1, or --dry-run: print the exact commands (hostfile included) instead of running them
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=launch/_common.sh
source "$here/_common.sh"

NPROC_PER_NODE=${NPROC_PER_NODE:-$(default_nproc)}
NODE_RANK=${NODE_RANK:-${SLURM_NODEID:-0}}
MASTER_PORT=${MASTER_PORT:-29500}
DEEPSPEED=${DEEPSPEED:-deepspeed}
SSH=${SSH:-0}
check_count NPROC_PER_NODE "$NPROC_PER_NODE"
check_port MASTER_PORT "$MASTER_PORT"
[[ "$NODE_RANK" =~ ^[0-9]+$ ]] || die "NODE_RANK='$NODE_RANK' must be 0 or a positive integer."
[[ "$SSH" == 0 || "$SSH" == 1 ]] || die "SSH='$SSH' must be 0 (one launcher per node) or 1 (pdsh from this node)."
parse_target "$@"

hostfile_lines() {
  local host
  for host in "${hosts[@]}"; do
    printf '%s slots=%s\n' "$host" "$NPROC_PER_NODE"
  done
}

hosts=()
if [[ -n "${NODELIST:-}" ]]; then
  [[ "$NODELIST" != *[* ]] || die "NODELIST='$NODELIST' is a compressed SLURM list: expand it first with" \
    "\$(scontrol show hostnames \"\$SLURM_JOB_NODELIST\")."
  read -ra hosts <<<"${NODELIST//,/ }"
  [[ ${#hosts[@]} -gt 0 ]] || die "NODELIST is set but names no host."
elif [[ -n "${HOSTFILE:-}" ]]; then
  [[ -f "$HOSTFILE" ]] || die "HOSTFILE='$HOSTFILE' not found (lines 'host slots=N'), or set NODELIST instead."
  while read -r host _; do
    [[ -z "$host" || "$host" == \#* ]] || hosts+=("$host")
  done <"$HOSTFILE"
  [[ ${#hosts[@]} -gt 0 ]] || die "HOSTFILE='$HOSTFILE' lists no host (lines 'host slots=N')."
fi

cmd=("$DEEPSPEED")
if [[ ${#hosts[@]} -eq 0 ]]; then  # this node alone
  cmd+=(--num_accelerators "$NPROC_PER_NODE" --master_addr "${MASTER_ADDR:-127.0.0.1}")
else
  [[ "$NODE_RANK" -lt ${#hosts[@]} || "$SSH" == 1 ]] \
    || die "NODE_RANK=$NODE_RANK but the host list has ${#hosts[@]} hosts (${hosts[*]})."
  if [[ -n "${NODELIST:-}" ]]; then  # write the hostfile: one line per node
    if [[ "${DRY_RUN:-0}" == 1 ]]; then
      hostfile=${HOSTFILE:-${TMPDIR:-/tmp}/fp8dist-hostfile}
      printf "cat > %q <<'EOF'\n%sEOF\n" "$hostfile" "$(hostfile_lines)"$'\n'
    else
      hostfile=${HOSTFILE:-$(mktemp "${TMPDIR:-/tmp}/fp8dist-hostfile.XXXXXX")}
      [[ -n "${HOSTFILE:-}" ]] || trap 'rm -f "$hostfile"' EXIT
      tmp=$(mktemp "$(dirname "$hostfile")/.fp8dist-hostfile.XXXXXX")
      hostfile_lines >"$tmp"
      mv -f "$tmp" "$hostfile"  # atomic: a reader never sees half a hostfile
    fi
  else
    hostfile=$HOSTFILE
  fi
  cmd+=(--hostfile "$hostfile" --master_addr "${MASTER_ADDR:-${hosts[0]}}")
  [[ "$SSH" == 1 ]] || cmd+=(--no_ssh --node_rank "$NODE_RANK")
fi
cmd+=(--master_port "$MASTER_PORT")
case "$TARGET_KIND" in
  train) cmd+=(--no_local_rank --module fp8dist.cli train --strategy deepspeed "${TARGET_ARGS[@]}") ;;
  module) cmd+=(--module "$TARGET_MODULE" "${TARGET_ARGS[@]}") ;;
  script) cmd+=("$TARGET_SCRIPT" "${TARGET_ARGS[@]}") ;;
esac
hint="Install DeepSpeed where fp8dist is installed (pip install deepspeed), activate that environment,"
[[ "${DRY_RUN:-0}" == 1 ]] || need "$DEEPSPEED" "$hint or set DEEPSPEED=/path/to/deepspeed."
run "${cmd[@]}"
