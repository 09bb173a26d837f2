import os

from hypothesis import HealthCheck, settings

# CI gets a fixed, moderate budget; FLASHLIB_HYPOTHESIS=thorough runs many more cases.
settings.register_profile("default", max_examples=40, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("thorough", max_examples=500, deadline=None)
settings.register_profile("quick", max_examples=8, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("FLASHLIB_HYPOTHESIS", "default"))

# Choose between compiled kernels and Triton's interpreter before anything imports triton
# (triton fixes some of its language functions to one mode at first import).
import flashlib.kernels  # noqa: E402,F401

from .cpu_seconds import pytest_runtest_makereport, pytest_runtest_setup  # noqa: E402,F401  (CPU seconds per test)
