"""The course's widgets in a real browser: JupyterLab in headless Chromium, every control moved.

Each notebook whose stored outputs hold a widget view is opened in JupyterLab; the cells its
widget cell needs are run (`browser_support.cells_needed`: the cells that bind the names it
reads, and theirs, not Run All, whose Triton-interpreter, model and process-spawning cells
would take minutes; nbval runs every notebook whole), then the widget cell itself. Every
slider moves two positions by key presses, every toggle is clicked twice, and each move must
show a new picture within 300 ms of the input, with no error output and no browser console
error. Each move starts from a settled widget: its kernel idle and the frames one move away
drawn ahead (`flashlib.course.widgets.FigureBox`), as they are a moment after a learner's move. Scratch notebooks check the harness itself: a slow redraw, a picture that does not
change, a raising cell and a console error are each caught.

Needs Debian's Chromium at /usr/bin/chromium (`bash tools/ensure_chromium.sh` installs it).
Without it the tests skip, except in CI (CI=true), where a missing browser is a failure.
Screenshots go to pytest's tmp_path and to test-output/browser/ for a person to look at.
"""

from __future__ import annotations

import os
from pathlib import Path

import nbformat
import pytest

from .browser_support import (
    CHROMIUM,
    Move,
    cell_output,
    cells_needed,
    copy_notebooks,
    dom_errors,
    launch_chromium,
    notebook_errors,
    open_and_run_all,
    open_notebook,
    run_cells,
    save_screenshot,
    shut_down_kernels,
    start_lab,
    wait_for_settled,
    watch_console,
    watched_move,
    widget_cells,
)

pytestmark = [pytest.mark.browser, pytest.mark.timed]  # timed: make test runs these alone

REPO = Path(__file__).resolve().parents[1]
HARNESS_NOTEBOOK = "browser_harness_check.ipynb"
LATENCY_NOTEBOOK = "browser_harness_latency.ipynb"
FAILING_NOTEBOOK = "browser_harness_error.ipynb"
SCREENSHOTS = REPO / "test-output" / "browser"
LATENCY_MS = 300
# Notebooks known to hold a widget: a stored output losing its widget view must not
# silently drop a notebook from the test.
COURSE_WIDGETS = {"02", "03", "10", "11", "12"}
WIDGETS = widget_cells(REPO / "notebooks")


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
    stepper (IntSlider "step" redrawing a matplotlib figure) after a stderr line; an Image
    under three sliders that redraw fast, slowly (0.6 s) and not at all; and a notebook
    whose second cell raises."""
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
    _write_notebook(root / LATENCY_NOTEBOOK, [
            "import io, time\n"
            "import ipywidgets as widgets\n"
            "from matplotlib.figure import Figure\n"
            "\n"
            "def frame(n):\n"
            "    fig = Figure(figsize=(2, 1))\n"
            "    fig.add_subplot().bar(range(6), [1 if i <= n else 0.1 for i in range(6)])\n"
            "    buf = io.BytesIO()\n"
            "    fig.savefig(buf, format='png')\n"
            "    return buf.getvalue()",
            "image = widgets.Image(value=frame(0), format='png')\n"
            "fast, slow, still = (widgets.IntSlider(value=0, min=0, max=5, description=d)\n"
            "                     for d in ('fast', 'slow', 'still'))\n"
            "fast.observe(lambda change: setattr(image, 'value', frame(change.new)), 'value')\n"
            "slow.observe(lambda change: (time.sleep(0.6), setattr(image, 'value', frame(change.new))), 'value')\n"
            "widgets.VBox([fast, slow, still, image])",
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
    page.console_errors = watch_console(page)
    yield page
    try:
        shut_down_kernels(page)
    finally:
        page.close()


# --- moving a widget's controls ------------------------------------------------------

def _slider_moves(page, slider, selector: str, label: str, timeout_ms: int) -> list[Move]:
    """Two key presses on the slider's handle: two new positions (back again on a range of two)."""
    handle = slider.locator(".noUi-handle").first
    readout = slider.locator(".widget-readout")
    now, low, high = (float(handle.get_attribute(f"aria-value{a}")) for a in ("now", "min", "max"))
    keys = (["ArrowRight"] * 2 if now + 2 <= high else ["ArrowLeft"] * 2 if now - 2 >= low
            else ["ArrowRight", "ArrowLeft"] if now < high else ["ArrowLeft", "ArrowRight"])
    moves = []
    for key in keys:
        before = readout.inner_text()
        handle.focus()
        move = watched_move(page, selector, lambda: page.keyboard.press(key), f"{label} {key}", timeout_ms)
        assert readout.inner_text() != before, f"slider {label!r} did not move on {key}"
        moves.append(move)
        wait_for_settled(page, selector)
    return moves


def _click_moves(page, buttons, selector: str, label: str, timeout_ms: int) -> list[Move]:
    """Two clicks that each change the control's value: a toggle twice, or two other options."""
    moves = []
    for _ in range(2):
        options = [buttons.nth(i) for i in range(buttons.count())]
        target = next(b for b in options if "mod-active" not in (b.get_attribute("class") or "")) \
            if len(options) > 1 else options[0]
        text = target.inner_text().strip()
        moves.append(watched_move(page, selector, target.click, f"{label} {text}", timeout_ms))
        wait_for_settled(page, selector)
    return moves


