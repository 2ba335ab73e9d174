"""The course's web pages (tools/course_site.py): an index, prev/next links, and every page
opened in a real headless Chromium: each image decodes, no script logs an error, the formulas
are typeset, and nothing is requested from outside the site's folder (it works offline)."""

import html
import json
import re
import shutil
import sys
from pathlib import Path
from urllib.parse import unquote, urlsplit

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import course_site  # noqa: E402  (tools/course_site.py)

pytestmark = pytest.mark.timeout(900)  # rendering 13 notebooks took over 120 s at load 30


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The committed notebooks (executed as committed) rendered and linked, as `make run` does."""
    html_dir = tmp_path_factory.mktemp("html")
    course_site.build_site(course_site.NOTEBOOKS, html_dir)
    return html_dir


def titles() -> list[str]:
    return [
        course_site.first_heading(nbformat.read(path, as_version=4))
        for path in course_site.NOTEBOOKS
    ]


def links(page: str) -> list[tuple[str, str]]:
    """(href, text) of each link in the page's nav bars and lists, in order."""
    return re.findall(r'<a href="([^"]+)"[^>]*>([^<]*)</a>', page)


def test_index_lists_every_notebook_in_order_with_its_heading(site):
    index = (site / "index.html").read_text(encoding="utf-8")
    assert "<h1>fsdp-lesson</h1>" in index and "fully-sharded data parallelism" in index
    expected = [
        (f"{path.stem}.html", html.escape(title))
        for path, title in zip(course_site.NOTEBOOKS, titles(), strict=True)
    ]
    assert links(index) == expected
    assert expected[0][1].startswith("01 · The dataset: names → tokens")


def test_every_page_links_to_its_neighbours_and_the_index_at_top_and_bottom(site):
    files = [f"{path.stem}.html" for path in course_site.NOTEBOOKS]
    for i, file in enumerate(files):
        page = (site / file).read_text(encoding="utf-8")
        nav = ["index.html"]
        if i > 0:
            nav.insert(0, files[i - 1])
        if i + 1 < len(files):
            nav.append(files[i + 1])
        hrefs = [href for href, _ in links(page) if href.endswith(".html")]
        assert hrefs == nav + nav, file  # one bar at the top, one at the bottom
        assert f"<title>{titles()[i]}</title>" in page


def test_linking_again_replaces_the_nav_bars(site):
    before = {page: page.read_text(encoding="utf-8") for page in site.glob("*.html")}
    course_site.link_pages(site)
    assert {page: page.read_text(encoding="utf-8") for page in site.glob("*.html")} == before


def test_pages_name_nothing_to_load_from_outside_the_site(site):
    """Without a browser: every script, style sheet and image is a file of the site or data:.
    (Links to read elsewhere, <a href="https://...">, are fine: they load only when clicked.)"""
    tags = r"script|link|img|iframe|source|audio|video"
    loads = re.compile(rf'<(?:{tags})\b[^>]*?\b(?:src|href)="([^"]*)"')
    for page in sorted(site.glob("*.html")):
        text = page.read_text(encoding="utf-8")
        urls = [url for url in loads.findall(text) if not url.startswith("data:")]
        remote = [url for url in urls if re.match(r"[a-z][a-z0-9+.-]*:|//", url)]
        assert remote == [], f"{page.name} loads {remote}"
        missing = [url for url in urls if not (site / urlsplit(url).path).is_file()]
        assert missing == [], f"{page.name} loads files that are not in the site: {missing}"
        assert not re.search(r"""(?:url\(|import\()\s*["']?(?:https?:)?//""", text), page.name
        assert "require.js" not in text and "mermaid.esm" not in text, page.name
        if page.name != "index.html":
            assert f'<script src="{course_site.MATHJAX_URL}">' in text, page.name
    assert (site / course_site.MATHJAX_DIR / "MathJax.js").is_file()


