"""What the fault cases do to a fleet: watch process lists, catch a stage midway, kill the controller, serve
tampered files. Each reaches the hosts only through podman exec, and each checks that it really did what it
claims (a sampler that saw no process, or a trap that never fired, fails the case instead of passing it)."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import yaml

from p40fleet.paths import ANSIBLE_CONFIG
from p40fleet_dev.paths import REPO_ROOT
from p40fleet_dev.sandbox import APT_HOSTNAME, HUB_TLS_PEM, LOGIN_USER, Sandbox, podman

HERE = Path(__file__).resolve().parent
TRAP_SCRIPT = HERE / "host_trap.py"
TRAP_PATH = "/root/p40fleet-faults-trap.py"
BIN = REPO_ROOT / ".venv" / "bin"
MODEL_REPO = "Qwen/Qwen2.5-0.5B-Instruct"  # training_data_model_repo's default
CONDA_TMPFS = "/opt/miniconda3"  # conda_env_install_prefix, on a filesystem of node1's own
# node1, the converged host the whole-stack cases share, and its env (on its own small filesystem).
CONVERGED_HOST = "node1"
ENV_OWNER = "p40fleet"
ENV = f"{CONDA_TMPFS}/envs/verl-env"
ENV_PYTHON = f"{ENV}/bin/python"
SITE_PACKAGES = f"{ENV}/lib/python3.11/site-packages"


def proc_command_lines() -> dict[int, bytes]:
    """Every process on this machine and its arguments (rootful podman: the hosts' processes are among them)."""
    found = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as handle:
                    found[int(entry)] = handle.read().replace(b"\0", b" ")
            except OSError:
                continue
    return found


@dataclass
class ProcessSampler:
    """Polls the argument lists of every process while a run goes: the controller's /proc (which shows the
    containers' processes too) every `interval` seconds, and each host's own view (podman exec) every
    `host_interval` seconds. `hits` are the argument lists that held a needle; `seen` counts what was looked at."""

    needles: list[bytes]
    containers: list[str]
    interval: float = 0.05
    host_interval: float = 2.0
    hits: list[tuple[str, bytes]] = field(default_factory=list)
    samples: int = 0
    host_samples: int = 0
    seen: list[bytes] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def _check(self, where: str, lines) -> None:
        for line in lines:
            if any(needle in line for needle in self.needles):
                self.hits.append((where, line))
            self.seen.append(line)

    def _run(self) -> None:
        next_host = 0.0
        me = os.getpid()
        while not self._stop.is_set():
            lines = [line for pid, line in proc_command_lines().items() if pid != me]
            self._check("controller /proc", set(lines))
            self.samples += 1
            if time.monotonic() >= next_host:
                for container in self.containers:
                    # The host's own process list, as `ps` there shows it.
                    listed = podman("exec", container, "ps", "-eo", "args", "--no-headers", check=False)
                    if listed.returncode == 0:
                        self._check(f"{container} ps", set(listed.stdout.splitlines()))
                        self.host_samples += 1
                next_host = time.monotonic() + self.host_interval
            # Keep the list of what was seen small: one copy of each distinct line.
            if len(self.seen) > 20000:
                self.seen = list(set(self.seen))
            self._stop.wait(self.interval)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="process-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=30)

    def saw(self, fragment: bytes) -> bool:
        return any(fragment in line for line in self.seen)


def find_files_holding(roots: list[Path], needles: list[bytes], skip: set[Path] = frozenset()) -> list[str]:
    """Files under `roots` (controller side) holding any needle. Other xdist workers' Ansible runs make and remove
    directories under ~/.ansible while this walks it: one gone before its listing is skipped (rglob raised), any
    other error is raised."""

    def gone_only(error: OSError) -> None:
        if not isinstance(error, FileNotFoundError):
            raise error

    found = []
    for root in roots:
        if root.is_file():
            paths = [root]
        else:
            walked = os.walk(root, onerror=gone_only)
            paths = (Path(top, name) for top, _, names in walked for name in names)
        for path in paths:
            if not path.is_file() or path.is_symlink():
                continue
            if path in skip:
                continue
            try:
                data = path.read_bytes()
            except OSError:
                continue
            if any(needle in data for needle in needles):
                found.append(str(path))
    return found


def host_files_holding(sandbox: Sandbox, host: str, needles: list[str]) -> list[str]:
    """Every file on the host's own filesystems holding a needle (grep as root; /proc, /sys, /dev left out)."""
    patterns = " ".join(f"-e {shlex.quote(n)}" for n in needles)
    result = sandbox.exec(
        host, f"grep -rlF --no-messages {patterns} / --exclude-dir=proc --exclude-dir=sys --exclude-dir=dev"
    )
    # grep: 0 found, 1 none found, 2 unreadable files (ignored with --no-messages, but the status stays).
    assert result.returncode in (0, 1, 2), result.stderr
    return result.stdout.split()


# What an SSH login and Ansible's own remote tmp write as the login user (sudo's timestamps with it); anything
# else written is the run's doing.
TOUCHED_BY_LOGIN = (f"/home/{LOGIN_USER}", "/var/log/", "/run/", "/var/lib/sudo/")


def mark_time(sandbox: Sandbox, host: str, marker: str) -> None:
    result = sandbox.exec(host, f"touch {marker}")
    assert result.returncode == 0, result.stderr


def written_since(sandbox: Sandbox, host: str, marker: str) -> list[str]:
    """Every path on the host's own filesystem newer than the marker, but the login's own traces."""
    found = sandbox.exec(host, f"find / -xdev -newer {marker} -not -path '/proc/*' -not -path '/sys/*' -print")
    assert found.returncode == 0, found.stderr
    return [
        path
        for path in found.stdout.split()
        if not path.startswith(TOUCHED_BY_LOGIN) and path not in ("/tmp", "/run", marker)
    ]


class HostTrap:
    """host_trap.py armed in one host; see its docstring."""

    def __init__(self, sandbox: Sandbox, host: str, name: str) -> None:
        self.sandbox, self.host, self.out = sandbox, host, f"/root/p40fleet-faults-{name}.json"
        self.container = sandbox.host(host).container

    def arm(self, **spec) -> None:
        podman("exec", "-i", self.container, "sh", "-c", f"cat > {TRAP_PATH}", input_bytes=TRAP_SCRIPT.read_bytes())
        self.sandbox.exec(self.host, f"rm -f {self.out} {self.out}.kill {self.out}.cont {self.out}.done")
        podman("exec", "-d", self.container, "python3", TRAP_PATH, json.dumps({**spec, "out": self.out}))

    def report(self) -> dict | None:
        read = self.sandbox.exec(self.host, f"cat {self.out} 2>/dev/null")
        return json.loads(read.stdout) if read.returncode == 0 and read.stdout else None

    def wait(self, run: subprocess.Popen | None = None, timeout: float = 600) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = self.report()
            if found is not None:
                return found
            if run is not None and run.poll() is not None:
                raise AssertionError(f"the run ended (rc {run.returncode}) before the trap on {self.host} fired")
            time.sleep(0.2)
        raise AssertionError(f"the trap on {self.host} did not fire within {timeout:.0f} s")

    def kill(self) -> dict:
        """SIGKILL the caught task's whole session on the host; its report says what was left (nothing)."""
        self.sandbox.exec(self.host, f"touch {self.out}.kill")
        for _ in range(200):
            done = self.sandbox.exec(self.host, f"cat {self.out}.done 2>/dev/null")
            if done.returncode == 0 and done.stdout:
                return json.loads(done.stdout)
            time.sleep(0.05)
        raise AssertionError(f"the trap on {self.host} did not kill the caught task")


def start_playbook(
    inventory: Path, password_file: Path, limit: str, log: Path, control_dir: Path, extra_args: tuple[str, ...] = ()
) -> subprocess.Popen:
    """ansible-playbook site.yml in a session of its own (so its whole process group can be killed), its SSH
    control sockets in `control_dir` (so the multiplexing masters this run starts can be found and killed)."""
    env = {
        **os.environ,
        "ANSIBLE_CONFIG": str(ANSIBLE_CONFIG),
        "ANSIBLE_CACHE_PLUGIN_CONNECTION": str(inventory / "fact_cache"),
        "ANSIBLE_SSH_CONTROL_PATH_DIR": str(control_dir),
        "ANSIBLE_FORCE_COLOR": "0",
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    argv = [str(BIN / "ansible-playbook"), "-i", str(inventory), str(REPO_ROOT / "site.yml"), "--limit", limit]
    argv += ["--become-password-file", str(password_file), *extra_args]
    with log.open("wb") as out:
        return subprocess.Popen(
            argv, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=REPO_ROOT, start_new_session=True
        )


def kill_controller(run: subprocess.Popen, control_dir: Path) -> list[int]:
    """SIGKILL the run's process group, then the SSH masters it left behind (they detach from the group): a
    controller that died takes its connections with it. Returns the masters' PIDs."""
    os.killpg(run.pid, signal.SIGKILL)
    run.wait(timeout=30)
    masters = [pid for pid, line in proc_command_lines().items() if str(control_dir).encode() in line]
    for pid in masters:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return masters


class MirrorServer:
    """A second HTTP server in the sandbox's mirror container, on its own port, over a directory of its own:
    the mirror's files copied and changed as a case needs (a tampered artifact, a Hub with a fresh token). A Hub
    serves https with the sandbox's certificate, as the hosts reach it (`url`, by the mirror's name; `address` is
    the mirror's own, for the controller)."""

    def __init__(self, sandbox: Sandbox, port: int, name: str, hub: bool = False) -> None:
        self.sandbox, self.port, self.hub = sandbox, port, hub
        self.root = f"/tmp/p40fleet-faults-{name}"
        self.container = sandbox.mirror_container
        group_vars = yaml.safe_load((sandbox.inventory_dir / "group_vars" / "p40_sandbox.yml").read_text())
        self.address = urlsplit(group_vars["p40fleet_sandbox_mirror_url"]).hostname
        self.url = f"https://{APT_HOSTNAME}:{port}" if hub else f"http://{self.address}:{port}"

    def exec(self, command: str) -> str:
        result = podman("exec", self.container, "sh", "-c", command, check=False)
        assert result.returncode == 0, f"mirror: {command}: {result.stderr.decode()}"
        return result.stdout.decode()

    def start(self) -> None:
        if self.hub:
            argv = ["python3", "/srv/hub_server.py", "--port", str(self.port), "--directory", self.root]
            argv += ["--hub-root", f"{self.root}/hub", "--tls-cert", f"/srv/{HUB_TLS_PEM}"]
        else:
            argv = ["python3", "-m", "http.server", str(self.port), "--directory", self.root]
        podman("exec", "-d", self.container, *argv)
        for _ in range(100):
            probe = podman("exec", self.container, "python3", "-c", _PORT_PROBE % self.port, check=False)
            if probe.returncode == 0:
                return
            time.sleep(0.1)
        raise AssertionError(f"the mirror's server on port {self.port} did not start")


_PORT_PROBE = "import socket; socket.create_connection(('127.0.0.1', %d), timeout=1)"


def control_dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="p40fleet-faults-cp-"))


# Run by the env's own python on the host: every installed distribution, each file its RECORD lists present
# with the sha256 the RECORD gives (byte-compiled caches aside, which Python rewrites on its own).
RECORD_CHECK = r"""
import base64, hashlib, importlib.metadata as md, json
broken, names = {}, []
for dist in md.distributions():
    names.append(dist.metadata["Name"])
    if dist.files is None:
        broken[dist.metadata["Name"]] = ["no RECORD"]
        continue
    bad = []
    for entry in dist.files:
        if not entry.hash or entry.hash.mode != "sha256" or "__pycache__" in entry.parts:
            continue
        try:
            data = open(entry.locate(), "rb").read()
        except OSError:
            bad.append(f"{entry} is missing")
            continue
        if base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode() != entry.hash.value:
            bad.append(f"{entry} differs")
    if bad:
        broken[dist.metadata["Name"]] = bad[:3]
print(json.dumps({"names": sorted(names), "broken": broken}))
"""


def env_packages(sandbox: Sandbox, host: str, python: str, owner: str) -> dict:
    """{'names': installed distributions, 'broken': {name: files missing or differing from its RECORD}}."""
    result = sandbox.exec(host, f"{python} -c {shlex.quote(RECORD_CHECK)}", user=owner)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)
