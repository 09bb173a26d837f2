"""The project's promises about itself: pins in step, two commands, CI calling the README's."""
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name


ROOT = Path(__file__).resolve().parent.parent


def _norm(req: str) -> str:
    return re.sub(r"\s+", "", req).replace("'", '"')


def _constraints() -> dict:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, version = line.split("==")
            pins[canonicalize_name(name)] = version
    return pins


def _declared() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    return [Requirement(r) for r in project["dependencies"] + extras["course"] + extras["test"] + extras["site"]
            + extras["grading"]]


def test_every_declared_range_holds_its_pin_in_the_lock():
    pins = _constraints()
    for req in _declared():
        name = canonicalize_name(req.name)
        assert name in pins, f"{req.name} has no pin in constraints.txt"
        assert req.specifier.contains(pins[name], prereleases=True), f"{req.name}=={pins[name]} outside {req}"
        assert not any(s.operator in ("==", "===", "<", "<=", "~=") for s in req.specifier), (
            f"{req}: the package declares lower bounds only, so a runtime keeps its own newer torch or Triton")


def test_environment_yml_installs_the_locked_set():
    lines = (ROOT / "environment.yml").read_text().splitlines()
    start = lines.index("  - pip:")
    pip_section = [line.strip()[2:] for line in lines[start + 1:] if line.strip().startswith("- ")]
    assert pip_section == ["-c constraints.txt", "torch", "-e .[course]"]


def test_makefile_installs_through_the_lock():
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^PIP +:= \$\(PY\) -m pip install .*-c constraints\.txt$", makefile, re.M)
    installs = re.findall(r"^\t\$\(PY\) -m pip install (.*)$", makefile, re.M)
    assert all("--target" in line for line in installs), installs  # only Triton 3.6's side folder bypasses it


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs the test environment")
def test_installing_flashlib_keeps_the_environments_torch_triton_and_numpy(tmp_path):
    """pip's own resolver, asked what installing flashlib here would do (--dry-run): this environment
    already holds torch, Triton and numpy in range, as a GPU runtime does, and pip must take nothing
    but flashlib."""
    report = tmp_path / "report.json"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--no-build-isolation",
                           "--disable-pip-version-check", "--report", str(report), str(ROOT)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    names = sorted(item["metadata"]["name"].lower() for item in json.loads(report.read_text())["install"])
    assert names == ["flashlib-course"], names


def test_readme_shows_the_two_commands_and_ci_runs_the_test_one():
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```(?:sh|bash)\n(.*?)```", readme, re.S)
    assert "make lab" in blocks[0] and "make test" in blocks[1]
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^make test$", ci, re.M)


def test_lab_binds_localhost_with_token():
    makefile = (ROOT / "Makefile").read_text()
    lab = re.search(r"^lab:.*\n((?:\t.*\n)+)", makefile, re.M).group(1)
    assert "--ServerApp.ip=127.0.0.1" in lab and "--notebook-dir=notebooks" in lab
    assert "token=''" not in lab and 'token=""' not in lab


def test_import_is_cheap_and_triton_free():
    code = "import sys, flashlib; print('triton' in sys.modules, 'matplotlib' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


REFERENCE_SUITE = ["test_dense.py", "test_softmax.py", "test_tiled.py", "test_backward.py", "test_errors.py",
                   "test_iomodel.py"]


# Every test function of the suite, each value of each of its parameters in one case at least: what
# Triton could be needed for is the code a value selects (a loop order, causal or not), not the sizes;
# the whole cross product runs, with Triton, in the suite itself.
EACH_VALUE_ONCE = """
class EachValueOnce:
    def pytest_collection_modifyitems(self, items):
        seen, kept = set(), []
        for item in items:
            spec = getattr(item, "callspec", None)
            values = {(item.module.__name__, item.originalname, name, repr(value))
                      for name, value in (spec.params.items() if spec else ())} or {(item.nodeid,)}
            if values - seen:
                kept.append(item)
                seen |= values
        items[:] = kept
"""


