"""Where things live in a p40fleet checkout."""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
CACHE_DIR = REPO_ROOT / ".cache"
SANDBOX_DIR = REPO_ROOT / ".sandbox"
RUNS_DIR = REPO_ROOT / ".runs"
UPSTREAM_DIR = CACHE_DIR / "upstream"
STANDINS_DIR = REPO_ROOT / "python" / "tests" / "fixtures" / "standins"
UPSTREAM_LIST = REPO_ROOT / "python" / "tests" / "fixtures" / "upstream.txt"
SITE_PLAYBOOK = REPO_ROOT / "site.yml"
ANSIBLE_CONFIG = REPO_ROOT / "ansible.cfg"
