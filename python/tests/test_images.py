"""The converged images' keys (p40fleet_dev.images): a key changes with whatever the converge depends on, so a
test never starts from an image of other roles, stand-ins or variant. Building and using the images is shown by
the modules that start from them (test_ray_cluster.py)."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from p40fleet_dev import images

BASE = {"profile": "p40", "login": "sudo", "os_name": "debian12", "tags": None, "extra_vars": None}


def key(**changes):
    return images.image_key(**{**BASE, **changes})


def test_the_same_variant_gets_the_same_key():
    assert key() == key()
    assert key()[0] == "p40-sudo-debian12-all"


@pytest.mark.parametrize(
    "change",
    [
        {"profile": "p40x2"},
        {"login": "root"},
        {"os_name": "debian11"},
        {"tags": "host_prereqs,conda_env"},
        {"extra_vars": {"verl_install_vllm": False}},
    ],
    ids=lambda change: next(iter(change)),
)
def test_each_part_of_the_variant_changes_the_name_and_the_key(change):
    variant, digest = key(**change)
    assert variant != key()[0]
    assert digest != key()[1]


def test_the_variant_is_a_valid_image_tag_however_long_the_tags():
    variant, _ = key(tags="host_prereqs,conda_env,pytorch,apex,verl,verl_patches,training_data,launch_script")
    assert re.fullmatch(r"[A-Za-z0-9_.-]{1,60}", variant), variant
    assert key(tags="a,b")[0] == "p40-sudo-debian12-a_b"


def test_the_key_follows_every_file_the_converge_reads(monkeypatch):
    before = key()[1]
    monkeypatch.setattr(images, "tree_digest", lambda paths: "another tree")
    assert key()[1] != before
    monkeypatch.undo()
    monkeypatch.setattr(images.fixtures, "standins_hash", lambda: "other stand-ins")
    assert key()[1] != before


def test_the_key_covers_the_collection_s_plugins():
    """A filter's change re-renders what the roles write (the launch script's estimate line, 2026-12-07): an image
    converged before it is another host's disk."""
    paths = [path.strip("/") for path in images.INPUTS]
    for reads in (
        "plugins/filter/launch_script_estimate.py",
        "plugins/modules/fleet_state_probe.py",
        "owner_scripts/verl_probe.py",
        "meta/runtime.yml",
    ):
        assert any(reads == path or reads.startswith(path + "/") for path in paths), reads


def test_the_tree_digest_sees_names_and_contents(tmp_path):
    (tmp_path / "roles" / "a").mkdir(parents=True)
    (tmp_path / "roles" / "a" / "main.yml").write_text("one\n")
    (tmp_path / "site.yml").write_text("---\n")
    first = images.tree_digest(["roles", "site.yml"], base=tmp_path)
    (tmp_path / "roles" / "a" / "main.yml").write_text("two\n")
    second = images.tree_digest(["roles", "site.yml"], base=tmp_path)
    (tmp_path / "roles" / "a" / "main.yml").rename(tmp_path / "roles" / "a" / "other.yml")
    third = images.tree_digest(["roles", "site.yml"], base=tmp_path)
    # Bytecode is not a source: a cache written by a run leaves the key alone.
    (tmp_path / "roles" / "a" / "__pycache__").mkdir()
    (tmp_path / "roles" / "a" / "__pycache__" / "x.cpython-311.pyc").write_bytes(b"\0")
    assert len({first, second, third}) == 3
    assert images.tree_digest(["roles", "site.yml"], base=tmp_path) == third


def test_a_published_host_is_the_image_converged_image_then_returns(monkeypatch, tmp_path):
    # podman answering as it would: the variant's image absent until the commit makes it.
    made = []

    def podman(*args, check=True):
        if args[:2] == ("image", "exists"):
            return SimpleNamespace(returncode=0 if args[2] in made else 1)
        if args[0] == "commit":
            made.append(args[-1])
        return SimpleNamespace(returncode=0, stdout=b"")

    monkeypatch.setattr(images, "podman", podman)
    monkeypatch.setattr(images, "LOCK_DIR", tmp_path)
    monkeypatch.setattr(images, "_build", lambda *args: pytest.fail("an image published is not built again"))
    tag = images.publish("p40fleet-site-node1", profile="p40", login="root")
    assert made == [tag] and tag.endswith("-" + "-".join(key(login="root")))
    assert images.converged_image(profile="p40", login="root") == tag
    # Published once: a second fleet's host does not replace it.
    assert images.publish("p40fleet-other-node1", login="root") == tag and made == [tag]


def test_only_the_variants_own_older_images_are_stale():
    # A default-variant build removed the image of the same host converged with extra vars (its name starts with the
    # default's), under a test that was about to start from it.
    base = f"{images.IMAGE_NAME}:{images.PODMAN_PREFIX}-p40-root-debian12-all"
    listed = [f"{base}-aaaa1111", f"{base}-bbbb2222", f"{base}-3c5b6fde-cccc3333", f"{base}x-dddd4444"]
    assert images.stale_images(listed, f"{base}-bbbb2222", "p40-root-debian12-all") == [f"{base}-aaaa1111"]
    assert images.stale_images(listed, f"{base}-3c5b6fde-eeee5555", "p40-root-debian12-all-3c5b6fde") == [
        f"{base}-3c5b6fde-cccc3333"
    ]
