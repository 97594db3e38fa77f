"""Check that the built HTML documentation works with no network.

Usage: ``python docs/_scripts/check_offline.py [docs/_build/html]`` (``.ci/run`` runs it
after the Sphinx build). It fails, listing each offence, when

* a page loads a resource (script, stylesheet, image, font, frame, media) from a remote
  address (``http:``, ``https:`` or protocol-relative ``//host/...``), or a stylesheet
  imports one through ``url(...)``/``@import``;
* a page loads a local resource that is missing from the build;
* no page loads the bundled math renderer (so the check cannot pass vacuously).

Plain hyperlinks (``<a href="https://...">``) are not resources and are allowed.
"""

from __future__ import annotations

import re
import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

#: (tag, attribute) pairs whose URL the browser fetches while it shows the page.
RESOURCE_ATTRIBUTES = {
    ("script", "src"), ("img", "src"), ("iframe", "src"), ("embed", "src"),
    ("source", "src"), ("audio", "src"), ("video", "src"), ("video", "poster"),
    ("object", "data"), ("input", "src"),
}
#: ``<link rel=...>`` values that make the browser fetch ``href``.
FETCHING_LINK_RELS = {"stylesheet", "preload", "modulepreload", "icon", "shortcut",
                      "apple-touch-icon", "manifest", "prefetch"}
CSS_URL = re.compile(r"""(?:@import\s+(?:url\()?|url\()\s*['"]?([^'")\s;]+)""")
MATH_RENDERER = "_static/mathjax/tex-chtml-full.js"


def is_remote(url: str) -> bool:
    """True where ``url`` points off the local build (an absolute or protocol-relative URL)."""
    parts = urlsplit(url.strip())
    return parts.scheme in {"http", "https", "ftp"} or url.strip().startswith("//")


class _ResourceCollector(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.urls: list[str] = []
        self.inline_css: list[str] = []
        self._in_style = False

    def handle_starttag(self, tag, attrs):
        values = dict(attrs)
        for attribute, value in attrs:
            if value and (tag, attribute) in RESOURCE_ATTRIBUTES:
                self.urls.append(value)
        if tag == "link" and values.get("href"):
            rels = set((values.get("rel") or "").lower().split())
            if rels & FETCHING_LINK_RELS:
                self.urls.append(values["href"])
        if values.get("style"):
            self.inline_css.append(values["style"])
        self._in_style = tag == "style"

    def handle_endtag(self, tag):
        if tag == "style":
            self._in_style = False

    def handle_data(self, data):
        if self._in_style:
            self.inline_css.append(data)


def page_problems(html: str, page: Path, root: Path) -> list[str]:
    """The offline problems of one HTML page (remote or missing resources)."""
    collector = _ResourceCollector()
    collector.feed(html)
    urls = collector.urls + [m.group(1) for css in collector.inline_css
                             for m in CSS_URL.finditer(css)]
    problems = []
    for url in urls:
        if is_remote(url):
            problems.append(f"{page.relative_to(root)}: loads remote {url}")
            continue
        parts = urlsplit(url)
        if parts.scheme or not parts.path:  # data:, blob:, javascript:, or a fragment
            continue
        target = (page.parent / unquote(parts.path)).resolve()
        if not target.exists():
            problems.append(f"{page.relative_to(root)}: loads missing {url}")
    return problems


def stylesheet_problems(css: str, sheet: Path, root: Path) -> list[str]:
    """Remote ``url(...)``/``@import`` references of one stylesheet."""
    return [f"{sheet.relative_to(root)}: imports remote {m.group(1)}"
            for m in CSS_URL.finditer(css) if is_remote(m.group(1))]


def html_pages(root: Path) -> list[Path]:
    """The built pages (the theme's Jinja templates copied into ``_static`` are not pages)."""
    return sorted(p for p in root.rglob("*.html") if "_static" not in p.relative_to(root).parts)


def check(root: Path) -> list[str]:
    """Every offline problem of the HTML build in ``root``."""
    pages = html_pages(root)
    if not pages:
        return [f"{root}: no HTML pages (build the docs first)"]
    problems, math_pages = [], 0
    for page in pages:
        html = page.read_text(encoding="utf-8", errors="replace")
        problems += page_problems(html, page, root)
        math_pages += MATH_RENDERER.rpartition("_static/")[2] in html
    for sheet in sorted(root.rglob("*.css")):
        problems += stylesheet_problems(sheet.read_text(encoding="utf-8", errors="replace"),
                                        sheet, root)
    if math_pages == 0:
        problems.append(f"no page loads the bundled math renderer {MATH_RENDERER}")
    return problems


def strip_remote_table_assets(app, docname: str, source: list[str]) -> None:
    """Sphinx ``source-read`` hook: drop the CDN block of sphinx-gallery's timing pages.

    ``sg_execution_times`` pages load jQuery, DataTables and Bootstrap from CDNs in a
    ``.. raw:: html`` block, to make their table sortable. The table is written slowest
    first already, so without the widget it stays readable, and works offline.
    """
    if docname.rpartition("/")[2] != "sg_execution_times":
        return
    kept, in_raw_html = [], False
    for line in source[0].splitlines(keepends=True):
        if line.strip() == ".. raw:: html":
            in_raw_html = True
        elif in_raw_html and line.strip() and not line.startswith("    "):
            in_raw_html = False  # the block ends at the first less indented line
        if not in_raw_html:
            kept.append(line)
    source[0] = "".join(kept)


def main(argv: list[str]) -> int:
    root = Path(argv[1] if len(argv) > 1 else "docs/_build/html").resolve()
    problems = check(root)
    for problem in problems:
        print(problem, file=sys.stderr)
    pages = len(html_pages(root))
    if problems:
        print(f"{len(problems)} offline problem(s) in {pages} pages", file=sys.stderr)
        return 1
    print(f"offline check: {pages} pages, no remote or missing resources")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
