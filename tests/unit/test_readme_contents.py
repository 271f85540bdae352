"""The README's contents line lists every section and links each to a heading that exists
(its 1,700 lines had no table of contents, and no heading for the OpenAI API)."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def headings(text: str) -> list[tuple[int, str]]:
    """Each heading outside code blocks: its level and title."""
    found, in_code = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and (match := re.match(r"^(#{2,4}) (.+)$", line)):
            found.append((len(match.group(1)), match.group(2)))
    return found


def github_anchor(title: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation but '-' dropped, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")


def test_the_contents_list_every_section_and_each_link_lands_on_a_heading() -> None:
    text = README.read_text()
    (contents,) = [line for line in text.splitlines() if line.startswith("**Contents:**")]
    links = re.findall(r"\[([^\]]+)\]\(#([^)]+)\)", contents)
    anchors = {github_anchor(title) for _, title in headings(text)}
    assert [a for _, a in links if a not in anchors] == []
    sections = [github_anchor(title) for level, title in headings(text) if level <= 3]
    assert [a for _, a in links if a in sections] == sections  # all of them, in order
    assert "the-openai-api" in {a for _, a in links}
