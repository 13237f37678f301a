"""Converged host images: one sandbox host taken through site.yml once, its disk kept as a podman image, so a
test that needs converged hosts starts copies of it in seconds (Sandbox.up(image=...)) where converging each
costs minutes on the test machine's cores.

An image is keyed by what the converge depends on: the digest of the files that drive it (roles, playbooks,
site.yml, the collection's plugins and owner scripts, the fleet-wide inventory variables, ansible.cfg, p40fleet's
own package and the host stand-ins), the stand-in artifacts' hash, the bare image's recipe, and the variant (GPU
profile, login mode, OS, tags). A change to any of them builds a new image; nothing is trusted from an older one.
pytest-xdist's workers share the images: the first that needs one builds it under a lock, the others wait for it and
reuse it, and the builder removes the images of the variant's older keys.

A copy is what a disk cloned onto another machine is: its stages' records came with it, and where files come from
is no stage input (docs/design.md, "Stage inputs"). Its first run re-verifies every stage where preflight's state
differs from the one the stack was verified on: always under another host name than the image's (node1), whose
stand-in GPUs differ, and on every copy of an image that did not go through every stage (no verification record).
Config that names this sandbox's mirror (the env's pip.conf) is rewritten there. The tests that use an image
converge nothing from fresh: those whose point is a fresh converge (conftest's site_fleet, which test_python_stack
shares, test_bundle, the fault suite) build their own hosts. A fleet that converges a host of an image's variant
anyway publishes it (publish): conftest's site_fleet keeps its node1 as the whole pipeline's image, which
test_ray_cluster.py, in the same work unit after it, starts from; run alone, that module builds the image.
A copy logs in as its own sandbox says (the login's account and sudo rule are set as each host starts).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
from collections.abc import Callable, Mapping

from p40fleet.run import run_playbook
from p40fleet_dev import fixtures
from p40fleet_dev.fixtures import tree_digest
from p40fleet_dev.paths import REPO_ROOT, RUNS_DIR, STANDINS_DIR
from p40fleet_dev.sandbox import (
    DEFAULT_LOGIN,
    DEFAULT_OS,
    PODMAN_PREFIX,
    Sandbox,
    SandboxError,
    image_recipe_hash,
    podman,
)

IMAGE_NAME = "localhost/p40fleet-converged"
# What a converge reads on the controller, besides the stand-ins (their own hash) and the bare image (its recipe).
INPUTS = (
    "ansible.cfg",
    "site.yml",
    "playbooks",
    "roles",
    # The collection's filters, modules, action and lookup plugins, and their routing: the roles call them by name.
    "plugins",
    # The scripts the roles hand the env owner's Python by name (the owner_script lookup).
    "owner_scripts",
    "meta/runtime.yml",
    "inventory/group_vars",
    "python/p40fleet",
    str(STANDINS_DIR.relative_to(REPO_ROOT)),
)
LOCK_DIR = RUNS_DIR / "images"


def image_key(profile: str, login: str, os_name: str, tags: str | None, extra_vars: Mapping | None) -> tuple[str, str]:
    """(variant, key): the variant names the image's kind, the key everything its converge depends on."""
    variant = f"{profile}-{login}-{os_name}-{(tags or 'all').replace(',', '_')}"
    if extra_vars:
        variant += "-" + hashlib.sha256(json.dumps(extra_vars, sort_keys=True).encode()).hexdigest()[:8]
    # An image tag is at most 128 characters of [A-Za-z0-9_.-].
    variant = re.sub(r"[^A-Za-z0-9_.-]", "_", variant)
    if len(variant) > 60:
        variant = f"{variant[:51]}-{hashlib.sha256(variant.encode()).hexdigest()[:8]}"
    digest = hashlib.sha256()
    for part in (tree_digest(INPUTS), fixtures.standins_hash(), image_recipe_hash(os_name), variant):
        digest.update(part.encode() + b"\0")
    return variant, digest.hexdigest()[:16]


