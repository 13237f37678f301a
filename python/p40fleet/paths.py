"""Where p40fleet's playbooks, roles and state live: in a checkout, or in the installed package.

Run from a checkout (this file is <checkout>/python/p40fleet/paths.py, as after `pip install -e .`), the
playbooks and roles are the checkout's own and state stays in its git-ignored dot directories, as always.
Installed from the wheel, they are the copy of the collection the wheel carries
(p40fleet/collection/ansible_collections/p40fleet/fleet/, found with importlib.resources; setup.py puts it there).
Either way COLLECTIONS_PATH holds ansible_collections/p40fleet/fleet, so the roles' fully qualified names
(p40fleet.fleet.<plugin>) resolve to this very copy: a checkout's is the committed link
collections/ansible_collections/p40fleet/fleet -> the checkout. Runs keep their state in the state directory
either way (p40fleet.state).

What only the sandbox and the tests use (the checkout's caches, the stand-ins, the tests' output) is the
development harness's (p40fleet_dev.paths), which no wheel carries.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path


def _find_checkout() -> Path | None:
    here = Path(__file__).resolve()
    root = here.parents[2]
    in_checkout = here == root / "python" / "p40fleet" / "paths.py"
    if in_checkout and (root / "site.yml").is_file() and (root / "roles").is_dir():
        return root
    return None


# Where a collections path holds p40fleet.fleet (galaxy.yml's namespace and name).
COLLECTION_SUBPATH = ("ansible_collections", "p40fleet", "fleet")


def _packaged_collection() -> Path:
    collection = Path(str(resources.files("p40fleet") / "collection")).joinpath(*COLLECTION_SUBPATH)
    if not ((collection / "site.yml").is_file() and (collection / "roles").is_dir()):
        raise RuntimeError(
            f"p40fleet: no playbooks and roles at {collection} (and {Path(__file__).resolve().parents[2]} is no"
            " checkout). This install is incomplete: reinstall the p40fleet wheel, or install from a checkout."
        )
    return collection


# The checkout this p40fleet runs from, or None when it is installed from the wheel.
CHECKOUT: Path | None = _find_checkout()

# site.yml, ansible.cfg, roles/ and playbooks/: the checkout, or the collection in the installed package.
ANSIBLE_DIR = CHECKOUT if CHECKOUT is not None else _packaged_collection()
# The directory Ansible's collections path names so that p40fleet.fleet is ANSIBLE_DIR.
COLLECTIONS_PATH = CHECKOUT / "collections" if CHECKOUT is not None else ANSIBLE_DIR.parents[2]
SITE_PLAYBOOK = ANSIBLE_DIR / "site.yml"
ANSIBLE_CONFIG = ANSIBLE_DIR / "ansible.cfg"
ROLES_DIR = ANSIBLE_DIR / "roles"
PLAYBOOKS_DIR = ANSIBLE_DIR / "playbooks"
