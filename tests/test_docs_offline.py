"""The offline check of the built documentation (``docs/_scripts/check_offline.py``).

``.ci/run`` runs the check on the real build; these tests make sure that the check itself
catches what it is meant to catch (a CDN script, a remote stylesheet or font, a missing
local file) and lets through what is harmless (hyperlinks, data URLs, bundled files).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "docs" / "_scripts" / "check_offline.py"


@pytest.fixture(scope="module")
def offline():
    spec = importlib.util.spec_from_file_location("check_offline", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _site(tmp_path: Path, body: str) -> Path:
    """A one-page build that loads the bundled math renderer plus ``body``."""
    (tmp_path / "_static" / "mathjax").mkdir(parents=True)
    (tmp_path / "_static" / "mathjax" / "tex-chtml-full.js").write_text("// math")
    (tmp_path / "theory").mkdir()
    (tmp_path / "theory" / "page.html").write_text(
        '<html><head><script src="../_static/mathjax/tex-chtml-full.js"></script>'
        f"</head><body>{body}</body></html>")
    return tmp_path


def test_bundled_renderer_and_hyperlinks_pass(offline, tmp_path):
    root = _site(tmp_path, '<a href="https://arxiv.org/abs/2204.04667">paper</a>'
                           '<img src="data:image/png;base64,AAAA">')
    assert offline.check(root) == []


@pytest.mark.parametrize("body", [
    '<script src="https://cdn.jsdelivr.net/npm/mathjax@3/es5/tex-mml-chtml.js"></script>',
    '<script src="//code.jquery.com/jquery-3.7.0.js"></script>',
    '<link rel="stylesheet" href="https://cdn.datatables.net/1.13.6/css/x.css">',
    '<style>@import url("https://fonts.googleapis.com/css?family=Lato");</style>',
    '<div style="background: url(https://example.org/a.png)"></div>',
    '<img src="http://example.org/plot.png">',
])
def test_remote_resources_fail(offline, tmp_path, body):
    (problem,) = offline.check(_site(tmp_path, body))
    assert "theory/page.html: loads remote" in problem


def test_missing_local_file_fails(offline, tmp_path):
    (problem,) = offline.check(_site(tmp_path, '<script src="../_static/gone.js"></script>'))
    assert "loads missing ../_static/gone.js" in problem


def test_remote_font_in_stylesheet_fails(offline, tmp_path):
    root = _site(tmp_path, "")
    (root / "_static" / "theme.css").write_text(
        "@font-face { src: url('https://fonts.gstatic.com/s/lato.woff2'); }")
    (problem,) = offline.check(root)
    assert "_static/theme.css: imports remote https://fonts.gstatic.com" in problem


def test_pages_without_math_renderer_fail(offline, tmp_path):
    (tmp_path / "index.html").write_text("<html><body>$x$</body></html>")
    (problem,) = offline.check(tmp_path)
    assert "math renderer" in problem


def test_empty_build_fails(offline, tmp_path):
    assert "no HTML pages" in offline.check(tmp_path)[0]


def test_timing_page_loses_only_its_cdn_block(offline):
    source = [
        "**00:01.000** total execution time:\n\n"
        ".. container::\n\n"
        "  .. raw:: html\n\n"
        "    <style scoped>\n"
        '    <link href="https://cdn.datatables.net/x.css" rel="stylesheet" />\n'
        "    </style>\n"
        '    <script src="https://code.jquery.com/jquery-3.7.0.js"></script>\n\n'
        "  .. list-table::\n"
        "   :header-rows: 1\n\n"
        "   * - Example\n"
    ]
    offline.strip_remote_table_assets(None, "auto_examples/sg_execution_times", source)
    assert "https://" not in source[0]
    assert ".. container::" in source[0]
    assert "  .. list-table::\n   :header-rows: 1\n\n   * - Example\n" in source[0]
    other = ["  .. raw:: html\n\n    <b>kept</b>\n"]
    offline.strip_remote_table_assets(None, "guide/index", other)
    assert other == ["  .. raw:: html\n\n    <b>kept</b>\n"]