def move_every_control(page, output, selector: str, timeout_ms: int = 10_000) -> list[Move]:
    """Every slider and toggle in `output`, in page order, each moved twice."""
    moves = []
    controls = output.locator(".widget-slider, .widget-toggle-buttons, button.widget-toggle-button")
    for i in range(controls.count()):
        control = controls.nth(i)
        classes = control.get_attribute("class") or ""
        if "widget-toggle-buttons" not in classes and control.evaluate(
                "el => !!el.parentElement.closest('.widget-toggle-buttons')"):
            continue  # one option of a group, moved with its group
        label = control.locator(".widget-label").first.inner_text().strip() \
            if control.locator(".widget-label").count() else control.inner_text().strip()
        if "widget-slider" in classes:
            moves += _slider_moves(page, control, selector, label, timeout_ms)
        elif "widget-toggle-buttons" in classes:
            moves += _click_moves(page, control.locator("button"), selector, label, timeout_ms)
        else:
            moves += _click_moves(page, control, selector, label, timeout_ms)
    return moves


def _report(moves: list[Move]) -> str:
    return "\n".join(f"  {m.control}: " + ("no new picture" if m.ms is None or not m.changed
                                            else f"{m.ms:.0f} ms") for m in moves)


def check_widget(page, server, name: str, index: int, cells: list[int], folders: list[Path],
                 timeout_ms: int = 10_000) -> list[Move]:
    """Run `cells` of notebook `name`, then move every control of the widget in cell `index`."""
    stem = f"{Path(name).stem}-cell{index}"
    try:
        open_notebook(page, server, name)
        run_cells(page, name, cells)
        errors = notebook_errors(page, name)
        assert not errors, f"{name} shows errors after running cells {cells}:\n" + "\n".join(errors)
        output = cell_output(page, name, index)
        selector = f'[data-test-cell="{index}"] .jp-Cell-outputArea'
        output.locator(".jupyter-widgets img").first.wait_for(state="visible")
        output.scroll_into_view_if_needed()
        wait_for_settled(page, selector)
        save_screenshot(page, f"{stem}-before.png", folders)
        moves = move_every_control(page, output, selector, timeout_ms)
        assert moves, f"{name} cell {index}: no slider or toggle found in the widget"
        errors = notebook_errors(page, name) + page.console_errors
        assert not errors, f"{name} shows errors after moving its controls:\n" + "\n".join(errors)
        return moves
    finally:
        save_screenshot(page, f"{stem}-after.png", folders)


def _assert_fast(name: str, moves: list[Move]) -> None:
    slow = [m for m in moves if m.ms is None or not m.changed or m.ms > LATENCY_MS]
    assert not slow, (f"{name}: each move must show a new picture within {LATENCY_MS} ms; "
                      f"moves:\n{_report(moves)}")


# --- the harness itself ---------------------------------------------------------------

def test_harness_on_a_known_stepper(page, lab, tmp_path):
    """A scratch interactive stepper passes; its stderr line is no error."""
    moves = check_widget(page, lab, HARNESS_NOTEBOOK, 1, [0, 1], [tmp_path])
    assert [m.control for m in moves] == ["step ArrowRight", "step ArrowRight"]
    assert all(m.changed for m in moves), _report(moves)


def test_harness_times_each_move(page, lab, tmp_path):
    """A slow redraw is measured as slow, a picture that does not change is seen as such."""
    moves = check_widget(page, lab, LATENCY_NOTEBOOK, 1, [0, 1], [tmp_path], timeout_ms=2000)
    by_slider = {label: [m for m in moves if m.control.startswith(label)] for label in ("fast", "slow", "still")}
    assert all(len(found) == 2 for found in by_slider.values()), _report(moves)
    assert all(m.changed and m.ms is not None for m in by_slider["fast"] + by_slider["slow"]), _report(moves)
    assert all(m.ms >= 600 for m in by_slider["slow"]), _report(moves)
    assert not any(m.changed for m in by_slider["still"]), _report(moves)
    print(_report(moves))
    with pytest.raises(AssertionError, match="within 300 ms"):
        _assert_fast(LATENCY_NOTEBOOK, moves)


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


def test_console_errors_are_collected(page):
    page.set_content("<p>console</p>")
    page.evaluate("console.warn('only a warning'); console.error('an error')")
    page.evaluate("setTimeout(() => { throw new Error('thrown later'); }, 0)")
    page.wait_for_timeout(200)
    assert any(e == "console.error: an error" for e in page.console_errors), page.console_errors
    assert any("thrown later" in e for e in page.console_errors), page.console_errors
    assert not any("only a warning" in e for e in page.console_errors)


# --- the course -----------------------------------------------------------------------

def test_every_course_widget_is_found():
    found = {name[:2] for name, _ in WIDGETS}
    assert COURSE_WIDGETS <= found, f"no stored widget view in notebooks {sorted(COURSE_WIDGETS - found)}"


@pytest.mark.parametrize(("name", "index"), WIDGETS, ids=[f"{n[:2]}-cell{i}" for n, i in WIDGETS])
def test_course_widget_in_the_browser(page, lab, tmp_path, name, index):
    """The widget cell runs in JupyterLab and every control redraws its figure within 300 ms."""
    cells = cells_needed(lab.root_dir / name, index)
    moves = check_widget(page, lab, name, index, cells, [tmp_path, SCREENSHOTS])
    print(f"{name} cells {cells}:\n{_report(moves)}")
    _assert_fast(name, moves)
