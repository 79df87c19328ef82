"""The book cannot drift from the code, and reads right in a browser.

The first test runs each check of maint/book_check.py on this repo and lists every problem it finds as
"<file>:<line>: <what is wrong>" (the checks themselves are tested on small synthetic books here and in
tests/test_tooling.py). Then: the formula preprocessor (course/book_math.py), the build (`pdm run book
--build`), and the built chapters rendered in headless Chromium at 1280 px: no raw LaTeX in what a
reader sees, every formula typeset as MathML, every image loaded, no table wider than the text column,
nothing fetched from the network.

The browser test needs Chromium (Debian's `chromium` package) and playwright (`pdm install` installs it).
Without them it is skipped, unless TINY_LLM_REQUIRE_BROWSER=1 (CI sets it) turns the skip into a
failure, so that CI cannot pass by not running it.
"""

import os
import shutil
import textwrap
from pathlib import Path

import pytest

from course import book_math
from maint import book_check
from scripts import book as book_command

REPO_ROOT = Path(__file__).resolve().parent.parent
REQUIRE_BROWSER = os.environ.get("TINY_LLM_REQUIRE_BROWSER") == "1"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.mark.parametrize("check", list(book_check.CHECKS))
def test_book_is_in_step_with_the_code(check):
    problems = book_check.CHECKS[check](REPO_ROOT)
    assert not problems, f"{len(problems)} problem(s) with the book ({check}):\n  " + "\n  ".join(problems)


# ---------------------------------------------------------------- formulas

def test_formulas_become_mathml_and_code_stays_as_written():
    markdown = textwrap.dedent("""\
        Rotated by the angle $p\\,\\omega_i$, costs \\$5, `$not math$`:

        $$
        \\text{silu}(W_\\text{gate}\\,x)
        $$

        ```bash
        $ echo $HOME $x$
        ```
        and $a_b * c$ after the code.
    """)
    html = book_math.render(markdown)
    assert html.count("<math") == 3, html
    assert '<mspace width="0.167em" />' in html  # the thin space Markdown used to eat
    assert 'display="block"' in html
    assert "\\$5" in html and "`$not math$`" in html and "$ echo $HOME $x$\n" in html
    # What the Markdown parser still reads between the tags cannot start emphasis or a link.
    inline = html.split("and ", 1)[1]
    assert "_" not in inline and "*" not in inline


@pytest.mark.parametrize("formula", ["$\\omgea_i$", "$$\\frac{a}{b} \\foo$$"])
def test_an_unknown_command_stops_the_build(formula):
    with pytest.raises(book_math.FormulaError, match="unknown command"):
        book_math.render(f"text {formula} text\n")


# ---------------------------------------------------------------- titles and links between days

def synthetic_book(root: Path) -> Path:
    from tests.test_tooling import make_book  # the correct little book those tests break one way each

    return make_book(root)


def test_day_references_must_link_their_chapter_and_fix_links_writes_them(tmp_path):
    root = synthetic_book(tmp_path / "course")
    gamma = root / "book" / "src" / "gamma.md"
    gamma.write_text(gamma.read_text() + "\nAs on day 1.2 and in [chapter 1.1](./beta.md), unlike days\n"
                                         "1.1 to 1.2 (day 2.1 is this one; day 9.9 is not in the course).\n")
    problems = book_check.day_link_problems(root)
    assert any("gamma.md:" in p and "day 1.2 is not a link; write [day 1.2](./beta.md)" in p
               for p in problems), problems
    assert any("day 1.1 links to ./beta.md; its chapter is ./alpha.md" in p for p in problems), problems
    assert not any("2.1" in p or "9.9" in p for p in problems), problems
    # days 1.1 to 1.2: a reference broken over two lines, each number its own link
    assert sum("is not a link" in p for p in problems) == 3, problems

    book_check.fix_day_links(root)
    text = gamma.read_text()
    assert "[day 1.2](./beta.md) and" in text and "[days\n1.1](./alpha.md) to [1.2](./beta.md)" in text
    # A link to the wrong chapter is left for a person to judge.
    assert book_check.day_link_problems(root) == [p for p in problems if "links to" in p]


def test_titles_carry_the_day_numbers(tmp_path):
    root = synthetic_book(tmp_path / "course")
    src = root / "book" / "src"
    (src / "SUMMARY.md").write_text((src / "SUMMARY.md").read_text().replace("[1.2 Beta]", "[Day 2: Beta]"))
    (src / "gamma.md").write_text((src / "gamma.md").read_text().replace("# Day 2.1: Gamma", "# Gamma"))
    problems = book_check.title_problems(root)
    assert any(p.startswith("book/src/SUMMARY.md:") and "[1.2 Beta](./beta.md)" in p for p in problems), problems
    assert any(p.startswith("book/src/gamma.md:1:") and "# Day 2.1: Gamma" in p for p in problems), problems
    assert len(problems) == 2, problems


# ---------------------------------------------------------------- the built book

