#!/usr/bin/env bash
# One GPU call: install the carried wheels (.whl), then run the named steps in order (default: tests bench).
#
#   bash benchmarks/device.sh STEP [STEP ...]     e.g. `bash benchmarks/device.sh tests ab`
#   bash benchmarks/device.sh --list              every step and what it measures
#
# Logs and CSVs go to $OUT (default /tmp/out), with gpu.txt (the GPU's clocks) and commit.txt; the last lines
# a step prints are its table. Each step is one function `step_<name>` below, the comment line above it is
# its --list entry, and the environment variables it reads (with their defaults) are in its body.
# Before the call: `git rev-parse --short HEAD > .device_commit` and carry `.whl` and `.device_commit` (the
# device copy has no .git). The 10-minute limit per call is why the timeouts are what they are.
set -uo pipefail

CFG=flce_dist/configs/helion/h200.json  # the config the tuning steps write (copied to $OUT after each)
SMALL=configs/train/llama_small_gpu.toml  # the training steps' model (6 layers, H=1024, V=32768 padded)

flt() { grep -v "DEBUG\|registered at"; }          # drop Helion's debug lines and torch's registration notes
tflt() { flt | grep -v "^W1\|^I1"; }               # ... and torchrun's per-rank W/I log lines
keep_config() { cp "$CFG" "$OUT/"; }               # the tuned config comes back with the call
tree_tag() { [ "$1" = . ] && echo new || basename "$1" | sed "s/^\.//"; }  # ab/fwdab/tpab: "." is this tree, "new"; ".old" "old"
# "=== <name> summary" onwards from a probe's log, or its last 20 lines if it stopped before printing it
summary() { grep -q "=== $2 summary" "$1" && sed -n "/=== $2 summary/,\$p" "$1" || tail -20 "$1"; }
# "N:shape,shape" as a file name the device tool brings back (no ':' or ','; run 35 lost two logs to a comma)
run_tag() { echo "$1" | tr ':,' '__'; }
# the launcher on the small model: small_train NGPU SECONDS train.sh-args...
small_train() { NGPU=$1 TORCHRUN=torchrun CONFIG=$SMALL timeout "$2" bash launch/train.sh "${@:3}"; }

# ---------------------------------------------------------------- tests
# no work: only the wheel install (for a command after it in the same call)
step_none() { :; }

# GPU test suite, tests/test_gpu.py -m gpu (TESTS_K: a -k filter; TESTS_N: pytest-xdist workers on the one GPU,
# carried as a wheel in .whl: the Helion/Triton compiles are host work on 16 cores; TESTS_TIMEOUT=450)
step_tests() {
  timeout ${TESTS_TIMEOUT:-450} python3 -m pytest -q -m gpu tests/test_gpu.py ${TESTS_K:+-k "$TESTS_K"} \
    ${TESTS_N:+-n "$TESTS_N"} 2>&1 | flt \
    | tee "$OUT/gpu_tests.log" | tail -8
  # with several workers the GPU's memory is shared: a test that failed there runs again alone (run 32: 8
  # workers, one chunk_stats case out of memory; alone it passed); both results stay in the log
  if [ -n "${TESTS_N:-}" ] && grep -q "^FAILED" "$OUT/gpu_tests.log"; then
    echo "--- the failed tests again, one process:" | tee -a "$OUT/gpu_tests.log"
    timeout ${TESTS_TIMEOUT:-450} python3 -m pytest -q -m gpu tests/test_gpu.py --lf 2>&1 | flt \
      | tee -a "$OUT/gpu_tests.log" | tail -4
  fi
}

# GPU tests of the float32 dtype and the memory bars only
step_tests32() {
  timeout 200 python3 -m pytest -q -m gpu tests/test_gpu.py -k "dtype0 or memory" 2>&1 | flt \
    | tee "$OUT/gpu_tests32.log" | tail -6
}

# DTensor checks on every GPU over NCCL (tests/dtensor_checks.py)
step_dtensor() {
  timeout 300 torchrun --nproc_per_node="$ngpu" tests/dtensor_checks.py --backend nccl 2>&1 | tflt \
    | tee "$OUT/dtensor_tests.log" | grep "FAIL\|passed\|Error" | tail -12
}

# TP checks on every GPU over NCCL, big shapes (tests/dist_checks.py; TP_TIMEOUT=300, TP_ARGS)
step_tp() {
  timeout ${TP_TIMEOUT:-300} torchrun --nproc_per_node="$ngpu" tests/dist_checks.py --backend nccl --big \
    $([ "$ngpu" -gt 2 ] && echo --quick) ${TP_ARGS:-} 2>&1 | tflt | tee "$OUT/tp_tests.log" \
    | grep "FAIL\|passed\|big\|Error\|rank 0\] case" | tail -20
}

# DeepSpeed ZeRO stages 1-3 with the flce head over NCCL (tests/test_integrations.py ds)
step_ds() {
  DS_ACCELERATOR=cuda FLCE_DS_BACKEND=nccl timeout 300 torchrun --nproc_per_node="$ngpu" tests/test_integrations.py \
    ds 1 2 3 2>&1 | flt | tee "$OUT/ds_nccl.log" | grep "ds stage\|FAIL\|Error" | tail -12
}

# ---------------------------------------------------------------- the benchmarks (TP=1)
# bench.py: every peer, all shapes, random + realistic data, time and memory against the matmul floors
step_bench() {
  timeout 300 python3 benchmarks/bench.py --out "$OUT" 2>&1 | flt | tee "$OUT/bench.log" | tail -30
}

# bench.py: flce with Helion vs cuBLAS logits, and torch (12 reps)
step_benchab() {
  timeout 300 python3 benchmarks/bench.py --impls flce,flce_cublas,torch --reps 12 --out "$OUT" 2>&1 | flt \
    | tee "$OUT/benchab.log" | tail -14
}

