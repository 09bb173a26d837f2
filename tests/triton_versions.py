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


def side_by_side(compile_fn, specs, label36="3.6", *, only_hopper36=False):
    """{"pinned": reports, label36: reports}: compile_fn(specs, triton_path=...) with the pinned
    Triton and with 3.6.0 at once (two processes); 3.6.0 is left out where it is not installed,
    and the test asking for it then skips or fails with triton36_dir()'s reason. only_hopper36:
    3.6.0 compiles the sm_90 specs only (the GPU check's machine, an H200, is where it runs them;
    the other targets are compiled with the pinned Triton)."""
    jobs = {"pinned": (None, specs)}
    try:
        hopper = [s for s in specs if tuple(s["capability"]) == (9, 0)] if only_hopper36 else specs
        jobs[label36] = (triton36_dir(), hopper)
    except (pytest.skip.Exception, pytest.fail.Exception):
        pass
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {label: pool.submit(compile_fn, chosen, triton_path=path) for label, (path, chosen) in jobs.items()}
        return {label: f.result() for label, f in futures.items()}
