"""The documentation holds together: every relative link in the README, docs/*.md, benchmarks/README.md and
notebooks/README.md leads to a file that exists (and, for a link into a markdown file, to one of its headings),
the README stays short enough to read as a start (under 15,000 bytes), and every minivit.X.Y name the pages
write resolves (the README's own names are checked in test_structure.py)."""

import re
from pathlib import Path

import pytest

import minivit

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted({ROOT / "README.md", ROOT / "benchmarks" / "README.md", ROOT / "notebooks" / "README.md",
                *(ROOT / "docs").glob("*.md")})
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")    # [text](target) and ![alt](target)
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def prose(path):
    """The page without its fenced code blocks, where `](` is code, not a link."""
    return FENCE.sub("", path.read_text(encoding="utf-8"))


def links(path):
    """(target, anchor) for every relative link of the page; web links and mail are left out."""
    found = []
    for target in LINK.findall(prose(path)):
        if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I):      # https:, mailto:...
            continue
        file, _, anchor = target.partition("#")
        found.append((file, anchor))
    return found


def slug(heading):
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path):
    return {slug(line.lstrip("#")) for line in prose(path).splitlines() if re.match(r"#{1,6} ", line)}


def test_the_pages_are_there():
    names = {p.relative_to(ROOT).as_posix() for p in PAGES}
    assert {"README.md", "docs/training.md", "docs/gpu.md", "docs/distributed.md", "docs/clip.md",
            "docs/checkpoints.md", "benchmarks/README.md", "notebooks/README.md"} <= names, names
    assert all(p.exists() for p in PAGES)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves(page):
    broken = []
    for file, anchor in links(page):
        target = (page.parent / file).resolve() if file else page
        if not target.exists():
            broken.append(f"{file}{'#' + anchor if anchor else ''}: no such file")
        elif anchor and target.suffix == ".md" and anchor not in anchors(target):
            broken.append(f"{file}#{anchor}: {target.relative_to(ROOT)} has no heading with that anchor")
    assert not broken, f"{page.relative_to(ROOT)}: links that lead nowhere:\n  " + "\n  ".join(broken)


def test_the_link_reader_sees_links_and_anchors(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# A page: the GPU's kernels\n\nSee [a](docs/a.md#x-y), ![pic](p.png), [web](https://e.org), "
                    "[here](#a-page-the-gpus-kernels).\n\n```python\nx[0](1)  # [no](link.md)\n```\n")
    assert links(page) == [("docs/a.md", "x-y"), ("p.png", ""), ("", "a-page-the-gpus-kernels")]
    assert anchors(page) == {"a-page-the-gpus-kernels"}


def test_the_readme_is_a_start_not_a_manual():
    size = (ROOT / "README.md").stat().st_size
    assert size < 15_000, f"README.md is {size:,} bytes: move detail into docs/ (limit 15,000)"
    first_screen = (ROOT / "README.md").read_text(encoding="utf-8")[:3000]
    assert "student path" in first_screen and "python -m minivit.check" in first_screen


def page_names():
    """(page, dotted) for every minivit.X.Y that docs/*.md and benchmarks/README.md write."""
    found = set()
    for page in PAGES:
        if page.name == "README.md" and page.parent == ROOT:
            continue                                   # test_structure.py checks the README's
        for dotted in re.findall(r"\bminivit(?:\.[A-Za-z_]\w*)+", page.read_text(encoding="utf-8")):
            found.add((page.relative_to(ROOT).as_posix(), dotted.rstrip(".")))
    return sorted(found)


@pytest.mark.parametrize("page,dotted", page_names())
def test_each_name_the_pages_show_resolves(page, dotted):
    obj = minivit
    for part in dotted.split(".")[1:]:
        if part in ("py", "md", "ipynb"):              # a file name, minivit.py: not an attribute
            return
        assert hasattr(obj, part), f"{page} writes {dotted}, but {getattr(obj, '__name__', obj)} has no {part!r}"
        obj = getattr(obj, part)
