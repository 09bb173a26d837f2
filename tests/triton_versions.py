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


def side_by_side(compile_fn, specs, label36="3.6", *, by_target=False):
    """{"pinned": reports, label36: reports}: compile_fn(specs, triton_path=...) with the pinned
    Triton and with 3.6.0 at once (two processes); 3.6.0 is left out where it is not installed,
    and the test asking for it then skips or fails with triton36_dir()'s reason. by_target: each
    spec compiled once, with the Triton that runs it: 3.6.0 the sm_90 specs (the GPU check's machine,
    an H200, runs 3.6.0), the pinned Triton the others (all of them where 3.6.0 is missing)."""
    jobs = {"pinned": (None, specs)}
    try:
        path = triton36_dir()
    except (pytest.skip.Exception, pytest.fail.Exception):
        path = None
    if path is not None:
        hopper = [s for s in specs if tuple(s["capability"]) == (9, 0)]
        jobs = {"pinned": (None, [s for s in specs if s not in hopper] if by_target else specs),
                label36: (path, hopper if by_target else specs)}
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {label: pool.submit(compile_fn, chosen, triton_path=where) for label, (where, chosen) in jobs.items()}
        return {label: f.result() for label, f in futures.items()}
