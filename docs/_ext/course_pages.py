"""Pages of the course's site made from the package: one API page per room, and the labs.

Written into the build's source folder when the builder starts, so they follow the code:
a new module appears on its room's page, a new lab on the labs page, without an edit here.
"""
from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path

# (page, title, what the room holds, the modules' prefix); top-level modules not named in
# PUBLIC_OPS are the reference room's.
ROOMS = [
    ("reference", "Reference algorithms",
     "The rules the course teaches and the algorithms of notebooks 01-04 and 09, in plain PyTorch: "
     "any device, differentiable, no Triton.", None),
    ("ops", "Public ops",
     "`flash_attention` and `flash_attention_varlen`, decoding from a KV cache, ring attention "
     "across processes, and flashlib's attention inside Hugging Face transformers.", None),
    ("machinery", "Machinery",
     "What the ops run on: the trace of mask and score functions, the walk over what they capture, the "
     "checks of every argument and the options of a call, checked once.", "flashlib.machinery"),
    ("kernels", "Teaching kernels",
     "The Triton kernels of notebooks 05-07 and 10, the rules they share with the reference, "
     "the interpreter set-up and compiling for GPU targets.", "flashlib.kernels"),
    ("ladder", "The optimisation ladder",
     "The faster rungs of notebook 08, forward and backward, their table and autotuner.", "flashlib.ladder"),
    ("course", "Course support",
     "The figures, steppers, exercise checkers and small models the notebooks use.", "flashlib.course"),
    ("labs", "Labs",
     "The labs' checkers, hints and harness kernels (the worked solutions are left out of the site).",
     "flashlib.labs"),
    ("bench", "Measurement",
     "The CPU and GPU benchmarks, the GPU check, recorded runs and their figures.", "flashlib.bench"),
]
PUBLIC_OPS = {"flashlib.op", "flashlib.decode", "flashlib.distributed", "flashlib.hf"}
LEFT_OUT = ("flashlib.labs.solutions",)  # spoilers on a page a learner reads before the lab


def package_modules() -> list[str]:
    """Every public module of flashlib, by name."""
    import flashlib

    names = []
    for info in pkgutil.walk_packages(flashlib.__path__, "flashlib."):
        parts = info.name.split(".")
        if any(p.startswith("_") for p in parts) or info.name.startswith(LEFT_OUT):
            continue
        names.append(info.name)
    return names


def rooms() -> dict[str, list[str]]:
    """page -> the modules on it; every public module is on exactly one page."""
    found = {page: [] for page, *_ in ROOMS}
    for name in package_modules():
        prefix = next((p for p, *_, pre in ROOMS if pre and (name == pre or name.startswith(pre + "."))), None)
        if prefix is None:
            prefix = "ops" if name in PUBLIC_OPS else "reference"
        found[prefix].append(name)
    return found


def _public_names() -> list[str]:
    """flashlib's own public names, by where each is defined (where its page documents it)."""
    import flashlib

    names = []
    for name in flashlib.__all__:
        obj = getattr(flashlib, name)
        module = getattr(obj, "__module__", None) or getattr(obj, "__name__", None)
        names.append(f"{module}.{name}" if module != obj.__name__ else module)
    return names


def _room_page(page: str, title: str, text: str, modules: list[str]) -> str:
    lines = [f"# {title}", "", text, "", "```{eval-rst}", ".. autosummary::", ""]
    lines += [f"   {m}" for m in modules] + ["```", ""]
    if page == "reference":
        # the names before the module: autosummary reads them from where they are defined
        lines += ["## `flashlib`", "", "```{eval-rst}", ".. autosummary::", ""]
        lines += [f"   {n}" for n in _public_names()]
        lines += ["", ".. automodule:: flashlib", "   :no-members:", "```", ""]
    for module in modules:
        lines += [f"## `{module}`", "", "```{eval-rst}", f".. automodule:: {module}", "```", ""]
    return "\n".join(lines)


def _api_index() -> str:
    lines = ["# The package", "",
             "The package the notebooks import, room by room, from its docstrings. Tensors are "
             "(batch, heads, seq, head_dim) throughout.", "",
             "```{toctree}", ":maxdepth: 1", ""]
    lines += [page for page, *_ in ROOMS] + ["```", ""]
    return "\n".join(lines)


def _labs_page() -> str:
    from flashlib.labs.catalog import LABS, MISTAKES

    lines = ["# Labs", "",
             "Most notebooks end with a lab: you write one piece of FlashAttention, "
             "`labs.check(name, fn)` runs it over awkward cases and names the mistake when it "
             "recognises one, `labs.hint(name)` gives three hints one at a time, and "
             "`labs.solution(name)` a worked solution (in the notebook, not here).", ""]
    from myst_parser.mdit_to_docutils.base import default_slugify  # the notebooks' heading anchors

    for spec in LABS.values():
        anchor = default_slugify(f"Lab: {spec.title}")  # labs.cells.markdown_cell's heading
        lines += [f"## {spec.title}", "",
                  f"In [notebook {spec.notebook[:2]}](notebooks/{spec.notebook}.ipynb#{anchor}).",
                  "", spec.task, "", "```python", spec.signature, "```", "",
                  "The checker tries " + ", ".join(spec.tries) + ".", ""]
        known = [MISTAKES[m][0] for m in spec.mistakes if m in MISTAKES]
        if known:
            lines += ["Mistakes it names: " + "; ".join(known) + ".", ""]
        for number, hint in enumerate(spec.hints, start=1):
            lines += [f"<details><summary>Hint {number}</summary>", "", hint, "", "</details>", ""]
    return "\n".join(lines)


def write_pages(srcdir: Path) -> list[Path]:
    """The API pages under api/ and labs.md, in `srcdir`."""
    api = srcdir / "api"
    api.mkdir(parents=True, exist_ok=True)
    written = {api / "index.md": _api_index(), srcdir / "labs.md": _labs_page()}
    found = rooms()
    for page, title, text, _ in ROOMS:
        written[api / f"{page}.md"] = _room_page(page, title, text, found[page])
    for path, text in written.items():
        path.write_text(text, encoding="utf-8")
    return list(written)


def _on_builder_inited(app) -> None:
    for module in package_modules():
        importlib.import_module(module)  # a module that cannot import fails here, by name
    write_pages(Path(app.srcdir))


def setup(app):
    app.connect("builder-inited", _on_builder_inited)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