def _ensure(variant: str, key: str, make: Callable[[str], None]) -> str:
    """The image of `variant` for `key`, made by make(tag) under the variant's lock where it does not exist yet (the
    variant's images of older keys removed then)."""
    tag = f"{IMAGE_NAME}:{PODMAN_PREFIX}-{variant}-{key}"
    LOCK_DIR.mkdir(parents=True, exist_ok=True)
    with (LOCK_DIR / f"{variant}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if podman("image", "exists", tag, check=False).returncode != 0:
            make(tag)
            _remove_older(tag, variant)
    return tag


def converged_image(
    *,
    profile: str = "p40",
    login: str = DEFAULT_LOGIN,
    os_name: str = DEFAULT_OS,
    tags: str | None = None,
    extra_vars: Mapping | None = None,
) -> str:
    """The podman image of a host `profile` named node1, logging in as `login`, converged by site.yml (`tags`,
    `extra_vars` as given): built on first use, then reused by every worker of the session (and by later sessions
    while nothing it depends on changes)."""
    variant, key = image_key(profile, login, os_name, tags, extra_vars)
    return _ensure(variant, key, lambda tag: _build(tag, profile, login, os_name, tags, extra_vars))


def publish(container: str, **variant) -> str:
    """Keep the disk of a host a test fleet converged as converged_image's image of `variant` (converged_image's
    keywords: its own name node1, site.yml with those tags and extra vars, logging in so, on that OS), where that
    image is not built yet: a fleet that converges such a host anyway saves the next test the minutes of building
    it. The caller vouches for the converge (it succeeded and a re-run changed nothing); the key is the current
    one."""
    variant, key = image_key(**{**converged_image.__kwdefaults__, **variant})
    return _ensure(variant, key, lambda tag: podman("commit", "--quiet", container, tag))


def _build(tag: str, profile: str, login: str, os_name: str, tags: str | None, extra_vars: Mapping | None) -> None:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    sandbox = Sandbox(f"image-{worker}")
    try:
        sandbox.up([profile], login=login, os_name=os_name)
        cmdline = ["--tags", tags] if tags else []
        password = sandbox.become_password_file if login == "sudo-password" else None
        result = run_playbook(
            REPO_ROOT / "site.yml",
            sandbox.inventory_dir,
            cmdline=cmdline,
            extravars=dict(extra_vars or {}),
            become_password_file=password,
        )
        if result.rc != 0:
            failures = "; ".join(f"{f.host}: {f.task}: {f.message}" for f in result.failures)
            raise SandboxError(f"converging the image {tag} failed (rc {result.rc}): {failures}")
        podman("commit", "--quiet", sandbox.host("node1").container, tag)
    finally:
        sandbox.down()


def stale_images(listed: list[str], tag: str, variant: str) -> list[str]:
    """The variant's images of other keys among `listed`. A key is one hex word: another variant whose name starts
    with this one's (the same host with extra vars: `...-all-3c5b6fde`) is not this variant's, and not stale."""
    prefix = f"{IMAGE_NAME}:{PODMAN_PREFIX}-{variant}-"
    return [
        name
        for name in listed
        if name.startswith(prefix) and name != tag and re.fullmatch(r"[0-9a-f]+", name[len(prefix) :])
    ]


def _remove_older(tag: str, variant: str) -> None:
    listed = podman("images", "--format", "{{.Repository}}:{{.Tag}}", IMAGE_NAME, check=False).stdout.decode()
    stale = stale_images(listed.split(), tag, variant)
    if stale:
        podman("image", "rm", "-f", *stale, check=False)


def owner_image(owner: str) -> str:
    """converged_image's host converged for the env owner `owner` (p40fleet_env_owner as an extra var), logging in as
    root: test_owner_fleet's fleet and docs/dev/sandbox-day.md's recipe (test_sandbox_docs) start from this one
    image, so the same key builds it once per suite run."""
    return converged_image(**_owner_variant(owner))


def publish_owner(container: str, owner: str) -> str:
    """Keep a host a test converged through the whole of site.yml for `owner` (node1, logging in as root, on the default
    OS, p40fleet_env_owner set to it) as owner_image's image: test_collection.py's converge, which test_owner_fleet.py
    and test_sandbox_docs.py then start from instead of converging another host (publish's terms)."""
    return publish(container, **_owner_variant(owner))


def _owner_variant(owner: str) -> dict:
    return {"profile": "p40", "login": "root", "extra_vars": {"p40fleet_env_owner": owner}}