def test_built_book_check_finds_broken_links_missing_images_and_network_loads(tmp_path):
    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "plot.png").write_bytes(b"png")
    (tmp_path / "b.html").write_text('<h2 id="there">x</h2>')
    (tmp_path / "a.html").write_text(textwrap.dedent("""\
        <a href="b.html#there">ok</a> <img src="images/plot.png"> <a href="https://example.org/">away</a>
        <a href="c.html">gone</a>
        <a href="b.html#nowhere">no anchor</a>
        <img src="images/missing.png">
        <script src="https://cdn.example.org/MathJax.js"></script>
    """))
    problems = book_check.built_book_problems(tmp_path)
    assert len(problems) == 4, problems
    for expected in ('a.html:2: <a href="c.html"> leads nowhere', 'has no id "nowhere"',
                     '<img src="images/missing.png"> leads nowhere', "loads from the network"):
        assert any(expected in p for p in problems), (expected, problems)


@pytest.mark.parametrize("argv, message", [
    (["--build", "book/src"], "pick a folder outside book/"),
    (["--port", "0"], "must be 1 to 65535"),
])
def test_book_command_user_errors_are_one_line(argv, message, capsys):
    assert book_command.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and err.startswith("pdm run book: error: ")


def test_book_command_without_mdbook_says_how_to_install_it(monkeypatch, capsys):
    monkeypatch.setattr(book_command, "mdbook", lambda: None)
    assert book_command.main(["--build", "anywhere"]) == 2
    assert "run `pdm install`" in capsys.readouterr().err


@pytest.fixture(scope="module")
def built_book(tmp_path_factory) -> Path:
    """The book as `pdm run book --build` writes it (a warning, a broken link or a bad formula fails it)."""
    executable = book_command.mdbook()
    if executable is None:
        pytest.skip("mdbook is not installed (`pdm install` installs it with the book group)")
    out = tmp_path_factory.mktemp("book") / "out"
    assert book_command.build(executable, out) == 0, "pdm run book --build failed: see the output above"
    return out


def test_the_book_builds_without_warnings_or_broken_links(built_book):
    assert (built_book / "week1-02-rope.html").exists()


# ---------------------------------------------------------------- in a browser

# Everything a reader would notice on one chapter, measured in the page: raw LaTeX left in the text
# (code is left out), a formula the browser does not typeset as MathML, an image that did not load, and a
# table wider than the text column (a sideways scroll hides columns the text quotes).
PAGE_PROBLEMS = r"""() => {
    const main = document.querySelector("main");
    const problems = [];
    const prose = main.cloneNode(true);
    prose.querySelectorAll("pre, code").forEach(node => node.remove());
    const text = prose.textContent;
    const raw = /\\[A-Za-z]+|\\[()\[\]]|\$\$|\$[^\s$][^$\n]*\$/g;
    for (const match of text.matchAll(raw)) {
        const around = text.slice(Math.max(0, match.index - 30), match.index + match[0].length + 30);
        problems.push(`raw LaTeX ${JSON.stringify(match[0])} in "...${around.replace(/\s+/g, " ")}..."`);
    }
    for (const formula of main.querySelectorAll("math")) {
        const display = getComputedStyle(formula).display;
        if (!display.includes("math") || formula.getBoundingClientRect().height === 0) {
            problems.push(`a formula not typeset as MathML (display: ${display}): ${formula.textContent}`);
        }
    }
    for (const image of main.querySelectorAll("img")) {
        if (!image.complete || image.naturalWidth === 0) {
            problems.push(`the image ${image.getAttribute("src")} did not load`);
        }
    }
    for (const table of main.querySelectorAll("table")) {
        if (table.scrollWidth > main.clientWidth + 1) {
            const header = Array.from(table.rows[0].cells, cell => cell.innerText.trim()).join(" | ");
            problems.push(`a table ${table.scrollWidth} px wide in a ${main.clientWidth} px column ` +
                          `at a ${window.innerWidth} px window: ${header}`);
        }
    }
    return problems;
}"""


def _chromium() -> str | None:
    named = os.environ.get("TINY_LLM_CHROMIUM")
    return named or next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)


def _skip_or_fail(reason: str):
    if REQUIRE_BROWSER:
        pytest.fail(f"{reason}, and TINY_LLM_REQUIRE_BROWSER=1 requires it")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def browser_page():
    """A page of 1280 x 900 in headless Chromium that may read files and nothing else: a request for
    anything but a file:// URL is refused and recorded."""
    executable = _chromium()
    if executable is None:
        _skip_or_fail("no Chromium to render the book in (Debian: apt-get install chromium)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _skip_or_fail("playwright is not installed (run `pdm install`)")
    with sync_playwright() as playwright:
        # playwright gives the browser a fresh profile (--user-data-dir) of its own each launch.
        browser = playwright.chromium.launch(executable_path=executable, args=CHROMIUM_FLAGS)
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.network_requests = []

        def only_files(route):
            if route.request.url.startswith("file:"):
                return route.continue_()
            page.network_requests.append(route.request.url)
            return route.abort()

        page.route("**/*", only_files)
        yield page
        browser.close()


CHAPTER_PAGES = [chapter.relative_to(REPO_ROOT / "book" / "src").with_suffix(".html").as_posix()
                 for chapter in book_check.chapters(REPO_ROOT)]


@pytest.mark.parametrize("page_name", CHAPTER_PAGES)
def test_chapter_renders_in_a_browser(built_book, browser_page, page_name):
    browser_page.network_requests.clear()
    browser_page.goto((built_book / page_name).as_uri(), wait_until="load")
    problems = browser_page.evaluate(PAGE_PROBLEMS)
    problems += [f"fetched from the network: {url}" for url in browser_page.network_requests]
    assert not problems, f"{page_name} at 1280 px:\n  " + "\n  ".join(problems)
