"""training_data's choice of the hub files to fetch at a pinned commit, and the hashes root checks them against.

`listing | training_data_hub_files(kind, repo, revision, files, patterns, host)` reads the hub's listing of a repo
at a commit (`/api/{models,datasets}/{repo}/revision/{commit}?blobs=true`, as the throwaway account fetched it:
roles/training_data/files/training_data_hub.py) and gives the files to download, sorted by path, each as
{"path", "size", "hash": "sha256" | "blob", "digest", "kind", "repo", "revision", "dest": "<kind>/<path>"}: the LFS
sha256 of a large file, the git blob sha1 of the others, which root recomputes over the staged bytes before the
owner gets them. `files` names exact paths (GSM8K's parquet files: each must be there); otherwise `patterns` selects as
huggingface_hub's allow_patterns do (fnmatch on the whole path; empty: every file). A listing for another commit, a
path that could leave the staging directory, or an entry without its hash is refused. Table-tested in
python/tests/test_training_data_rules.py.
"""

import fnmatch
import json
import re

from ansible.errors import AnsibleFilterError

COMMIT = re.compile(r"[0-9a-f]{40}")
SHA256 = re.compile(r"[0-9a-f]{64}")
# One part of a repo path: a plain file or directory name, never `.`, `..`, an option or a control character.
PART = re.compile(r"(?!\.\.?$)[A-Za-z0-9_.][A-Za-z0-9._+=-]*")
KINDS = ("model", "dataset")


def _refuse(host, what, fix):
    raise AnsibleFilterError(f"{host}: {what}. {fix}")


def _entry(sibling, host, where):
    name = sibling.get("rfilename") if isinstance(sibling, dict) else None
    if not isinstance(name, str) or not all(PART.fullmatch(part) for part in name.split("/")):
        _refuse(
            host,
            f"the hub's listing of {where} names a file {str(name)[:120]!r}",
            "Required: relative paths of plain names (letters, digits, . _ + = -); nothing was downloaded.",
        )
    lfs = sibling.get("lfs")
    if isinstance(lfs, dict) and lfs:
        digest, size, hash_kind = lfs.get("sha256"), lfs.get("size"), "sha256"
        good = isinstance(digest, str) and SHA256.fullmatch(digest)
    else:
        digest, size, hash_kind = sibling.get("blobId"), sibling.get("size"), "blob"
        good = isinstance(digest, str) and COMMIT.fullmatch(digest)
    if not good or not isinstance(size, int) or isinstance(size, bool) or size < 0:
        _refuse(
            host,
            f"the hub's listing of {where} gives {name} no {hash_kind} hash and size ({str(digest)[:80]!r}, {size!r})",
            "Required: a hub that lists files with ?blobs=true (their LFS sha256 or git blob id); root checks every "
            "file against it. Nothing was downloaded.",
        )
    return {"path": name, "size": size, "hash": hash_kind, "digest": digest}


def training_data_hub_files(listing, kind, repo, revision, files=None, patterns=None, host="this host"):
    """The files to fetch from the listing of REPO at REVISION, with the hash each must have."""
    where = f"{kind} {repo} at {revision}"
    if kind not in KINDS:
        _refuse(host, f"unknown repo kind {kind!r}", f"Required: one of {', '.join(KINDS)}.")
    if not isinstance(revision, str) or not COMMIT.fullmatch(revision):
        _refuse(
            host,
            f"the {kind} revision is {str(revision)[:80]!r}",
            "Required: a commit id (40 hex digits): a branch or tag is not a pin.",
        )
    if isinstance(listing, str):
        try:
            listing = json.loads(listing)
        except ValueError as error:
            _refuse(host, f"the hub's listing of {where} is not JSON ({error})", "Check the hub endpoint.")
    if not isinstance(listing, dict) or not isinstance(listing.get("siblings"), list):
        _refuse(host, f"the hub's listing of {where} has no file list", "Check the hub endpoint.")
    if listing.get("sha") != revision:
        _refuse(
            host,
            f"the hub listed {kind} {repo} at commit {str(listing.get('sha'))[:80]!r}, not the pinned {revision}",
            "Required: a hub that serves the pinned commit; nothing was downloaded.",
        )
    # Only the chosen entries are judged: a file the run does not fetch may be named as its repo likes.
    entries = {s.get("rfilename"): s for s in listing["siblings"] if isinstance(s, dict)}
    if files:
        missing = sorted(set(files) - set(entries))
        if missing:
            _refuse(
                host,
                f"{where} has no {', '.join(missing)}",
                "Required: the files training_data_dataset_files names, at the pinned commit.",
            )
        chosen = [entries[name] for name in files]
    else:
        chosen = [
            e
            for name, e in entries.items()
            if isinstance(name, str) and (not patterns or any(fnmatch.fnmatch(name, p) for p in patterns))
        ]
    # Staged as <kind>/<path> in root's directory, the layout the controller's copies use.
    chosen = [
        {
            **_entry(sibling, host, where),
            "kind": kind,
            "repo": repo,
            "revision": revision,
            "dest": f"{kind}/{sibling['rfilename']}",
        }
        for sibling in chosen
    ]
    if not chosen:
        _refuse(
            host,
            f"no file of {where} matches {list(patterns or [])}",
            "Required: training_data_model_allow_patterns that select the model's files.",
        )
    return sorted({e["path"]: e for e in chosen}.values(), key=lambda e: e["path"])


class FilterModule:
    def filters(self):
        return {"training_data_hub_files": training_data_hub_files}
