#!/bin/sh
# make gpu-check: the GPU check on a CUDA machine, with its own torch and Triton, no venv and
# no package index. Wheels carried in .whl/ (tools/notebook_wheels.sh: nbval, ipykernel, IPython,
# ipywidgets and what they import, for CPython 3.12) are first installed into a temporary folder for the
# notebooks; then `python -m flashlib gpu-check` runs with the arguments given here.
#   sh tools/gpu_check.sh [--budget S] [--skip-tests] [--skip-notebooks] [--skip-bench]
# PYTHON (default python3) names the interpreter, FLASHLIB_GPU_SITE the folder for the wheels.
set -eu
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
SITE=${FLASHLIB_GPU_SITE:-/tmp/flashlib-gpu-site}
if ls .whl/*.whl >/dev/null 2>&1; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl
    PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 exec "$PYTHON" -m flashlib gpu-check "$@"
