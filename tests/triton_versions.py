"""Where the compile tests find Triton 3.6.0, the version the GPU check's machine runs."""
import os
from concurrent.futures import ThreadPoolExecutor

import pytest


def triton36_dir():
    """The directory holding triton 3.6.0 (FLASHLIB_TRITON36); skips locally, fails in CI."""
    path = os.environ.get("FLASHLIB_TRITON36")
    if not path:
        message = ("FLASHLIB_TRITON36 is not set: install Triton 3.6.0 with `pip install --no-deps "
                   "--target .venv/triton-3.6.0 triton==3.6.0` and point FLASHLIB_TRITON36 at it (make test does)")
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(message)
        pytest.skip(message)
    if not os.path.isdir(os.path.join(path, "triton")):
        pytest.fail(f"FLASHLIB_TRITON36={path} holds no 'triton' package")
    return path


def on_hopper(s) -> bool:
    """The sm_90 specs: the GPU check's machine, an H200, runs Triton 3.6.0."""
    return tuple(s["capability"]) == (9, 0)


def _installed_36():
    try:
        return triton36_dir()
    except (pytest.skip.Exception, pytest.fail.Exception):
        return None


def _run(compile_fn, jobs):
    """{label: compile_fn(specs, triton_path=where)} for jobs {label: (where, specs)}, at once (two
    processes); an empty list of specs starts none."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {label: pool.submit(compile_fn, chosen, triton_path=where) for label, (where, chosen) in jobs.items()
                   if chosen}
        return {label: futures[label].result() if label in futures else [] for label in jobs}


def side_by_side(compile_fn, specs, label36="3.6", *, by_target=False, for_36=None):
    """{"pinned": reports, label36: reports}: compile_fn(specs, triton_path=...) with the pinned
    Triton and with 3.6.0 at once (two processes); 3.6.0 is left out where it is not installed,
    and the test asking for it then skips or fails with triton36_dir()'s reason. for_36: each spec
    compiled once, by 3.6.0 where for_36(spec) holds and by the pinned Triton elsewhere (by the pinned
    Triton all of them where 3.6.0 is missing); by_target: for_36 is on_hopper, each spec compiled with
    the Triton that runs it (3.6.0 the H200's sm_90 specs, the pinned Triton the others)."""
    for_36 = on_hopper if by_target else for_36
    jobs = {"pinned": (None, specs)}
    path = _installed_36()
    if path is not None:
        jobs = {"pinned": (None, [s for s in specs if not for_36(s)] if for_36 else specs),
                label36: (path, [s for s in specs if for_36(s)] if for_36 else specs)}
    return _run(compile_fn, jobs)


def each_once(compile_fn, specs, for_36, label36="3.6") -> list:
    """[(label, report) per spec]: each spec compiled once, by 3.6.0 (label36) where for_36(spec)
    holds and by the pinned Triton ("pinned") elsewhere, the two side by side; the report is None
    where 3.6.0 is not installed (a test then calls triton36_dir()). compile_fn returns one report
    per spec, in order."""
    labels = [label36 if for_36(s) else "pinned" for s in specs]
    path = _installed_36()
    jobs = {label: (where, [s for s, got in zip(specs, labels) if got == label])
            for label, where in (("pinned", None), (label36, path)) if label == "pinned" or path is not None}
    found = {label: iter(reports) for label, reports in _run(compile_fn, jobs).items()}
    return [(label, next(found[label]) if label in found else None) for label in labels]
