#!/bin/sh
# The wheels the GPU check's notebooks need on a machine that has torch, Triton, numpy, matplotlib
# and pytest but neither Jupyter nor a package index (the H200 the check runs on, Python 3.12):
# nbval and the kernel it starts (ipykernel, jupyter_client, pyzmq, ...), IPython and ipywidgets.
# Downloaded here into .whl/ (ignored by git), carried with the working tree, and installed
# there by tools/gpu_check.sh with --no-index --no-deps into a temporary folder. The versions
# are the ones this checkout's environment runs the notebooks with (read from .venv, which
# `make test` installs through constraints.txt). Left out, because that machine has them:
# pytest, psutil, packaging, python-dateutil, attrs, pygments, typing-extensions, coverage; and
# what is never imported there: debugpy (ipykernel's optional debugger), widgetsnbextension and
# jupyterlab_widgets (browser assets).
#   sh tools/notebook_wheels.sh                  wheels for CPython 3.12 on x86-64 Linux, in .whl/
#   PYVER=3.11 DEST=dir sh tools/notebook_wheels.sh   for another CPython (the CPU proof of the set)
# PYTHON (default .venv/bin/python) names the interpreter whose pip downloads and whose versions count.
set -eu
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
PYVER=${PYVER:-3.12}
DEST=${DEST:-.whl}
NAMES="nbval nbformat fastjsonschema jsonschema jsonschema-specifications referencing rpds-py
jupyter_client jupyter_core platformdirs pyzmq tornado ipykernel comm nest-asyncio2 traitlets
ipython ipython_pygments_lexers matplotlib-inline jedi parso pexpect ptyprocess prompt_toolkit
wcwidth stack_data executing asttokens pure_eval ipywidgets"
# shellcheck disable=SC2086  # one argument per name
PINS=$("$PYTHON" -c 'import sys, importlib.metadata as m; print(" ".join(f"{n}=={m.version(n)}" for n in sys.argv[1:]))' $NAMES)
rm -rf "$DEST"
mkdir -p "$DEST"
# binary wheels (pyzmq, tornado, rpds-py) for that CPython on manylinux x86-64, the rest pure Python
PLATFORMS=""
for tag in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_26_x86_64 manylinux_2_24_x86_64 \
           manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64 linux_x86_64 any; do
    PLATFORMS="$PLATFORMS --platform $tag"
done
# shellcheck disable=SC2086
"$PYTHON" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version "$PYVER" --implementation cp $PLATFORMS -d "$DEST" $PINS
count=$(ls "$DEST"/*.whl | wc -l)
expected=$(echo $NAMES | wc -w)
if [ "$count" -ne "$expected" ]; then
    echo "notebook_wheels: $count wheels for $expected packages in $DEST" >&2
    exit 1
fi
du -sh "$DEST"
