"""Where the harness keeps what only a checkout has: the repository, its caches, the sandboxes, the tests' output.

p40fleet.paths says where the playbooks and roles are (for an operator too); these are the checkout's own,
found from this file's place in it (<checkout>/python/p40fleet_dev/paths.py).
"""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
CACHE_DIR = REPO_ROOT / ".cache"
SANDBOX_DIR = REPO_ROOT / ".sandbox"
# The tests' and the demo's output.
RUNS_DIR = REPO_ROOT / ".runs"
# The test fixtures fetched from upstream (make fixtures).
UPSTREAM_DIR = CACHE_DIR / "upstream"
FIXTURES_DIR = REPO_ROOT / "python" / "tests" / "fixtures"
STANDINS_DIR = FIXTURES_DIR / "standins"
UPSTREAM_LIST = FIXTURES_DIR / "upstream.txt"
