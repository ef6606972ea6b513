#!/usr/bin/env bash
# Set up a fresh CPU machine: .venv with the project (editable), tests, training, DeepSpeed and the
# framework adapters' frameworks (torchtitan, TRL, verl). Used by the README's first command and by
# .ci/run. Exact versions come from constraints-cpu.txt (the library itself declares ranges).
#
#   bash launch/setup.sh                  the pinned stack in .venv (constraints-cpu.txt): torch 2.13.0's CPU
#                                         wheel, helion 1.4.0, every framework (the README's set-up, CI's first job)
#   bash launch/setup.sh --stack newest   the newest stack in .venv-newest (constraints-newest.txt): torch 2.15.0,
#                                         helion 1.5.1 and the test tools only, then the library installed as a
#                                         user installs it (a wheel, dependencies resolved by pip, no pins) and
#                                         checked to have kept that torch and helion (CI's second job)
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1
t0=$(date +%s)

if [ "${1:-}" = --stack ] && [ "${2:-}" = newest ]; then
  [ -x .venv-newest/bin/python ] || python3 -m venv .venv-newest
  py=.venv-newest/bin/python
  # PIP_CONSTRAINT replaces this machine's global cap (torch<=2.14.1) for these commands only, with the
  # newest job's exact pins; torch 2.15.0 comes from the index as a CUDA build (~3 GB), which runs on the CPU.
  PIP_CONSTRAINT="$PWD/constraints-newest.txt" $py -m pip install -q torch helion packaging pytest hypothesis matplotlib build
  keep() { $py -c 'import importlib.metadata as m; print(m.version("torch"), m.version("helion"))'; }
  before=$(keep)
  # The library as a user installs it into that environment: a built wheel, dependencies resolved by pip,
  # no constraints file (/dev/null lifts the machine's cap as a user's pip has none).
  rm -rf build/newest && $py -m pip wheel -q --no-deps -w build/newest .
  PIP_CONSTRAINT=/dev/null $py -m pip install -q build/newest/flce_dist-*.whl
  after=$(keep)
  [ "$before" = "$after" ] || { echo "error: installing flce_dist changed torch/helion: $before -> $after" >&2; exit 1; }
  # the installed wheel (not this checkout) finds the shipped configs, helion's series overlay included
  (cd build && ../$py -c 'import flce_dist, flce_dist.kernels.launch as L; assert "site-packages" in flce_dist.__file__; \
    fs = L.config_files("h200"); assert fs and all(f.is_file() for f in fs), fs; print("installed:", flce_dist.__file__, [f.name for f in fs])')
  echo "newest stack kept: torch/helion $after; setup: $(( $(date +%s) - t0 )) s"
  exit 0
fi
[ -x .venv/bin/python ] || python3 -m venv .venv
pip=(.venv/bin/pip install -q -c constraints-cpu.txt)
# constraints-cpu.txt pins torch==2.13.0, so pip takes the CPU wheel on disk, never a CUDA build.
"${pip[@]}" -e '.[test,train,dev]'   # dev: ruff, mypy, build, pre-commit (the checks .ci/run runs)
# DeepSpeed 0.19.8 is an sdist that imports torch at build time: no build isolation, no ops built.
"${pip[@]}" setuptools wheel
DS_BUILD_OPS=0 "${pip[@]}" --no-build-isolation 'deepspeed==0.19.8'
# Framework adapters (tests/test_trl.py, test_torchtitan.py, test_verl.py); versions in constraints-cpu.txt.
# TRL with its dependencies (datasets 5.x).
"${pip[@]}" 'trl==1.16.0'
# torchtitan 0.3.0 pins datasets<4.8, which conflicts with TRL's: --no-deps, plus tyro, the one
# dependency its config, loss and model code import (its full trainer also needs tensorboard, wandb,
# torchdata, datasets: not installed here).
"${pip[@]}" --no-deps 'torchtitan==0.3.0' 'spmd_types==0.2.3'
"${pip[@]}" 'tyro==1.0.17'
# verl 0.9.1 pins transformers<5.11 (and vllm-era extras): --no-deps, plus what `import verl` and its
# FSDP forward import: ray, omegaconf, and tensordict's own dependencies (hydra is not imported there).
"${pip[@]}" --no-deps 'verl==0.9.1' 'tensordict==0.10.0' 'pyvers==0.1.0'
"${pip[@]}" 'ray==2.60.0' omegaconf cloudpickle orjson importlib_metadata
# ---- Megatron-Core (flce_dist/integrations/megatron.py, tests/test_megatron.py) -------------------
# megatron-core >= 0.17 declares Requires-Python >= 3.12 and ships only a cp312 wheel; its one compiled
# file is the C++ dataset helper (megatron/core/datasets/helpers_cpp*.so, never loaded by the model
# code or the tests), and every .py compiles under 3.11. pip refuses it on this Python 3.11, so: fetch
# the released wheel for 3.12 (no dependencies) and unpack its pure-Python part, dist-info included
# (importlib.metadata sees the version), into the venv's site-packages. Its declared dependencies
# (torch, numpy, packaging) are installed above. The version is constraints-cpu.txt's.
mcore=$(sed -n 's/^megatron-core==//p' constraints-cpu.txt)
if ! .venv/bin/python -c "import importlib.metadata as m, sys; sys.exit(m.version('megatron-core') != '$mcore')" 2>/dev/null; then
  wheels=$(mktemp -d)
  .venv/bin/pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 -d "$wheels" "megatron-core==$mcore"
  .venv/bin/python - "$wheels"/megatron_core-"$mcore"-*.whl <<'PY'
import sys, sysconfig, zipfile
with zipfile.ZipFile(sys.argv[1]) as whl:
    whl.extractall(sysconfig.get_paths()["purelib"], [n for n in whl.namelist() if not n.endswith(".so")])
PY
  rm -rf "$wheels"
fi
# ---- end Megatron-Core ------------------------------------------------------------------------------
echo "setup: $(( $(date +%s) - t0 )) s"
case "$(.venv/bin/python -c 'import torch; print(torch.version.cuda)')" in
  None) ;;
  *) echo "error: a CUDA build of torch was installed; expected the 2.13.0 CPU wheel" >&2; exit 1 ;;
esac
