"""Helpers for tests/test_browser.py: a throwaway JupyterLab server and headless Chromium.

Everything here starts from a test fixture; nothing runs at import.
"""

from __future__ import annotations

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