def test_notebooks_without_a_page_are_left_out(tmp_path):
    for stem in ("02_single_rank_mlp", "05_zero3"):
        (tmp_path / f"{stem}.html").write_text("<html><head></head><body>\n</body></html>")
    linked = course_site.link_pages(tmp_path)
    assert [path.name for path in linked] == ["02_single_rank_mlp.html", "05_zero3.html"]
    first = (tmp_path / "02_single_rank_mlp.html").read_text()
    assert [href for href, _ in links(first)] == ["index.html", "05_zero3.html"] * 2


# --- a real browser ---------------------------------------------------------------------------


BROWSER_ARGUMENTS = [
    "--headless=new",
    "--no-sandbox",  # as root, in a container
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--host-resolver-rules=MAP * ~NOTFOUND",  # no host resolves: no request leaves the machine
    "--disable-background-networking",  # nor does the browser itself look for updates
    "--window-size=1200,1400",
]


@pytest.fixture(scope="module")
def browser():
    """Headless Chromium driven by chromedriver (Debian: chromium, chromium-driver).

    No host name resolves, so the browser is offline whether this machine is or not: a page
    that still asked a CDN for something would fail here as it would in a classroom without
    network. Its performance log lists every request a page makes (requests_made).
    """
    reason = "selenium is not installed: pip install -e '.[dev]'"
    webdriver = pytest.importorskip("selenium.webdriver", reason=reason)
    chromium, driver_path = shutil.which("chromium"), shutil.which("chromedriver")
    if not (chromium and driver_path):
        pytest.skip("no Chromium here: apt-get install chromium chromium-driver (.ci/run does)")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for argument in BROWSER_ARGUMENTS:
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    try:
        driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(driver_path))
    except Exception as err:  # a browser that cannot start here: say why, do not fail
        pytest.skip(f"Chromium did not start: {str(err).strip().splitlines()[0]}")
    driver.set_page_load_timeout(60)
    driver.set_script_timeout(60)
    yield driver
    driver.quit()


def open_page(driver, path: Path) -> tuple[int, list[str], list[str]]:
    """Load path; return (images, the ones that did not decode, the errors the page logged).

    An error is a SEVERE console entry: a script's exception or console.error, or anything that
    failed to load (a local file, or anything from another host: none resolves here).
    """
    driver.get(path.as_uri())
    images = driver.execute_script(
        "return Array.from(document.images, i => [i.complete && i.naturalWidth > 0, i.src]);"
    )
    broken = [src[:80] for decoded, src in images if not decoded]
    errors = [entry["message"] for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]
    return len(images), broken, errors


def test_every_page_shows_every_image_and_logs_no_error(browser, site):
    pages = [site / "index.html", *(site / f"{path.stem}.html" for path in course_site.NOTEBOOKS)]
    total_images = 0
    for page in pages:
        n_images, broken, errors = open_page(browser, page)
        assert broken == [], f"{page.name}: images that do not decode: {broken}"
        assert errors == [], f"{page.name}: {errors}"
        total_images += n_images
    assert total_images >= 10  # the notebooks' plots: the check above saw them


def test_the_browser_check_sees_a_broken_image_and_a_script_error(browser, tmp_path):
    page = tmp_path / "broken.html"
    page.write_text(
        "<html><body><img src='missing.png'><img src='data:image/png;base64,iVBORw0KGgo='>"
        "<script>console.error('boom')</script><script>no_such_function()</script></body></html>"
    )
    n_images, broken, errors = open_page(browser, page)
    assert n_images == 2 and len(broken) == 2
    assert len(errors) == 3  # missing.png, console.error, the uncaught ReferenceError
    assert any("boom" in e for e in errors) and any("no_such_function" in e for e in errors)


def requests_made(driver) -> list[str]:
    """Every URL the browser requested since the last call (its DevTools log of the page's
    network events, which also lists file:// and data: loads and those that failed)."""
    urls = []
    for entry in driver.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message["method"] == "Network.requestWillBeSent":
            urls.append(message["params"]["request"]["url"])
    return urls


def outside(urls: list[str], folder: Path) -> list[str]:
    """The URLs that are neither data: nor a file in folder."""

    def inside(url: str) -> bool:
        parts = urlsplit(url)
        if parts.scheme == "data":
            return True
        return parts.scheme == "file" and Path(unquote(parts.path)).is_relative_to(folder)

    return [url for url in urls if not inside(url)]


