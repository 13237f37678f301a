"""A sandbox fleet: Debian 12 (or 11) containers that play GPU hosts, reached over real SSH.

Nothing here is pulled from a registry: the host image is built with debootstrap (minbase plus only
what SSH, Python and sudo need) and cached by a hash of its recipe. The packages the roles install
(host_prereqs' list for that release) are fetched once from Debian's archive at image build time into
a local apt repository, signed with a key made for the cache; the hosts trust only that key and know
only that repository, so runs stay offline. Each sandbox gets its own podman network, an SSH key pair
made for it, a mirror container that serves the stand-in artifacts and the apt repository over HTTP,
and an inventory that puts its hosts into the group the playbooks target (p40-hosts) through a child
group, p40_sandbox, whose variables point the roles at the stand-ins.
"""

from __future__ import annotations

import copy
import fcntl
import functools
import hashlib
import importlib.util
import json
import os
import re
import secrets
import shlex
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import yaml

from p40fleet.paths import ROLES_DIR
from p40fleet_dev import fixtures
from p40fleet_dev import standins as standins_mod
from p40fleet_dev.paths import CACHE_DIR, REPO_ROOT, SANDBOX_DIR, STANDINS_DIR

IMAGE_NAME = "localhost/p40fleet-sandbox"
# Sandbox.replicate's copies of a host's disk, one tag per sandbox, removed with it.
COPY_IMAGE_NAME = "localhost/p40fleet-copy"
# Release name -> (Debian suite, host_prereqs vars file for it).
OS_RELEASES = {"debian12": ("bookworm", "Debian-12"), "debian11": ("bullseye", "Debian-11")}
DEFAULT_OS = "debian12"
DEBIAN_ARCHIVE = "http://deb.debian.org/debian"
# Minbase plus what an SSH login, Ansible's modules (python3, python3-apt for the apt module) and sudo
# need; everything else a role runs must come from the host_prereqs stage.
IMAGE_PACKAGES = ("python3", "python3-apt", "openssh-server", "sudo")
# The stand-ins' own needs, not the roles' (the sandbox inventory adds them to host_prereqs): the
# stand-in conda makes its envs as venvs of the host's python3, and the stand-in Apex compiles C
# extensions against that python's headers (a real conda env has both itself).
STANDIN_PACKAGES = ("python3-venv", "python3-dev")
HOST_PREREQS_VARS = ROLES_DIR / "host_prereqs" / "vars"
# dpkg's fsync after each file it unpacks guards against the machine losing power mid-install. A sandbox host is a
# container on the test machine's kernel: a stopped or killed container loses nothing the page cache holds, so the
# syncs only cost time (figures: docs/benchmarks-code.md). The usual setting of container images.
DPKG_SPEEDUP = "force-unsafe-io"
MIRROR_PORT = 8080
APT_PORT = 8081
APT_HOSTNAME = "p40fleet-apt"
APT_KEYRING = "/etc/apt/keyrings/p40fleet-sandbox.gpg"
APT_DIR = CACHE_DIR / "apt"
# Extra suites (stand-in packages a test opts into, apt_suite()), served by the mirror on a port of their own.
APT_SUITES_DIR = APT_DIR / "suites"
APT_SUITES_PORT = 8082
# The Hub's routes over https (training_data downloads over TLS alone), with a certificate of the sandbox's own for
# APT_HOSTNAME: its PEM (certificate, then key) in the sandbox's directory, the certificate given to the hosts as the
# mirror's CA (training_data_hub_ca).
HUB_TLS_PORT = 8443
HUB_TLS_PEM = "hub-tls.pem"
GPU_PROFILE_PATH = "/etc/p40fleet-sandbox/gpu.json"
NVIDIA_SMI_STANDIN = "/opt/p40fleet-sandbox/bin/nvidia-smi"
# What preflight asks of a sandbox host's disk, per install path. The stand-ins take megabytes, and a sandbox host's
# filesystems are the test machine's: asking for the real artifacts' 47 GiB made every test hang on how full the
# test machine was (CI failed at 43.7 GiB free). The real figures stay in gpu_preflight's defaults, held by
# test_gpu_preflight_rules; a too-small disk is shown with tmpfs hosts (test_sandbox, fault case 6).
SANDBOX_DISK_GIB = 1
# Hosts a sandbox starts side by side.
START_WORKERS = 4

# Podman 4.3 on Debian 12: crun fails on hybrid cgroups and setrlimit needs explicit ulimits. nproc counts every
# thread of a uid machine-wide, and the hosts' env owners share one uid on this machine: at 1024, two sandboxes running
# Ray side by side (its gRPC threads) ran out ("pthread_create failed: Resource temporarily unavailable") and their
# nodes never came up. 32768 is of a real host's order (a Debian host's default is threads-max / 2).
CONTAINERS_CONF = """\
[containers]
default_ulimits = ["nofile=1024:1024", "nproc=32768:32768"]
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
"""

# Podman names are machine-wide: two checkouts on one machine (or CI beside a developer) must not
# share containers or networks, so every name carries a short hash of the checkout's path.
PODMAN_PREFIX = f"p40fleet-{hashlib.sha256(str(REPO_ROOT).encode()).hexdigest()[:6]}"

# How Ansible logs in: by default as an ordinary user with password-less sudo, as on a real fleet;
# or with sudo asking for a password; or as root.
LOGIN_USER = "ops"
LOGIN_MODES = ("sudo", "sudo-password", "root")
DEFAULT_LOGIN = "sudo"

SSHD_COMMAND = "ssh-keygen -A >/dev/null && mkdir -p /run/sshd && exec /usr/sbin/sshd -D -e"
# The hosts have no systemd: where a sandbox asks for services (Sandbox.up(services=True), the Ray cluster tests), a
# stand-in service manager (python/tests/fixtures/standins/host/systemd/, its header says what it reproduces)
# starts with the host, as systemd would at boot, and answers `systemctl`. Other sandboxes' hosts have neither.
STANDIN_SYSTEMD_DIR = "/opt/p40fleet-sandbox/systemd"
SERVICES_HOST_COMMAND = (
    f"ln -sf {STANDIN_SYSTEMD_DIR}/standin_systemd.py /usr/local/sbin/systemctl && "
    f"(python3 {STANDIN_SYSTEMD_DIR}/standin_systemd.py boot >/dev/null 2>&1 &) && {SSHD_COMMAND}"
)