# bench.py in float32: llama3, N=4096, flce vs torch (FLCE_CHUNK_MB names the log)
step_bench32() {
  timeout 200 python3 benchmarks/bench.py --dtype fp32 --n 4096 --reps 5 --shapes llama3 --impls flce,torch \
    --out "$OUT" 2>&1 | flt | tee "$OUT/bench32${FLCE_CHUNK_MB:+_$FLCE_CHUNK_MB}.log" | tail -6
}

# bench.py: exact vs the gradient filter vs CCE (BENCH_IMPLS, BENCH_DATA, BENCH_REPS=8, BENCH_TAIL=30)
step_benchfilter() {
  timeout 330 python3 benchmarks/bench.py --impls ${BENCH_IMPLS:-flce,flce_filter,cce,cce_exact} \
    --data ${BENCH_DATA:-random,realistic} --reps ${BENCH_REPS:-8} --out "$OUT" 2>&1 | flt \
    | tee "$OUT/bench_filter.log" | tail -${BENCH_TAIL:-30}
}

# bench.py: the gradient filter with a sorted copy of W vs gathered through the order (filter_order), and exact
# (BENCH_SHAPES=llama3,qwen3,gemma, BENCH_DATA=random,realistic, BENCH_REPS=8, GATHER_TIMEOUT=420)
step_gatherab() {
  timeout ${GATHER_TIMEOUT:-420} python3 benchmarks/bench.py --shapes ${BENCH_SHAPES:-llama3,qwen3,gemma} \
    --impls flce,flce_filter_copy,flce_filter_gather --data ${BENCH_DATA:-random,realistic} --reps ${BENCH_REPS:-8} \
    --out "$OUT" 2>&1 | flt | tee "$OUT/gatherab.log" | tail -${BENCH_TAIL:-24}
}

# issue 30's table: bench.py at its shapes, one process per token count, every peer (ISSUE_IMPLS, BENCH_REPS=5,
# ISSUE_RUNS="N:shapes ..."; the RL token counts at qwen3, the literal H x V shapes of the issue's table;
# ISSUE_ROUNDS=K: each case's impls again in K interleaved rounds, flce's lead over each peer per round)
step_benchissue() {
  for run in ${ISSUE_RUNS:-4096:4096x32000 1024:qwen3 2048:qwen3 32768:4096x32000 32768:qwen3}; do
    timeout ${ISSUE_TIMEOUT:-200} python3 benchmarks/bench.py --n "${run%%:*}" --shapes "${run#*:}" \
      --impls ${ISSUE_IMPLS:-flce,flce_filter,liger,liger_c16,cce,cce_exact,torch,torch_lce} --data ${BENCH_DATA:-random,realistic} \
      --reps ${BENCH_REPS:-5} --rounds ${ISSUE_ROUNDS:-0} --out "$OUT" 2>&1 | flt \
      | tee "$OUT/benchissue_${run%%:*}_${run#*:}.log" | tail -${BENCH_TAIL:-22}
  done
}

# bench.py with QuACK (after quack1, quack2; BENCH_SHAPES, BENCH_IMPLS, BENCH_DATA, BENCH_REPS, BENCH_TIMEOUT)
step_benchquack() {
  timeout ${BENCH_TIMEOUT:-330} python3 benchmarks/bench.py --shapes ${BENCH_SHAPES:-llama3,qwen3,gemma} \
    --impls ${BENCH_IMPLS:-flce,flce_filter,quack,quack_c2048,cce} --data ${BENCH_DATA:-random,realistic} \
    --reps ${BENCH_REPS:-8} --out "$OUT" 2>&1 | flt | tee "$OUT/bench_quack.log" | tail -${BENCH_TAIL:-32}
}

# bench.py: the row-scale gradient form vs the chunk_grad_ form, both data modes (BENCH_REPS=10)
step_gradbench() {
  timeout 420 python3 benchmarks/bench.py --impls flce,flce_chunkgrad --data random,realistic \
    --reps ${BENCH_REPS:-10} --out "$OUT" 2>&1 | flt | tee "$OUT/gradbench.log" | tail -16
}

# bench.py at llama3 with 256, 512 and 1024 MiB chunk budgets (FLCE_CHUNK_MB)
step_sweep() {
  for mb in 256 512 1024; do
    echo "FLCE_CHUNK_MB=$mb"
    FLCE_CHUNK_MB=$mb timeout 120 python3 benchmarks/bench.py --shapes llama3 --impls flce --reps 8 2>&1 | flt | tail -3
  done | tee "$OUT/sweep.log"
}

# bench_rl.py: per-token log-probs + entropy with gradients, TP=1 (RL_ARGS, RL_TIMEOUT=480, RL_TAIL=40;
# RL_RUNS="N:shapes ...": one process per run, each with --n N --shapes shapes and RL_ARGS, its own log)
step_rl() {
  if [ -z "${RL_RUNS:-}" ]; then
    timeout ${RL_TIMEOUT:-480} python3 benchmarks/bench_rl.py --out "$OUT" ${RL_ARGS:-} 2>&1 | flt \
      | tee "$OUT/bench_rl.log" | tail -${RL_TAIL:-40}
    return
  fi
  for run in $RL_RUNS; do
    timeout ${RL_TIMEOUT:-480} python3 benchmarks/bench_rl.py --out "$OUT" --n "${run%%:*}" --shapes "${run#*:}" \
      ${RL_ARGS:-} 2>&1 | flt | tee "$OUT/bench_rl_${run%%:*}_${run#*:}.log" | tail -${RL_TAIL:-40}
  done
}

