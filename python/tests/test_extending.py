"""The checklists of docs/extending.md and docs/extending-modules.md name files that exist, and docs/README.md
indexes every page (no containers).

Each checklist (a GPU profile, a verl patch, a fact, a stage, a module, an owner script) is walked: every path it
names in backticks resolves from the repository root, so an edit that moves a file the checklist sends a reader to
fails here."""

from __future__ import annotations

import re

from p40fleet_dev.paths import REPO_ROOT

DOCS = REPO_ROOT / "docs"
CHECKLISTS = ("A GPU profile", "A verl patch", "A fact", "A stage", "A module", "An owner script")
TOP = ("roles/", "plugins/", "python/", "playbooks/", "docs/", "molecule/", "inventory/", "owner_scripts/")
CODE = re.compile(r"`([^`\s]+)`")


def sections(text: str) -> dict[str, str]:
    parts = re.split(r"^## (.+)$", text, flags=re.MULTILINE)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def test_every_checklist_is_there_and_its_paths_resolve():
    found = {}
    for page in ("docs/extending.md", "docs/extending-modules.md"):
        found.update(sections((REPO_ROOT / page).read_text()))
    assert list(found) == list(CHECKLISTS)
    for title, body in found.items():
        paths = [p for p in CODE.findall(body) if p.startswith(TOP) or p in ("site.yml",)]
        steps = re.findall(r"^\d+\. ", body, flags=re.MULTILINE)
        assert len(steps) >= 3 and len(paths) >= 3, title
        missing = [p for p in paths if "<" not in p and not (REPO_ROOT / p.rstrip("/")).exists()]
        assert missing == [], f"{title}: {missing}"


def test_the_index_lists_every_page_under_its_reader():
    index = (REPO_ROOT / "docs/README.md").read_text()
    assert list(sections(index)) == ["Operating", "Extending", "Developing"]
    linked = set(re.findall(r"\]\(([^)#\s]+)", index))
    pages = {
        str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md") if p.name != "README.md" and "gpu-runs" not in p.parts
    }
    assert sorted(pages - linked) == [], "pages the index does not list"
    assert sorted(p for p in linked if not (DOCS / p).is_file()) == [], "index links that resolve to nothing"
    developing = sections(index)["Developing"]
    assert all(f"({p})" in developing for p in pages if p.startswith("dev/")), "harness pages belong to Developing"
