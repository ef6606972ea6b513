#!/usr/bin/env bash
# Set up a fresh CPU machine: .venv with the project (editable), tests, training and DeepSpeed.
# Used by the README's first command and by .ci/run.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1
t0=$(date +%s)
[ -x .venv/bin/python ] || python3 -m venv .venv
# torch==2.13.0 is pinned in pyproject.toml, so pip takes the CPU wheel on disk, never a CUDA build.
.venv/bin/pip install -q -e '.[test,train]'
# DeepSpeed 0.19.8 is an sdist that imports torch at build time: no build isolation, no ops built.
.venv/bin/pip install -q setuptools wheel
DS_BUILD_OPS=0 .venv/bin/pip install -q --no-build-isolation 'deepspeed==0.19.8'
echo "setup: $(( $(date +%s) - t0 )) s"
case "$(.venv/bin/python -c 'import torch; print(torch.version.cuda)')" in
  None) ;;
  *) echo "error: a CUDA build of torch was installed; expected the 2.13.0 CPU wheel" >&2; exit 1 ;;
esac
