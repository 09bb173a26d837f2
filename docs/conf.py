"""Sphinx configuration of the course's site: `make site` (tools/build_site.py) builds it.

The sources are laid out by tools/build_site.py in build/site-src: this folder's pages, the
stored notebooks under notebooks/ (never executed here), and the API and labs pages it
generates from the package (docs/_ext/course_pages.py).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "_ext"))
sys.path.insert(0, str(HERE.parent))  # the package, as the notebooks import it
sys.path.insert(0, str(HERE.parent / "tools"))
import notebook_setup  # noqa: E402

# the course's address, as tools/build_site.py hands it over; else the one in pyproject.toml, which a
# site (published material) must have: notebook_setup.repository() stops, saying what to set
REPOSITORY = os.environ.get("FLASHLIB_SITE_REPOSITORY") or notebook_setup.repository()

project = "flashlib: FlashAttention, tile by tile"
author = "flashlib"
copyright = "flashlib"
root_doc = "index"

extensions = [
    "myst_nb",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.mathjax",
    "sphinx.ext.viewcode",
    "sphinx-mathjax-offline",  # MathJax 3 copied into _static: the site needs no CDN
    "course_pages",
    "plain_docstrings",
    "figure_zoom",  # every figure links to its image; a click enlarges it
]

exclude_patterns = ["_build", "**.ipynb_checkpoints", "_ext"]
templates_path = []
html_static_path = [str(HERE / "_static")]
html_css_files = ["course.css"]
html_js_files = ["code_wrap.js"]  # long lines wrap with a hanging indent
html_favicon = str(HERE / "_static" / "favicon.svg")

# --- notebooks: shown as stored --------------------------------------------------------
nb_execution_mode = "off"
myst_enable_extensions = ["dollarmath", "amsmath", "colon_fence", "deflist"]
myst_heading_anchors = 3
# A widget view needs a kernel holding its widget; the site shows the frame the widget stored
# beside it as image/png (flashlib.course.widgets.FigureBox) instead.
nb_mime_priority_overrides = [("*", "application/vnd.jupyter.widget-view+json", None)]
nb_merge_streams = True

# --- API pages from the docstrings ------------------------------------------------------
# members defined in each module only: a name a module re-exports is documented where it is defined
autodoc_default_options = {"members": True, "show-inheritance": True, "ignore-module-all": True}
autodoc_inherit_docstrings = False  # not torch.autograd.Function's docstrings under ours
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_preserve_defaults = True
autosummary_generate = False  # course_pages writes the API pages itself, one per room

# --- the theme ---------------------------------------------------------------------------
html_theme = "sphinx_book_theme"
html_title = "FlashAttention, tile by tile"
html_theme_options = {
    "home_page_in_toc": True,
    "show_navbar_depth": 1,
    "show_toc_level": 2,
    "use_download_button": True,
    "use_fullscreen_button": False,
    "navigation_with_keys": False,
    # every notebook page: the repository and a Colab launch button for that notebook, from the one
    # URL in pyproject.toml (as the notebooks' own badges: tools/notebook_setup.py)
    "repository_url": REPOSITORY,
    "repository_branch": "main",
    "path_to_docs": "",
    "use_repository_button": True,
    "launch_buttons": {"colab_url": "https://colab.research.google.com"},
}
# a mode in the page itself: with none stored yet, the theme's script logs an error
html_context = {"default_mode": "light"}
html_last_updated_fmt = None
html_show_sourcelink = True
html_copy_source = True

# What the build may warn about, each with its reason; anything else fails the build (-W).
suppress_warnings = []
