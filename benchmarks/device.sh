#!/usr/bin/env bash
# One device call: install carried wheels, run the GPU tests, then the benchmark(s).
# Usage on the device tool:  bash benchmarks/device.sh [tests] [bench] [tp]   (default: all)
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
what=${*:-tests bench}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,memory.used --format=csv | tee "$OUT/gpu.txt"
git rev-parse --short HEAD 2>/dev/null | tee "$OUT/commit.txt"
for w in $what; do
  case $w in
    tests) timeout 240 python3 -m pytest -q -m gpu tests/test_gpu.py -x 2>&1 | tee "$OUT/gpu_tests.log" | tail -30 ;;
    bench) timeout 300 python3 benchmarks/bench.py --out "$OUT" 2>&1 | tee "$OUT/bench.log" | tail -30 ;;
    bench32) python3 benchmarks/bench.py --dtype fp32 --shapes llama3 --impls flce,torch,matmul --out "$OUT" 2>&1 | tee "$OUT/bench32.log" | tail -12 ;;
    tp) torchrun --nproc_per_node=2 -m pytest -q -m "dist" tests/test_distributed.py 2>&1 | tee "$OUT/tp_tests.log" | tail -30 ;;
  esac
done