class SandboxError(RuntimeError):
    """A sandbox operation failed; the message says what and what to do."""


def sandbox_disk_checks(**min_free_gib: int) -> list[dict]:
    """gpu_preflight's disk checks (its defaults: the same paths, purposes and markers) with the sandbox's need,
    SANDBOX_DISK_GIB, on each; min_free_gib={purpose word: GiB} sets another on the checks whose purpose has it."""
    checks = yaml.safe_load((ROLES_DIR / "gpu_preflight" / "defaults" / "main.yml").read_text())[
        "gpu_preflight_disk_checks"
    ]
    for check in checks:
        check["min_free_gib"] = next(
            (gib for word, gib in min_free_gib.items() if word in check["purpose"]), SANDBOX_DISK_GIB
        )
    return checks


def host_standins() -> Path:
    return STANDINS_DIR / "host"


@functools.cache
def _gpu_profiles_file() -> dict[str, dict]:
    # Read once a process: every host's start and every profile change looks its profile up here.
    with (host_standins() / "gpu_profiles.yml").open(encoding="utf-8") as handle:
        return yaml.safe_load(handle)


def gpu_profiles() -> dict[str, dict]:
    """The stand-in GPU profiles by name (python/tests/fixtures/standins/host/gpu_profiles.yml), a copy the caller
    may change."""
    return copy.deepcopy(_gpu_profiles_file())


# sshd's key, which each host's start waits for and known_hosts records. `ssh-keygen -A` makes it last, after an
# RSA key: seconds of CPU on a busy test machine, so the wait is generous (docs/benchmarks-code.md).
SSHD_HOST_KEY = "/etc/ssh/ssh_host_ed25519_key.pub"
HOST_KEY_WAIT_S = 60


def _known_hosts_key(host: str, answer: subprocess.CompletedProcess) -> str:
    """The key type and key of a `cat` of SSHD_HOST_KEY, as known_hosts records them (the comment left out)."""
    words = answer.stdout.decode(errors="replace").split()
    if answer.returncode != 0 or len(words) < 2:
        raise SandboxError(f"{host}: no sshd host key in {SSHD_HOST_KEY}: {answer.stderr.decode(errors='replace')}")
    return " ".join(words[:2])


def _podman_env() -> dict[str, str]:
    conf = CACHE_DIR / "containers.conf"
    if not conf.exists() or conf.read_text() != CONTAINERS_CONF:
        conf.parent.mkdir(parents=True, exist_ok=True)
        conf.write_text(CONTAINERS_CONF)
    return {**os.environ, "CONTAINERS_CONF": str(conf)}


def podman(*args: str, check: bool = True, input_bytes: bytes | None = None) -> subprocess.CompletedProcess:
    if shutil.which("podman") is None:
        raise SandboxError("podman is not installed: run `make sandbox-deps` (podman, runc, debootstrap)")
    result = subprocess.run(["podman", *args], env=_podman_env(), capture_output=True, input=input_bytes, check=False)
    if check and result.returncode != 0:
        stderr = result.stderr.decode(errors="replace").strip()
        raise SandboxError(f"podman {' '.join(args[:3])} failed (rc {result.returncode}): {stderr}")
    return result


