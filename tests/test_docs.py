"""The docs stay true to the code: the configuration reference is generated, every relative link
resolves, and the README stays a short entry point (the reference lives in docs/)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tokenloom.settings.reference import render_configuration_reference

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"
PAGES = [REPO / "README.md", *sorted(DOCS.glob("*.md")), REPO / "bench" / "README.md"]
README_MAX_LINES = 200

# [text](target) and [text]: target; the target up to whitespace or ')'. Code spans and fenced
# blocks are removed first, so a Markdown example inside them is no link.
_FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
_CODE_SPAN = re.compile(r"`[^`\n]*`")
_INLINE_LINK = re.compile(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE_LINK = re.compile(r"^\s*\[[^\]]+\]:\s*(\S+)", re.MULTILINE)


def relative_links(markdown: str) -> list[str]:
    text = _CODE_SPAN.sub("", _FENCE.sub("", markdown))
    targets = _INLINE_LINK.findall(text) + _REFERENCE_LINK.findall(text)
    return [t for t in targets if not re.match(r"^[a-z][a-z0-9+.-]*:", t, re.IGNORECASE) and not t.startswith("#")]


def test_configuration_page_is_the_generator_output():
    page = DOCS / "configuration.md"
    assert page.is_file(), (
        "docs/configuration.md is missing: python -m tokenloom.settings.reference > docs/configuration.md"
    )
    assert page.read_text(encoding="utf-8") == render_configuration_reference(), (
        "docs/configuration.md differs from the config dataclasses and config.toml's comments; regenerate it with\n"
        "    python -m tokenloom.settings.reference > docs/configuration.md"
    )


def test_configuration_page_lists_every_key_with_its_env_var():
    from tokenloom.settings.config import ENV_VARS

    page = render_configuration_reference()
    for var, (section, key) in ENV_VARS.items():
        assert f"`{var}`" in page and f"`{key}`" in page, (section, key)
    assert "[kv_cache]" in page and "| `block_size` | integer | `16` | [1, 256] |" in page


def heading_anchors(markdown: str) -> set[str]:
    """GitHub's anchors for a page's headings: lower case, punctuation dropped, spaces to '-'."""
    anchors: set[str] = set()
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*$", _FENCE.sub("", markdown), re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        anchor, n = slug, 0
        while anchor in anchors:
            n += 1
            anchor = f"{slug}-{n}"
        anchors.add(anchor)
    return anchors


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_point_at_files_that_exist(page: Path):
    assert page.is_file(), page
    text = page.read_text(encoding="utf-8")
    broken = []
    for target in relative_links(text) + [
        t for t in _INLINE_LINK.findall(_CODE_SPAN.sub("", _FENCE.sub("", text))) if t.startswith("#")
    ]:
        path, _, anchor = target.partition("#")
        linked = (page.parent / path) if path else page
        if not linked.exists():
            broken.append(target)
        elif anchor and linked.suffix == ".md" and anchor not in heading_anchors(linked.read_text(encoding="utf-8")):
            broken.append(target)
    assert not broken, f"{page.relative_to(REPO)} links to missing files or headings: {broken}"


def test_the_link_finder_sees_links_and_skips_code():
    text = "[a](docs/x.md) [b](https://example.com) [c](#anchor) `[d](no.md)`\n```\n[e](no2.md)\n```\n[f]: ../y.md\n"
    assert relative_links(text) == ["docs/x.md", "../y.md"]
    assert heading_anchors("# A page\n## Finding it: `tokenloom sweep`\n## A page\n") == {
        "a-page",
        "finding-it-tokenloom-sweep",
        "a-page-1",
    }


def test_readme_is_short():
    lines = (REPO / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines (at most {README_MAX_LINES}): move reference material to docs/"
    )
