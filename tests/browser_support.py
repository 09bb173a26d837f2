"""Helpers for tests/test_browser.py: a throwaway JupyterLab server and headless Chromium.

Everything here starts from a test fixture; nothing runs at import.
"""

from __future__ import annotations

import ast
import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import nbformat

CHROMIUM = Path("/usr/bin/chromium")

# The machine may have no network: these flags stop Chromium from trying to reach
# update, sync and metrics services while the test runs.
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]

# Settings for a fresh JupyterLab: no news or update checks (network), no toasts over
# the notebook in the screenshots, and every cell attached to the page so that errors
# far down the notebook are in the DOM too.
LAB_USER_SETTINGS = {
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {
        "fetchNews": "false",
        "checkForUpdates": False,
        "doNotDisturbMode": True,
    },
}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class LabServer:
    process: subprocess.Popen
    port: int
    token: str
    root_dir: Path
    log_path: Path

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def notebook_url(self, name: str) -> str:
        # reset: start from an empty workspace, not the tabs an earlier test left open
        return f"{self.base_url}/lab/tree/{name}?reset&token={self.token}"

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no server log)"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=15)


def _answers(url: str, token: str) -> bool:
    request = urllib.request.Request(url, headers={"Authorization": f"token {token}"})
    try:
        with urllib.request.urlopen(request, timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def start_lab(root_dir: Path, state_dir: Path, timeout: float = 90.0) -> LabServer:
    """Start JupyterLab from this interpreter's environment on 127.0.0.1 with a random token.

    `state_dir` receives the server's config, runtime, settings and workspace folders, so
    the user's own Jupyter set-up never leaks into the test.
    """
    settings_dir = state_dir / "lab-settings"
    for relative, values in LAB_USER_SETTINGS.items():
        path = settings_dir / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))
    env = dict(os.environ)
    env.update(
        JUPYTER_CONFIG_DIR=str(state_dir / "config"),
        JUPYTER_DATA_DIR=str(state_dir / "data"),
        JUPYTER_RUNTIME_DIR=str(state_dir / "runtime"),
        IPYTHONDIR=str(state_dir / "ipython"),
        PATH=str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", ""),
    )
    env.pop("JUPYTER_PATH", None)
    # A learner's kernel starts without it; flashlib sets it in the kernel when it needs to.
    env.pop("TRITON_INTERPRET", None)
    token = secrets.token_hex(24)
    port = free_port()
    log_path = state_dir / "jupyterlab.log"
    command = [
        sys.executable, "-m", "jupyterlab",
        "--no-browser",
        "--ServerApp.ip=127.0.0.1",
        f"--ServerApp.port={port}",
        "--ServerApp.port_retries=0",
        f"--IdentityProvider.token={token}",
        f"--ServerApp.root_dir={root_dir}",
        f"--LabApp.user_settings_dir={settings_dir}",
        f"--LabApp.workspaces_dir={state_dir / 'workspaces'}",
        "--LabApp.news_url=",
        "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
        "--LabApp.extension_manager=readonly",
        # window.jupyterapp lets the test read kernel status and cell outputs exactly.
        "--LabApp.expose_app_in_browser=True",
        "--ServerApp.terminals_enabled=False",
    ]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        command.append("--allow-root")  # CI containers run as root
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            command, cwd=root_dir, env=env, stdout=log, stderr=subprocess.STDOUT
        )
    server = LabServer(process, port, token, root_dir, log_path)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(
                f"JupyterLab exited with code {process.returncode} before answering:\n"
                + server.log_tail()
            )
        if _answers(f"{server.base_url}/api/status", token):
            return server
        time.sleep(0.5)
    server.stop()
    raise RuntimeError(f"JupyterLab did not answer within {timeout:.0f} s:\n" + server.log_tail())


def launch_chromium(playwright, user_data_dir: Path):
    """Headless Debian Chromium driven by Playwright, with a fresh profile."""
    return playwright.chromium.launch_persistent_context(
        str(user_data_dir),
        executable_path=str(CHROMIUM),
        headless=True,
        args=CHROMIUM_ARGS,
        viewport={"width": 1400, "height": 1000},
    )


# --- reading the notebook page -------------------------------------------------------

# JavaScript run in the page. Each is `(name) => ...` over the open notebook panel whose
# file is `name`; window.jupyterapp exists because the server sets expose_app_in_browser.
_FIND_PANEL = """
  const app = window.jupyterapp;
  const panel = app && Array.from(app.shell.widgets('main')).find(
    w => w.context && w.context.path.split('/').pop() === name);
"""

# The notebook is open and its kernel is idle.
_KERNEL_IDLE_JS = "(name) => {" + _FIND_PANEL + """
  const kernel = panel && panel.sessionContext.session && panel.sessionContext.session.kernel;
  return !!kernel && kernel.status === 'idle' && panel.context.isReady;
}"""

