"""Where the compile tests find Triton 3.6.0, the version the GPU check's machine runs."""
import os

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
