#!/bin/sh
# The pure-Python wheels the GPU check's notebooks need on a machine without IPython and
# ipywidgets and without a package index (the H200 the check runs on): downloaded here into
# .whl/ (ignored by git), carried with the working tree, and installed there by
# tools/gpu_check.sh with --no-index --no-deps into a temporary folder. The versions are the
# ones the CI environment runs the notebooks with; widgetsnbextension and jupyterlab_widgets
# (browser assets, never imported) are left out.
#   sh tools/notebook_wheels.sh          (PYTHON=... to use another interpreter's pip)
set -eu
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
WHEELS="ipywidgets==8.1.9 comm==0.2.3 traitlets==5.16.1 ipython==9.18.1 ipython_pygments_lexers==1.1.1
matplotlib-inline==0.2.2 jedi==0.20.1 parso==0.8.7 pexpect==4.9.0 ptyprocess==0.7.0 prompt_toolkit==3.0.53
wcwidth==0.9.4 stack_data==0.6.3 executing==2.3.0 asttokens==3.0.2 pure_eval==0.2.4"
rm -rf .whl
mkdir -p .whl
# --platform any: only wheels without compiled code (wcwidth has both kinds)
# shellcheck disable=SC2086  # one argument per wheel
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform any -d .whl $WHEELS
for wheel in .whl/*.whl; do
    case "$wheel" in
        *-none-any.whl) ;;
        *) echo "not pure Python, would not run on every machine: $wheel" >&2; exit 1 ;;
    esac
done
du -sh .whl
