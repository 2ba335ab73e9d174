"""The lesson as a small website: an index page and prev/next links on every notebook's page.

    python tools/course_site.py [--out DIR]   the committed notebooks, as committed, to build/html/

`make run` (tools/lesson.py) writes each executed notebook with write_page, then calls
link_pages. The course's title and one-line summary come from README.md's heading and first
paragraph, each notebook's line from its first markdown heading, so nothing here needs editing
when a notebook is added or renamed. (Not tools/site.py: that name is Python's own site module.)

The site works offline (a classroom without network, a train): no page requests anything from
outside its folder. nbconvert's pages load MathJax, require.js and mermaid from a CDN; here
MathJax 2.7 comes from the jupyter-server-mathjax package (the copy Jupyter itself serves),
copied to DIR/mathjax/ by link_pages, and the pages load it from there. require.js only serves
ipywidgets and mermaid only ```mermaid diagrams, neither of which the notebooks have: both are
left out (a widget would show nothing, a diagram its source). Images are embedded as data: URIs.
"""

from __future__ import annotations

import argparse
import html
import importlib.util
import re
import shutil
import sys
from pathlib import Path

import nbformat
from nbconvert import HTMLExporter
from nbconvert.filters.markdown_mistune import markdown2html_mistune

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
HTML_DIR = ROOT / "build" / "html"
NAV_START, NAV_END = "<!-- course-nav -->", "<!-- /course-nav -->"
MATHJAX_DIR = "mathjax"  # in the site's folder, beside the pages
# The configuration the Jupyter Notebook loads from this package: TeX input, HTML-CSS output.
MATHJAX_URL = f"{MATHJAX_DIR}/MathJax.js?config=TeX-AMS-MML_HTMLorMML-full,Safe"
# nbconvert's lab template, with MathJax from the site's folder and nothing from a CDN. MathJax
# is configured before it loads: the package ships only the STIX-Web web fonts (no TeX ones, no
# image fonts), so it is told to use those; and its placeholder font MathJax_Blank, meant never
# to load, is a local() name instead of url('about:blank'), which a page opened from a file://
# address may not fetch (Chromium logs a CORS error for it).
TEMPLATE = """{%- extends 'index.html.j2' -%}
{% from 'mathjax.html.j2' import mathjax %}
{%- block html_head_js_requirejs -%}{%- endblock html_head_js_requirejs -%}
{%- block jupyter_widgets -%}{%- endblock jupyter_widgets -%}
{%- block html_head_js_mermaidjs -%}{%- endblock html_head_js_mermaidjs -%}
{%- block html_head_js_mathjax -%}
<script>
window.MathJax = {"HTML-CSS": {
  availableFonts: [], preferredFont: null, webFont: "STIX-Web", imageFont: null,
  linebreaks: {automatic: true},
  styles: {"@font-face": {"font-family": "MathJax_Blank", src: "local('MathJax_Blank')"}}}};
</script>
{{ mathjax(resources.mathjax_url) }}
{%- endblock html_head_js_mathjax -%}
"""
STYLE = """<style>
.course-nav { display: flex; justify-content: space-between; gap: 1em; max-width: 1100px;
  margin: 0.5em auto; padding: 0.4em 0.8em; font: 14px/1.4 system-ui, sans-serif;
  background: #f3f5f7; border: 1px solid #d8dde3; border-radius: 6px; }
.course-nav a { color: #1a5fb4; text-decoration: none; }
.course-nav a:hover { text-decoration: underline; }
.course-nav span { flex: 1; }
.course-nav .next { text-align: right; }
.course-nav .index { flex: 0 0 auto; }
</style>"""


def first_heading(nb: nbformat.NotebookNode) -> str | None:
    """The notebook's first markdown heading: '03 · Data parallelism: four ranks, one model'."""
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            for line in cell.source.splitlines():
                if line.startswith("# "):
                    return line[2:].strip()
    return None