def test_reference_suite_runs_without_triton():
    # Simulates macOS/Windows, where Triton has no wheel: importing it must fail and nothing may need it.
    blocker = ("import sys, pytest; sys.modules['triton'] = None\n" + EACH_VALUE_ONCE +
               "sys.exit(pytest.main(sys.argv[1:], plugins=[EachValueOnce()]))")
    args = [str(ROOT / "tests" / f) for f in REFERENCE_SUITE]
    # nbval (for notebooks, none here) takes seconds of each pytest start: left out
    done = subprocess.run([sys.executable, "-c", blocker, "-q", "-p", "no:cacheprovider", "-p", "no:nbval", *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=900,
                          env={**__import__("os").environ, "FLASHLIB_HYPOTHESIS": "quick"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert re.search(r"\d+ passed", done.stdout) and "failed" not in done.stdout.splitlines()[-1]


def test_flash_attention_without_triton_says_how_to_run():
    code = ("import sys; sys.modules['triton'] = None\n"
            "import flashlib\n"
            "try:\n    flashlib.flash_attention\nexcept Exception as e:\n    print(type(e).__name__, e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout
    assert "Triton" in out and "Linux" in out, out


@pytest.mark.parametrize("tool,expect", [
    ("try_software_pipelining.py", r"exp2 between each wgmma group's issue and its wait: \[[0-9, ]+\]"),
    ("try_warp_specialize.py", r"tiles 128x64, 8 warps, 3 stages: \d+ registers"),
])
def test_evidence_tools_still_run(tool, expect):
    """The scripts behind statements in data/bench/LOG.md and notebook 08 rewrite the current
    kernels' source: they must still find what they rewrite and compile it."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("Triton ships Linux wheels only")
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "experiments" / tool)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert len(re.findall(expect, done.stdout)) >= 1, done.stdout


def test_the_wheel_carries_the_recorded_runs_and_every_module(tmp_path):
    """A wheel built from the repository (what a runtime's pip install of a clone or of FLASHLIB_SOURCE
    builds) holds every package of the tree and data/bench/'s runs as flashlib/recorded, where
    flashlib.bench.records.bench_dir() finds them without the repository beside it."""
    import zipfile

    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet",
                           "--disable-pip-version-check", "-w", str(tmp_path), str(ROOT)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    names = set(zipfile.ZipFile(next(tmp_path.glob("*.whl"))).namelist())
    packages = {str(p.parent.relative_to(ROOT)) for p in (ROOT / "flashlib").rglob("__init__.py")}
    assert {p + "/__init__.py" for p in packages} <= names
    recorded = {"flashlib/recorded/" + p.name for p in (ROOT / "data" / "bench").glob("*.json")}
    assert recorded and recorded <= names
    modules = {str(p.relative_to(ROOT)) for p in (ROOT / "flashlib").rglob("*.py")}
    assert modules <= names, sorted(modules - names)
    # installed alone, away from the repository, it reads the runs it carries
    target, elsewhere = tmp_path / "site", tmp_path / "cwd"
    elsewhere.mkdir()
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--quiet", "--disable-pip-version-check",
                           "--target", str(target), str(next(tmp_path.glob("*.whl")))],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    probe = ("import flashlib; from flashlib.bench import records; d = records.bench_dir(); "
             "print(d.relative_to(d.parent.parent), sorted(p.name for p in d.glob('*.json')) == "
             f"{sorted(p.name for p in (ROOT / 'data' / 'bench').glob('*.json'))!r})")
    done = subprocess.run([sys.executable, "-c", probe], cwd=elsewhere, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(target)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["flashlib/recorded", "True"], done.stdout


def _tool(name: str):
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(ROOT / "tools"))


def test_every_notebook_opens_with_its_badge_and_setup_cell():
    """tools/notebook_setup.py keeps them in step with [project.urls] Repository; --check says where not."""
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "notebook_setup.py"), "--check"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    import nbformat

    notebook_setup = _tool("notebook_setup")
    repo = notebook_setup.address()
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        badge, setup = nbformat.read(path, as_version=4).cells[:2]
        if repo is None:
            assert "not published" in badge.source and "make wheel" in badge.source and "FLASHLIB_SOURCE" in badge.source
        else:
            assert notebook_setup.colab_url(path.name) in badge.source
        assert 'os.environ.get("FLASHLIB_SOURCE")' in setup.source
        # where the course is importable the cell prints only its line on the runtime, which depends on the
        # device: the GPU check reports it rather than comparing it
        assert "device-dependent-output" in setup.metadata["tags"]
        (line,) = [o for o in setup.outputs if o.get("name") == "stdout"]
        assert line.text.startswith("Runtime: ") and line.text.count("\n") == 1, (path.name, setup.outputs)


# the form of a published address, under an owner no GitHub account can have (GitHub's names hold no dots)
ADDRESS = "https://github.com/example.invalid/flashlib-course"


def _pyproject_with_address(folder: Path, url: str) -> Path:
    text = (ROOT / "pyproject.toml").read_text()
    path = folder / "pyproject.toml"
    path.write_text(re.sub(r'^Repository = ".*"$', f'Repository = "{url}"', text, flags=re.M))
    return path


def test_the_address_is_a_github_repository_or_unpublished(tmp_path):
    notebook_setup = _tool("notebook_setup")
    unset = _pyproject_with_address(tmp_path, "https://unpublished.invalid/flashlib-course")
    assert notebook_setup.address(unset) is None
    with pytest.raises(SystemExit, match=r"no public address yet: set \[project.urls\] Repository in pyproject.toml "
                                         r"to the address of your copy of the course on GitHub \(https://github.com/<owner>/<repo>\)"):
        notebook_setup.repository(unset)
    assert notebook_setup.repository(_pyproject_with_address(tmp_path, ADDRESS)) == ADDRESS
    with pytest.raises(SystemExit, match=r"'https://example.org/course': it must be https://github.com/<owner>/<repo>"):
        notebook_setup.address(_pyproject_with_address(tmp_path, "https://example.org/course"))
    # unpublished, the setup cell has nothing to install from but what it is given: given nothing, in a
    # Python that has no flashlib (-S: no site-packages), it stops and says how to bring the course in
    done = subprocess.run([sys.executable, "-S", "-c", notebook_setup.setup_source(None)], cwd=tmp_path,
                          env=_without_pythonpath(), capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and done.stdout == ""
    assert ("RuntimeError: flashlib-course is not installed here and this copy of the course is not published: upload "
            "the wheel that `make wheel` builds (build/wheel/flashlib_course-*.whl) into ") in done.stderr, done.stderr
    assert "or set FLASHLIB_SOURCE to a path or a git URL of your copy" in done.stderr
    assert f'published="git+{ADDRESS}"' in notebook_setup.setup_source(ADDRESS)


def test_make_site_without_an_address_stops_saying_what_to_set(tmp_path):
    """The site is published material: tools/build_site.py (make site) in a copy whose address is unset
    stops before Sphinx starts, naming the setting and its form."""
    (tmp_path / "tools").mkdir()
    for name in ("build_site.py", "notebook_setup.py", "nbval_tags.py"):
        shutil.copy(ROOT / "tools" / name, tmp_path / "tools" / name)
    _pyproject_with_address(tmp_path, "https://unpublished.invalid/flashlib-course")
    done = subprocess.run([sys.executable, str(tmp_path / "tools" / "build_site.py"), "--out", str(tmp_path / "site")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and not (tmp_path / "site").exists()
    assert "no public address yet: set [project.urls] Repository in pyproject.toml" in done.stderr, done.stderr


# a Colab link, a git install, or GitHub's "flashlib" account (an unrelated person's: the course once pointed there)
ELSEWHERE = re.compile(r"colab\.research\.google\.com/github/[^/\s]+/[\w.-]+|git\+https?://[^/\s\"')`]+/[^/\s\"')`]+/[^\s\"')`]+|github\.com/flashlib\b")
OWNER = re.compile(r"(?:github\.com|colab\.research\.google\.com/github)/([^/\s]+)")


def _points_at_no_one(hit: str, repo: str | None) -> bool:
    """The course's own address, or one under an owner no GitHub account can have: a placeholder
    (<owner>, or a template's {name}) or a name with a dot."""
    if repo is not None and (hit.startswith(f"git+{repo}") or repo.removeprefix("https://github.com") in hit):
        return True
    owner = OWNER.search(hit)
    return owner is not None and (owner.group(1)[0] in "<{" or "." in owner.group(1))


def test_no_address_points_anywhere_but_the_courses_own():
    """Colab links and git installs, in every tracked file, are derived from the one address (none while it
    is unset) or name no one; and nothing names the unrelated GitHub account."""
    repo = _tool("notebook_setup").address()
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout.decode()
    found = {}
    for name in filter(None, files.split("\0")):
        path = ROOT / name
        if path.suffix in (".png", ".svg", ".json", ".whl") or not path.is_file():
            continue
        hits = [h for h in ELSEWHERE.findall(path.read_text(errors="replace")) if not _points_at_no_one(h, repo)]
        if hits:
            found[name] = sorted(set(hits))
    assert found == {}
    # what it finds, it reports (spelt in two parts, so that this file does not hold the address)
    assert not _points_at_no_one("git+https://github.com/" + "flashlib/flashlib", repo)


def test_the_course_has_a_name_of_its_own_and_declares_the_tested_floors():
    """Its distribution is flashlib-course everywhere (the index's "flashlib" is another project), its
    module says so in the line the setup cells read, and its lower bounds are the tested releases."""
    import flashlib
    from flashlib.course import runtime

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["name"] == runtime.DISTRIBUTION == _tool("notebook_setup").DISTRIBUTION == flashlib.__course__
    assert f'\n__course__ = "{runtime.DISTRIBUTION}"\n' in (ROOT / "flashlib" / "__init__.py").read_text()
    assert "name: flashlib-course" in (ROOT / "environment.yml").read_text()
    floors = {}
    for req in map(Requirement, project["dependencies"]):
        (bound,) = req.specifier
        assert bound.operator == ">=", req
        floors[req.name] = bound.version
    assert floors == runtime.TESTED
    readme = (ROOT / "README.md").read_text()
    for name, floor in runtime.TESTED.items():
        shown = {"triton": "Triton"}.get(name, name)
        assert f"{shown} ≥ {floor}" in readme, f"README.md does not state the floor {shown} ≥ {floor}"


def _recipe(name: str) -> str:
    """The code block of README.md after the comment <!-- recipe: NAME -->, as written there."""
    found = re.search(rf"<!-- recipe: {name} -->\n\s*```\w*\n(.*?)\n\s*```", (ROOT / "README.md").read_text(), re.S)
    assert found, f"README.md has no recipe {name!r}"
    return textwrap.dedent(found.group(1))


def _clone(folder: Path) -> Path:
    clone = folder / "flashlib-course"
    shutil.copytree(ROOT / "flashlib", clone / "flashlib", ignore=shutil.ignore_patterns("__pycache__"))
    (clone / "notebooks").mkdir()
    return clone


def _without_pythonpath() -> dict:
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "FLASHLIB_SOURCE")}


def test_readmes_clone_recipe_gives_kernels_the_clones_flashlib(tmp_path):
    """The recipe's shell lines run as written, with `jupyter` a stand-in that does what a kernel of the
    server would: start in the notebook folder, with the server's environment, and import flashlib.
    (The recipe it replaced, PYTHONPATH=., gave kernels notebooks/ as the path.)"""
    clone = _clone(tmp_path)
    (tmp_path / "bin").mkdir()
    stand_in = tmp_path / "bin" / "jupyter"
    stand_in.write_text('#!/bin/sh\nfor arg in "$@"; do case "$arg" in --notebook-dir=*) dir="${arg#*=}";; esac; done\n'
                        f'cd "$dir" && exec {sys.executable} -c "import flashlib; print(flashlib.__file__)"\n')
    stand_in.chmod(0o755)
    env = dict(_without_pythonpath(), PATH=f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    done = subprocess.run(["bash", "-euc", _recipe("clone")], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(clone / "flashlib" / "__init__.py")


def test_readmes_colab_recipe_puts_the_clone_on_the_path_and_the_setup_cell_finds_it(tmp_path):
    clone = _clone(tmp_path)
    setup = _tool("notebook_setup").setup_source(None)
    code = _recipe("colab") + "\nimport flashlib; print(flashlib.__file__)\n" + setup
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=_without_pythonpath(), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    path, line = done.stdout.splitlines()
    assert path == str(Path("flashlib-course") / "flashlib" / "__init__.py") or Path(path).resolve() == \
        clone / "flashlib" / "__init__.py"
    assert line.startswith("Runtime: ")  # the course's own package, found: nothing installed
