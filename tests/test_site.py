"""The course's web pages (tools/course_site.py): an index, prev/next links, and every page
opened in a real headless Chromium: each image decodes and no script logs an error."""

import html
import re
import shutil
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import course_site  # noqa: E402  (tools/course_site.py)

pytestmark = pytest.mark.timeout(120)


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
    "--host-resolver-rules=MAP * ~NOTFOUND",  # no host but this machine's files
]


@pytest.fixture(scope="module")
def browser():
    """Headless Chromium driven by chromedriver (Debian: chromium, chromium-driver).

    External hosts resolve to nothing, so the result is the same online and offline: the
    scripts nbconvert links from a CDN (MathJax, require.js) never load, and must not matter.
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
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    try:
        driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(driver_path))
    except Exception as err:  # a browser that cannot start here: say why, do not fail
        pytest.skip(f"Chromium did not start: {str(err).strip().splitlines()[0]}")
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()


def open_page(driver, path: Path) -> tuple[int, list[str], list[str]]:
    """Load path; return (images, the ones that did not decode, the errors the page logged).

    An error is a SEVERE console entry: a script's exception or console.error, or a local file
    that failed to load. Failed loads from other hosts are the blocked CDN scripts: not counted.
    """
    driver.get(path.as_uri())
    images = driver.execute_script(
        "return Array.from(document.images, i => [i.complete && i.naturalWidth > 0, i.src]);"
    )
    broken = [src[:80] for decoded, src in images if not decoded]
    errors = [
        entry["message"]
        for entry in driver.get_log("browser")
        if entry["level"] == "SEVERE"
        and not (entry.get("source") == "network" and entry["message"].startswith("http"))
    ]
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
