"""Where the grader runs students' code: a bubblewrap sandbox, and the student edition of the package.

``bwrap`` (Debian's ``bubblewrap``) starts a process with no network, its own process ids (the grader and
every other process are out of sight), its own empty /tmp and /work, no capabilities, and a read-only view
of what it is given and nothing else: the Python installation, its site-packages, the system's libraries,
and a copy of the course's package as students get it, with no worked solutions or answers
(:func:`package_copy`). It ends when the grader does (``--die-with-parent``). Where ``bwrap`` is missing or
cannot make a sandbox here, :func:`find` says why, and the grader says that it runs unsandboxed.
"""
from __future__ import annotations

import ast
import compileall
import os
import shutil
import site
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent  # the course's flashlib/
SOLUTIONS = Path("labs") / "solutions"  # the labs' worked solutions, left out of the student edition
ANSWERS = Path("course") / "answers.py"  # the exercises' worked answers, left out too
_LEFT_OUT = ("__pycache__", "*.egg-info", ".ipynb_checkpoints", ".flashlib-progress.json")
COURSE = "/course"  # where the package copy is, inside the sandbox
INSIDE_UID = 1000
_SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_ETC = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime", "/etc/nsswitch.conf",
        "/etc/passwd", "/etc/group")


@dataclass(frozen=True)
class Sandbox:
    """How cells are run: ``prefix`` is the bwrap command that wraps each worker (None: no sandbox), ``why``
    the line the grader prints about it."""

    prefix: tuple[str, ...] | None
    why: str
    binds: tuple[str, ...] = field(default=())

    @property
    def sandboxed(self) -> bool:
        return self.prefix is not None


def package_copy(dest: Path, source: Path = PACKAGE, *, hints: int | None = None, compiled: bool = True) -> Path:
    """The student edition's package: ``source`` copied to ``dest``/flashlib without the worked solutions and
    answers; with ``hints``, the hints past the first ``hints`` of every lab and exercise are emptied in its
    files (:func:`strip_hints`); ``compiled``, with its bytecode (a read-only copy cannot write its own).
    Returns ``dest``/flashlib."""
    out = Path(dest) / "flashlib"
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(source, out, ignore=shutil.ignore_patterns(*_LEFT_OUT))
    shutil.rmtree(out / SOLUTIONS, ignore_errors=True)
    (out / ANSWERS).unlink(missing_ok=True)
    if hints is not None:
        for path in sorted(out.rglob("*.py")):
            strip_hints(path, hints)
    if compiled:
        compileall.compile_dir(out, quiet=2, workers=1)
    return out


_HINTED = {"Lab": 7, "HintSteps": 0}  # a call of these, and the position of its first hint argument


def strip_hints(path: Path, hints: int) -> bool:
    """Empty, in the file ``path``, every hint past the first ``hints`` of a lab (the tuple ``Lab(...)`` is
    given) and of an exercise's steps (``HintSteps(...)``); whether the file changed."""
    source = path.read_bytes()
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return False
    spans = []
    for node in ast.walk(tree):
        name = getattr(node.func, "id", None) if isinstance(node, ast.Call) else None
        if name not in _HINTED:
            continue
        given = node.args[_HINTED[name]:]
        if name == "Lab":
            given = given[0].elts if given and isinstance(given[0], ast.Tuple) else []
        spans += [(n.lineno, n.col_offset, n.end_lineno, n.end_col_offset) for n in given[hints:]
                  if isinstance(n, ast.Constant) and isinstance(n.value, str)]
    if not spans:
        return False
    starts = [0]
    for line in source.splitlines(keepends=True):
        starts.append(starts[-1] + len(line))
    for line, col, end_line, end_col in sorted(spans, reverse=True):  # offsets are in bytes, as ast gives them
        source = source[:starts[line - 1] + col] + b'""' + source[starts[end_line - 1] + end_col:]
    path.write_bytes(source)
    return True


def _python_roots() -> list[str]:
    """Folders the interpreter needs: its installation, the environment's, their site-packages."""
    roots = {sys.base_prefix, sys.prefix, sys.exec_prefix, *site.getsitepackages()}
    user = site.getusersitepackages()
    if isinstance(user, str) and os.path.isdir(user):
        roots.add(user)
    keep = sorted(str(Path(r).resolve()) for r in roots if Path(r).is_dir())
    return [r for r in keep if not any(r != o and r.startswith(o.rstrip("/") + "/") for o in keep)]


def _hidden(roots, excluded) -> list[str]:
    """Folders inside ``roots`` that the sandbox covers with an empty one: a flashlib installed there (not the
    copy the cells get), and whatever of ``excluded`` (the course, the class, the grader's output) lies there."""
    found = []
    for root in map(Path, roots):
        found += [str(p.parent) for p in root.glob("flashlib/__init__.py")]
    for path in map(lambda x: Path(x).resolve(), excluded):
        folder = path if path.is_dir() else path.parent
        if any(folder.is_relative_to(root) for root in roots):
            found.append(str(folder))
    return sorted(set(found))


def _system_binds() -> list[str]:
    args = []
    for path in _SYSTEM:
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    for path in _ETC:
        args += ["--ro-bind-try", path, path]
    for device in sorted(Path("/dev").glob("nvidia*")):  # a GPU, for the kernel labs' compiled runs
        if not device.is_dir():
            args += ["--dev-bind", str(device), str(device)]
    return args


def command(package_dir: Path, excluded=()) -> list[str]:
    """The bwrap command (up to ``--``) that sandboxes a worker with ``package_dir`` (a package copy's folder)
    as /course."""
    roots = _python_roots()
    # the empty folders first: a later bind inside one of them (a Python under /tmp) stays visible
    # --as-pid-1: the worker is its namespace's init, which no process inside can kill or stop
    args = ["bwrap", "--unshare-all", "--unshare-user", "--uid", str(INSIDE_UID), "--gid", str(INSIDE_UID),
            "--die-with-parent", "--new-session", "--as-pid-1", "--cap-drop", "ALL", "--proc", "/proc", "--dev", "/dev",
            "--tmpfs", "/tmp", "--tmpfs", "/work", *_system_binds()]
    for root in roots:
        args += ["--ro-bind", root, root]
    for folder in _hidden(roots, [PACKAGE.parent, *excluded]):
        args += ["--tmpfs", folder]
    return [*args, "--ro-bind", str(package_dir), COURSE, "--chdir", "/work", "--"]


def find(package_dir: Path, excluded=()) -> Sandbox:
    """The sandbox this machine can give (tried once with this Python), or why there is none."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return Sandbox(None, "NOT SANDBOXED: bubblewrap (bwrap) is not installed here (Debian: apt-get install "
                             "bubblewrap); every cell can read and write what the grader can")
    prefix = command(package_dir, excluded)
    probe = [*prefix, sys.executable, "-I", "-c", "import os; print(os.getpid())"]
    try:
        done = subprocess.run(probe, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as error:
        return Sandbox(None, f"NOT SANDBOXED: bwrap could not start ({error})")
    if done.returncode != 0 or done.stdout.strip() != "1":
        detail = (done.stderr.strip().splitlines() or ["no message"])[-1]
        return Sandbox(None, f"NOT SANDBOXED: bwrap could not make a sandbox here ({detail})")
    version = subprocess.run([bwrap, "--version"], capture_output=True, text=True).stdout.strip() or "bwrap"
    return Sandbox(tuple(prefix), f"sandboxed with {version}: each worker in its own namespaces (no network, no "
                                  "other process, read-only package and Python), one cell at a time",
                   tuple(_python_roots()))