@contextmanager
def _locked(name: str) -> Iterator[None]:
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    with (CACHE_DIR / f"{name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def repo_packages(os_name: str) -> list[str]:
    """What the local apt repository offers: host_prereqs' list for the release, plus the stand-ins' needs."""
    data = yaml.safe_load((HOST_PREREQS_VARS / f"{OS_RELEASES[os_name][1]}.yml").read_text())
    return [*data["host_prereqs_os_packages"], *data["host_prereqs_os_compiler_packages"], *STANDIN_PACKAGES]


def _gpg(*args: str, input_bytes: bytes | None = None) -> bytes:
    home = APT_DIR / "gnupg"
    argv = ["gpg", "--homedir", str(home), "--batch", "--quiet", *args]
    result = subprocess.run(argv, input=input_bytes, capture_output=True, check=False)
    if result.returncode != 0:
        raise SandboxError(f"gpg {' '.join(args[:2])} failed: {result.stderr.decode(errors='replace').strip()}")
    return result.stdout


def _stop_gpg_agent() -> None:
    subprocess.run(["gpgconf", "--homedir", str(APT_DIR / "gnupg"), "--kill", "gpg-agent"], check=False)


@functools.cache
def signing_key() -> tuple[str, bytes]:
    """The key that signs the sandbox apt repositories, made once per cache: (fingerprint, public key)."""
    if shutil.which("gpg") is None:
        raise SandboxError("gpg is not installed: run `make sandbox-deps`")
    home = APT_DIR / "gnupg"
    with _locked("apt-signing-key"):
        if not (home / "done").exists():
            shutil.rmtree(home, ignore_errors=True)
            home.mkdir(parents=True, mode=0o700)
            try:
                _gpg(
                    "--pinentry-mode",
                    "loopback",
                    "--passphrase",
                    "",
                    "--quick-gen-key",
                    "p40fleet sandbox apt repository (test key, made for this cache)",
                    "rsa3072",
                    "sign",
                    "never",
                )
            finally:
                _stop_gpg_agent()
            (home / "done").touch()
        # The public listing: the secret one would start a gpg-agent.
        listing = _gpg("--with-colons", "--list-keys").decode()
    fingerprint = next(line.split(":")[9] for line in listing.splitlines() if line.startswith("fpr:"))
    return fingerprint, _gpg("--export", fingerprint)


def image_recipe_hash(os_name: str = DEFAULT_OS) -> str:
    fingerprint, _ = signing_key()
    digest = hashlib.sha256()
    digest.update(f"{OS_RELEASES[os_name][0]}\n{' '.join(IMAGE_PACKAGES)}\n{SSHD_COMMAND}\nown-host-keys\n".encode())
    digest.update(f"login-user {LOGIN_USER}\n".encode())
    digest.update(f"dpkg {DPKG_SPEEDUP}\n".encode())
    digest.update(f"apt {' '.join(repo_packages(os_name))} {fingerprint} {APT_HOSTNAME}:{APT_PORT}\n".encode())
    digest.update((host_standins() / "nvidia-smi").read_bytes())
    return digest.hexdigest()[:16]


def _chroot(rootfs: Path, *argv: str, log: Path) -> None:
    with log.open("ab") as out:
        result = subprocess.run(["chroot", str(rootfs), *argv], stdout=out, stderr=subprocess.STDOUT, check=False)
    if result.returncode != 0:
        raise SandboxError(f"{' '.join(argv[:3])} in the image failed (rc {result.returncode}); see {log}")


def _build_apt_repo(rootfs: Path, packages: list[str], repo: Path, fingerprint: str, log: Path) -> None:
    """Fetch the packages (and what they need beyond the image) from Debian's archive, once, into a
    signed flat repository."""
    shutil.copy("/etc/resolv.conf", rootfs / "etc/resolv.conf")
    archives = rootfs / "var/cache/apt/archives"
    for deb in archives.glob("*.deb"):
        deb.unlink()
    _chroot(rootfs, "apt-get", "-q", "update", log=log)
    _chroot(
        rootfs,
        "apt-get",
        "-q",
        "-y",
        "--download-only",
        "--no-install-recommends",
        "install",
        *packages,
        log=log,
    )
    staging = repo.with_name(repo.name + ".building")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    for deb in archives.glob("*.deb"):
        shutil.move(deb, staging / deb.name)
    _index_and_sign(staging, fingerprint)
    staging.rename(repo)


def _index_and_sign(staging: Path, fingerprint: str) -> None:
    """Index the .deb files of a flat repository directory and sign its Release with the sandbox key."""
    if shutil.which("apt-ftparchive") is None:
        raise SandboxError("apt-ftparchive is not installed: run `make sandbox-deps` (package apt-utils)")
    packages_index = subprocess.run(
        ["apt-ftparchive", "packages", "."], cwd=staging, capture_output=True, check=True
    ).stdout
    (staging / "Packages").write_bytes(packages_index)
    release = subprocess.run(
        ["apt-ftparchive", "-o", "APT::FTPArchive::Release::Origin=p40fleet-sandbox", "release", "."],
        cwd=staging,
        capture_output=True,
        check=True,
    ).stdout
    (staging / "Release").write_bytes(release)
    try:
        (staging / "InRelease").write_bytes(_gpg("--local-user", fingerprint, "--clearsign", input_bytes=release))
    finally:
        _stop_gpg_agent()


def _point_apt_at_the_sandbox_repo(rootfs: Path, public_key: bytes) -> None:
    keyring = rootfs / APT_KEYRING.lstrip("/")
    keyring.parent.mkdir(parents=True, exist_ok=True)
    keyring.write_bytes(public_key)
    keyring.chmod(0o644)
    (rootfs / "etc/apt/sources.list").write_text(
        f"# The sandbox's own apt repository (p40fleet): the only source, so runs stay offline.\n"
        f"deb [signed-by={APT_KEYRING}] http://{APT_HOSTNAME}:{APT_PORT}/ ./\n"
    )
    for path in (rootfs / "etc/apt/sources.list.d").glob("*"):
        path.unlink()
    for path in (rootfs / "var/lib/apt/lists").glob("*"):
        if path.is_file():
            path.unlink()
    for path in (rootfs / "var/cache/apt").glob("*.bin"):
        path.unlink()
    (rootfs / "etc/resolv.conf").unlink(missing_ok=True)


def apt_repo_dir(os_name: str = DEFAULT_OS) -> Path:
    return APT_DIR / f"{os_name}-{image_recipe_hash(os_name)}"


def apt_suite(builder: Path) -> str:
    """An extra apt suite built by a stand-in builder (a module with SUITE and build(out_dir) writing .deb
    files), signed with the sandbox key and cached by a hash of the builder: its directory name under
    APT_SUITES_DIR, which the mirror serves on APT_SUITES_PORT. No host sees it until a test enables it on that
    host (Sandbox.enable_apt_suite): the image's repository and every other test stay as they were."""
    fingerprint, _ = signing_key()
    module = _load_builder(builder)
    name = f"{module.SUITE}-{hashlib.sha256(builder.read_bytes() + fingerprint.encode()).hexdigest()[:16]}"
    suite = APT_SUITES_DIR / name
    with _locked("apt-suites"):
        if not (suite / "InRelease").exists():
            staging = APT_SUITES_DIR / f".{name}.building"
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir(parents=True)
            module.build(staging)
            _index_and_sign(staging, fingerprint)
            staging.rename(suite)
    return name


def _load_builder(path: Path):
    spec = importlib.util.spec_from_file_location(f"p40fleet_apt_suite_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def ensure_image(os_name: str = DEFAULT_OS) -> str:
    """Build the host image and its apt repository once per recipe; later calls reuse them."""
    if os_name not in OS_RELEASES:
        raise SandboxError(f"unknown sandbox OS {os_name!r}; known: {', '.join(OS_RELEASES)}")
    suite = OS_RELEASES[os_name][0]
    tag = f"{IMAGE_NAME}:{os_name}-{image_recipe_hash(os_name)}"
    repo = apt_repo_dir(os_name)
    # One lock per OS: a worker building one release's image (debootstrap is slow) keeps no other worker from
    # starting hosts of another.
    with _locked(f"sandbox-image-{os_name}"):
        image_exists = podman("image", "exists", tag, check=False).returncode == 0
        if image_exists and (repo / "InRelease").exists():
            return tag
        if shutil.which("debootstrap") is None:
            raise SandboxError("debootstrap is not installed: run `make sandbox-deps`")
        fingerprint, public_key = signing_key()
        with tempfile.TemporaryDirectory(dir=CACHE_DIR, prefix="rootfs-") as tmp:
            rootfs = Path(tmp) / "rootfs"
            log = CACHE_DIR / f"debootstrap-{os_name}.log"
            with log.open("wb") as out:
                result = subprocess.run(
                    [
                        "debootstrap",
                        "--variant=minbase",
                        f"--include={','.join(IMAGE_PACKAGES)}",
                        suite,
                        str(rootfs),
                        DEBIAN_ARCHIVE,
                    ],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    check=False,
                )
            if result.returncode != 0:
                raise SandboxError(f"debootstrap failed (rc {result.returncode}); see {log}")
            if not (repo / "InRelease").exists():
                _build_apt_repo(rootfs, repo_packages(os_name), repo, fingerprint, log)
            _point_apt_at_the_sandbox_repo(rootfs, public_key)
            standin = rootfs / NVIDIA_SMI_STANDIN.lstrip("/")
            standin.parent.mkdir(parents=True)
            shutil.copy2(host_standins() / "nvidia-smi", standin)
            standin.chmod(0o755)
            (rootfs / "etc/dpkg/dpkg.cfg.d/p40fleet-sandbox-speedup").write_text(DPKG_SPEEDUP + "\n")
            (rootfs / "etc/p40fleet-sandbox").mkdir()
            # Each host makes its own SSH host keys at first start, as a real host has its own.
            for key in (rootfs / "etc/ssh").glob("ssh_host_*"):
                key.unlink()
            (rootfs / "root/.ssh").mkdir(mode=0o700, exist_ok=True)
            # The ordinary login user a real fleet has; whether it may sudo is set per host at start.
            subprocess.run(
                ["chroot", str(rootfs), "useradd", "--create-home", "--shell", "/bin/bash", LOGIN_USER], check=True
            )
            subprocess.run(
                [
                    "chroot",
                    str(rootfs),
                    "install",
                    "-d",
                    "-m",
                    "0700",
                    "-o",
                    LOGIN_USER,
                    "-g",
                    LOGIN_USER,
                    f"/home/{LOGIN_USER}/.ssh",
                ],
                check=True,
            )
            if not image_exists:
                tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
                podman("import", "--change", "CMD=/bin/sh", "-", tag, input_bytes=tar.stdout.read())
                if tar.wait() != 0:
                    raise SandboxError("tar of the sandbox root filesystem failed")
    return tag


@dataclass
class Host:
    name: str
    container: str
    address: str
    profile: str
    login: str = DEFAULT_LOGIN
    os: str = DEFAULT_OS
    # Size-limited filesystems mounted in the host ({path: size}, e.g. {"/srv/small": "64m"}).
    tmpfs: dict[str, str] = field(default_factory=dict)
    # Whether the stand-in service manager runs on the host (Sandbox.up(services=True)).
    services: bool = False
    # Whether the operator's stand-ins are on the host (Sandbox.up(standins=True): `sandbox up --services`).
    standins: bool = False
    # The env owner written into the inventory (p40fleet_env_owner; Sandbox.up(owner=...)), "" for the default.
    owner: str = ""
    # The podman image the host started from where it is not the bare sandbox image (Sandbox.up(image=...)).
    image: str = ""
    # The controller's directories the host sees, read-only ({controller path: host path}; Sandbox.up(volumes=...)).
    volumes: dict[str, str] = field(default_factory=dict)
    # sshd's ed25519 public key ("ssh-ed25519 AAAA..."), read as the host started: known_hosts is written from it.
    host_key: str = ""


class Sandbox:
    """One sandbox fleet, named; its state lives in .sandbox/<name>/."""

    def __init__(self, name: str = "default") -> None:
        if not name.replace("-", "").replace("_", "").isalnum():
            raise SandboxError(f"sandbox name {name!r}: use letters, digits, '-' and '_' only")
        self.name = name
        self.dir = SANDBOX_DIR / name
        self.inventory_dir = self.dir / "inventory"
        self.network = f"{PODMAN_PREFIX}-{name}"
        self.mirror_container = f"{PODMAN_PREFIX}-{name}-mirror"

    # -- state -------------------------------------------------------------------------------
    @property
    def state_file(self) -> Path:
        return self.dir / "state.json"

    def hosts(self) -> list[Host]:
        if not self.state_file.exists():
            return []
        return [Host(**host) for host in json.loads(self.state_file.read_text())["hosts"]]

    def host(self, name: str) -> Host:
        for host in self.hosts():
            if host.name == name:
                return host
        raise SandboxError(f"sandbox {self.name} has no host {name!r}")

    def _save_hosts(self, hosts: list[Host]) -> None:
        self.state_file.write_text(json.dumps({"hosts": [vars(h) for h in hosts]}, indent=2))

    @property
    def key_file(self) -> Path:
        return self.dir / "id_ed25519"

    @property
    def become_password_file(self) -> Path:
        """The sudo password of `ops` in sudo-password mode (0600, never written to the inventory)."""
        return self.dir / "become_password"

    # -- lifecycle ---------------------------------------------------------------------------
    def up(
        self,
        profiles: Sequence[str],
        login: str = DEFAULT_LOGIN,
        os_name: str = DEFAULT_OS,
        tmpfs: Mapping[str, Mapping[str, str]] | None = None,
        services: bool = False,
        image: str = "",
        volumes: Mapping[str, str] | None = None,
        standins: bool = False,
        owner: str = "",
    ) -> list[Host]:
        """Start one host per profile (node1, node2, ...); a running sandbox with the same
        profiles, login, OS and mounts is kept as it is, any other is replaced. `login` is how Ansible logs
        in: `sudo` (the ordinary user `ops`, password-less sudo), `sudo-password` (ops, sudo asks for
        the password in become_password_file) or `root`. `os_name` is a key of OS_RELEASES. `tmpfs` gives
        hosts small filesystems of their own, {host name: {path: size}}: a disk that is too small or fills up,
        without touching the test machine's disk. `services` starts the stand-in service manager on every host
        (`systemctl` answers there), for roles that run systemd units. `image` starts every host from a
        converged host's disk (p40fleet_dev.images.converged_image, built for the same OS; the login is set up as
        each host starts) instead of a bare one. `volumes` shows every host directories of the controller, read-only,
        {controller path: host path}: what a test needs on the hosts that is too large to copy (the CPU venv's
        torch). `standins` (with `services`) puts the stand-ins of p40fleet_dev.standins on every host and points
        train_run and gpu_qualify at them in the inventory, so `p40fleet train` and `p40fleet qualify` run as
        written (`sandbox up --services`, docs/dev/sandbox.md). `owner` writes p40fleet_env_owner into the
        inventory's sandbox group, the stand-ins then made for that account (`sandbox up --owner`)."""
        if owner and not re.fullmatch(r"[a-z_][a-z0-9_-]{0,31}", owner):
            raise SandboxError(f"the env owner {owner!r} is no account name: use lower-case letters, digits, _ and -")
        if standins and not services:
            raise SandboxError("the training and qualification stand-ins need the stand-in service manager (services)")
        if login not in LOGIN_MODES:
            raise SandboxError(f"unknown login mode {login!r}; known: {', '.join(LOGIN_MODES)}")
        if os_name not in OS_RELEASES:
            raise SandboxError(f"unknown sandbox OS {os_name!r}; known: {', '.join(OS_RELEASES)}")
        known = gpu_profiles()
        unknown = [p for p in profiles if p not in known]
        if unknown:
            raise SandboxError(f"unknown GPU profile(s) {unknown}; known: {sorted(known)}")
        if not profiles:
            raise SandboxError("a sandbox needs at least one host")
        tmpfs = {name: dict(mounts) for name, mounts in (tmpfs or {}).items()}
        names = [f"node{index}" for index in range(1, len(profiles) + 1)]
        strays = sorted(set(tmpfs) - set(names))
        if strays:
            raise SandboxError(f"tmpfs names hosts {strays} this sandbox does not have ({', '.join(names)})")
        for mounts in tmpfs.values():
            for path, size in mounts.items():
                if not path.startswith("/") or "," in path or not size.rstrip("kmg").isdigit():
                    raise SandboxError(f"tmpfs {path}={size}: use an absolute path and a size like 64m")
        volumes = {str(source): str(target) for source, target in (volumes or {}).items()}
        for source, target in volumes.items():
            # podman's -v splits on ':'; a relative path would be taken as a named volume.
            if not (source.startswith("/") and target.startswith("/")) or ":" in source + target:
                raise SandboxError(f"volume {source}:{target}: use absolute paths without ':'")
        current = self.hosts()
        wanted = [
            (p, login, os_name, tmpfs.get(n, {}), services, image, volumes, standins, owner)
            for p, n in zip(profiles, names, strict=True)
        ]
        if [
            (h.profile, h.login, h.os, h.tmpfs, h.services, h.image, h.volumes, h.standins, h.owner) for h in current
        ] == wanted and self._running(current):
            return current
        self.down()
        base = ensure_image(os_name)
        artifacts = fixtures.build_standins()
        self.dir.mkdir(parents=True, exist_ok=True)
        self._make_key()
        self._make_hub_certificate()
        if login == "sudo-password":
            self._make_become_password()
        try:
            podman("network", "create", self.network)
            self._start_mirror(base, artifacts.mirror_dir, apt_repo_dir(os_name))
            mirror = self._address(self.mirror_container)
            _wait_for_port(mirror, APT_PORT)
            # Side by side: a host's start is mostly podman, conmon and apt waiting; one after the other, a large
            # fleet's start adds up (docs/benchmarks-code.md).
            with ThreadPoolExecutor(max_workers=START_WORKERS) as pool:
                started = [
                    pool.submit(
                        self._start_host,
                        image or base,
                        name,
                        profile,
                        login,
                        os_name,
                        mirror,
                        tmpfs.get(name, {}),
                        services,
                        volumes,
                    )
                    for name, profile in zip(names, profiles, strict=True)
                ]
                hosts = [future.result() for future in started]
        except BaseException:
            # A start that failed leaves no host running: the record of hosts is written only once all started,
            # so the containers are found by name.
            self.down()
            raise
        for host in hosts:
            host.image = image
            host.standins = standins
            host.owner = owner
        self._save_hosts(hosts)
        if standins:
            try:
                for host in hosts:
                    standins_mod.install_operator_standins(self, host.name, owner or standins_mod.DEFAULT_OWNER)
            except BaseException:
                self.down()
                raise
        self._write_known_hosts(hosts)
        # Where the stand-ins lie on the controller: the hash locks made with them are read from there.
        standin_vars = {**artifacts.group_vars, "p40fleet_sandbox_mirror_dir": str(artifacts.mirror_dir)}
        operator_vars = {
            **(standins_mod.OPERATOR_VARS if standins else {}),
            **({"p40fleet_env_owner": owner} if owner else {}),
        }
        self._write_inventory(hosts, {**standin_vars, **operator_vars})
        for host in hosts:
            _wait_for_port(host.address, 22)
        return hosts

    def down(self) -> None:
        remove_sandboxes([self])

    def _running(self, hosts: list[Host]) -> bool:
        names = [h.container for h in hosts] + [self.mirror_container]
        result = podman("inspect", "-f", "{{.State.Running}}", *names, check=False)
        return result.returncode == 0 and set(result.stdout.decode().split()) == {"true"}

    def _make_key(self) -> None:
        if not self.key_file.exists():
            subprocess.run(
                [
                    "ssh-keygen",
                    "-q",
                    "-t",
                    "ed25519",
                    "-N",
                    "",
                    "-C",
                    f"p40fleet-{self.name}",
                    "-f",
                    str(self.key_file),
                ],
                check=True,
            )
        authorized = self.dir / "authorized_keys"
        shutil.copy(self.key_file.with_suffix(".pub"), authorized)
        authorized.chmod(0o644)

    def _make_hub_certificate(self) -> None:
        pem = self.dir / HUB_TLS_PEM
        if pem.exists():
            return
        with tempfile.TemporaryDirectory() as tmp:
            cert, key = Path(tmp) / "cert.pem", Path(tmp) / "key.pem"
            key_type = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-days", "3650"]
            subject = ["-subj", "/CN=p40fleet sandbox hub", "-addext", f"subjectAltName=DNS:{APT_HOSTNAME}"]
            subprocess.run(
                ["openssl", "req", "-x509", *key_type, *subject, "-keyout", str(key), "-out", str(cert)],
                check=True,
                capture_output=True,
            )
            text = cert.read_text() + key.read_text()
        fd = os.open(pem, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        with os.fdopen(fd, "w") as handle:
            handle.write(text)

    def hub_ca(self) -> str:
        """The certificate the sandbox's https Hub serves, which the hosts trust as the mirror's CA."""
        text = (self.dir / HUB_TLS_PEM).read_text()
        return text[: text.index("-----END CERTIFICATE-----") + len("-----END CERTIFICATE-----")] + "\n"

    def _make_become_password(self) -> None:
        fd = os.open(self.become_password_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(secrets.token_urlsafe(24) + "\n")

    def _start_mirror(self, image: str, mirror_dir: Path, apt_repo: Path) -> None:
        # Servers in one container: the apt repository the hosts use, the extra suites a test may enable, and the
        # stand-in artifacts as static files plus the Hub's routes for huggingface_hub.
        APT_SUITES_DIR.mkdir(parents=True, exist_ok=True)
        serve = (
            f"python3 -m http.server {APT_PORT} --directory /srv/apt >/dev/null 2>&1 & "
            f"python3 -m http.server {APT_SUITES_PORT} --directory /srv/apt-suites >/dev/null 2>&1 & "
            f"python3 /srv/hub_server.py --port {HUB_TLS_PORT} --directory /srv/mirror --tls-cert /srv/{HUB_TLS_PEM} & "
            f"exec python3 /srv/hub_server.py --port {MIRROR_PORT} --directory /srv/mirror"
        )
        podman(
            "run",
            "-d",
            "--init",
            "--name",
            self.mirror_container,
            "--network",
            self.network,
            "-v",
            f"{mirror_dir}:/srv/mirror:ro",
            "-v",
            f"{apt_repo}:/srv/apt:ro",
            "-v",
            f"{APT_SUITES_DIR}:/srv/apt-suites:ro",
            "-v",
            f"{STANDINS_DIR / 'hub_server.py'}:/srv/hub_server.py:ro",
            "-v",
            f"{self.dir / HUB_TLS_PEM}:/srv/{HUB_TLS_PEM}:ro",
            image,
            "sh",
            "-c",
            serve,
        )

    def _start_host(
        self,
        image: str,
        name: str,
        profile: str,
        login: str,
        os_name: str,
        mirror: str,
        tmpfs: dict[str, str],
        services: bool = False,
        volumes: Mapping[str, str] | None = None,
    ) -> Host:
        container = f"{PODMAN_PREFIX}-{self.name}-{name}"
        home = "/root" if login == "root" else f"/home/{LOGIN_USER}"
        mounts = []
        for path, size in sorted(tmpfs.items()):
            mounts += ["--mount", f"type=tmpfs,destination={path},tmpfs-size={size}"]
        for source, target in sorted((volumes or {}).items()):
            mounts += ["-v", f"{source}:{target}:ro"]
        podman(
            "run",
            "-d",
            "--init",
            "--name",
            container,
            "--hostname",
            name,
            "--network",
            self.network,
            "--add-host",
            f"{APT_HOSTNAME}:{mirror}",
            "-v",
            f"{self.dir / 'authorized_keys'}:{home}/.ssh/authorized_keys:ro",
            *(["-v", f"{host_standins() / 'systemd'}:{STANDIN_SYSTEMD_DIR}:ro"] if services else []),
            # Every host may load p40fleet's firewall (nft: site.yml's launch_script stage, ray_cluster), as a real
            # host's root does: its own network namespace's rules only.
            "--cap-add",
            "NET_ADMIN",
            *mounts,
            image,
            "sh",
            "-c",
            SERVICES_HOST_COMMAND if services else SSHD_COMMAND,
        )
        # Everything else a started host needs, in one `podman exec` (each costs the test machine a podman, a
        # conmon and a runc): each step named, its output kept for the error; the password only on stdin.
        steps = []
        if login != "root":
            rule = "ALL" if login == "sudo-password" else "NOPASSWD: ALL"
            sudoers = shlex.quote(f"{LOGIN_USER} ALL=(ALL:ALL) {rule}")
            steps.append(("sudo rule", f"(umask 0227 && printf '%s\\n' {sudoers} > /etc/sudoers.d/{LOGIN_USER})"))
        password = b""
        if login == "sudo-password":
            password = self.become_password_file.read_text().strip().encode() + b"\n"
            steps.append(("the login password", f"IFS= read -r p && printf '%s:%s\\n' {LOGIN_USER} \"$p\" | chpasswd"))
        # The image has no package lists; a real host's first boot (cloud-init) fetches them.
        steps.append(("apt-get update from the sandbox repository", "apt-get -q update"))
        steps.append(("the GPU profile", _profile_commands(name, profile, gpu_profiles()[profile])))
        key = SSHD_HOST_KEY
        steps.append(
            (
                "the sshd host key",
                f"for i in $(seq {HOST_KEY_WAIT_S * 10}); do test -s {key} && break; sleep 0.1; done; test -s {key}",
            )
        )
        script = "".join(
            f"{{ {command}; }} >&2 || {{ echo {shlex.quote(f'p40fleet-sandbox: {step} failed')} >&2; exit 1; }}\n"
            for step, command in steps
        )
        ready = podman("exec", "-i", container, "sh", "-c", script + f"cat {key}\n", check=False, input_bytes=password)
        if ready.returncode != 0:
            raise SandboxError(f"{name}: starting the host failed: {ready.stderr.decode(errors='replace')[-3000:]}")
        return Host(
            name=name,
            container=container,
            address=self._address(container),
            profile=profile,
            login=login,
            os=os_name,
            tmpfs=tmpfs,
            services=services,
            volumes=dict(volumes or {}),
            host_key=_known_hosts_key(name, ready),
        )

    def _address(self, container: str) -> str:
        template = f'{{{{(index .NetworkSettings.Networks "{self.network}").IPAddress}}}}'
        return podman("inspect", "-f", template, container).stdout.decode().strip()

    def _write_known_hosts(self, hosts: list[Host]) -> None:
        lines = [f"{host.address} {host.host_key or self._read_host_key(host)}" for host in hosts]
        (self.dir / "known_hosts").write_text("\n".join(lines) + "\n")

    def _read_host_key(self, host: Host) -> str:
        """A host's key where its record has none (a sandbox kept from before the records held them)."""
        return _known_hosts_key(host.name, podman("exec", host.container, "cat", SSHD_HOST_KEY, check=False))

    def _write_hosts_file(self, hosts: list[Host]) -> None:
        inventory = {
            "all": {
                "children": {
                    "p40-hosts": {
                        "children": {
                            "p40_sandbox": {
                                "hosts": {
                                    h.name: {"ansible_host": h.address, "p40fleet_sandbox_profile": h.profile}
                                    for h in hosts
                                }
                            }
                        }
                    }
                }
            }
        }
        (self.inventory_dir / "hosts.yml").write_text(
            "---\n# Written by `p40fleet sandbox up`; replaced on every start.\n"
            + yaml.safe_dump(inventory, sort_keys=False)
        )

    def _write_inventory(self, hosts: list[Host], standin_vars: dict) -> None:
        group_vars = self.inventory_dir / "group_vars"
        group_vars.mkdir(parents=True, exist_ok=True)
        # The example inventory's fleet-wide choices (the pins are role defaults: roles/p40fleet_defaults).
        fleet = group_vars / "p40-hosts"
        if not fleet.exists():
            fleet.symlink_to(REPO_ROOT / "inventory" / "group_vars" / "p40-hosts")
        self._write_hosts_file(hosts)
        mirror = self._address(self.mirror_container)
        # Every host of a sandbox shares one login mode; only `--login root` logs in as root.
        login_user = LOGIN_USER if any(h.login != "root" for h in hosts) else "root"
        sandbox_vars = {
            "ansible_user": login_user,
            "ansible_python_interpreter": "/usr/bin/python3",
            "ansible_ssh_private_key_file": str(self.key_file),
            "ansible_ssh_common_args": (
                f"-o UserKnownHostsFile={self.dir / 'known_hosts'} -o StrictHostKeyChecking=yes"
            ),
            "p40fleet_sandbox_name": self.name,
            "p40fleet_sandbox_mirror_url": f"http://{mirror}:{MIRROR_PORT}",
            "p40fleet_sandbox_hub_url": f"https://{APT_HOSTNAME}:{HUB_TLS_PORT}",
            "p40fleet_sandbox_hub_ca": self.hub_ca(),
            # Stand-ins carry the real file names: keep them out of the controller's real caches.
            "artifact_fetch_controller_cache_dir": str(self.dir / "artifact-cache"),
            "apex_controller_cache_dir": str(self.dir / "apex-wheels"),
            "host_prereqs_extra_packages": list(STANDIN_PACKAGES),
            "gpu_preflight_disk_checks": sandbox_disk_checks(),
            **standin_vars,
        }
        (group_vars / "p40_sandbox.yml").write_text(
            "---\n# Sandbox hosts: stand-in artifacts served by the sandbox mirror (test fixtures).\n"
            + yaml.safe_dump(sandbox_vars, sort_keys=True)
        )

    @property
    def kept_file(self) -> Path:
        """Present where a session left this sandbox on purpose, for the next to reuse (leftover_sandboxes)."""
        return self.dir / "kept"

    @property
    def copy_image(self) -> str:
        return f"{COPY_IMAGE_NAME}:{PODMAN_PREFIX}-{self.name}"

    def replicate(self, source: str, names: Sequence[str]) -> list[Host]:
        """Make the hosts `names` copies of host `source` as its disk is now (podman commit), each keeping its own
        name, profile, login, small filesystems and service manager, with a new address: a converged host copied
        in seconds where converging it again costs minutes. Like a disk image cloned onto other machines, a copy
        carries the source's installed stages and their records, while its GPUs are its own (the stand-in's UUIDs
        follow the host name): preflight sees new GPUs there, and the next run re-verifies each stage on the copy
        instead of trusting it."""
        hosts = self.hosts()
        by_name = {h.name: h for h in hosts}
        unknown = [n for n in (source, *names) if n not in by_name]
        if unknown or source in names or not names:
            raise SandboxError(
                f"replicate {source} to {list(names)}: name other hosts of sandbox {self.name} "
                f"({', '.join(by_name)}){'; unknown: ' + ', '.join(unknown) if unknown else ''}"
            )
        podman("commit", "--quiet", by_name[source].container, self.copy_image)
        mirror = self._address(self.mirror_container)
        for name in names:
            old = by_name[name]
            podman("rm", "-f", "-t", "0", old.container)
            by_name[name] = self._start_host(
                self.copy_image, name, old.profile, old.login, old.os, mirror, old.tmpfs, old.services, old.volumes
            )
            # The copy's disk is the source's: its stand-ins too, where the sandbox has them.
            by_name[name].standins = old.standins
        hosts = [by_name[h.name] for h in hosts]
        self._save_hosts(hosts)
        self._write_known_hosts(hosts)
        self._write_hosts_file(hosts)
        for name in names:
            _wait_for_port(by_name[name].address, 22)
        return [by_name[n] for n in names]

    # -- host operations -----------------------------------------------------------------------
    def power_off(self, host: str) -> None:
        """Stop a host at once (its container, no shutdown): an outage. Whatever ran on it dies unfinished."""
        podman("stop", "-t", "0", self.host(host).container)

    def power_on(self, host: str) -> Host:
        """Start a stopped host again, as a host back from an outage. podman gives the container another
        address, as a DHCP lease may: the inventory and known_hosts follow, as DNS would on a real fleet."""
        hosts = self.hosts()
        entry = next(h for h in hosts if h.name == host)
        podman("start", entry.container)
        entry.address = self._address(entry.container)
        _wait_for_port(entry.address, 22)
        self._save_hosts(hosts)
        self._write_known_hosts(hosts)
        self._write_hosts_file(hosts)
        return entry

    def put_file(self, host: str, path: str, data: bytes, mode: str) -> None:
        """Write a root-owned file on a host, as root, its directories made root's 0755 where missing: a stand-in
        of a root-owned program or record (p40fleet_dev.standins)."""
        quoted = shlex.quote(path)
        command = f"install -d -m 0755 {shlex.quote(path.rsplit('/', 1)[0])} && cat > {quoted} && chmod {mode} {quoted}"
        podman("exec", "-i", self.host(host).container, "sh", "-c", command, input_bytes=data)

    def exec(self, host: str, command: str, user: str = "root") -> subprocess.CompletedProcess:
        """Run a shell command inside a host, bypassing Ansible: for asserting real state."""
        result = podman("exec", "-u", user, self.host(host).container, "sh", "-c", command, check=False)
        return subprocess.CompletedProcess(
            result.args,
            result.returncode,
            result.stdout.decode(errors="replace"),
            result.stderr.decode(errors="replace"),
        )

    def enable_apt_suite(self, host: str, suite: str) -> None:
        """Add an extra suite (apt_suite()'s name) to a host's apt sources, signed by the key it already trusts,
        and refresh its lists: as an operator adds NVIDIA's repository."""
        line = f"deb [signed-by={APT_KEYRING}] http://{APT_HOSTNAME}:{APT_SUITES_PORT}/{suite}/ ./\n"
        container = self.host(host).container
        path = f"/etc/apt/sources.list.d/p40fleet-{suite.rsplit('-', 1)[0]}.list"
        podman("exec", "-i", container, "sh", "-c", f"cat > {path}", input_bytes=line.encode())
        update = podman("exec", container, "apt-get", "-q", "update", check=False)
        if update.returncode != 0:
            raise SandboxError(f"{host}: apt-get update with suite {suite} failed: {update.stdout.decode()}")

    def set_profile(self, host: str, profile: str) -> None:
        """Give a host another simulated GPU setup, as a driver upgrade or a card swap would."""
        spec = gpu_profiles().get(profile)
        if spec is None:
            raise SandboxError(f"unknown GPU profile {profile!r}")
        podman("exec", self.host(host).container, "sh", "-c", _profile_commands(host, profile, spec))
        hosts = self.hosts()
        for entry in hosts:
            if entry.name == host:
                entry.profile = profile
        self._save_hosts(hosts)


def _profile_commands(host: str, profile: str, spec: Mapping[str, Any]) -> str:
    """The shell commands that give a host a simulated GPU setup (`spec`, gpu_profiles()[profile]): the stand-in
    nvidia-smi's profile, and the command itself only where the profile has a driver."""
    data = json.dumps({"host": host, "profile": profile, **spec}, indent=2)
    smi = f"ln -sfn {NVIDIA_SMI_STANDIN} /usr/bin/nvidia-smi" if spec["driver_version"] else "rm -f /usr/bin/nvidia-smi"
    return (
        f"mkdir -p {Path(GPU_PROFILE_PATH).parent} && printf '%s\\n' {shlex.quote(data)} > {GPU_PROFILE_PATH} && {smi}"
    )


def remove_sandboxes(sandboxes: Sequence[Sandbox]) -> None:
    """Remove sandboxes with all they started: one `podman rm` for every container of them all, which podman
    removes side by side (a converged host's disk takes seconds to delete; one call a sandbox waited on each in
    turn at the end of a test session)."""
    containers = [c for s in sandboxes for c in [h.container for h in s.hosts()] + [s.mirror_container]]
    # And any host of theirs no record names: one a start that failed or was killed left running.
    pattern = "|".join(re.escape(f"{PODMAN_PREFIX}-{s.name}-") for s in sandboxes)
    listed = podman("ps", "-a", "--filter", f"name=^({pattern})node[0-9]+$", "--format", "{{.Names}}", check=False)
    containers += sorted(set(listed.stdout.decode().split()) - set(containers))
    if containers:
        podman("rm", "-f", "-t", "0", "--ignore", *containers, check=False)
    podman("image", "rm", "-f", "--ignore", *[s.copy_image for s in sandboxes], check=False)
    networks = [s.network for s in sandboxes if podman("network", "exists", s.network, check=False).returncode == 0]
    if networks:
        podman("network", "rm", "-f", *networks, check=False)
    for sandbox in sandboxes:
        if sandbox.dir.exists():
            shutil.rmtree(sandbox.dir)


def leftover_sandboxes(name_prefix: str) -> list[Sandbox]:
    """The sandboxes named name_prefix* of this checkout that podman or .sandbox/ still holds: its containers
    (hosts named <sandbox>-node<N> and the <sandbox>-mirror), networks and state directories; not those a session
    kept on purpose (kept_file)."""
    own = f"{PODMAN_PREFIX}-{name_prefix}"
    names: set[str] = set()
    listed = podman("ps", "-a", "--filter", f"name=^{re.escape(own)}", "--format", "{{.Names}}", check=False)
    named = re.compile(rf"{re.escape(PODMAN_PREFIX)}-({re.escape(name_prefix)}.*)-(?:mirror|node[0-9]+)")
    for container in listed.stdout.decode().split():
        found = named.fullmatch(container)
        if found:
            names.add(found.group(1))
    networks = podman("network", "ls", "--format", "{{.Name}}", check=False)
    names.update(n[len(PODMAN_PREFIX) + 1 :] for n in networks.stdout.decode().split() if n.startswith(own))
    if SANDBOX_DIR.is_dir():
        names.update(path.name for path in SANDBOX_DIR.glob(f"{name_prefix}*") if path.is_dir())
    # Left on purpose (P40FLEET_FAULTS_KEEP): not a leftover.
    return [sandbox for sandbox in map(Sandbox, sorted(names)) if not sandbox.kept_file.exists()]


def claim_session(lock_path: Path, name_prefix: str) -> tuple[IO[str] | None, list[str]]:
    """Start a test session's hold on the sandboxes named name_prefix*: where no other live session holds lock_path,
    take it (the kernel lets go when this process ends) and remove what a killed session left (its hosts ran on,
    idle Ray heads and services using the CPU the next session's tests need; nothing removed them, since only the
    session that made a sandbox knows it). Where another session holds the lock, nothing is removed: its sandboxes
    are live. Returns the open lock (keep it for the session) or None, and the names removed."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    handle = lock_path.open("w")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        return None, []
    stale = leftover_sandboxes(name_prefix)
    if stale:
        remove_sandboxes(stale)
    return handle, [sandbox.name for sandbox in stale]


def _wait_for_port(address: str, port: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((address, port), timeout=1):
                return
        except OSError:
            time.sleep(0.1)
    raise SandboxError(f"{address}:{port} did not answer within {timeout:.0f} s")
