"""Where p40fleet's playbooks, roles and state live: in a checkout, or in the installed package.

Run from a checkout (this file is <checkout>/python/p40fleet/paths.py, as after `pip install -e .`), the
playbooks and roles are the checkout's own and state stays in its git-ignored dot directories, as always.
Installed from the wheel, they are the copy of the collection the wheel carries (p40fleet/collection/, found
with importlib.resources; setup.py puts it there). Runs keep their state in the state directory either way
(p40fleet.state).

What only the sandbox and the tests use (the repository itself, the stand-ins, the test fixtures, the tests'
output) exists in a checkout only: reading REPO_ROOT, STANDINS_DIR, UPSTREAM_LIST, UPSTREAM_DIR or RUNS_DIR
elsewhere raises CheckoutRequired, which says so.
"""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path

from p40fleet.state import default_state_dir


class CheckoutRequired(RuntimeError):
    """A checkout-only path was asked for by an installed p40fleet."""


def _find_checkout() -> Path | None:
    here = Path(__file__).resolve()
    root = here.parents[2]
    in_checkout = here == root / "python" / "p40fleet" / "paths.py"
    if in_checkout and (root / "site.yml").is_file() and (root / "roles").is_dir():
        return root
    return None


def _packaged_collection() -> Path:
    collection = Path(str(resources.files("p40fleet") / "collection"))
    if not ((collection / "site.yml").is_file() and (collection / "roles").is_dir()):
        raise RuntimeError(
            f"p40fleet: no playbooks and roles at {collection} (and {Path(__file__).resolve().parents[2]} is no"
            " checkout). This install is incomplete: reinstall the p40fleet wheel, or install from a checkout."
        )
    return collection


def _user_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME")
    return (Path(base) if base else Path.home() / ".cache") / "p40fleet"


# The checkout this p40fleet runs from, or None when it is installed from the wheel.
CHECKOUT: Path | None = _find_checkout()

# site.yml, ansible.cfg, roles/ and playbooks/: the checkout, or the collection in the installed package.
ANSIBLE_DIR = CHECKOUT if CHECKOUT is not None else _packaged_collection()
SITE_PLAYBOOK = ANSIBLE_DIR / "site.yml"
ANSIBLE_CONFIG = ANSIBLE_DIR / "ansible.cfg"
ROLES_DIR = ANSIBLE_DIR / "roles"
PLAYBOOKS_DIR = ANSIBLE_DIR / "playbooks"

if CHECKOUT is not None:
    CACHE_DIR = CHECKOUT / ".cache"
    SANDBOX_DIR = CHECKOUT / ".sandbox"
    # Checkout-only (see the module docstring).
    RUNS_DIR = CHECKOUT / ".runs"
    REPO_ROOT = CHECKOUT
    UPSTREAM_DIR = CACHE_DIR / "upstream"
    STANDINS_DIR = CHECKOUT / "python" / "tests" / "fixtures" / "standins"
    UPSTREAM_LIST = CHECKOUT / "python" / "tests" / "fixtures" / "upstream.txt"
else:
    CACHE_DIR = _user_cache_dir()
    # No sandbox outside a checkout (p40fleet.sandbox says so); no inventory is ever under this.
    SANDBOX_DIR = default_state_dir() / "sandbox"

_CHECKOUT_ONLY = {
    "REPO_ROOT": "the p40fleet repository",
    "UPSTREAM_DIR": "the test fixtures fetched from upstream",
    "STANDINS_DIR": "the sandbox's stand-in artifacts",
    "UPSTREAM_LIST": "the list of upstream test fixtures",
    "RUNS_DIR": "the tests' and the demo's output",
}


def checkout(purpose: str) -> Path:
    """The checkout, or CheckoutRequired naming what needed it."""
    if CHECKOUT is None:
        raise CheckoutRequired(
            f"a p40fleet checkout is needed for this ({purpose}: the sandbox, its stand-ins and the test fixtures are"
            " not in the installed package): clone the repository and run p40fleet from it (make deps)"
        )
    return CHECKOUT


def __getattr__(name: str):
    if name in _CHECKOUT_ONLY:
        checkout(_CHECKOUT_ONLY[name])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