# The kernel is idle and every non-empty code cell has run, or an error stopped Run All
# (so a failing notebook ends the wait early instead of timing out).
_RUN_DONE_JS = "(name) => {" + _FIND_PANEL + """
  const kernel = panel && panel.sessionContext.session && panel.sessionContext.session.kernel;
  if (!kernel || kernel.status !== 'idle') return false;
  const cells = panel.content.model.cells;
  let pending = false;
  for (let i = 0; i < cells.length; i++) {
    const cell = cells.get(i);
    if (cell.type !== 'code') continue;
    if (cell.outputs.toJSON().some(o => o.output_type === 'error')) return true;
    if (cell.sharedModel.getSource().trim() && cell.executionCount == null) pending = true;
  }
  return !pending;
}"""

# Error outputs in the notebook model, as [cell index, ename, evalue].
_MODEL_ERRORS_JS = "(name) => {" + _FIND_PANEL + """
  const found = [];
  const cells = panel.content.model.cells;
  for (let i = 0; i < cells.length; i++) {
    const cell = cells.get(i);
    if (cell.type !== 'code') continue;
    for (const o of cell.outputs.toJSON()) {
      if (o.output_type === 'error') found.push([i, o.ename, o.evalue]);
    }
  }
  return found;
}"""

# Errors and tracebacks render with the stderr MIME type, like warnings do; only the
# traceback text tells them apart. Widget views that failed to render show their own box.
_TRACEBACK = re.compile(r"Traceback \(most recent call last\)|^\s*Cell In\[\d+\], line \d+", re.M)
_DOM_ERROR_SELECTORS = (".jupyter-widgets-error-widget",)


def dom_errors(page) -> list[str]:
    """Texts of everything on the page that a reader would see as an error."""
    found = []
    stderr = page.locator('.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]')
    for text in stderr.all_inner_texts():
        if _TRACEBACK.search(text) or text.startswith("Javascript Error"):
            found.append(text[:2000])
    for selector in _DOM_ERROR_SELECTORS:
        found.extend(t[:2000] for t in page.locator(selector).all_inner_texts())
    return found


def notebook_errors(page, name: str) -> list[str]:
    """Error outputs in the notebook's model (exact) plus errors visible on the page."""
    model = page.evaluate(_MODEL_ERRORS_JS, name)
    return [f"cell {i}: {ename}: {evalue}" for i, ename, evalue in model] + dom_errors(page)


def open_and_run_all(page, server: LabServer, name: str, timeout_ms: int = 180_000) -> None:
    """Open notebook `name` in JupyterLab, wait for its kernel, then Run All from the menu."""
    page.goto(server.notebook_url(name), wait_until="domcontentloaded")
    page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=timeout_ms)
    page.wait_for_function(_KERNEL_IDLE_JS, arg=name, timeout=timeout_ms, polling=250)
    # A stored notebook arrives executed; clearing first makes "every cell has a count" mean
    # "every cell ran now".
    _menu(page, "Edit", "Clear Outputs of All Cells")
    _menu(page, "Run", "Run All Cells")
    page.wait_for_function(_RUN_DONE_JS, arg=name, timeout=timeout_ms, polling=250)


def _menu(page, menu: str, item: str) -> None:
    """Click `item` in the main menu `menu`, as a person would."""
    page.locator(".lm-MenuBar-item", has_text=re.compile(rf"^{re.escape(menu)}$")).click()
    page.locator(".lm-Menu-item", has=page.locator(
        ".lm-Menu-itemLabel", has_text=re.compile(rf"^{re.escape(item)}$"))).click()


def shut_down_kernels(page) -> None:
    """Stop every kernel the page's JupyterLab started, so tests do not share kernels."""
    page.evaluate("() => window.jupyterapp && jupyterapp.serviceManager.sessions.shutdownAll()")


def step_slider(page, label: str = "step"):
    """The first ipywidgets slider whose description is exactly `label`."""
    return page.locator(".widget-slider").filter(
        has=page.locator(".widget-label", has_text=re.compile(rf"^\s*{re.escape(label)}\s*$"))
    ).first


def figure_images(slider):
    """The images of the widget that owns `slider`: the nearest enclosing element with an <img>."""
    return slider.locator("xpath=ancestor::*[.//img][1]").first.locator("img")


def snapshot_images(images, attempts: int = 20) -> list[bytes]:
    """PNG screenshots of each image element, as rendered on the page.

    A redraw may replace or move an <img> while it is being captured ("not attached to the
    DOM", "not stable"): then the images are looked up again and captured afresh.
    """
    from playwright.sync_api import Error as PlaywrightError

    for attempt in range(attempts):
        try:
            return [images.nth(i).screenshot(timeout=5000) for i in range(images.count())]
        except PlaywrightError:
            if attempt == attempts - 1:
                raise
            time.sleep(0.2)
    raise AssertionError("unreachable")


