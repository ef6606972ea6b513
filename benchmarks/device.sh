#!/usr/bin/env bash
# One device call: install carried wheels, then run the named steps (default: tests bench).
#   bash benchmarks/device.sh tests rl tprl dtensor ab fwdab shardab tpab tune tunestore tunecls tunepers storeab chunksweep gradab gradbench eventprobe epiprobe optrace mergeprobe launchprobe scaleprobe tunechunk sweep bench benchab bench32 tests32 profile train trainbench ds scaling tp tpquick tpbench tpprofile filterprobe benchfilter filtertrain trainedbench quack1 quack2 benchquack
# (PROFILE_ARGS="--mode fwd --dtype fp32 --n 4096", PROFILE_TAG=_fwd name the profile's log; FLCE_CHUNK_MB=1024 names bench32's)
# (SCALING_N="8192" or "32768": one N per call keeps P = 1, 2, 4, 8 under the 10-minute limit)
# Logs and CSVs go to $OUT; the last lines printed are the tables.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [ -d .whl ]; then  # once per machine (a second device.sh in the same call, e.g. on the other GPU, reuses it)
  if [ ! -f /tmp/site/.flce_ok ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    touch /tmp/site/.flce_ok
  fi
  export PYTHONPATH=/tmp/site:$PWD
fi
ngpu=$(nvidia-smi -L | wc -l)
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,memory.used --format=csv | tee "$OUT/gpu.txt"
{ cat .device_commit 2>/dev/null || git rev-parse --short HEAD; } | tee "$OUT/commit.txt"  # the device copy has no .git: before the call run `git rev-parse --short HEAD > .device_commit` and carry it
flt() { grep -v "DEBUG\|registered at"; }
for w in ${*:-tests bench}; do
  case $w in
    tests) timeout 450 python3 -m pytest -q -m gpu tests/test_gpu.py ${TESTS_K:+-k "$TESTS_K"} 2>&1 | flt | tee "$OUT/gpu_tests.log" | tail -8 ;;
    tunestore) timeout 360 python3 -m flce_dist.tune --only lse_forward_store --out flce_dist/configs/helion/h200.json 2>&1 | flt | tee "$OUT/tune_store.log" | tail -14; cp flce_dist/configs/helion/h200.json "$OUT/" ;;
    tunecls) timeout 360 python3 -m flce_dist.tune --h ${TUNE_H:-2304} --v ${TUNE_V:-262208} --shape-class --only lse_forward,lse_forward_store --out flce_dist/configs/helion/h200.json 2>&1 | flt | tee "$OUT/tune_h${TUNE_H:-2304}.log" | grep -v failed | tail -28; cp flce_dist/configs/helion/h200.json "$OUT/" ;;
    tunepers) for sh in "" "--h 2304 --v 262208 --shape-class --rows 1664"; do  # run 17: flattened persistent logits kernels, llama3 then gemma's class
               timeout 200 python3 -m flce_dist.tune --candidates persistent --only lse_forward,lse_forward_store $sh --out flce_dist/configs/helion/h200.json 2>&1 | flt | tee -a "$OUT/tune_pers.log" | grep -v failed; done | tail -${TUNE_TAIL:-44}; cp flce_dist/configs/helion/h200.json "$OUT/" ;;
    storeab) for cfg in "" benchmarks/results/run17/store_winner; do tag=$([ -n "$cfg" ] && echo run17store || echo shipped)  # run 17's puzzle: a faster store kernel, a slower loss
               FLCE_CONFIG_DIR=$cfg timeout 200 python3 benchmarks/ab_flce.py --tag $tag --shapes ${AB_SHAPES:-llama3,gemma} --data ${AB_DATA:-random,realistic} 2>&1 | flt | grep "^\["
               FLCE_CONFIG_DIR=$cfg timeout 250 python3 benchmarks/kernel_profile.py --shapes llama3 --data ${AB_DATA:-random,realistic} 2>&1 | flt > "$OUT/profile_$tag.log"; tail -14 "$OUT/profile_$tag.log"; done | tee "$OUT/storeab.log" ;;
    chunksweep) for mb in ${CHUNK_MBS:-default 2048 4200}; do  # run 21: chunk budgets (MiB; default: the 1 GiB plan) against the three distinct matmuls and the plan's own cuBLAS work
                  FLCE_CHUNK_MB=${mb#default} timeout 190 python3 benchmarks/ab_flce.py --tag "c$mb" --shapes ${AB_SHAPES:-llama3,qwen3,gemma} \
                    --data ${AB_DATA:-random,realistic} --reps 15 --out "$OUT" 2>&1 | flt | grep "^\["; done | tee "$OUT/chunk_sweep.log" ;;
    gradab) timeout 560 python3 benchmarks/ab_flce.py --tag gf --grad-forms chunk_grad,rowscale --shapes ${AB_SHAPES:-llama3,qwen3,gemma} --data ${AB_DATA:-random,realistic} 2>&1 | flt | grep "^\[" | tee "$OUT/gradab.log" ;;  # rowscale.py vs chunk_grad_, A B A B in one process
    gradbench) timeout 420 python3 benchmarks/bench.py --impls flce,flce_chunkgrad --data random,realistic --reps ${BENCH_REPS:-10} --out "$OUT" 2>&1 | flt | tee "$OUT/gradbench.log" | tail -16 ;;
    eventprobe) for m in fb fwd; do timeout 280 python3 benchmarks/event_probe.py --mode $m --shapes ${PROBE_SHAPES:-llama3,gemma} --data ${PROBE_DATA:-random,realistic} 2>&1 | flt > "$OUT/event_probe_$m.log"  # the loss split by CUDA events, no profiler
                 grep -q "=== event_probe summary" "$OUT/event_probe_$m.log" && sed -n '/=== event_probe summary/,$p' "$OUT/event_probe_$m.log" || tail -20 "$OUT/event_probe_$m.log"; done ;;
    mergeprobe) timeout 150 python3 benchmarks/merge_probe.py --out flce_dist/configs/helion/h200.json 2>&1 | flt | tee "$OUT/merge_probe.log" | tail -14; cp flce_dist/configs/helion/h200.json "$OUT/" ;;  # the partial merge's config (writes the winner)
    epiprobe) timeout ${PROBE_TIMEOUT:-560} python3 benchmarks/epilogue_probe.py --shapes ${PROBE_SHAPES:-llama3,gemma} --data ${PROBE_DATA:-random,realistic} ${PROBE_ARGS:-} 2>&1 | flt > "$OUT/epilogue_probe.log"  # run 20: the store pass's epilogue, part by part
              grep -q "=== epilogue_probe summary" "$OUT/epilogue_probe.log" && sed -n '/=== epilogue_probe summary/,$p' "$OUT/epilogue_probe.log" || tail -20 "$OUT/epilogue_probe.log" ;;
    optrace) timeout 200 python3 benchmarks/op_trace.py --shapes ${PROBE_SHAPES:-llama3,gemma} --data ${PROBE_DATA:-random} 2>&1 | flt > "$OUT/op_trace.log"  # run 21: the small ops and kernels of one call, by name
             grep "===\|CUDA kernels of one call" "$OUT/op_trace.log" ;;
    launchprobe) timeout 120 python3 benchmarks/launch_probe.py 2>&1 | flt | tee "$OUT/launch_probe.log" | tail -2 ;;  # where the profile's "idle" goes
    scaleprobe) timeout 90 python3 benchmarks/scale_probe.py ${SCALE_BLOCKS:+--blocks $SCALE_BLOCKS} 2>&1 | flt | tee "$OUT/scale_probe.log" | tail -4 ;;
    tunechunk) timeout 300 python3 -m flce_dist.tune --only chunk_stats,chunk_grad ${TUNE_ARGS:-} --out flce_dist/configs/helion/h200.json 2>&1 | flt | tee "$OUT/tune_chunk.log" | grep -v failed | tail -${TUNE_TAIL:-40}; cp flce_dist/configs/helion/h200.json "$OUT/" ;;
    tune) timeout 420 python3 -m flce_dist.tune --out flce_dist/configs/helion/h200.json 2>&1 | flt | tee "$OUT/tune.log" | tail -40; cp flce_dist/configs/helion/h200.json "$OUT/" ;;
    sweep) for mb in 256 512 1024; do echo "FLCE_CHUNK_MB=$mb"; FLCE_CHUNK_MB=$mb timeout 120 python3 benchmarks/bench.py --shapes llama3 --impls flce --reps 8 2>&1 | flt | tail -3; done | tee "$OUT/sweep.log" ;;
    bench) timeout 300 python3 benchmarks/bench.py --out "$OUT" 2>&1 | flt | tee "$OUT/bench.log" | tail -30 ;;
    benchab) timeout 300 python3 benchmarks/bench.py --impls flce,flce_cublas,torch --reps 12 --out "$OUT" 2>&1 | flt | tee "$OUT/benchab.log" | tail -14 ;;
    trainbench) OUT="$OUT/train_bench" timeout 590 bash benchmarks/train_bench.sh 2>&1 | flt | tail -12 ;;  # RUNS=, BATCHES= (see the script)
    dtensor) timeout 300 torchrun --nproc_per_node="$ngpu" tests/dtensor_checks.py --backend nccl 2>&1 | flt | grep -v "^W1\|^I1" | tee "$OUT/dtensor_tests.log" | grep "FAIL\|passed\|Error" | tail -12 ;;
    ab) for tree in ${AB_TREES:-.old .}; do  # before/after a refactor: the loss alone vs the matmul, same machine
          tag=$([ "$tree" = . ] && echo new || echo "$tree")
          PYTHONPATH="$tree:${PYTHONPATH:-}" timeout 280 python3 benchmarks/ab_flce.py --tag "$tag" --shapes ${AB_SHAPES:-llama3,qwen3,gemma} --data ${AB_DATA:-random,realistic} --out "$OUT" 2>&1 | flt | grep "^\[" ; done | tee "$OUT/ab.log" ;;
    fwdab) for tree in ${AB_TREES:-.old .}; do  # run 22: the forward against the bare matmul, interleaved rounds (ab_flce.py --fwd-rounds)
          tag=$([ "$tree" = . ] && echo new || echo "$tree")
          PYTHONPATH="$tree:${PYTHONPATH:-}" timeout 200 python3 benchmarks/ab_flce.py --tag "$tag" --fwd-only --fwd-rounds ${FWD_ROUNDS:-5} --reps 10 \
            --shapes ${AB_SHAPES:-llama3,qwen3,gemma} --data ${AB_DATA:-random,realistic} --out "$OUT" 2>&1 | flt | grep "^\[" ; done | tee "$OUT/fwdab.log" ;;
    shardab) timeout ${AB_TIMEOUT:-280} python3 benchmarks/ab_flce.py --tag "tp${SHARD:-2}rank" --shard ${SHARD:-2} --fwd-rounds 3 --reps ${AB_REPS:-10} \
               --shapes ${AB_SHAPES:-llama3,qwen3,gemma} --data ${AB_DATA:-random,realistic} --out "$OUT" 2>&1 | flt | grep "^\[" | tee "$OUT/shardab.log" ;;  # run 22: one TP rank's work on one GPU, no collectives
    tpab) for tree in ${AB_TREES:-.old .}; do  # TP=2 before/after (e.g. the per-call guard): flce vs its floor, same machine
          tag=$([ "$tree" = . ] && echo new || echo "$tree")
          PYTHONPATH="$tree:${PYTHONPATH:-}" timeout 240 torchrun --nproc_per_node="$ngpu" benchmarks/bench_tp.py --impls flce \
            --data random --shapes ${AB_SHAPES:-llama3,gemma} --reps 10 2>&1 | flt | grep -v "^W1\|^I1" | tail -6 | sed "s/^/[$tag] /"; done | tee "$OUT/tpab.log" ;;
    tests32) timeout 200 python3 -m pytest -q -m gpu tests/test_gpu.py -k "dtype0 or memory" 2>&1 | flt | tee "$OUT/gpu_tests32.log" | tail -6 ;;
    bench32) timeout 200 python3 benchmarks/bench.py --dtype fp32 --n 4096 --reps 5 --shapes llama3 --impls flce,torch --out "$OUT" 2>&1 | flt | tee "$OUT/bench32${FLCE_CHUNK_MB:+_$FLCE_CHUNK_MB}.log" | tail -6 ;;
    profile) timeout 280 python3 benchmarks/kernel_profile.py --shapes ${PROFILE_SHAPES:-llama3,gemma} --data ${PROFILE_DATA:-random,realistic} ${PROFILE_ARGS:-} --out "$OUT" 2>&1 | flt | tee "$OUT/profile${PROFILE_TAG:-}.log" | tail -30 ;;
    tpprofile) timeout 400 torchrun --nproc_per_node="$ngpu" benchmarks/kernel_profile.py --shapes ${PROFILE_SHAPES:-llama3,gemma} --data ${PROFILE_DATA:-random,realistic} ${PROFILE_ARGS:-} --out "$OUT" 2>&1 | flt | grep -v "^W1\|^I1" | tee "$OUT/profile_tp.log" | tail -30 ;;
    train) for run in ${TRAIN_RUNS:-2:flce 1:flce 1:torch}; do set -- ${run/:/ }
             NGPU=$1 TORCHRUN=torchrun CONFIG=configs/train/llama_small_gpu.toml timeout 200 bash launch/train.sh --head $2 \
               --overwrite --set parallel.tp=$1 --set job.out_dir=runs/gpu_$2_$1 --set training.steps=${TRAIN_STEPS:-120} --set job.progress=off 2>&1 | flt \
               | tee "$OUT/train_$2_$1.log" | grep "steady state\|done:\|Error" | sed "s/^/[NGPU=$1 head=$2] /"; done ;;
    ds) DS_ACCELERATOR=cuda FLCE_DS_BACKEND=nccl timeout 300 torchrun --nproc_per_node="$ngpu" tests/test_integrations.py ds 1 2 3 2>&1 | flt | tee "$OUT/ds_nccl.log" | grep "ds stage\|FAIL\|Error" | tail -12 ;;
    scaling) for n in ${SCALING_N:-8192}; do for p in 1 2 4 8; do [ "$p" -le "$ngpu" ] || continue
               timeout ${TP_TIMEOUT:-300} torchrun --nproc_per_node=$p benchmarks/bench_tp.py --n $n --impls ${SCALING_IMPLS:-flce,megatron} \
                 --out "$OUT" 2>&1 | flt | grep -v "^W1\|^I1" | tail -9; done; done | tee "$OUT/scaling_runs.log"
             python3 benchmarks/scaling.py "$OUT" --out "$OUT" 2>&1 | tail -30 ;;
    tp) timeout ${TP_TIMEOUT:-300} torchrun --nproc_per_node="$ngpu" tests/dist_checks.py --backend nccl --big $([ "$ngpu" -gt 2 ] && echo --quick) ${TP_ARGS:-} 2>&1 | flt | grep -v "^W1\|^I1" | tee "$OUT/tp_tests.log" | grep "FAIL\|passed\|big\|Error\|rank 0\] case" | tail -20 ;;
    tpquick) timeout 90 torchrun --nproc_per_node="$ngpu" benchmarks/bench_tp.py --shapes llama3 --impls flce,megatron --reps 5 --out "$OUT" 2>&1 | flt | tee "$OUT/bench_tp_quick.log" | tail -6 ;;
    rl) timeout ${RL_TIMEOUT:-480} python3 benchmarks/bench_rl.py --out "$OUT" ${RL_ARGS:-} 2>&1 | flt | tee "$OUT/bench_rl.log" | tail -${RL_TAIL:-40} ;;
    tprl) timeout ${RL_TIMEOUT:-480} torchrun --nproc_per_node="$ngpu" benchmarks/bench_rl.py --out "$OUT" ${RL_ARGS:-} 2>&1 | flt | grep -v "^W1\|^I1" | tee "$OUT/bench_rl_tp.log" | tail -${RL_TAIL:-40} ;;
    filterprobe) timeout 300 python3 benchmarks/filter_probe.py --shapes ${PROBE_SHAPES:-llama3} --write-config flce_dist/configs/helion/h200.json --out "$OUT" 2>&1 | flt | tee "$OUT/filter_probe.log" | tail -${PROBE_TAIL:-30}; cp flce_dist/configs/helion/h200.json "$OUT/" ;;
    benchfilter) timeout 330 python3 benchmarks/bench.py --impls ${BENCH_IMPLS:-flce,flce_filter,cce,cce_exact} --data ${BENCH_DATA:-random,realistic} --reps ${BENCH_REPS:-8} --out "$OUT" 2>&1 | flt | tee "$OUT/bench_filter.log" | tail -${BENCH_TAIL:-30} ;;
    filtertrain) for e in "" auto; do tag=${e:-exact}  # the small model's loss curve, exact vs grad_filter_eps="auto" (1 GPU)
             NGPU=1 TORCHRUN=torchrun CONFIG=configs/train/llama_small_gpu.toml timeout 200 bash launch/train.sh --overwrite --set parallel.tp=1 \
               --set training.steps=${TRAIN_STEPS:-200} --set model.grad_filter_eps=\"$e\" --set job.out_dir=\"runs/gpu_filter_$tag\" --set job.progress=\"off\" \
               --set checkpoint.ckpt_every=0 2>&1 | flt > "$OUT/train_filter_$tag.log"; cp runs/gpu_filter_$tag/losses.json "$OUT/losses_filter_$tag.json"; tail -1 "$OUT/train_filter_$tag.log"; done
             python3 benchmarks/compare_losses.py "$OUT/losses_filter_exact.json" "$OUT/losses_filter_auto.json" 2>&1 | tee "$OUT/filter_curve.txt" | tail -4 ;;
    trainedbench) st=${TRAIN_STEPS:-300}  # issue 15 item 1: a model launch/train.py trained here, its DCP checkpoint -> the trained fixture -> bench
             NGPU=1 TORCHRUN=torchrun CONFIG=configs/train/llama_small_gpu.toml timeout 240 bash launch/train.sh --overwrite --set parallel.tp=1 \
               --set training.steps=$st --set checkpoint.ckpt_every=$st --set job.out_dir=\"runs/gpu_trained\" --set job.progress=\"off\" 2>&1 | flt > "$OUT/train_trained.log"; tail -1 "$OUT/train_trained.log"
             timeout 150 python3 benchmarks/capture_trained.py --checkpoint runs/gpu_trained/checkpoints/step_$(printf %08d $st) \
               --config configs/train/llama_small_gpu.toml --out benchmarks/fixtures/trained.pt 2>&1 | flt | tee "$OUT/capture_trained.log" | tail -2
             timeout ${BENCH_TIMEOUT:-300} python3 benchmarks/bench.py --data trained --fixture benchmarks/fixtures/trained.pt --impls ${BENCH_IMPLS:-flce,flce_filter,cce,cce_exact,liger,torch} \
               --reps ${BENCH_REPS:-8} --out "$OUT" 2>&1 | flt | tee "$OUT/bench_trained.log" | tail -${BENCH_TAIL:-10} ;;
    quack1) mkdir -p /tmp/qk && cp .qk1/* /tmp/qk/ ;;  # QuACK's wheels, first half (benchmarks/quack_wheels.sh)
    quack2) cp .qk2/* /tmp/qk/ && (cd /tmp/qk && cat cu12.whl.part00 cu12.whl.part01 > "$(cut -d' ' -f3 cu12.sha256)" && sha256sum -c cu12.sha256 \
              && rm -f cu12.whl.part* && python3 -m pip install -q --no-deps --no-index --target /tmp/site-packages /tmp/qk/*.whl) 2>&1 | tail -2
            export PYTHONPATH=/tmp/site-packages:/tmp/site-packages/nvidia_cutlass_dsl/dsl_packages:${PYTHONPATH:-$PWD} ;;
    benchquack) timeout ${BENCH_TIMEOUT:-330} python3 benchmarks/bench.py --shapes ${BENCH_SHAPES:-llama3,qwen3,gemma} --impls ${BENCH_IMPLS:-flce,flce_filter,quack,quack_c2048,cce} --data ${BENCH_DATA:-random,realistic} --reps ${BENCH_REPS:-8} --out "$OUT" 2>&1 | flt | tee "$OUT/bench_quack.log" | tail -${BENCH_TAIL:-32} ;;
    tpbench) timeout 400 torchrun --nproc_per_node="$ngpu" benchmarks/bench_tp.py --out "$OUT" 2>&1 | flt | tee "$OUT/bench_tp.log" | tail -30 ;;
  esac
done
