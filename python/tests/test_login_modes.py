"""Sandbox hosts log in as a real fleet's do (an ordinary user with sudo, with or without a sudo
password, or root), start minimal, and get their prerequisites from the host_prereqs stage, whose
packages come from the sandbox's own signed apt repository."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from p40fleet import cli
from p40fleet.run import RunError, run_playbook
from p40fleet.state import StateDir
from p40fleet_dev.sandbox import APT_HOSTNAME, LOGIN_USER, Sandbox

pytestmark = pytest.mark.sandbox

PREREQS = "python/tests/playbooks/host_prereqs.yml"
PROBE = "python/tests/playbooks/sandbox_probe.yml"
# What the minimal image lacks and the stage must bring: git (verl), xz (cuDNN), libxml2 (the CUDA
# 11 installer exits 127 without it), the gcc nvcc 11.8 accepts (Apex).
MARKERS = "command -v git && command -v xz && dpkg-query -W -f '${Status}' libxml2 | grep -q '^install ok'"


@pytest.fixture(scope="module")
def sudo_fleet(make_sandbox) -> Sandbox:
    return make_sandbox("login-sudo", ["p40"], login="sudo")


@pytest.fixture(scope="module")
def password_fleet(make_sandbox) -> Sandbox:
    return make_sandbox("login-password", ["p40"], login="sudo-password")


@pytest.fixture(scope="module")
def root_fleet(make_sandbox) -> Sandbox:
    return make_sandbox("login-root-debian11", ["p40"], login="root", os_name="debian11")


def ssh(sandbox: Sandbox, user: str, command: str) -> subprocess.CompletedProcess:
    host = sandbox.hosts()[0]
    return subprocess.run(
        [
            "ssh",
            "-i",
            str(sandbox.key_file),
            "-o",
            f"UserKnownHostsFile={sandbox.dir / 'known_hosts'}",
            "-o",
            "StrictHostKeyChecking=yes",
            "-o",
            "BatchMode=yes",
            "-o",
            "ControlMaster=no",
            f"{user}@{host.address}",
            command,
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=30,
    )


@pytest.mark.parametrize("fleet_name", ["sudo_fleet", "password_fleet"])
def test_sudo_modes_log_in_as_ops_never_as_root(fleet_name, request):
    fleet = request.getfixturevalue(fleet_name)
    assert ssh(fleet, LOGIN_USER, "id -un").stdout == f"{LOGIN_USER}\n"
    refused = ssh(fleet, "root", "true")
    assert refused.returncode == 255 and "Permission denied" in refused.stderr
    inventory = (fleet.inventory_dir / "group_vars" / "p40_sandbox.yml").read_text()
    assert f"ansible_user: {LOGIN_USER}\n" in inventory
    assert "become_pass" not in inventory and "ansible_password" not in inventory
    if fleet.become_password_file.exists():
        password = fleet.become_password_file.read_text().strip()
        assert not [p for p in fleet.inventory_dir.rglob("*") if p.is_file() and password in p.read_text()]


def test_root_mode_logs_in_as_root(root_fleet):
    assert ssh(root_fleet, "root", "id -un").stdout == "root\n"
    assert ssh(root_fleet, LOGIN_USER, "true").returncode == 255


def test_sudo_password_mode_asks_for_the_password(password_fleet):
    assert ssh(password_fleet, LOGIN_USER, "sudo -n true").returncode != 0
    password = password_fleet.become_password_file.read_text().strip()
    assert password_fleet.become_password_file.stat().st_mode & 0o777 == 0o600
    result = ssh(password_fleet, LOGIN_USER, f"echo {password} | sudo -S -p '' id -un")
    assert result.stdout == "root\n", result.stderr


def test_hosts_know_only_the_sandbox_repository_and_its_key(sudo_fleet):
    sources = sudo_fleet.exec("node1", "cat /etc/apt/sources.list; ls /etc/apt/sources.list.d")
    lines = [line for line in sources.stdout.splitlines() if line and not line.startswith("#")]
    assert lines == [f"deb [signed-by=/etc/apt/keyrings/p40fleet-sandbox.gpg] http://{APT_HOSTNAME}:8081/ ./"]


def test_prereqs_stage_installs_what_the_minimal_image_lacks_idempotently(sudo_fleet, run_playbook):
    assert sudo_fleet.exec("node1", MARKERS).returncode != 0
    # Lists that offer nothing (a fresh install, or lists cleaned) are refreshed whatever their age.
    sudo_fleet.exec("node1", "find /var/lib/apt/lists -maxdepth 1 -type f -name '*_Packages' -delete")
    first = run_playbook(PREREQS, sudo_fleet.inventory_dir)
    assert first.stats["node1"]["failures"] == 0, first.stdout
    assert first.stats["node1"]["changed"] >= 1
    assert sudo_fleet.exec("node1", MARKERS + " && command -v gcc-11 g++-11 make").returncode == 0
    assert sudo_fleet.exec("node1", "ls /var/lib/apt/lists | grep -c _Packages").stdout.strip() == "1"
    second = run_playbook(PREREQS, sudo_fleet.inventory_dir)
    assert second.stats["node1"]["changed"] == 0, second.stdout
    checked = run_playbook(PREREQS, sudo_fleet.inventory_dir, check=True, diff=True)
    assert checked.stats["node1"]["changed"] == 0, checked.stdout
    verified = run_playbook(PREREQS, sudo_fleet.inventory_dir, tags="verify")
    assert verified.stats["node1"]["failures"] == 0, verified.stdout


def test_check_mode_on_a_minimal_host_reports_and_changes_nothing(password_fleet, run_playbook):
    # Before the password-mode test installs anything: check mode needs no sudo and leaves no lists.
    checked = run_playbook(PREREQS, password_fleet.inventory_dir, check=True)
    assert checked.stats["node1"]["failures"] == 0, checked.stdout
    assert checked.stats["node1"]["changed"] == 1
    assert "would install ca-certificates, git" in checked.stdout
    assert password_fleet.exec("node1", MARKERS).returncode != 0


def test_sudo_password_mode_converges_with_the_password_file_and_leaks_it_nowhere(password_fleet, tmp_path):
    password = password_fleet.become_password_file.read_text().strip()
    runs = StateDir().inventory(password_fleet.inventory_dir)
    before = set(runs.runs())
    without = run_playbook(PREREQS, password_fleet.inventory_dir)
    assert without.stats["node1"]["failures"] == 1
    assert "password" in without.failures[0].message.lower(), without.failures[0].message

    report = tmp_path / "report.json"
    args = ["run", "-i", str(password_fleet.inventory_dir), "--playbook", PREREQS, "--report", str(report)]
    assert cli.main([*args, "--become-password-file", str(password_fleet.become_password_file)]) == cli.EXIT_OK
    assert password_fleet.exec("node1", MARKERS).returncode == 0
    # And through ansible-playbook itself, the same option: converged, nothing to do.
    direct = subprocess.run(
        [
            str(Path(cli.__file__).parents[2] / ".venv" / "bin" / "ansible-playbook"),
            "-i",
            str(password_fleet.inventory_dir),
            "--become-password-file",
            str(password_fleet.become_password_file),
            PREREQS,
        ],
        cwd=Path(cli.__file__).parents[2],
        capture_output=True,
        text=True,
        check=False,
    )
    assert direct.returncode == 0 and "changed=0" in direct.stdout, direct.stdout + direct.stderr

    written = [report, *[p for run in set(runs.runs()) - before for p in run.rglob("*") if p.is_file()]]
    assert any("job_events" in str(p) for p in written) and any(p.name == "command" for p in written)
    leaks = [str(p) for p in written if password.encode() in p.read_bytes()]
    assert leaks == []
    assert password not in direct.stdout + direct.stderr


def test_a_loose_password_file_is_refused(tmp_path, sudo_fleet):
    loose = tmp_path / "password"
    loose.write_text("secret\n")
    loose.chmod(0o644)
    with pytest.raises(RunError, match=r"open to other users \(mode 0644\)"):
        run_playbook(PROBE, sudo_fleet.inventory_dir, become_password_file=loose)
    with pytest.raises(RunError, match="not a readable file"):
        run_playbook(PROBE, sudo_fleet.inventory_dir, become_password_file=tmp_path / "missing")


def test_debian11_root_login_installs_its_own_release_packages(root_fleet, run_playbook):
    assert root_fleet.exec("node1", "cat /etc/debian_version").stdout.startswith("11.")
    assert root_fleet.exec("node1", MARKERS).returncode != 0
    first = run_playbook(PREREQS, root_fleet.inventory_dir)
    assert first.stats["node1"]["failures"] == 0, first.stdout
    assert root_fleet.exec("node1", MARKERS + " && command -v gcc-10 g++-10").returncode == 0
    second = run_playbook(PREREQS, root_fleet.inventory_dir)
    assert second.stats["node1"]["changed"] == 0, second.stdout


def test_debian11_removes_a_tree_through_descriptors_with_its_python_3_9(root_fleet, run_playbook):
    """Every env removal and Apex build cleanup removes a tree with fleet_state_path, on the host's Python: Debian
    11's 3.9, where shutil.rmtree(dir_fd=...) raised TypeError. The link inside is removed, /etc left as it was."""
    host = root_fleet.hosts()[0].name
    assert root_fleet.exec(host, "python3 -c 'import sys; print(sys.version_info[:2])'").stdout.strip() == "(3, 9)"
    result = run_playbook("python/tests/playbooks/tree_removal.yml", root_fleet.inventory_dir)
    assert result.rc == 0, result.failures
    assert root_fleet.exec(host, "test ! -e /srv/p40fleet-removal/env && test -d /srv/p40fleet-removal").returncode == 0
    assert root_fleet.exec(host, "test -f /etc/passwd && test -d /etc/ssh").returncode == 0