def save_screenshot(page, name: str, folders: list[Path]) -> list[Path]:
    """One full-page screenshot written to every folder in `folders`."""
    data = page.screenshot(full_page=True)
    paths = []
    for folder in folders:
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / name
        path.write_bytes(data)
        paths.append(path)
    return paths


def copy_notebooks(source: Path, destination: Path) -> Path:
    """A scratch copy of the notebooks folder: the test edits and saves only the copy."""
    shutil.copytree(
        source, destination, ignore=shutil.ignore_patterns(".ipynb_checkpoints", "__pycache__")
    )
    return destination


# --- the notebooks' widgets ----------------------------------------------------------

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


def widget_cells(folder: Path) -> list[tuple[str, int]]:
    """(notebook, code cell index) of every stored output that is a widget view, in course order."""
    found = []
    for path in sorted(folder.glob("*.ipynb")):
        notebook = nbformat.read(path, as_version=4)
        for index, cell in enumerate(notebook.cells):
            outputs = cell.get("outputs", []) if cell.cell_type == "code" else []
            if any(WIDGET_VIEW in output.get("data", {}) for output in outputs):
                found.append((path.name, index))
    return found


def _python(source: str) -> str:
    from IPython.core.inputtransformer2 import TransformerManager

    return TransformerManager().transform_cell(source)  # magics become plain calls


def _names(source: str) -> tuple[set[str], set[str]]:
    """(names a cell binds at top level, top-level names it reads without binding them)."""
    import symtable

    table = symtable.symtable(_python(source), "<cell>", "exec")
    bound = {s.get_name() for s in table.get_symbols() if s.is_assigned() or s.is_imported()}
    read = {s.get_name() for s in table.get_symbols() if s.is_referenced()}
    stack = list(table.get_children())
    while stack:  # names that functions and comprehensions read from the top level
        child = stack.pop()
        stack.extend(child.get_children())
        read |= {s.get_name() for s in child.get_symbols() if s.is_global() and s.is_referenced()}
    return bound, read - bound


def cells_needed(path: Path, target: int) -> list[int]:
    """The code cells that cell `target` of notebook `path` needs, and itself, in order.

    A cell needs, for each top-level name it reads, the last earlier cell that binds it, and
    what that cell needs in turn. Cells that act only through side effects are not found: a
    notebook that relies on one fails its widget test with a NameError or a wrong picture.
    """
    cells = nbformat.read(path, as_version=4).cells
    names = {i: _names(c.source) for i, c in enumerate(cells) if c.cell_type == "code"}
    needed, todo = set(), [target]
    while todo:
        index = todo.pop()
        if index in needed:
            continue
        needed.add(index)
        for name in names[index][1]:
            binders = [i for i in names if i < index and name in names[i][0]]
            if binders:  # otherwise a builtin or one of IPython's (display)
                todo.append(binders[-1])
    return sorted(needed)


_CELL_NODE_JS = "([name, index]) => {" + _FIND_PANEL + """
  const cell = panel.content.widgets[index];
  cell.node.setAttribute('data-test-cell', String(index));
  return cell.model.type;
}"""

_RUN_CELL_JS = "([name, index]) => {" + _FIND_PANEL + """
  panel.content.activeCellIndex = index;
  panel.content.deselectAll();
  window.jupyterapp.commands.execute('notebook:run-cell');
}"""

# The cell has run (a fresh execution count) or shows an error, and the kernel is idle.
_CELL_DONE_JS = "([name, index]) => {" + _FIND_PANEL + """
  const kernel = panel && panel.sessionContext.session && panel.sessionContext.session.kernel;
  if (!kernel || kernel.status !== 'idle') return false;
  const cell = panel.content.model.cells.get(index);
  if (cell.outputs.toJSON().some(o => o.output_type === 'error')) return true;
  return cell.executionCount != null;
}"""


_CURRENT_IDLE_JS = """() => {
  const panel = window.jupyterapp.shell.currentWidget;
  const kernel = panel && panel.sessionContext && panel.sessionContext.session
                 && panel.sessionContext.session.kernel;
  return !!kernel && kernel.status === 'idle';
}"""


def wait_for_idle_kernel(page, timeout_ms: int = 60_000) -> None:
    """Wait until the current notebook's kernel is idle: every message of the last move is in."""
    page.wait_for_function(_CURRENT_IDLE_JS, timeout=timeout_ms, polling=50)


