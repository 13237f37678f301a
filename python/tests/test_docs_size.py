"""The manual stays short and its pages stay topic pages (no containers).

README.md is the operator's manual: under 2,800 words, its median sentence under 20 words. Every page in docs/ is
under 600 words; a longer topic is split into pages.

Words are counted as a reader meets them: every whitespace-separated token with a letter or digit in it, code blocks
and tables included (an operator reads a command too); table rules, list bullets and fence marks are not words.
Sentences are measured in prose only: paragraphs and list items, split after `.`, `!` or `?`. Code blocks, tables and
headings hold no sentences (a command or a table row is read differently), so they are left out of the median.
"""

from __future__ import annotations

import re
import statistics

import pytest

from p40fleet_dev.paths import REPO_ROOT

README_MAX_WORDS = 2800
README_MAX_MEDIAN_SENTENCE = 20
PAGE_MAX_WORDS = 600

WORD = re.compile(r"[A-Za-z0-9]")
SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
BULLET = re.compile(r"^\s*(?:[-*+]|\d+\.)\s+")


def words(text: str) -> int:
    """Every token with a letter or digit in it, code and tables included."""
    return sum(1 for token in text.split() if WORD.search(token) and not token.startswith("```"))


def sentences(text: str) -> list[str]:
    """The prose sentences of a Markdown text: paragraphs and list items, without code, tables or headings."""
    blocks: list[list[str]] = []
    current: list[str] = []
    in_code = False
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("```"):
            in_code = not in_code
            blocks.append(current)
            current = []
            continue
        if in_code or stripped.startswith(("|", "#")) or not stripped:
            blocks.append(current)
            current = []
            continue
        if BULLET.match(line):
            blocks.append(current)
            current = [BULLET.sub("", line)]
            continue
        current.append(stripped)
    blocks.append(current)
    found = []
    for block in blocks:
        prose = " ".join(block).strip()
        found += [s for s in SENTENCE_END.split(prose) if words(s)]
    return found


def median_sentence(text: str) -> float:
    return statistics.median(words(s) for s in sentences(text))


def test_words_count_tokens_with_letters_or_digits():
    assert words("| --- | --- |\n- `make demo` runs 3 hosts.\n```sh\nmake test\n```") == 7


def test_sentences_skip_code_tables_and_headings():
    text = "# A heading\n\nOne two. Three four\nfive!\n\n```sh\nnot a sentence. at all\n```\n| a | b. |\n- An item."
    assert sentences(text) == ["One two.", "Three four five!", "An item."]
    assert median_sentence(text) == 2


def test_readme_is_a_manual_read_in_ten_minutes():
    text = (REPO_ROOT / "README.md").read_text()
    count, median = words(text), median_sentence(text)
    assert count < README_MAX_WORDS, f"README.md has {count} words; move a topic to docs/ (limit {README_MAX_WORDS})"
    assert median < README_MAX_MEDIAN_SENTENCE, (
        f"README.md's median sentence is {median} words; split long sentences (limit {README_MAX_MEDIAN_SENTENCE})"
    )


@pytest.mark.parametrize(
    "page", sorted(str(p.relative_to(REPO_ROOT / "docs")) for p in (REPO_ROOT / "docs").rglob("*.md"))
)
def test_each_docs_page_is_a_topic_page(page):
    count = words((REPO_ROOT / "docs" / page).read_text())
    assert count < PAGE_MAX_WORDS, f"docs/{page} has {count} words; split it into pages (limit {PAGE_MAX_WORDS})"
