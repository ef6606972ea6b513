#!/usr/bin/env bash
# Launch launch/train.py under torchrun, torchtitan-style.
#
#   bash launch/train.sh                                        # 2 ranks, configs/train/tiny_cpu.toml
#   NGPU=4 CONFIG=configs/train/llama_small_gpu.toml bash launch/train.sh --set training.steps=500
#   FAIL_AT_STEP=30 MAX_RESTARTS=1 bash launch/train.sh --set job.out_dir=runs/restart --overwrite
#                                  # rank 1 SIGKILLs itself after step 30; torchrun restarts both, they resume from step 25
#
# Environment: NGPU (ranks on this node, default 2 = dp x tp of the config's [parallel] section, dp = -1
# taking the rest; on CPU-only machines the ranks are gloo processes), CONFIG (TOML, default configs/train/tiny_cpu.toml), MAX_RESTARTS
# (torchrun --max-restarts, default 0), LOG_RANK (ranks whose output is shown, default all; e.g. 0).
# TORCHRUN (default: .venv/bin/torchrun if present, else torchrun). Every other argument is passed to launch/train.py (--set key=value, --head, --resume, ...).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
NGPU=${NGPU:-2}
CONFIG=${CONFIG:-"$here/../configs/train/tiny_cpu.toml"}
MAX_RESTARTS=${MAX_RESTARTS:-0}
filter=()
if [ -n "${LOG_RANK:-}" ]; then
  filter=(--local-ranks-filter "$LOG_RANK")
fi

# torchrun of the project's .venv when there is one (README set-up), else the one on PATH
if [ -z "${TORCHRUN:-}" ]; then
  if [ -x "$here/../.venv/bin/torchrun" ]; then TORCHRUN="$here/../.venv/bin/torchrun"; else TORCHRUN=torchrun; fi
fi

export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export PYTORCH_ALLOC_CONF=${PYTORCH_ALLOC_CONF:-expandable_segments:True}
exec "$TORCHRUN" --standalone --nproc_per_node="$NGPU" --max-restarts="$MAX_RESTARTS" \
  "${filter[@]}" "$here/train.py" --config "$CONFIG" "$@"