def wait_for_settled(page, selector: str, timeout_ms: int = 60_000) -> None:
    """Wait until the kernel is idle and no widget under `selector` is still drawing frames
    ahead (flashlib.course.widgets.FigureBox marks itself while it does)."""
    wait_for_idle_kernel(page, timeout_ms)
    page.wait_for_function("(selector) => !document.querySelector(selector + ' .flashlib-drawing-ahead')",
                           arg=selector, timeout=timeout_ms, polling=50)


def open_notebook(page, server: LabServer, name: str, timeout_ms: int = 180_000) -> None:
    """Open notebook `name` in JupyterLab, wait for its kernel, and clear its stored outputs."""
    page.goto(server.notebook_url(name), wait_until="domcontentloaded")
    page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=timeout_ms)
    page.wait_for_function(_KERNEL_IDLE_JS, arg=name, timeout=timeout_ms, polling=250)
    _menu(page, "Edit", "Clear Outputs of All Cells")


def run_cells(page, name: str, indices: list[int], timeout_ms: int = 180_000) -> None:
    """Run the cells `indices` of the open notebook one by one, as "Run Selected Cell" does;
    stop at the first that shows an error."""
    for index in indices:
        assert page.evaluate(_CELL_NODE_JS, [name, index]) == "code", f"{name} cell {index} is not code"
        page.evaluate(_RUN_CELL_JS, [name, index])
        page.wait_for_function(_CELL_DONE_JS, arg=[name, index], timeout=timeout_ms, polling=100)
        if page.evaluate(_MODEL_ERRORS_JS, name):
            return


def cell_output(page, name: str, index: int):
    """The output area of cell `index` of the open notebook."""
    page.evaluate(_CELL_NODE_JS, [name, index])
    return page.locator(f'[data-test-cell="{index}"] .jp-Cell-outputArea')


# Watch one widget's figure across one move. Installed before the move: the time of the
# first key press or pointer press (event.timeStamp, on performance.now()'s clock), then the
# time the figure's <img> holds a new picture, decoded and ready to paint, and its pixels' hash.
_WATCH_JS = """async (selector) => {
  const root = document.querySelector(selector);
  const image = () => root.querySelector('img');
  const hash = async (img) => {
    await img.decode();
    const canvas = document.createElement('canvas');
    canvas.width = img.naturalWidth; canvas.height = img.naturalHeight;
    const context = canvas.getContext('2d');
    context.drawImage(img, 0, 0);
    const data = new Uint32Array(context.getImageData(0, 0, canvas.width, canvas.height).data.buffer);
    let h = 2166136261;
    for (let i = 0; i < data.length; i++) { h = Math.imul(h ^ data[i], 16777619) >>> 0; }
    return `${canvas.width}x${canvas.height}:${h}`;
  };
  const before = image();
  const state = {input: null, ready: null, before: await hash(before), after: null, src: before.src};
  window.__testMove = state;
  const onInput = (event) => { if (state.input === null) state.input = event.timeStamp; };
  document.addEventListener('keydown', onInput, {capture: true, once: true});
  document.addEventListener('pointerdown', onInput, {capture: true, once: true});
  let seen = false;
  const observer = new MutationObserver(async () => {
    const img = image();
    if (seen || !img || img.src === state.src) return;
    seen = true;
    observer.disconnect();
    try { await img.decode(); } catch (error) { state.error = String(error); }
    state.ready = performance.now();
    state.after = await hash(img);
  });
  observer.observe(root, {subtree: true, childList: true, attributes: true, attributeFilter: ['src']});
  return state.before;
}"""

_MOVE_DONE_JS = "() => window.__testMove && (window.__testMove.after !== null || !!window.__testMove.error)"


@dataclass
class Move:
    control: str
    ms: float | None  # from the input event to the new picture, ready to paint
    changed: bool


def watched_move(page, selector: str, act, control: str, timeout_ms: int = 30_000) -> Move:
    """Do `act()` (one key press or click) and time the figure under `selector` changing."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    page.evaluate(_WATCH_JS, selector)
    act()
    try:
        page.wait_for_function(_MOVE_DONE_JS, timeout=timeout_ms, polling=50)
    except PlaywrightTimeout:
        return Move(control, None, False)
    state = page.evaluate("() => window.__testMove")
    ms = None if state["input"] is None else state["ready"] - state["input"]
    return Move(control, ms, state["after"] != state["before"])


def watch_console(page) -> list[str]:
    """Everything the page logs as an error, and uncaught exceptions, as they happen."""
    errors: list[str] = []
    page.on("console", lambda message: errors.append(f"console.{message.type}: {message.text}")
            if message.type == "error" else None)
    page.on("pageerror", lambda error: errors.append(f"uncaught: {error}"))
    return errors
