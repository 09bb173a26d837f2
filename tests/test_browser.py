"""Notebook 03 in a real browser: JupyterLab in headless Chromium, Run All, move the step slider.

Needs Debian's Chromium at /usr/bin/chromium (`bash tools/ensure_chromium.sh` installs it).
Without it the tests skip, except in CI (CI=true), where a missing browser is a failure.
Screenshots go to pytest's tmp_path and to test-output/browser/ for a person to look at.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import nbformat
import pytest

from .browser_support import (
    CHROMIUM,
    copy_notebooks,
    dom_errors,
    figure_images,
    launch_chromium,
    notebook_errors,
    open_and_run_all,
    save_screenshot,
    shut_down_kernels,
    snapshot_images,
    start_lab,
    step_slider,
)

pytestmark = pytest.mark.browser

REPO = Path(__file__).resolve().parents[1]
NOTEBOOK = "03_tiled_attention.ipynb"
HARNESS_NOTEBOOK = "browser_harness_check.ipynb"
FAILING_NOTEBOOK = "browser_harness_error.ipynb"
SCREENSHOTS = REPO / "test-output" / "browser"


def _require_chromium() -> None:
    if CHROMIUM.exists():
        return
    reason = f"{CHROMIUM} is missing: run `bash tools/ensure_chromium.sh` as root to install it"
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true and {reason}", pytrace=False)
    pytest.skip(reason)


def _write_notebook(path: Path, sources: list[str]) -> None:
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s) for s in sources])
    notebook.metadata["kernelspec"] = {
        "name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"
    }
    nbformat.write(notebook, path)


def _write_harness_notebooks(root: Path) -> None:
    """Scratch notebooks whose behaviour is known, to check the harness itself: a tiny
    stepper (IntSlider "step" redrawing a matplotlib figure) after a stderr line, and a
    notebook whose second cell raises."""
    _write_notebook(root / HARNESS_NOTEBOOK, [
            "import sys\n"
            "import ipywidgets as widgets\n"
            "import matplotlib.pyplot as plt\n"
            "print('a warning-like line on stderr', file=sys.stderr)",
            "def draw(step):\n"
            "    fig, ax = plt.subplots(figsize=(3, 2))\n"
            "    ax.bar(range(6), [1 if i <= step else 0.1 for i in range(6)])\n"
            "    ax.set_title(f'step {step}')\n"
            "    plt.show()\n"
            "\n"
            "slider = widgets.IntSlider(value=0, min=0, max=5, description='step')\n"
            "widgets.interactive(draw, step=slider)",
    ])
    _write_notebook(root / FAILING_NOTEBOOK, ["x = 1", "1 / 0", "y = 2"])


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    _require_chromium()
    root = copy_notebooks(REPO / "notebooks", tmp_path_factory.mktemp("lab") / "notebooks")
    _write_harness_notebooks(root)
    server = start_lab(root, tmp_path_factory.mktemp("lab-state"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def browser(lab, tmp_path_factory):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        context = launch_chromium(playwright, tmp_path_factory.mktemp("chromium-profile"))
        try:
            yield context
        finally:
            context.close()


@pytest.fixture
def page(browser):
    page = browser.new_page()
    page.set_default_timeout(60_000)
    yield page
    try:
        shut_down_kernels(page)
    finally:
        page.close()


def _step_and_compare(page, server, name: str, folders: list[Path]) -> None:
    """Run all of `name`, press ArrowRight on its step slider, assert the figure changed."""
    stem = Path(name).stem
    try:
        open_and_run_all(page, server, name)
        errors = notebook_errors(page, name)
        assert not errors, f"{name} shows errors after Run All:\n" + "\n".join(errors)

        slider = step_slider(page)
        slider.wait_for(state="visible")
        handle = slider.locator(".noUi-handle").first
        readout = slider.locator(".widget-readout")
        images = figure_images(slider)
        images.first.wait_for(state="visible")
        slider.scroll_into_view_if_needed()
        before_value = readout.inner_text()
        before = snapshot_images(images)
        save_screenshot(page, f"{stem}-before.png", folders)

        handle.focus()
        page.keyboard.press("ArrowRight")
        deadline = time.monotonic() + 30
        after = before
        while time.monotonic() < deadline:
            images.first.wait_for(state="visible")
            after = snapshot_images(images)
            if after != before:
                break
            page.wait_for_timeout(200)
        save_screenshot(page, f"{stem}-after.png", folders)

        assert readout.inner_text() != before_value, "the step slider did not move"
        assert after != before, "the figure did not change after the step slider moved"
        errors = notebook_errors(page, name)
        assert not errors, f"{name} shows errors after moving the slider:\n" + "\n".join(errors)
    finally:
        save_screenshot(page, f"{stem}-final.png", folders)


def test_harness_on_a_known_stepper(page, lab, tmp_path):
    """The harness itself: a scratch stepper changes its figure; stderr is no error."""
    _step_and_compare(page, lab, HARNESS_NOTEBOOK, [tmp_path, SCREENSHOTS])


def test_harness_reports_a_failing_cell(page, lab, tmp_path):
    """Run All stops at a raising cell; the harness must stop waiting and name the error."""
    try:
        open_and_run_all(page, lab, FAILING_NOTEBOOK)
        errors = notebook_errors(page, FAILING_NOTEBOOK)
    finally:
        save_screenshot(page, "browser_harness_error.png", [tmp_path])
    assert any(e.startswith("cell 1: ZeroDivisionError") for e in errors), errors
    assert any("Traceback (most recent call last)" in e for e in errors), errors


def test_error_detection_sees_tracebacks_not_warnings(page):
    """dom_errors must flag a rendered traceback and let a stderr warning through."""
    stderr = 'class="jp-OutputArea-output" data-mime-type="application/vnd.jupyter.stderr"'
    page.set_content(
        f"<div {stderr}><pre>UserWarning: a harmless warning</pre></div>"
    )
    assert dom_errors(page) == []
    page.set_content(
        f"<div {stderr}><pre>ValueError    Traceback (most recent call last)\n"
        "Cell In[2], line 1\nValueError: bad</pre></div>"
    )
    assert len(dom_errors(page)) == 1


def test_notebook_03_steps_in_the_browser(page, lab, tmp_path):
    """Notebook 03 runs in JupyterLab without errors and its step slider redraws the figure."""
    assert (lab.root_dir / NOTEBOOK).exists(), f"notebooks/{NOTEBOOK} is missing"
    _step_and_compare(page, lab, NOTEBOOK, [tmp_path, SCREENSHOTS])
