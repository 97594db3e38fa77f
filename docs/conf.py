"""Sphinx configuration for the xattn documentation.

Build with ``sphinx-build -W --keep-going -b html docs docs/_build/html`` (or ``nox -s docs``).
Nothing here needs the network: intersphinx reads the small inventories committed in
``_inventories`` (written by ``_scripts/make_inventories.py``), and the math renderer is
bundled in ``_static``.
"""

from __future__ import annotations

import os
import sys
import warnings

import xattn

project = "xattn"
author = "xattn developers"
copyright = "2026, xattn developers"
release = xattn.__version__
version = ".".join(release.split(".")[:2])

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.intersphinx",
    "sphinx.ext.autosummary",
    "sphinx.ext.mathjax",
    "numpydoc",
    "myst_parser",
    "sphinx_gallery.gen_gallery",
]

templates_path = ["_templates"]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
# ``examples`` holds the gallery sources; sphinx-gallery renders them into auto_examples.
exclude_patterns = ["_build", "examples", "Thumbs.db", ".DS_Store"]

# ``|X|`` (the number of MRF states) appears in docstrings' shape specs; make it literal.
rst_epilog = r"""
.. |X| replace:: \|X\|
"""

# -- autodoc / autosummary / numpydoc ----------------------------------------------------
autosummary_generate = True
autodoc_member_order = "bysource"
# A member without its own docstring does not borrow its base class's (torch's
# ``Module.__init__`` docstring on the layer pages, for instance).
autodoc_inherit_docstrings = False
autodoc_typehints = "none"  # numpydoc's Parameters sections carry the types
numpydoc_show_class_members = False
numpydoc_class_members_toctree = False

# -- cross-references --------------------------------------------------------------------
# Every reference must resolve (a broken one fails the -W build). External names resolve
# through the committed inventories: add a missing one in _scripts/make_inventories.py.
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "_scripts"))
from check_offline import strip_remote_table_assets
from make_inventories import PROJECTS

nitpicky = True
intersphinx_mapping = {key: (url, f"_inventories/{key}.inv") for key, (_, url) in PROJECTS.items()}
intersphinx_timeout = 1

# -- MyST (Markdown pages, MathJax equations) -------------------------------------------
myst_enable_extensions = ["dollarmath", "amsmath", "colon_fence", "deflist"]
myst_heading_anchors = 3
myst_dmath_double_inline = True

# -- sphinx-gallery ---------------------------------------------------------------------
# Examples run with small sizes; the whole build stays within a few minutes on 2 cores.
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the gallery's JAX example runs on the CPU
os.environ.setdefault("KERAS_BACKEND", "jax")  # xattn.keras's page: Keras on JAX, not TF
warnings.filterwarnings("ignore", message="Matplotlib is currently using agg")

sphinx_gallery_conf = {
    "examples_dirs": "examples",
    "gallery_dirs": "auto_examples",
    "filename_pattern": r"/plot_",
    "ignore_pattern": r"__init__\.py",
    "image_scrapers": ("matplotlib",),
    "download_all_examples": False,
    "remove_config_comments": True,
    "show_memory": False,
    "within_subsection_order": "FileNameSortKey",
    "matplotlib_animations": False,
}

# -- HTML -------------------------------------------------------------------------------
html_theme = "pydata_sphinx_theme"
html_title = f"xattn {release}"
html_theme_options = {
    "navigation_with_keys": False,
    "show_toc_level": 2,
    "navbar_align": "left",
}
html_context = {"default_mode": "auto"}
# Pages without sub-pages: no (empty) section navigation on the left.
html_sidebars = {page: [] for page in ("getting_started", "bibliography", "capabilities",
                                       "contributing", "changelog")}
html_static_path = ["_static"]

# -- math offline -----------------------------------------------------------------------
# MathJax 3.2.2 (Apache-2.0, files from the npm package ``mathjax``, ``es5/`` folder) is
# vendored in ``_static/mathjax``: the full TeX build plus its CHTML web fonts, so that
# formulas render with no network. ``.ci/run`` checks that no page loads anything remote.
mathjax_path = "mathjax/tex-chtml-full.js"
# sphinx-gallery's timing pages load a sortable-table widget from CDNs: drop it (see
# check_offline.strip_remote_table_assets).


def setup(app):
    app.connect("source-read", strip_remote_table_assets)