def typeset(driver, path: Path) -> tuple[int, int, int, list[str]]:
    """Load path and wait until MathJax, if the page loads it, has typeset all it will.

    Returns (formulas found, formulas typeset, formulas MathJax could not parse, the URLs
    requested). MathJax runs what is queued in order: a function queued once it is ready
    runs after the page's typesetting.
    """
    requests_made(driver)  # drop what earlier pages requested
    driver.get(path.as_uri())
    found, done, failed = driver.execute_async_script(
        """
        const finish = arguments[arguments.length - 1];
        const count = () => {
            const math = [...document.querySelectorAll('script[type^="math/tex"]')];
            const done = math.filter(s => document.getElementById(s.id + "-Frame"));
            const failed = document.querySelectorAll(".MathJax .merror, .noError");
            finish([math.length, done.length, failed.length]);
        };
        if (!document.querySelector('script[src*="MathJax.js"]')) return count();
        const ready = () => window.MathJax && MathJax.isReady
            ? MathJax.Hub.Queue(count) : setTimeout(ready, 50);
        ready();
        """
    )
    return found, done, failed, requests_made(driver)


def has_formulas(path: Path) -> bool:
    """Whether a notebook's markdown has TeX: $...$, $$...$$, \\(...\\) or \\[...\\]."""
    math = re.compile(r"\$\$.+?\$\$|\$[^$\n]+\$|\\\(.+?\\\)|\\\[.+?\\\]", re.DOTALL)
    nb = nbformat.read(path, as_version=4)
    return any(math.search(c.source) for c in nb.cells if c.cell_type == "markdown")


def test_offline_every_page_typesets_its_formulas_from_files_of_the_site(browser, site):
    pages = [(site / "index.html", False)] + [
        (site / f"{path.stem}.html", has_formulas(path)) for path in course_site.NOTEBOOKS
    ]
    formulas, requested = 0, []
    for page, with_formulas in pages:
        found, done, failed, urls = typeset(browser, page)
        assert outside(urls, site) == [], f"{page.name} requested {outside(urls, site)}"
        # resource timing lists what the page fetched over a network (never file://): nothing
        fetched = browser.execute_script(
            "return performance.getEntriesByType('resource').map(e => e.name)"
        )
        assert outside(fetched, site) == [], f"{page.name} fetched {outside(fetched, site)}"
        assert found == done and failed == 0, f"{page.name}: {done}/{found} typeset, {failed} bad"
        if with_formulas:
            assert found > 0, f"{page.name}: its notebook has formulas, the page none typeset"
        formulas += found
        requested += urls
    assert formulas >= 5  # notebooks 02, 03 and 08: the check above saw them typeset
    mathjax = (site / course_site.MATHJAX_DIR).as_uri()
    assert any(url.startswith(f"{mathjax}/MathJax.js") for url in requested)
    fonts = [url for url in requested if url.startswith(mathjax) and ".woff" in url]
    assert fonts, "MathJax drew the formulas without its web fonts"


def test_the_offline_check_sees_a_request_to_another_host_and_a_bad_formula(browser, tmp_path):
    course_site.copy_mathjax(tmp_path)
    page = tmp_path / "page.html"
    page.write_text(
        f"<html><head><script src='{course_site.MATHJAX_URL}'></script></head><body>"
        "<p>$$a^2 + b^2 = c^2$$ and \\(\\frac{1}{\\)</p>"  # the second: unbalanced braces
        "<img src='https://cdn.example.invalid/logo.png'>"
        f"<img src='{(tmp_path.parent / 'elsewhere.png').as_uri()}'></body></html>"
    )
    found, done, failed, urls = typeset(browser, page)
    assert (found, done, failed) == (2, 2, 1)
    assert sorted(outside(urls, tmp_path)) == [
        (tmp_path.parent / "elsewhere.png").as_uri(),
        "https://cdn.example.invalid/logo.png",  # not resolved: no request left the machine
    ]
