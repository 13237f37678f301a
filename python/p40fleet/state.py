"""The state directory: runner private dirs, the last report and the hosts' state, per inventory.

Outside the repository, so a checkout stays clean and an installed package has somewhere to write:
`--state-dir`, else `$P40FLEET_STATE_DIR`, else `$XDG_STATE_HOME/p40fleet`, else
`~/.local/state/p40fleet`. Layout:

    <state>/inventories/<key>/     key: a hash of the inventory's resolved path
        inventory                  that path, for people
        lock                       held (flock) while a run against the inventory goes on
        last-report.json           the report of the last `p40fleet run` (what --retry-failed reads)
        hosts.json                 per host: the last run it took part in, the last state probe
        listings/                  what the input check may reuse, each under a sha256 of what it was made
                                   from: ansible-inventory's listings, the argument specs, the verdicts
        runs/<run id>/             ansible-runner's private data dir of each run (the last N kept)
    <state>/tmp/                   0700: extra vars files of running runs, removed when they end
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import shutil
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

STATE_DIR_ENV = "P40FLEET_STATE_DIR"
KEEP_RUNS_ENV = "P40FLEET_KEEP_RUNS"
DEFAULT_KEEP_RUNS = 10


def default_state_dir() -> Path:
    if os.environ.get(STATE_DIR_ENV):
        return Path(os.environ[STATE_DIR_ENV]).expanduser()
    xdg = os.environ.get("XDG_STATE_HOME")
    base = Path(xdg).expanduser() if xdg and Path(xdg).is_absolute() else Path.home() / ".local" / "state"
    return base / "p40fleet"


def default_keep_runs() -> int:
    value = os.environ.get(KEEP_RUNS_ENV, "")
    if not value:
        return DEFAULT_KEEP_RUNS
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{KEEP_RUNS_ENV}={value!r}: expected a whole number of runs to keep, at least 1")
    return int(value)


def now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def _write_json(path: Path, data: dict) -> None:
    """Atomically: a reader never sees half a file, a crash never leaves one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n", encoding="utf-8")
    tmp.replace(path)


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class StateDir:
    def __init__(self, root: Path | str | None = None) -> None:
        self.root = Path(root).expanduser().resolve() if root else default_state_dir().resolve()

    def inventory(self, inventory: Path | str) -> InventoryState:
        return InventoryState(self, Path(inventory))

    @property
    def tmp(self) -> Path:
        path = self.root / "tmp"
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
        path.chmod(0o700)
        return path

    @contextlib.contextmanager
    def secret_json(self, data: dict) -> Iterator[Path]:
        """A 0600 JSON file for `-e @FILE`, removed when the block ends: variables given to a run go
        to ansible-playbook by path, so their values (tokens among them) reach no runner artifact.
        Files left by a killed process are removed by the next run."""
        tmp = self.tmp
        for stale in tmp.glob("extravars-*.json"):
            pid = stale.name.split("-")[1]
            if pid.isdigit() and not _pid_alive(int(pid)):
                stale.unlink(missing_ok=True)
        path = tmp / f"extravars-{os.getpid()}-{secrets.token_hex(4)}.json"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                json.dump(data, handle, default=str)
            yield path
        finally:
            path.unlink(missing_ok=True)


class InventoryState:
    def __init__(self, state: StateDir, inventory: Path) -> None:
        self.state = state
        self.inventory = inventory.expanduser().resolve()
        self.key = hashlib.sha256(str(self.inventory).encode()).hexdigest()[:16]
        self.dir = state.root / "inventories" / self.key

    def ensure(self) -> InventoryState:
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        marker = self.dir / "inventory"
        if not marker.exists():
            marker.write_text(f"{self.inventory}\n", encoding="utf-8")
        return self

    @property
    def lock_path(self) -> Path:
        return self.dir / "lock"

    @property
    def listings_dir(self) -> Path:
        """What p40fleet.inputs keeps of this inventory's input check, by hashes of what it was made from."""
        return self.dir / "listings"

    @property
    def runs_dir(self) -> Path:
        return self.dir / "runs"

    @property
    def last_report_path(self) -> Path:
        return self.dir / "last-report.json"

    @property
    def hosts_path(self) -> Path:
        return self.dir / "hosts.json"

    def new_run(self) -> tuple[str, Path]:
        """A fresh private data dir, named so that names sort by start time."""
        self.ensure()
        run_id = f"{datetime.now(UTC):%Y%m%dT%H%M%S%fZ}-{secrets.token_hex(2)}"
        path = self.runs_dir / run_id
        path.mkdir(parents=True, mode=0o700)
        return run_id, path

    def runs(self) -> list[Path]:
        if not self.runs_dir.is_dir():
            return []
        return sorted(p for p in self.runs_dir.iterdir() if p.is_dir())

    def rotate(self, keep: int) -> list[Path]:
        """Remove all but the newest `keep` private dirs (artifacts and all); returns what went."""
        removed = self.runs()[:-keep] if keep > 0 else []
        for path in removed:
            shutil.rmtree(path, ignore_errors=True)
        return removed

    def read_last_report(self) -> dict | None:
        return _read_json(self.last_report_path)

    def write_last_report(self, report: dict) -> None:
        _write_json(self.last_report_path, report)

    def read_hosts(self) -> dict:
        empty = {"schema": "p40fleet.hosts/v1", "inventory": str(self.inventory), "hosts": {}}
        return _read_json(self.hosts_path) or empty

    def write_hosts(self, data: dict) -> None:
        _write_json(self.hosts_path, data)