# bench_trl.py: TRL 1.16 GRPO plain vs flce_dist.integrations.trl.patch(): the fused head, a 1B Llama's loss pass, GRPOTrainer steps (TRL_ARGS, TRL_TIMEOUT=400)
step_trl() {
  timeout ${TRL_TIMEOUT:-400} python3 benchmarks/bench_trl.py --out "$OUT" ${TRL_ARGS:-} 2>&1 | flt \
    | tee "$OUT/bench_trl.log" | sed -n '/=== TRL summary/,$p'
}

# bench_torchtitan.py: does torchtitan import on this torch; its ChunkedLossWrapper vs flce_dist's torchtitan loss (TITAN_ARGS)
step_titan() {
  timeout 240 python3 benchmarks/bench_torchtitan.py --out "$OUT" ${TITAN_ARGS:-} 2>&1 | flt \
    | tee "$OUT/bench_torchtitan.log" | tail -8
}

# bench_megatron.py: a ~1B Megatron-Core GPTModel (local spec, bf16, seq 4096, V=128256, TP=1) trained by Megatron's
# own pieces, its native fused CE vs flce_dist's install(): step time, peak memory, loss curves (carry megatron-core's
# cp312 wheel in .whl: docs/integrations/megatron.md; MEGATRON_STEPS=300, MEGATRON_ARGS, MEGATRON_TIMEOUT=560)
step_megatron() {
  python3 -c "import megatron.core" 2>&1 | tail -1 | sed 's/^/megatron-core import: /'
  timeout ${MEGATRON_TIMEOUT:-560} python3 benchmarks/bench_megatron.py --steps ${MEGATRON_STEPS:-300} --out "$OUT" \
    ${MEGATRON_ARGS:-} 2>&1 | flt | tee "$OUT/bench_megatron.log" | sed -n '/=== bench_megatron summary/,$p'
}

# ---------------------------------------------------------------- the benchmarks (TP on every GPU)
# bench_tp.py: flce vs Megatron-style, Liger vocab-parallel, DeepSpeed, against the TP floor
step_tpbench() {
  timeout 400 torchrun --nproc_per_node="$ngpu" benchmarks/bench_tp.py --out "$OUT" 2>&1 | flt \
    | tee "$OUT/bench_tp.log" | tail -30
}

# bench_tp.py, quick: llama3, flce vs Megatron-style, 5 reps
step_tpquick() {
  timeout 90 torchrun --nproc_per_node="$ngpu" benchmarks/bench_tp.py --shapes llama3 --impls flce,megatron \
    --reps 5 --out "$OUT" 2>&1 | flt | tee "$OUT/bench_tp_quick.log" | tail -6
}

# bench_rl.py under torchrun (RL_ARGS, RL_TIMEOUT=480, RL_TAIL=40)
step_tprl() {
  timeout ${RL_TIMEOUT:-480} torchrun --nproc_per_node="$ngpu" benchmarks/bench_rl.py --out "$OUT" ${RL_ARGS:-} \
    2>&1 | tflt | tee "$OUT/bench_rl_tp.log" | tail -${RL_TAIL:-40}
}

# TP scaling efficiency: bench_tp.py at P = 1, 2, 4, 8 (up to the GPUs), then scaling.py (SCALING_N="8192",
# one N per call keeps it under the limit; SCALING_IMPLS=flce,megatron; TP_TIMEOUT=300)
step_scaling() {
  for n in ${SCALING_N:-8192}; do
    for p in 1 2 4 8; do
      [ "$p" -le "$ngpu" ] || continue
      timeout ${TP_TIMEOUT:-300} torchrun --nproc_per_node=$p benchmarks/bench_tp.py --n $n \
        --impls ${SCALING_IMPLS:-flce,megatron} --out "$OUT" 2>&1 | tflt | tail -9
    done
  done | tee "$OUT/scaling_runs.log"
  python3 benchmarks/scaling.py "$OUT" --out "$OUT" 2>&1 | tail -30
}

