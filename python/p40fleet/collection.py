"""The Ansible collection p40fleet.fleet: which files of a checkout it is made of.

`ansible-galaxy collection build` packs a checkout's files minus galaxy.yml's build_ignore patterns and
its own fixed ignores; setup.py copies the same selection into the wheel (p40fleet/collection/), so an
installed p40fleet has the very playbooks and roles a collection build would ship. The selection is a
walk of the whole tree, never a list of roles: a new role ships without an edit here.

Imported by setup.py at build time by file path (not as part of the package): standard library and
PyYAML only.
"""

from __future__ import annotations

import fnmatch
import os
from pathlib import Path

import yaml

# ansible-galaxy's own ignores (ansible/galaxy/collection/__init__.py, _build_files_manifest_walk, in
# ansible-core 2.19): python/tests/test_collection.py compares this selection with a real build's FILES.json.
GALAXY_IGNORE_PATTERNS = ("MANIFEST.json", "FILES.json", "galaxy.yml", "galaxy.yaml", ".git", "*.pyc", "*.retry")
GALAXY_IGNORE_PATTERNS += ("tests/output",)
GALAXY_IGNORE_DIRS = frozenset({"CVS", ".bzr", ".hg", ".git", ".svn", "__pycache__", ".tox"})


class CollectionError(RuntimeError):
    pass


def galaxy_metadata(root: Path) -> dict:
    path = root / "galaxy.yml"
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as error:
        raise CollectionError(f"{path}: {error.strerror}: not a p40fleet checkout") from error
    for key in ("namespace", "name", "version"):
        if not isinstance(data.get(key), str) or not data[key]:
            raise CollectionError(f"{path}: '{key}' must be a non-empty string, found {data.get(key)!r}")
    return data


def collection_files(root: Path) -> list[str]:
    """Relative paths (POSIX) of every file the collection built from `root` holds, sorted."""
    meta = galaxy_metadata(root)
    patterns = [*GALAXY_IGNORE_PATTERNS, f"{meta['namespace']}-{meta['name']}-*.tar.gz"]
    patterns += [str(p) for p in meta.get("build_ignore") or []]
    top = root.resolve()
    found: list[str] = []

    def ignored(rel: str) -> bool:
        return any(fnmatch.fnmatch(rel, pattern) for pattern in patterns)

    def walk(directory: Path, rel_dir: str) -> None:
        for entry in sorted(os.listdir(directory)):
            path = directory / entry
            rel = f"{rel_dir}{entry}"
            if path.is_dir():
                if entry in GALAXY_IGNORE_DIRS or ignored(rel):
                    continue
                if path.is_symlink():
                    if not path.resolve().is_relative_to(top):
                        continue  # ansible-galaxy skips it too, with a warning
                    # ansible-galaxy would pack the link itself, which a wheel cannot hold.
                    raise CollectionError(f"{path}: a symlinked directory in the collection; make it a real one")
                walk(path, rel + "/")
            elif not ignored(rel):
                found.append(rel)

    walk(top, "")
    return sorted(found)
