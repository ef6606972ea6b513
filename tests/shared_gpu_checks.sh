#!/usr/bin/env bash
# Issue 31 item 3: the CUDA code paths of tp/dp > 1 on ONE GPU, with gloo ranks that all use cuda:0
# (a testing mode: gloo moves CUDA tensors through the host, so speed means nothing here).
#   bash tests/shared_gpu_checks.sh [probe] [checks] [train] [resume] [compare]   (default: all)
# On the device machine, carrying .whl (helion 1.4.0 + filecheck). Logs under $OUT.
#   probefix: the two ops that crash, with launch/components/shared_gpu.install()
#   probe:   which gloo collectives work on CUDA tensors (tests/gloo_cuda_probe.py)
#   checks:  tests/dist_checks.py and tests/dtensor_checks.py at 2 ranks, --device cuda-shared
#   train:   configs/train/llama_small_gpu.toml (bf16 autocast, fused AdamW, compile, grad filter "auto"),
#            STEPS steps: 1 GPU (NCCL-free reference), (dp=1, tp=2, sp) and (dp=2, tp=1, FSDP2), checkpoints every STEPS/2
#   resume:  (dp=2, tp=1) resumed from the (dp=1, tp=2, sp) checkpoint at STEPS/2, and the other way round
#   compare: per-step losses of each run against the 1-GPU run
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1 OMP_NUM_THREADS=1
if [ -d .whl ] && [ ! -f /tmp/site/.flce_ok ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && touch /tmp/site/.flce_ok
fi
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site:$PWD
STEPS=${STEPS:-12}; half=$((STEPS / 2))
R=${RUNS_DIR:-/tmp/sg_runs}; mkdir -p "$R"
flt() { grep -v "DEBUG\|registered at\|^W1\|^I1"; }
train() {  # train NAME NGPU DEVICE TP SP [extra --set ...]
  local name=$1 n=$2 dev=$3 tp=$4 sp=$5; shift 5
  timeout ${TRAIN_TIMEOUT:-280} torchrun --standalone --nproc_per_node="$n" launch/train.py --config configs/train/llama_small_gpu.toml \
    --set training.steps=$STEPS --set job.log_every=1 --set job.progress='"off"' --set training.batch_size=8 \
    --set model.compile='"inductor"' --set model.grad_filter_eps='"auto"' --set checkpoint.ckpt_every=$half --set checkpoint.keep=4 \
    --set job.device="\"$dev\"" --set parallel.tp=$tp --set parallel.sp=$sp --set job.out_dir="\"$R/$name\"" "$@" \
    > "$OUT/train_$name.log" 2>&1
  echo "train $name: exit $? ($(grep -c "Fatal Python error\|Segmentation" "$OUT/train_$name.log") crash lines); $(grep "done:" "$OUT/train_$name.log" | tail -1 | sed 's/.*done: //')"
}
resume_from() {  # resume_from SRC DST: DST starts from SRC's checkpoint at step STEPS/2
  rm -rf "$R/$2"; mkdir -p "$R/$2/checkpoints"
  cp -r "$R/$1/checkpoints/step_$(printf %08d $half)" "$R/$2/checkpoints/"
}
for w in ${*:-probe checks train resume compare}; do
  case $w in
    probe) timeout 240 python3 tests/gloo_cuda_probe.py 2>"$OUT/probe_err.log" | tee "$OUT/probe.log" ;;
    probefix) SHARED_GPU_FIX=1 timeout 120 python3 tests/gloo_cuda_probe.py fc_all_gather_tensor dtensor_shard_to_replicate \
                2>"$OUT/probefix_err.log" | sed 's/$/  (with shared_gpu.install)/' | tee "$OUT/probefix.log" ;;
    checks) for f in ${CHECKS:-dist_checks dtensor_checks}; do
              timeout 280 torchrun --standalone --nproc_per_node=2 tests/$f.py --backend gloo --device cuda-shared 2>&1 | flt > "$OUT/$f.log"
              echo "$f: exit $?"; grep "FAIL\|passed\|failed\|Error\|Fatal" "$OUT/$f.log" | head -8; done ;;
    train) train ref 1 cuda 1 false
           train tp2sp 2 cuda-shared 2 true
           train dp2 2 cuda-shared 1 false ;;
    resume) resume_from tp2sp dp2_from_tp2; train dp2_from_tp2 2 cuda-shared 1 false --resume
            resume_from dp2 tp2sp_from_dp2; train tp2sp_from_dp2 2 cuda-shared 2 true --resume ;;
    compare) python3 - "$R" <<'PY' | tee "$OUT/compare.log"
import json, sys, pathlib
root = pathlib.Path(sys.argv[1])
def losses(name):
    p = root / name / "losses.json"
    return json.loads(p.read_text())["losses"] if p.is_file() else None
ref = losses("ref")
print("run               steps  max|dloss| vs 1 GPU   first/last loss")
for name in ("ref", "tp2sp", "dp2", "dp2_from_tp2", "tp2sp_from_dp2"):
    l = losses(name)
    if l is None or ref is None:
        print(f"{name:17s} missing"); continue
    n = min(len(l), len(ref))
    d = max((abs(a - b) for a, b in zip(l[:n], ref[:n]) if a is not None and b is not None), default=float("nan"))
    print(f"{name:17s} {len(l):5d}  {d:.2e}               {l[0]:.4f} / {l[-1]:.4f}")
PY
    ;;
  esac
done