# ---------------------------------------------------------------- helion series (issue 50)
# helion 1.5.1 for the steps after it (carry .whl15 with helion-1.5.1's wheel; .whl keeps 1.4.0): installed
# into /tmp/site15, put ahead of /tmp/site on PYTHONPATH (flce_dist supplies torch 2.11's missing name itself)
step_h15() {
  [ -f /tmp/site15/.flce_ok ] || { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --target /tmp/site15 .whl15/*.whl && touch /tmp/site15/.flce_ok; } || return 1
  export PYTHONPATH=/tmp/site15:${PYTHONPATH:-$PWD}
  python3 -c "import flce_dist.kernels.launch as L, helion; print('helion', helion.__version__, [f.name for f in L.config_files('h200')])"
}

# back to helion 1.4.0 (.whl) for the steps after it
step_h14() {
  export PYTHONPATH=${PYTHONPATH#/tmp/site15:}
  python3 -c "import helion; print('helion', helion.__version__)"
}

# ab_flce.py under helion 1.4.0 and 1.5.1, one process each, alternating (HAB_SHAPES=llama3,qwen3,gemma,
# HAB_DATA=random,realistic, HAB_ORDER="14 15", HAB_REPS=10)
step_helionab() {
  [ -f /tmp/site15/.flce_ok ] || step_h15 > /dev/null
  local base=${PYTHONPATH#/tmp/site15:}
  for v in ${HAB_ORDER:-14 15}; do
    local pp=$base; [ "$v" = 15 ] && pp=/tmp/site15:$base
    PYTHONPATH=$pp timeout ${HAB_TIMEOUT:-280} python3 benchmarks/ab_flce.py --tag "helion$v" --reps ${HAB_REPS:-10} \
      --shapes ${HAB_SHAPES:-llama3,qwen3,gemma} --data ${HAB_DATA:-random,realistic} --out "$OUT" 2>&1 | flt \
      | grep "^\["
  done | tee -a "$OUT/helionab.log"
}

# ---------------------------------------------------------------- A/B: the loss alone vs its matmuls
# ab_flce.py per tree: the loss alone vs the matmul floors, before/after a refactor (AB_TREES=".old .";
# ".old . .old ." for rounds: the trees alternate, each process's ratios to its own matmuls; AB_SHAPES, AB_DATA,
# AB_N=8192, AB_REPS=20, AB_TIMEOUT=280 per tree); the log and CSVs under $OUT/ab_<N>_<shapes>/
step_ab() {
  local dir; dir="$OUT/ab_$(run_tag "${AB_N:-8192}:${AB_SHAPES:-llama3,qwen3,gemma}")"; mkdir -p "$dir"
  local k=0
  for tree in ${AB_TREES:-.old .}; do
    k=$((k + 1))
    PYTHONPATH="$tree:${PYTHONPATH:-}" timeout ${AB_TIMEOUT:-280} python3 benchmarks/ab_flce.py \
      --tag "$(tree_tag "$tree")_r$k" --n ${AB_N:-8192} --reps ${AB_REPS:-20} \
      --shapes ${AB_SHAPES:-llama3,qwen3,gemma} --data ${AB_DATA:-random,realistic} --out "$dir" 2>&1 | flt \
      | grep "^\["
  done | tee "$dir/ab.log"
}

# ab_flce.py per tree: the forward against the bare matmul in interleaved rounds (AB_TREES, FWD_ROUNDS=5,
# AB_SHAPES, AB_DATA)
step_fwdab() {
  for tree in ${AB_TREES:-.old .}; do
    PYTHONPATH="$tree:${PYTHONPATH:-}" timeout 200 python3 benchmarks/ab_flce.py --tag "$(tree_tag "$tree")" \
      --fwd-only --fwd-rounds ${FWD_ROUNDS:-5} --reps 10 --shapes ${AB_SHAPES:-llama3,qwen3,gemma} \
      --data ${AB_DATA:-random,realistic} --out "$OUT" 2>&1 | flt | grep "^\["
  done | tee "$OUT/fwdab.log"
}

# ab_flce.py --shard: one TP rank's work on one GPU, no collectives (SHARD=2, AB_REPS=10, AB_TIMEOUT=280)
step_shardab() {
  timeout ${AB_TIMEOUT:-280} python3 benchmarks/ab_flce.py --tag "tp${SHARD:-2}rank" --shard ${SHARD:-2} \
    --fwd-rounds 3 --reps ${AB_REPS:-10} --shapes ${AB_SHAPES:-llama3,qwen3,gemma} \
    --data ${AB_DATA:-random,realistic} --out "$OUT" 2>&1 | flt | grep "^\[" | tee "$OUT/shardab.log"
}

# bench_tp.py per tree at TP on every GPU: flce vs its floor, before/after (AB_TREES, AB_SHAPES=llama3,gemma)
step_tpab() {
  for tree in ${AB_TREES:-.old .}; do
    PYTHONPATH="$tree:${PYTHONPATH:-}" timeout 240 torchrun --nproc_per_node="$ngpu" benchmarks/bench_tp.py \
      --impls flce --data random --shapes ${AB_SHAPES:-llama3,gemma} --reps 10 2>&1 | tflt | tail -6 \
      | sed "s/^/[$(tree_tag "$tree")] /"
  done | tee "$OUT/tpab.log"
}

# ab_flce.py: the row-scale vs the chunk_grad_ gradient form, A B A B in one process (AB_SHAPES, AB_DATA)
step_gradab() {
  timeout 560 python3 benchmarks/ab_flce.py --tag gf --grad-forms chunk_grad,rowscale \
    --shapes ${AB_SHAPES:-llama3,qwen3,gemma} --data ${AB_DATA:-random,realistic} 2>&1 | flt | grep "^\[" \
    | tee "$OUT/gradab.log"
}

# ab_flce.py per chunk budget in MiB vs the floors and the plan's cuBLAS work (CHUNK_MBS="default 2048 4200")
step_chunksweep() {
  for mb in ${CHUNK_MBS:-default 2048 4200}; do
    FLCE_CHUNK_MB=${mb#default} timeout 190 python3 benchmarks/ab_flce.py --tag "c$mb" \
      --shapes ${AB_SHAPES:-llama3,qwen3,gemma} --data ${AB_DATA:-random,realistic} --reps 15 --out "$OUT" 2>&1 \
      | flt | grep "^\["
  done | tee "$OUT/chunk_sweep.log"
}

# ab_flce.py and a kernel profile with the shipped store config vs run 17's store winners (AB_SHAPES, AB_DATA)
step_storeab() {
  for cfg in "" benchmarks/results/run17/store_winner; do
    tag=$([ -n "$cfg" ] && echo run17store || echo shipped)
    FLCE_CONFIG_DIR=$cfg timeout 200 python3 benchmarks/ab_flce.py --tag $tag --shapes ${AB_SHAPES:-llama3,gemma} \
      --data ${AB_DATA:-random,realistic} 2>&1 | flt | grep "^\["
    FLCE_CONFIG_DIR=$cfg timeout 250 python3 benchmarks/probes/kernel_profile.py --shapes llama3 \
      --data ${AB_DATA:-random,realistic} 2>&1 | flt > "$OUT/profile_$tag.log"
    tail -14 "$OUT/profile_$tag.log"
  done | tee "$OUT/storeab.log"
}

# ---------------------------------------------------------------- tuning (each writes $CFG, copied to $OUT)
# python -m flce_dist.tune: every kernel's bounded search
step_tune() {
  timeout 420 python3 -m flce_dist.tune --out "$CFG" 2>&1 | flt | tee "$OUT/tune.log" | tail -40
  keep_config
}

# the tuner on the fused strategy's logits-storing pass only
step_tunestore() {
  timeout 360 python3 -m flce_dist.tune --only lse_forward_store --out "$CFG" 2>&1 | flt | tee "$OUT/tune_store.log" \
    | tail -14
  keep_config
}

# the tuner on the gather order's storing pass only (lse_forward_store_gather: W through an index), llama3's chunk
step_tunegather() {
  timeout ${TUNE_TIMEOUT:-300} python3 -m flce_dist.tune --only lse_forward_store_gather --rows ${TUNE_ROWS:-2816} \
    2>&1 | flt | tee "$OUT/tune_gather.log" | tail -${TUNE_TAIL:-12}
  keep_config
}

# the tuner on the fused strategy's storing pass at several chunks, settled in interleaved rounds (run 31;
# STORE_RUNS="N:H:V:rows ...", default llama3, qwen3 and 32768 x 32000 at their default chunks; TUNE_ROUNDS=5;
# writes each shape's winner to its own JSON under $OUT, never to the shipped file)
step_tunestorer() {
  for run in ${STORE_RUNS:-8192:4096:128256:2816 8192:4096:151936:2816 32768:4096:32000:11008}; do
    IFS=: read -r n h v rows <<< "$run"
    timeout ${TUNE_TIMEOUT:-150} python3 -m flce_dist.tune --only lse_forward_store --candidates all --rounds ${TUNE_ROUNDS:-5} \
      --n "$n" --h "$h" --v "$v" --rows "$rows" --out "$OUT/store_${v}_${rows}.json" 2>&1 | flt \
      | tee "$OUT/tune_store_${v}_${rows}.log" | grep "cuBLAS\|rounds:\|wrote"
  done
}

# after tunestorer: per "V_rows:N:shapes" in STORE_CHECKS whose search picked another entry than the shipped one,
# bench.py --rounds (flce, Liger C16; random) with the shipped configs, then with that winner merged into a copy
# of them (FLCE_CONFIG_DIR): one process each, C16 the anchor they share (ISSUE_ROUNDS=4)
step_storecheck() {
  for chk in ${STORE_CHECKS:-151936_2816:8192:qwen3 32000_11008:32768:4096x32000}; do
    IFS=: read -r tag n shapes <<< "$chk"
    js="$OUT/store_${tag}.json"
    [ -f "$js" ] || { echo "storecheck: no $js"; continue; }
    grep -q "kept the shipped entry" "$js" && { echo "storecheck $tag: the shipped entry kept"; continue; }
    mkdir -p "/tmp/alt_$tag"
    python3 -c "import json,sys; s=json.load(open('$CFG')); s['lse_forward_store']['bf16']=json.load(open('$js'))['lse_forward_store']['bf16']; json.dump(s, open('/tmp/alt_$tag/h200.json','w'), indent=1)"
    for cd in "" "/tmp/alt_$tag"; do
      FLCE_CONFIG_DIR=$cd timeout ${ISSUE_TIMEOUT:-150} python3 benchmarks/bench.py --n "$n" --shapes "$shapes" \
        --impls flce,liger_c16 --data random --reps 3 --rounds ${ISSUE_ROUNDS:-4} --out "$OUT" 2>&1 | flt \
        | tee -a "$OUT/storecheck_${tag}.log" | grep "interleaved" | sed "s|^|[${cd:-shipped}] |"
    done
  done
}

# the tuner on one shape class's logits passes (TUNE_H=2304, TUNE_V=262208: gemma's)
step_tunecls() {
  timeout 360 python3 -m flce_dist.tune --h ${TUNE_H:-2304} --v ${TUNE_V:-262208} --shape-class \
    --only lse_forward,lse_forward_store --out "$CFG" 2>&1 | flt | tee "$OUT/tune_h${TUNE_H:-2304}.log" \
    | grep -v failed | tail -28
  keep_config
}

# the tuner's persistent candidates for the logits passes, llama3 then gemma's class (TUNE_TAIL=44)
step_tunepers() {
  for sh in "" "--h 2304 --v 262208 --shape-class --rows 1664"; do
    timeout 200 python3 -m flce_dist.tune --candidates persistent --only lse_forward,lse_forward_store $sh \
      --out "$CFG" 2>&1 | flt | tee -a "$OUT/tune_pers.log" | grep -v failed
  done | tail -${TUNE_TAIL:-44}
  keep_config
}

# the tuner on chunk_stats and chunk_grad (TUNE_ARGS, TUNE_TAIL=40)
step_tunechunk() {
  timeout 300 python3 -m flce_dist.tune --only chunk_stats,chunk_grad ${TUNE_ARGS:-} --out "$CFG" 2>&1 | flt \
    | tee "$OUT/tune_chunk.log" | grep -v failed | tail -${TUNE_TAIL:-40}
  keep_config
}

# probes/merge_probe.py: the partial merge's config search (writes the winner)
step_mergeprobe() {
  timeout 150 python3 benchmarks/probes/merge_probe.py --out "$CFG" 2>&1 | flt | tee "$OUT/merge_probe.log" \
    | tail -14
  keep_config
}

# probes/filter_probe.py: the gradient filter's mask statistics and masked_mm configs (writes them;
# PROBE_SHAPES=llama3, PROBE_TAIL=30)
step_filterprobe() {
  timeout 300 python3 benchmarks/probes/filter_probe.py --shapes ${PROBE_SHAPES:-llama3} --write-config "$CFG" \
    --out "$OUT" 2>&1 | flt | tee "$OUT/filter_probe.log" | tail -${PROBE_TAIL:-30}
  keep_config
}

# ---------------------------------------------------------------- probes: where the loss's time goes
# probes/kernel_profile.py: torch.profiler kernel classes and gaps, TP=1 (PROFILE_SHAPES, PROFILE_DATA,
# PROFILE_ARGS, e.g. "--mode fwd --dtype fp32 --n 4096"; PROFILE_TAG, e.g. _fwd, names the log)
step_profile() {
  timeout 280 python3 benchmarks/probes/kernel_profile.py --shapes ${PROFILE_SHAPES:-llama3,gemma} \
    --data ${PROFILE_DATA:-random,realistic} ${PROFILE_ARGS:-} --out "$OUT" 2>&1 | flt \
    | tee "$OUT/profile${PROFILE_TAG:-}.log" | tail -30
}

# probes/kernel_profile.py under torchrun on every GPU (PROFILE_SHAPES, PROFILE_DATA, PROFILE_ARGS)
step_tpprofile() {
  timeout 400 torchrun --nproc_per_node="$ngpu" benchmarks/probes/kernel_profile.py \
    --shapes ${PROFILE_SHAPES:-llama3,gemma} --data ${PROFILE_DATA:-random,realistic} ${PROFILE_ARGS:-} \
    --out "$OUT" 2>&1 | tflt | tee "$OUT/profile_tp.log" | tail -30
}

# probes/op_trace.py: the torch ops and CUDA kernels of one call, by name (PROBE_SHAPES, PROBE_DATA=random)
step_optrace() {
  timeout 200 python3 benchmarks/probes/op_trace.py --shapes ${PROBE_SHAPES:-llama3,gemma} \
    --data ${PROBE_DATA:-random} 2>&1 | flt > "$OUT/op_trace.log"
  grep "===\|CUDA kernels of one call" "$OUT/op_trace.log"
}

# ---------------------------------------------------------------- training
# the launcher on the small model: tokens/s and memory per layout (TRAIN_RUNS="2:flce 1:flce 1:torch" as
# NGPU:head, TRAIN_STEPS=120)
step_train() {
  for run in ${TRAIN_RUNS:-2:flce 1:flce 1:torch}; do
    set -- ${run/:/ }
    small_train $1 200 --head $2 --overwrite --set parallel.tp=$1 --set job.out_dir=runs/gpu_$2_$1 \
      --set training.steps=${TRAIN_STEPS:-120} --set job.progress=off 2>&1 | flt | tee "$OUT/train_$2_$1.log" \
      | grep "steady state\|done:\|Error" | sed "s/^/[NGPU=$1 head=$2] /"
  done
}

# train_bench.sh: the ~1.2B Llama's tokens/s and memory per layout and head (RUNS, BATCHES: see the script)
step_trainbench() {
  OUT="$OUT/train_bench" timeout 590 bash benchmarks/train_bench.sh 2>&1 | flt | tail -12
}

# the small model's loss curve, exact vs grad_filter_eps="auto", 1 GPU, then compare_losses.py (TRAIN_STEPS=200)
step_filtertrain() {
  for e in "" auto; do
    tag=${e:-exact}
    small_train 1 200 --overwrite --set parallel.tp=1 --set training.steps=${TRAIN_STEPS:-200} \
      --set model.grad_filter_eps=\"$e\" --set job.out_dir=\"runs/gpu_filter_$tag\" --set job.progress=\"off\" \
      --set checkpoint.ckpt_every=0 2>&1 | flt > "$OUT/train_filter_$tag.log"
    cp runs/gpu_filter_$tag/losses.json "$OUT/losses_filter_$tag.json"
    tail -1 "$OUT/train_filter_$tag.log"
  done
  python3 benchmarks/compare_losses.py "$OUT/losses_filter_exact.json" "$OUT/losses_filter_auto.json" 2>&1 \
    | tee "$OUT/filter_curve.txt" | tail -4
}

# the ~1.2B Llama (llama_1b_gpu.toml, tp=1, 1 GPU) for TRAIN_STEPS=300 steps, exact vs grad_filter_eps="auto",
# the seeds in SEEDS="0" (each seed's two runs side by side on the one GPU), then compare_losses.py per seed
step_filtertrain1b() {
  for seed in ${SEEDS:-0}; do
    for e in "" auto; do
      tag=${e:-exact}_s$seed
      NGPU=1 TORCHRUN=torchrun CONFIG=configs/train/llama_1b_gpu.toml timeout ${TRAIN_TIMEOUT:-540} bash launch/train.sh \
        --overwrite --set parallel.tp=1 --set training.steps=${TRAIN_STEPS:-300} --set job.seed=$seed \
        --set model.grad_filter_eps=\"$e\" --set job.out_dir=\"runs/f1b_$tag\" --set job.progress=\"off\" \
        --set checkpoint.ckpt_every=0 > "$OUT/train1b_$tag.log" 2>&1 &
    done
    wait
    for e in exact auto; do
      cp runs/f1b_${e}_s$seed/losses.json "$OUT/losses1b_${e}_s$seed.json"; flt < "$OUT/train1b_${e}_s$seed.log" | tail -1
    done
    python3 benchmarks/compare_losses.py "$OUT/losses1b_exact_s$seed.json" "$OUT/losses1b_auto_s$seed.json" 2>&1 \
      | tee "$OUT/filter1b_curve_s$seed.txt" | tail -4
  done
}

# probes/real_setups.py --dw-sweep: the fused dW error per token-chunk count, bf16 vs float32 accumulation, random and realistic
# (DW_SHAPE=N,H,V, default llama3's 8192,4096,128256)
step_dwsweep() {
  timeout ${DW_TIMEOUT:-300} python3 benchmarks/probes/real_setups.py --dw-sweep --dw-shape ${DW_SHAPE:-8192,4096,128256} \
    --out "$OUT" 2>&1 | flt | tee "$OUT/dw_sweep.log" \
    | sed -n '/=== dW sweep summary/,$p'
}

# the trained data mode end to end: the launcher trains the small model, capture_trained.py reads its
# checkpoint into the fixture, bench.py --data trained times every peer on it (TRAIN_STEPS=300, BENCH_IMPLS)
step_trainedbench() {
  local st=${TRAIN_STEPS:-300}
  small_train 1 240 --overwrite --set parallel.tp=1 --set training.steps=$st --set checkpoint.ckpt_every=$st \
    --set job.out_dir=\"runs/gpu_trained\" --set job.progress=\"off\" 2>&1 | flt > "$OUT/train_trained.log"
  tail -1 "$OUT/train_trained.log"
  timeout 150 python3 benchmarks/capture_trained.py --checkpoint runs/gpu_trained/checkpoints/step_$(printf %08d $st) \
    --config $SMALL --out benchmarks/fixtures/trained.pt 2>&1 | flt | tee "$OUT/capture_trained.log" | tail -2
  timeout ${BENCH_TIMEOUT:-300} python3 benchmarks/bench.py --data trained --fixture benchmarks/fixtures/trained.pt \
    --impls ${BENCH_IMPLS:-flce,flce_filter,cce,cce_exact,liger,torch} --reps ${BENCH_REPS:-8} --out "$OUT" 2>&1 \
    | flt | tee "$OUT/bench_trained.log" | tail -${BENCH_TAIL:-10}
}

# ---------------------------------------------------------------- QuACK (wheels: benchmarks/quack_wheels.sh)
# QuACK's wheels, first half (carry .qk1; the next call on the same machine: quack2)
step_quack1() { mkdir -p /tmp/qk && cp .qk1/* /tmp/qk/; }

# QuACK's wheels, second half (carry .qk2): joined, checked, installed, put on PYTHONPATH for later steps
step_quack2() {
  cp .qk2/* /tmp/qk/ && (cd /tmp/qk && cat cu12.whl.part00 cu12.whl.part01 > "$(cut -d' ' -f3 cu12.sha256)" \
    && sha256sum -c cu12.sha256 && rm -f cu12.whl.part* \
    && python3 -m pip install -q --no-deps --no-index --target /tmp/site-packages /tmp/qk/*.whl) 2>&1 | tail -2
  export PYTHONPATH=/tmp/site-packages:/tmp/site-packages/nvidia_cutlass_dsl/dsl_packages:${PYTHONPATH:-$PWD}
}

# ---------------------------------------------------------------- issue 53: the newest peers, both timing modes
# put the CuTe DSL that quack2 installed on a warm machine back on PYTHONPATH (a later call on the same machine;
# quack2 itself exports it for the steps after it in its own call); says whether `import cutlass.cute` works
step_cutedsl() {
  if [ -d /tmp/site-packages/nvidia_cutlass_dsl ]; then
    case ":${PYTHONPATH:-}:" in *:/tmp/site-packages:*) ;; *)
      export PYTHONPATH=/tmp/site-packages:/tmp/site-packages/nvidia_cutlass_dsl/dsl_packages:${PYTHONPATH:-$PWD} ;; esac
  fi
  python3 -c "import cutlass.cute, cuda.bindings.driver; print('cutlass DSL', getattr(cutlass, '__version__', '?'), 'importable')" \
    2>&1 | tail -1
}

# bench.py with Liger's CuTe DSL SM90 FLCE (liger_cute) beside flce and Liger C16, both timing modes (single from an
# idle GPU, steady) and both data modes, one process per "N:shapes" in CUTE_RUNS (default llama3 at N=1024 4096
# 8192; a second call CUTE_RUNS=8192:qwen3,gemma, where CuTe skips V % 256 != 0 with its reason); after quack1 +
# quack2 (or cutedsl) on the same machine (CUTE_IMPLS, BENCH_DATA, BENCH_REPS=10, CUTE_TIMEOUT=170 per run,
# ISSUE_ROUNDS=0: K interleaved rounds per timing mode, BENCH_TAIL=16); each run's CSV under $OUT/cute_<N>_<shapes>/
step_benchcute() {
  step_cutedsl
  for run in ${CUTE_RUNS:-1024:llama3 4096:llama3 8192:llama3}; do
    local tag; tag=$(run_tag "$run")
    mkdir -p "$OUT/cute_$tag"
    timeout ${CUTE_TIMEOUT:-170} python3 benchmarks/bench.py --n "${run%%:*}" --shapes "${run#*:}" \
      --impls ${CUTE_IMPLS:-flce,liger_cute,liger_c16} --data ${BENCH_DATA:-random,realistic} \
      --reps ${BENCH_REPS:-10} --rounds ${ISSUE_ROUNDS:-0} --out "$OUT/cute_$tag" 2>&1 | flt \
      | tee "$OUT/benchcute_$tag.log" | tail -${BENCH_TAIL:-16}
  done
}

# bench_rl.py with Liger's CuTe DSL fused scaled CE (liger_sm90 with the entropy, liger_sm90_noent without) beside
# flce_rl / flce_loss, both timing modes, one process per "N:shapes" in RLCUTE_RUNS (default N=1024 and 8192 at llama3
# and qwen3; also 2048) and temperature in RL_TEMPS (default 0.7; a second call RL_TEMPS=1.0); after quack1 + quack2
# (or cutedsl) (RLCUTE_IMPLS, BENCH_DATA, RL_REPS=10, RL_TIMEOUT=250, RL_TAIL=12; RL_ROUNDS=K: every row again in K
# interleaved rounds per timing mode, each Liger row's median per-round ratio to its flce row)
step_rlcute() {
  step_cutedsl
  for temp in ${RL_TEMPS:-0.7}; do
    for run in ${RLCUTE_RUNS:-1024:llama3,qwen3 8192:llama3,qwen3}; do
      timeout ${RL_TIMEOUT:-250} python3 benchmarks/bench_rl.py --out "$OUT" --n "${run%%:*}" --shapes "${run#*:}" \
        --impls ${RLCUTE_IMPLS:-flce_rl,flce_loss,liger_sm90,liger_sm90_noent} --temperature "$temp" \
        --data ${BENCH_DATA:-random,realistic} --reps ${RL_REPS:-10} --rounds ${RL_ROUNDS:-0} 2>&1 | flt \
        | tee "$OUT/rlcute_$(run_tag "$run")_T$temp.log" | tail -${RL_TAIL:-12}
    done
  done
}

# probes/host_cost.py: flce's host cost per fwd+bwd at the llama3 head: single - steady, kernel launches by class
# (Helion vs torch vs cuBLAS), host time per phase behind a busy GPU (HOST_NS=1024,2048,4096, HOST_SHAPE=llama3,
# HOST_REPS=30, HOSTCOST_TIMEOUT=300), then the per-phase op list of one N=1024 call (--trace, on the GPU)
step_hostcost() {
  timeout ${HOSTCOST_TIMEOUT:-300} python3 benchmarks/probes/host_cost.py --ns ${HOST_NS:-1024,2048,4096} \
    --shape ${HOST_SHAPE:-llama3} --reps ${HOST_REPS:-30} --out "$OUT" 2>&1 | flt > "$OUT/host_cost.log"
  summary "$OUT/host_cost.log" host_cost
  timeout 120 python3 benchmarks/probes/host_cost.py --trace --n 1024 --h 4096 --v 128256 --out "$OUT" 2>&1 | flt \
    > "$OUT/host_cost_trace.log"
  grep "^=== trace\|^  [a-zA-Z]" "$OUT/host_cost_trace.log" | cut -c1-240
}

# probes/launch_cost.py: kernels/fast_launch.py against Helion's default launcher: the call bit for bit, single /
# steady / host ms in interleaved rounds, host us per Helion launch by kernel, a cProfile of one launch
# (LAUNCH_NS=1024,4096, LAUNCH_REPS=40, LAUNCH_TIMEOUT=240)
step_launchcost() {
  timeout ${LAUNCH_TIMEOUT:-240} python3 benchmarks/probes/launch_cost.py --ns ${LAUNCH_NS:-1024,4096} \
    --reps ${LAUNCH_REPS:-40} --out "$OUT" 2>&1 | flt > "$OUT/launch_cost.log"
  summary "$OUT/launch_cost.log" launch_cost
}

# ---------------------------------------------------------------- issue 60: token counts that change every call
# the GPU test of a new N against a cached one (12 never-seen N, loss and RL heads, llama3; its table in the log)
step_newn() {
  timeout ${NEWN_TIMEOUT:-200} python3 -m pytest -q -s -m gpu tests/test_gpu.py -k new_token_count 2>&1 | flt \
    | tee "$OUT/newn.log" | grep "new N\|passed\|failed\|Error" | tail -30
}

# bench_trace.py: the grpo and padfree token-count traces (TRACE_CALLS=200 calls each), every impl from a fresh
# process, for the heads in TRACE_HEADS (loss, rl); after quack1 + quack2 (or cutedsl) for the CuTe DSL rows
# (TRACE_TRACES, TRACE_DATA=random, TRACE_TIMEOUT=150 per process)
step_trace() {
  step_cutedsl
  for head in ${TRACE_HEADS:-loss rl}; do
    python3 benchmarks/bench_trace.py --head "$head" --traces ${TRACE_TRACES:-grpo,padfree} --calls ${TRACE_CALLS:-200} \
      --data ${TRACE_DATA:-random} --timeout ${TRACE_TIMEOUT:-150} ${TRACE_IMPLS:+--impls "$TRACE_IMPLS"} --out "$OUT" \
      2>&1 | flt | tee "$OUT/trace_$head.log" | sed -n '/=== bench_trace/,$p'
  done
}

# the smallest call that answers issues 60-62's GPU questions (about 300 s; for a small device budget, no CuTe DSL
# wheels to carry): new N vs cached, the Megatron CUDA-graph and misaligned-input tests, the loss head's grpo trace
# against Liger C16 and torch, and ab at llama3 + gemma (old = .old) on random data
step_short() {
  NEWN_TIMEOUT=90 step_newn
  TESTS_K="megatron_head_cuda_graph or misaligned or fast_launch or target_dot" TESTS_TIMEOUT=90 step_tests
  TRACE_HEADS=loss TRACE_TRACES=grpo TRACE_IMPLS=flce,liger_c16,torch TRACE_TIMEOUT=45 step_trace
  AB_REPS=5 AB_SHAPES=llama3,gemma AB_DATA=random AB_TIMEOUT=50 step_ab
}

# ---------------------------------------------------------------- the call
list_steps() {  # each step_<name> with the comment lines right above it
  awk '/^# ---/ { d = ""; next }
       /^# / { d = d (d ? " " : "") substr($0, 3); next }
       /^step_[a-z0-9]+\(\)/ { n = $1; sub(/^step_/, "", n); sub(/\(\).*/, "", n); printf "  %-13s %s\n", n, d }
       { d = "" }' "${BASH_SOURCE[0]}"
}

if [ "${1:-}" = --list ] || [ "${1:-}" = -l ] || [ "${1:-}" = --help ] || [ "${1:-}" = -h ]; then
  echo "bash benchmarks/device.sh STEP [STEP ...]   (default: tests bench); the steps:"
  list_steps
  exit 0
fi
steps=${*:-tests bench}
for w in $steps; do
  declare -F "step_$w" > /dev/null || { echo "device.sh: unknown step '$w' (bash benchmarks/device.sh --list)" >&2; exit 2; }
done

OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [ -d .whl ]; then  # once per machine (a second device.sh in the same call, e.g. on the other GPU, reuses it)
  if [ ! -f /tmp/site/.flce_ok ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      || exit 1
    touch /tmp/site/.flce_ok
  fi
  export PYTHONPATH=/tmp/site:$PWD
fi
ngpu=$(nvidia-smi -L | wc -l)
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,memory.used --format=csv | tee "$OUT/gpu.txt"
{ cat .device_commit 2>/dev/null || git rev-parse --short HEAD; } | tee "$OUT/commit.txt"
for w in $steps; do
  "step_$w"
done
