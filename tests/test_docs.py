"""The README and docs/: every relative link names a file that exists and, where it names a heading, that heading."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    kept = "".join(c for c in heading.strip().lower() if c.isalpha() or c.isdecimal() or c in " -_")
    return kept.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # a '#' comment in a code block is no heading
    return {slug(m.group(1)) for m in re.finditer(r"^#+\s+(.+)$", text, flags=re.M)}


def test_slug_matches_githubs_for_our_headings():
    assert slug("EAL vs CE by training budget") == "eal-vs-ce-by-training-budget"
    assert slug("D²SD: trees from a first and a second drafter") == "dsd-trees-from-a-first-and-a-second-drafter"
    assert slug("ReTrace `W_o` zeroed (1.0)") == "retrace-w_o-zeroed-10"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target} (no such heading)")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)
