"""A test's CPU seconds beside its wall seconds in the junit XML (property ``cpu_seconds``): this process's
and its finished subprocesses' (compilers, fresh interpreters), set-up to tear-down. Wall time far above CPU
time is a test that waits (a timeout, a sleeping child), which a second worker per core could fill;
tools/test_durations.py sums both per file. A notebook kernel's CPU is not counted: it ends with its file."""
from __future__ import annotations

import resource

import pytest

_START = pytest.StashKey[float]()


def cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    item.stash[_START] = cpu_seconds()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    # the tear-down report carries the test's properties into the XML: add it before that report is made
    if call.when == "teardown" and _START in item.stash:
        item.user_properties.append(("cpu_seconds", round(cpu_seconds() - item.stash[_START], 2)))
    yield
