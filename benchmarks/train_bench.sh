#!/usr/bin/env bash
# The training job's throughput and memory on GPUs (issue 13): a ~1.2B Llama (V=128256, seq 2048,
# bf16; configs/train/llama_1b_gpu.toml) for STEPS steps per layout and head, tokens/s (steady
# state: after the first log_every steps) and peak memory per GPU (torch.cuda.max_memory_allocated,
# max over ranks), from each run's losses.json.
#
#   bash benchmarks/train_bench.sh                         # RUNS below, on 2 GPUs
#   RUNS="1x1:flce 1x1:torch" bash benchmarks/train_bench.sh
#   BATCHES="8 16 24 32" RUNS="1x2:flce 1x2:torch" bash benchmarks/train_bench.sh   # micro-batch sweep (stops at OOM per run)
#
# A run is DPxTP:HEAD (world = DP*TP GPUs, sp on when TP > 1). Environment: CONFIG, STEPS (30),
# BATCHES (global batch sizes, default the config's 8), OUT (logs + results.tsv; default
# benchmarks/results/train_<date>), RUN_TIMEOUT (seconds per run, 420), TORCHRUN, EXTRA (more
# --set items), REPEATS (runs of each layout/head/batch, default 1: the table gets one row per repeat,
# tagged _r<k>, so a noisy small-batch comparison can be read as a spread). Each run gets its own
# out_dir and --overwrite.
set -uo pipefail
cd "$(dirname "$0")/.."
CONFIG=${CONFIG:-configs/train/llama_1b_gpu.toml}
STEPS=${STEPS:-30}
RUNS=${RUNS:-"1x1:flce 1x1:torch 1x2:flce 1x2:torch 2x1:flce 2x1:torch"}
BATCHES=${BATCHES:-8}
OUT=${OUT:-benchmarks/results/train_$(date +%Y%m%d_%H%M%S)}
RUN_TIMEOUT=${RUN_TIMEOUT:-420}
TORCHRUN=${TORCHRUN:-torchrun}
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-8} NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
export PYTORCH_ALLOC_CONF=${PYTORCH_ALLOC_CONF:-expandable_segments:True}
mkdir -p "$OUT"
printf "dp\ttp\thead\tbatch\ttokens_per_step\ttok_s_steady\tpeak_gib_per_gpu\tfinal_loss\n" > "$OUT/results.tsv"
for run in $RUNS; do
  layout=${run%%:*}; head=${run##*:}; dp=${layout%%x*}; tp=${layout##*x}; n=$((dp * tp))
  sp=$([ "$tp" -gt 1 ] && echo true || echo false)
  for b in $BATCHES; do
   for rep in $(seq "${REPEATS:-1}"); do
    tag="dp${dp}_tp${tp}_${head}_b${b}$([ "${REPEATS:-1}" -gt 1 ] && echo "_r$rep")"
    timeout "$RUN_TIMEOUT" "$TORCHRUN" --standalone --nproc_per_node="$n" launch/train.py --config "$CONFIG" --head "$head" \
      --overwrite --set parallel.dp="$dp" --set parallel.tp="$tp" --set parallel.sp="$sp" --set training.steps="$STEPS" \
      --set training.batch_size="$b" --set job.out_dir="\"runs/bench/$tag\"" ${EXTRA:-} > "$OUT/$tag.log" 2>&1
    rc=$?
    if [ $rc -ne 0 ]; then
      why=$(grep -o "OutOfMemoryError\|CUDA out of memory" "$OUT/$tag.log" | head -1)
      printf "%s\t%s\t%s\t%s\tFAILED rc=%s %s\n" "$dp" "$tp" "$head" "$b" "$rc" "$why" | tee -a "$OUT/results.tsv"
      break 2  # larger batches of this run would not fit either
    fi
    python3 - "runs/bench/$tag/losses.json" "$dp" "$tp" "$head" "$b" >> "$OUT/results.tsv" <<'PY'
import json, sys
r = json.load(open(sys.argv[1])); seq = r["config"]["data"]["seq_len"]
print("\t".join([*sys.argv[2:6], str(int(sys.argv[5]) * seq), f"{r['tokens_per_s_steady']:.0f}", f"{r['peak_gib_per_rank']:.2f}", f"{r['losses'][-1]:.4f}"]))
PY
    tail -1 "$OUT/results.tsv"
   done
  done
done
echo "== $OUT/results.tsv"
{ column -t -s $'\t' "$OUT/results.tsv" 2>/dev/null || cat "$OUT/results.tsv"; }  # no column(1) on the GPU image
