"""Every repository path that code, comments, docs and README name exists in the repository (no containers).

A reader who follows `docs/facts.md#...`, `roles/x/defaults/main.yml` or `[design](design.md)` must find it. A path
is a word that starts with one of the repository's top folders (roles/, docs/, python/, playbooks/, plugins/,
molecule/, inventory/) or ends in `.md`; it must exist from the repository root, or (for a relative link or a bare
file name) beside the file that names it.
"""

from __future__ import annotations

import re
import subprocess

import pytest

from p40fleet_dev.paths import REPO_ROOT

# Files whose words are history, records or test data, not references: the changelog names files as they were
# when each entry was written (some since moved); the GPU run records quote the hosts' own paths and logs; this test
# test_unit_costs.py and test_owner_boundary.py hold made-up paths as their table data.
NOT_SCANNED = (
    "CHANGELOG.md",
    "docs/gpu-runs/",
    "python/tests/test_references.py",
    "python/tests/test_unit_costs.py",
    "python/tests/test_owner_boundary.py",
)
SCANNED_SUFFIXES = (".py", ".yml", ".yaml", ".j2", ".sh", ".md", ".cfg", ".toml", ".txt", ".in", ".json")
SCANNED_NAMES = ("Makefile", "nvidia-smi", "nvcc", "ansible.cfg", "run")

# Paths that exist only once something ran, or in another repository, each with the reason it is not in this one.
CREATED_AT_RUN_TIME = {
    # Made by the operator from inventory/hosts.example.yml (quick start); ignored by git.
    "inventory/hosts.yml": "the operator's copy of inventory/hosts.example.yml",
    # The patch set verl_patches' refusal asks the operator to write for an unsupported verl release.
    "roles/verl_patches/vars/main/patchsets/verl-0.4.0.yml": "the operator writes it for verl 0.4.0",
    # Not this repository's: files of conda/conda-docs and pyenv/pyenv, each named beside its repository.
    "docs/source/miniconda.rst": "conda/conda-docs' file, cited as the source of a pin",
    "plugins/python-build/share/python-build/miniconda3-3.10-23.3.1-0": "pyenv/pyenv's file, the pin's second source",
}

TOP = r"(?:roles|docs|python|playbooks|plugins|molecule|inventory)/"
PATH = re.compile(rf"(?<![\w./~$-])((?:{TOP})[\w./-]*[\w/]|[\w./-]*[\w-]\.md)(?:#[\w-]+)?")
MD_LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
# A word with a placeholder or a pattern is a family of paths, not one.
PATTERN = re.compile(r"[*<>{}$]|\.\.\.|py3?X[XY]")


def scanned_files() -> list[str]:
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    return [
        f
        for f in listed
        if not f.startswith(NOT_SCANNED)
        and (f.endswith(SCANNED_SUFFIXES) or f.rsplit("/", 1)[-1] in SCANNED_NAMES)
        and (REPO_ROOT / f).is_file()
    ]


def _exists(word: str, where: str) -> bool:
    if word in CREATED_AT_RUN_TIME:
        return True
    here = (REPO_ROOT / where).parent
    return (REPO_ROOT / word).exists() or (here / word).exists()


def dangling(name: str, text: str) -> list[str]:
    """The references in `text` (of the file `name`) that lead nowhere, as `name:line: word`."""
    found = []
    for number, line in enumerate(text.splitlines(), start=1):
        for token in line.split():
            if "://" in token or PATTERN.search(token):
                continue
            words = [m.group(1) for m in PATH.finditer(token)] + [m.group(1) for m in MD_LINK.finditer(token)]
            for word in words:
                word = word.rstrip(".")
                if not _exists(word, name):
                    found.append(f"{name}:{number}: {word}")
    return sorted(set(found))


def test_a_reference_to_a_missing_file_is_found():
    text = "see docs/nowhere.md and roles/gpu_preflight/defaults/main.yml, [facts](facts.md), FACTS.md"
    assert dangling("docs/design.md", text) == ["docs/design.md:1: FACTS.md", "docs/design.md:1: docs/nowhere.md"]


def test_patterns_links_and_run_time_paths_are_not_references():
    text = "roles/<role>/meta, roles/*/tasks, https://example.org/docs/x.md, inventory/hosts.yml, roles/{{ x }}/docs"
    assert dangling("README.md", text) == []


@pytest.mark.parametrize("reason", CREATED_AT_RUN_TIME.values())
def test_each_run_time_path_says_why(reason):
    assert reason.strip()


def test_every_reference_resolves():
    missing = [
        ref for name in scanned_files() for ref in dangling(name, (REPO_ROOT / name).read_text(errors="replace"))
    ]
    assert not missing, "references to files that are not in the repository:\n" + "\n".join(missing)