def course_heading() -> tuple[str, str]:
    """(title, summary as HTML) from README.md: its first heading and first paragraph."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    title = next(line[2:].strip() for line in text.splitlines() if line.startswith("# "))
    paragraphs = text.split("\n\n")
    summary = next(p for p in paragraphs[1:] if p.strip() and not p.startswith("#"))
    return title, markdown2html_mistune(summary.strip())


def write_page(nb: nbformat.NotebookNode, path: Path) -> None:
    """Render an (executed) notebook to path as HTML, titled with its first heading."""
    title = first_heading(nb) or path.stem
    exporter = HTMLExporter(raw_template=TEMPLATE, mathjax_url=MATHJAX_URL)
    body, _ = exporter.from_notebook_node(nb, resources={"metadata": {"name": title}})
    path.write_text(body, encoding="utf-8")


def mathjax_source() -> Path:
    """MathJax's files as the jupyter-server-mathjax package ships them (found, not imported:
    importing it would load jupyter_server)."""
    spec = importlib.util.find_spec("jupyter_server_mathjax")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(
            "MathJax for the site comes from jupyter-server-mathjax: pip install -e . "
            "(or pip install jupyter-server-mathjax)"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "static"


def copy_mathjax(html_dir: Path) -> Path:
    """html_dir/mathjax/: a fresh copy of MathJax (all of it, 12 MB: its menu can switch
    renderer and language, and each loads more files)."""
    target = html_dir / MATHJAX_DIR
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(mathjax_source(), target)
    return target


def nav_bar(previous: tuple[str, str] | None, following: tuple[str, str] | None) -> str:
    """A bar of links: ← the previous page, the index, the next page → ((file, title) each)."""

    def link(page: tuple[str, str] | None, rel: str) -> str:
        if page is None:
            return f'<span class="{rel}"></span>'
        file, title = page
        text = f"← {html.escape(title)}" if rel == "prev" else f"{html.escape(title)} →"
        return f'<span class="{rel}"><a href="{file}" rel="{rel}">{text}</a></span>'

    index = '<span class="index"><a href="index.html">contents</a></span>'
    return f'<nav class="course-nav">{link(previous, "prev")}{index}{link(following, "next")}</nav>'


def with_nav(page: str, nav: str) -> str:
    """page with nav at the top and the bottom of its body (an earlier nav replaced)."""
    page = re.sub(f"{re.escape(NAV_START)}.*?{re.escape(NAV_END)}\n?", "", page, flags=re.DOTALL)
    block = f"{NAV_START}\n{nav}\n{NAV_END}\n"
    page = re.sub(r"(<body[^>]*>\n?)", lambda m: m.group(1) + block, page, count=1)
    head_block = f"{NAV_START}\n{STYLE}\n{NAV_END}\n"
    page = page.replace("</head>", head_block + "</head>", 1)
    return page.replace("</body>", block + "</body>", 1)


def index_page(pages: list[tuple[str, str]]) -> str:
    """The contents page: the course's title and summary, one line per notebook."""
    title, summary = course_heading()
    items = "\n".join(f'<li><a href="{file}">{html.escape(name)}</a></li>' for file, name in pages)
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1.0">
<title>{html.escape(title)}</title>
<style>
body {{ max-width: 48em; margin: 2em auto; padding: 0 1em; font: 16px/1.5 system-ui, sans-serif; }}
ul {{ list-style: none; padding: 0; }}
li {{ margin: 0.6em 0; font-size: 1.1em; }}
a {{ color: #1a5fb4; text-decoration: none; }}
a:hover {{ text-decoration: underline; }}
</style>
</head>
<body>
<h1>{html.escape(title)}</h1>
{summary}
<h2>The notebooks</h2>
<ul>
{items}
</ul>
</body>
</html>
"""


def link_pages(html_dir: Path = HTML_DIR, notebooks: list[Path] = NOTEBOOKS) -> list[Path]:
    """Write html_dir/index.html, put prev/next links on each notebook's page found there, and
    copy in the MathJax the pages load (html_dir/mathjax/).

    Pages of notebooks not in `notebooks` are left alone; returns the pages linked, in order.
    """
    found = [path for path in notebooks if (html_dir / f"{path.stem}.html").exists()]
    pages = [
        (f"{path.stem}.html", first_heading(nbformat.read(path, as_version=4)) or path.stem)
        for path in found
    ]
    for i, (file, _) in enumerate(pages):
        previous = pages[i - 1] if i > 0 else None
        following = pages[i + 1] if i + 1 < len(pages) else None
        page = html_dir / file
        page.write_text(
            with_nav(page.read_text(encoding="utf-8"), nav_bar(previous, following)),
            encoding="utf-8",
        )
    (html_dir / "index.html").write_text(index_page(pages), encoding="utf-8")
    copy_mathjax(html_dir)
    return [html_dir / file for file, _ in pages]


def build_site(notebooks: list[Path], html_dir: Path) -> list[Path]:
    """The notebooks as committed (executed, outputs and all) rendered and linked in html_dir."""
    html_dir.mkdir(parents=True, exist_ok=True)
    for path in notebooks:
        write_page(nbformat.read(path, as_version=4), html_dir / f"{path.stem}.html")
    return link_pages(html_dir, notebooks)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HTML_DIR, help="default: build/html")
    args = parser.parse_args()
    build_site(NOTEBOOKS, args.out)
    print(f"wrote {args.out / 'index.html'} and {len(NOTEBOOKS)} pages")
    return 0


if __name__ == "__main__":
    sys.exit(main())
