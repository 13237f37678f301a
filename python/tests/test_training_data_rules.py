"""training_data's choice of hub files and their hashes (plugins/filter/training_data.py), without hosts.

The listing comes from the hub through the throwaway account: root downloads only what the filter names, each with
the hash root recomputes before the owner gets it. A listing for another commit, a path that would leave root's
staging directory, an entry without a hash, or a named file that is absent must be refused.
"""

from __future__ import annotations

import json

import pytest
from ansible.errors import AnsibleFilterError

from p40fleet_dev.paths import REPO_ROOT
from tests.source_modules import load_module

rules = load_module(REPO_ROOT / "plugins" / "filter" / "training_data.py", "training_data_filters")
COMMIT = "0123456789abcdef0123456789abcdef01234567"
BLOB = "89abcdef0123456789abcdef0123456789abcdef"
SHA = "ab" * 32
PARQUET = ["main/train-00000-of-00001.parquet", "main/test-00000-of-00001.parquet"]
PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model"]


def small(name, size=10):
    return {"rfilename": name, "size": size, "blobId": BLOB}


def large(name, size=1000):
    return {"rfilename": name, "size": size, "blobId": BLOB, "lfs": {"sha256": SHA, "size": size, "pointerSize": 134}}


def listing(*siblings, sha=COMMIT):
    return json.dumps({"id": "org/repo", "sha": sha, "siblings": list(siblings)})


MODEL = listing(
    small(".gitattributes"),
    small("odd name"),
    small("README.md"),
    small("config.json"),
    large("model.safetensors"),
    small("tokenizer.json"),
    small("merges.txt"),
    small("onnx/config.json"),
    large("onnx/model.onnx"),
)


@pytest.mark.parametrize(
    ("text", "kind", "files", "patterns", "expected"),
    [
        # GSM8K: exactly the two parquet files, in the order named, their LFS sha256 to check.
        (
            listing(small("README.md"), large(PARQUET[0], 5), large(PARQUET[1], 7), large("socratic/x.parquet")),
            "dataset",
            PARQUET,
            [],
            [
                {"path": PARQUET[1], "size": 7, "hash": "sha256", "digest": SHA},
                {"path": PARQUET[0], "size": 5, "hash": "sha256", "digest": SHA},
            ],
        ),
        # The model: allow_patterns as huggingface_hub reads them (fnmatch over the whole path, nested too).
        (
            MODEL,
            "model",
            [],
            PATTERNS,
            [
                {"path": "config.json", "size": 10, "hash": "blob", "digest": BLOB},
                {"path": "merges.txt", "size": 10, "hash": "blob", "digest": BLOB},
                {"path": "model.safetensors", "size": 1000, "hash": "sha256", "digest": SHA},
                {"path": "onnx/config.json", "size": 10, "hash": "blob", "digest": BLOB},
                {"path": "tokenizer.json", "size": 10, "hash": "blob", "digest": BLOB},
            ],
        ),
        # No patterns: the whole repo.
        (
            listing(small("a.txt"), small("b/c.bin", 3)),
            "model",
            [],
            [],
            [
                {"path": "a.txt", "size": 10, "hash": "blob", "digest": BLOB},
                {"path": "b/c.bin", "size": 3, "hash": "blob", "digest": BLOB},
            ],
        ),
    ],
)
def test_the_files_to_fetch_and_their_hashes(text, kind, files, patterns, expected):
    staged = [
        {**e, "kind": kind, "repo": "org/repo", "revision": COMMIT, "dest": f"{kind}/{e['path']}"} for e in expected
    ]
    assert rules.training_data_hub_files(text, kind, "org/repo", COMMIT, files, patterns, "node3") == staged


@pytest.mark.parametrize(
    ("text", "revision", "files", "patterns", "message"),
    [
        (listing(small("config.json"), sha="f" * 40), COMMIT, [], [], "not the pinned " + COMMIT),
        (listing(small("config.json")), "main", [], [], "a branch or tag is not a pin"),
        (listing(small("config.json")), "v1.0", [], [], "revision is 'v1.0'"),
        ("<html>", COMMIT, [], [], "not JSON"),
        (json.dumps({"sha": COMMIT}), COMMIT, [], [], "no file list"),
        (listing(small("../etc/passwd")), COMMIT, [], [], "names a file '../etc/passwd'"),
        (listing(small("/etc/passwd")), COMMIT, [], [], "names a file '/etc/passwd'"),
        (listing(small("a/./b.json")), COMMIT, [], [], "names a file 'a/./b.json'"),
        (listing(small("-rf.json")), COMMIT, [], [], "names a file '-rf.json'"),
        (listing(small("a/../b.json")), COMMIT, [], [], "names a file 'a/../b.json'"),
        (listing(small("./b.json")), COMMIT, [], [], "names a file"),
        (listing(small("a\nb.json")), COMMIT, [], [], "names a file"),
        (listing({"rfilename": "config.json", "size": 3}), COMMIT, [], [], "no blob hash and size"),
        (listing({"rfilename": "config.json", "size": 3, "blobId": "x"}), COMMIT, [], [], "no blob hash"),
        (listing({"rfilename": "m.safetensors", "size": 3, "lfs": {"size": 3}}), COMMIT, [], [], "no sha256 hash"),
        (listing({"rfilename": "config.json", "size": True, "blobId": BLOB}), COMMIT, [], [], "no blob hash"),
        (listing(large(PARQUET[0])), COMMIT, PARQUET, [], "has no " + PARQUET[1]),
        (listing(small("README.md")), COMMIT, [], PATTERNS, "no file of model org/repo"),
    ],
)
def test_a_listing_root_cannot_trust_is_refused(text, revision, files, patterns, message):
    kind = "dataset" if files else "model"
    with pytest.raises(AnsibleFilterError) as raised:
        rules.training_data_hub_files(text, kind, "org/repo", revision, files, patterns, "node3")
    assert str(raised.value).startswith("node3: ")
    assert message in str(raised.value)
