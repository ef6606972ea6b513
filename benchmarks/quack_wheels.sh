#!/usr/bin/env bash
# Wheels for QuACK (quack-kernels 0.6.5, CuTe DSL) on the offline GPU image, split into two carries
# of < 64 MiB each (the device tool's limit per call): .qk1 (everything but the second half of the
# 87 MiB nvidia-cutlass-dsl-libs-cu12 wheel) and .qk2 (that half). Run here (network), then on ONE
# warm machine, two calls back to back:
#   carry .qk1:                      bash benchmarks/device.sh quack1
#   carry .qk2 .whl .device_commit:  bash benchmarks/device.sh quack2 benchquack
# Notes (run 16): the python half of cutlass is in nvidia-cutlass-dsl-libs-core (only libs-base
# requires it, so --no-deps must name it); the install folder must be called site-packages (quack's
# gemm_runtime/identity.py treats only files under */site-packages/ as library code); a --target
# install does not run nvidia_cutlass_dsl's .pth, so device.sh adds nvidia_cutlass_dsl/dsl_packages
# to PYTHONPATH; the image's cuda-bindings 13.3.1 is used; libs-cu12 runs on the image's driver.
# The same two carries serve Liger 0.8.5's CuTe DSL Hopper kernels (issue 53: bench.py's liger_cute, bench_rl.py's
# liger_sm90 rows; liger-kernel itself is in .whl): its `cutedsl` extra is nvidia-cutlass-dsl>=4.6.0 and
# apache-tvm-ffi (optional at run time), both here; it imports cuda.bindings.driver (the image's). No other wheel:
#   call 1, carry .qk1:                                 bash benchmarks/device.sh quack1
#   call 2, carry .qk2 .whl .device_commit:             bash benchmarks/device.sh quack2 benchcute
#   later calls on that warm machine, carry .whl .device_commit:  bash benchmarks/device.sh cutedsl rlcute
set -euo pipefail
D=$(mktemp -d)
plat=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
      --platform manylinux_2_24_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64)
python3 -m pip download -q --no-deps "${plat[@]}" -d "$D" quack-kernels==0.6.5 nvidia-cutlass-dsl==4.8.1 \
  nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 nvidia-cutlass-dsl-libs-cu12==4.8.1 \
  apache-tvm-ffi==0.1.15.post2 torch-c-dlpack-ext==0.1.5 einops==0.8.2 packaging==26.4 typing_extensions==4.16.0 \
  protobuf==7.36.2
rm -rf .qk1 .qk2 && mkdir -p .qk1 .qk2
big=$(ls "$D"/nvidia_cutlass_dsl_libs_cu12-*.whl)
(cd "$D" && sha256sum "$(basename "$big")" > cu12.sha256 && split -b 44m -d "$(basename "$big")" cu12.whl.part && rm "$(basename "$big")")
mv "$D"/cu12.whl.part01 .qk2/ && mv "$D"/* .qk1/ && rmdir "$D"
du -sh .qk1 .qk2
