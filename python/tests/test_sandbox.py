"""The sandbox fleet and the p40fleet command, against real containers over real SSH."""

from __future__ import annotations

import json
import subprocess

import pytest
import yaml

from p40fleet import cli
from p40fleet.paths import ROLES_DIR
from p40fleet_dev import sandbox as sandbox_module
from p40fleet_dev.sandbox import SANDBOX_DISK_GIB, Sandbox, SandboxError, gpu_profiles, podman, sandbox_disk_checks
from tests.workers import sandbox_name

pytestmark = pytest.mark.sandbox

PROBE = "python/tests/playbooks/sandbox_probe.yml"


@pytest.fixture(scope="module")
def fleet(make_sandbox) -> Sandbox:
    return make_sandbox("fleet", ["p40", "p40-upgraded-unloaded", "nogpu"])


def test_hosts_answer_as_their_profiles_say(fleet):
    p40 = fleet.exec("node1", "nvidia-smi --query-gpu=name,compute_cap,memory.total --format=csv,noheader")
    assert (p40.returncode, p40.stdout) == (0, "Tesla P40, 6.1, 23040 MiB\n")
    upgraded = fleet.exec("node2", "nvidia-smi")
    assert upgraded.returncode == 18
    assert "Failed to initialize NVML: Driver/library version mismatch" in upgraded.stdout
    assert fleet.exec("node3", "command -v nvidia-smi").returncode != 0


def test_old_driver_lacks_compute_cap_field(fleet):
    fleet.set_profile("node1", "p40-old-smi")
    try:
        result = fleet.exec("node1", "nvidia-smi --query-gpu=name,compute_cap --format=csv,noheader")
        assert result.returncode == 2
        assert result.stdout.startswith('Field "compute_cap" is not a valid field to query.')
        names = fleet.exec("node1", "nvidia-smi --query-gpu=name,driver_version --format=csv,noheader")
        assert names.stdout == "Tesla P40, 520.61.05\n"
    finally:
        fleet.set_profile("node1", "p40")


def test_run_reports_per_host_outcomes_over_ssh(fleet, run_playbook):
    result = run_playbook(PROBE, fleet.inventory_dir)
    assert set(result.stats) == {"node1", "node2", "node3"}
    assert result.stats["node1"]["failures"] == 0
    failed = {f.host: f for f in result.failures}
    assert set(failed) == {"node2", "node3"}
    # Ansible's bare phrase, then the command's own words (p40fleet.run's failure message).
    assert failed["node2"].message.startswith(
        "non-zero return code (rc 18): Failed to initialize NVML: Driver/library version mismatch"
    ), failed["node2"].message
    assert failed["node3"].message == "Error executing command."
    assert failed["node2"].task == "Query the GPUs through nvidia-smi."
    assert cli.exit_code_for(result) == cli.EXIT_HOSTS_FAILED


def test_cli_exit_codes_and_report(fleet, tmp_path):
    report_path = tmp_path / "report.json"
    code = cli.main(
        ["run", "-i", str(fleet.inventory_dir), "--playbook", PROBE, "-l", "node1", "--report", str(report_path)]
    )
    assert code == cli.EXIT_OK
    report = json.loads(report_path.read_text())
    assert report["schema"] == "p40fleet.report/v1"
    assert report["runs"][0]["hosts"]["node1"]["state"] == "ok"

    code = cli.main(
        [
            "run",
            "-i",
            str(fleet.inventory_dir),
            "--playbook",
            PROBE,
            "-l",
            "node1",
            "--report",
            str(report_path),
            "-t",
            "never-a-tag",
        ]
    )
    assert code == cli.EXIT_OK

    assert cli.main(["run", "-i", str(tmp_path / "missing.yml")]) == cli.EXIT_ERROR


def test_host_keys_are_checked(fleet, run_playbook, tmp_path):
    known_hosts = fleet.dir / "known_hosts"
    original = known_hosts.read_text()
    try:
        # Another host's key for node1's address: strict checking must refuse to connect.
        lines = original.splitlines()
        swapped = [lines[0].split()[0] + " " + " ".join(lines[1].split()[1:]), *lines[1:]]
        known_hosts.write_text("\n".join(swapped) + "\n")
        # A fresh SSH control path, so no open master connection skips the check.
        result = run_playbook(
            PROBE, fleet.inventory_dir, limit="node1", envvars={"ANSIBLE_SSH_CONTROL_PATH_DIR": str(tmp_path)}
        )
        assert result.stats["node1"]["unreachable"] == 1, result.stdout
        assert "Host key verification failed" in result.failures[0].message
    finally:
        known_hosts.write_text(original)


def test_unknown_profile_is_refused():
    with pytest.raises(SandboxError, match="unknown GPU profile"):
        Sandbox("pytest-refused").up(["p40", "not-a-gpu"])
    assert "p40" in gpu_profiles()


def test_the_profiles_are_read_once_and_each_caller_gets_its_own_copy():
    first = gpu_profiles()
    first["p40"]["driver_version"] = "changed by a caller"
    assert gpu_profiles()["p40"]["driver_version"] != "changed by a caller"
    assert sandbox_module._gpu_profiles_file.cache_info().misses == 1


@pytest.mark.parametrize(
    ("rc", "out", "found"),
    [
        (0, b"ssh-ed25519 AAAAC3Nza root@node1\n", "ssh-ed25519 AAAAC3Nza"),
        (0, b"ssh-ed25519 AAAAC3Nza\n", "ssh-ed25519 AAAAC3Nza"),
        (0, b"ssh-ed25519\n", None),
        (0, b"", None),
        (1, b"ssh-ed25519 AAAAC3Nza root@node1\n", None),
    ],
)
def test_the_known_hosts_key_is_the_type_and_key_of_a_whole_answer(rc, out, found):
    answer = subprocess.CompletedProcess(["podman"], rc, out, b"cat: no such file")
    if found is None:
        with pytest.raises(SandboxError, match=r"node3: no sshd host key in /etc/ssh/ssh_host_ed25519_key.pub"):
            sandbox_module._known_hosts_key("node3", answer)
    else:
        assert sandbox_module._known_hosts_key("node3", answer) == found


def test_a_small_filesystem_for_a_host_it_lacks_or_of_no_size_is_refused():
    with pytest.raises(SandboxError, match=r"tmpfs names hosts \['node2'\] this sandbox does not have \(node1\)"):
        Sandbox("pytest-refused").up(["p40"], tmpfs={"node2": {"/srv/small": "64m"}})
    with pytest.raises(SandboxError, match="tmpfs /srv/small=lots: use an absolute path and a size like 64m"):
        Sandbox("pytest-refused").up(["p40"], tmpfs={"node1": {"/srv/small": "lots"}})


def test_a_volume_that_is_not_two_absolute_paths_is_refused():
    with pytest.raises(SandboxError, match="volume cache:/srv/cache: use absolute paths without ':'"):
        Sandbox("pytest-refused").up(["p40"], volumes={"cache": "/srv/cache"})


def test_a_host_starts_with_one_exec_and_its_password_on_stdin_alone(monkeypatch, tmp_path):
    # Every podman call a sudo-password host's start makes, answered as podman would: no argument list, which
    # any account on the test machine can read, holds the password.
    calls = []

    def podman_answering(*args, check=True, input_bytes=None):
        calls.append((args, input_bytes))
        out = b"ssh-ed25519 AAAAC3Nza root@node1\n" if args[0] == "exec" else b"10.88.0.7\n"
        return subprocess.CompletedProcess(["podman", *args], 0, out, b"")

    monkeypatch.setattr(sandbox_module, "podman", podman_answering)
    monkeypatch.setattr(sandbox_module, "SANDBOX_DIR", tmp_path)
    box = Sandbox("pytest-start")
    box.dir.mkdir(parents=True)
    box.become_password_file.write_text("s3cret-Pass\n")
    host = box._start_host("image", "node1", "p40", "sudo-password", "debian12", "10.88.0.2", {}, False)
    assert (host.address, host.host_key) == ("10.88.0.7", "ssh-ed25519 AAAAC3Nza")
    assert [args[0] for args, _ in calls] == ["run", "exec", "inspect"]
    assert not any("s3cret" in " ".join(args) for args, _ in calls)
    assert calls[1][1] == b"s3cret-Pass\n"
    script = calls[1][0][-1]
    for step in ("sudo rule", "the login password", "apt-get update", "the GPU profile", "the sshd host key"):
        assert f"p40fleet-sandbox: {step}" in script, step


@pytest.mark.parametrize("overrides", [{}, {"p40fleet_conda_prefix": 0}])
def test_sandbox_disk_checks_are_preflights_own_with_the_sandbox_size(overrides):
    real = yaml.safe_load((ROLES_DIR / "gpu_preflight" / "defaults" / "main.yml").read_text())[
        "gpu_preflight_disk_checks"
    ]
    ours = sandbox_disk_checks(**overrides)
    strip = [{k: v for k, v in c.items() if k != "min_free_gib"} for c in real]
    assert [{k: v for k, v in c.items() if k != "min_free_gib"} for c in ours] == strip
    # The real figures are much larger; the sandbox's stand-ins are not the real artifacts.
    assert sum(c["min_free_gib"] for c in real) > 40
    sizes = {c["purpose"].rsplit(", ", 1)[1]: c["min_free_gib"] for c in ours}
    assert sizes == {name: overrides.get(name, SANDBOX_DISK_GIB) for name in sizes}


def test_the_sandbox_inventory_asks_preflight_for_the_sandbox_disk(fleet):
    group_vars = yaml.safe_load((fleet.inventory_dir / "group_vars" / "p40_sandbox.yml").read_text())
    assert group_vars["gpu_preflight_disk_checks"] == sandbox_disk_checks()


def test_a_replicated_host_carries_the_disk_and_keeps_its_own_identity(make_sandbox, run_playbook):
    sandbox = make_sandbox("replica", ["p40", "p40x2", "p40"])
    sandbox.exec("node1", "mkdir -p /opt/installed && echo stage-done > /opt/installed/record")
    node3_before = sandbox.host("node3")
    copies = sandbox.replicate("node1", ["node2"])
    assert [h.name for h in copies] == ["node2"]
    assert sandbox.exec("node2", "cat /opt/installed/record").stdout == "stage-done\n"
    # Its own name, profile (2 GPUs) and login; the host not named is untouched.
    assert sandbox.exec("node2", "hostname").stdout == "node2\n"
    gpus = sandbox.exec("node2", "nvidia-smi -L").stdout.splitlines()
    assert len(gpus) == 2 and gpus != sandbox.exec("node1", "nvidia-smi -L").stdout.splitlines()[:2]
    assert sandbox.host("node3") == node3_before
    # Reached over SSH as before, known by its own address.
    probe = run_playbook(PROBE, sandbox.inventory_dir)
    assert probe.rc == 0 and probe.stats["node2"]["unreachable"] == 0, probe.stdout
    with pytest.raises(SandboxError, match=r"replicate node1 to \['node1'\]: name other hosts"):
        sandbox.replicate("node1", ["node1"])
    with pytest.raises(SandboxError, match="unknown: node9"):
        sandbox.replicate("node1", ["node9"])


def test_a_host_gets_the_small_filesystem_it_asks_for(make_sandbox):
    sandbox = make_sandbox("tmpfs", ["p40"], tmpfs={"node1": {"/srv/small": "8m"}})
    mount = sandbox.exec("node1", "grep ' /srv/small ' /proc/mounts").stdout.split()
    assert mount[2] == "tmpfs" and "size=8192k" in mount[3]
    assert sandbox.host("node1").tmpfs == {"/srv/small": "8m"}
    # Filling it fills it, not the test machine's disk.
    full = sandbox.exec("node1", "dd if=/dev/zero of=/srv/small/fill bs=1M count=16")
    assert full.returncode != 0 and "No space left on device" in full.stderr


def test_a_start_that_fails_leaves_nothing_running_and_names_the_host(monkeypatch):
    # node2's start fails after its container runs (a step of its one exec fails): the sandbox removes node1,
    # node2 and the mirror it started, which no record of hosts names yet.
    real = sandbox_module._profile_commands
    monkeypatch.setattr(
        sandbox_module,
        "_profile_commands",
        lambda host, profile, spec: "false" if host == "node2" else real(host, profile, spec),
    )
    sandbox = Sandbox(sandbox_name("failed-start"))
    failed = r"(?s)node2: starting the host failed: .*p40fleet-sandbox: the GPU profile failed"
    with pytest.raises(SandboxError, match=failed):
        sandbox.up(["p40", "p40"])
    prefix = f"{sandbox_module.PODMAN_PREFIX}-{sandbox.name}-"
    left = podman("ps", "-a", "--filter", f"name=^{prefix}", "--format", "{{.Names}}")
    assert left.stdout.decode().split() == []
    assert podman("network", "exists", sandbox.network, check=False).returncode != 0


def test_a_killed_session_s_sandboxes_go_when_the_next_session_starts_unless_one_is_running(tmp_path):
    # What a killed session leaves: a host and its mirror (created, as a running one would be listed), the network,
    # the state directory. Named under a prefix of this test's own, so the session's live sandboxes stay out of it.
    prefix = sandbox_name("killed") + "-"
    left = Sandbox(prefix + "run1")
    image = sandbox_module.ensure_image()
    for container in (f"{sandbox_module.PODMAN_PREFIX}-{left.name}-node3", left.mirror_container):
        podman("create", "--name", container, image, "sleep", "infinity")
    podman("network", "create", left.network)
    left.dir.mkdir(parents=True)
    # And one a session kept on purpose (P40FLEET_FAULTS_KEEP), for the next to reuse.
    kept = Sandbox(prefix + "kept")
    podman("create", "--name", kept.mirror_container, image, "sleep", "infinity")
    kept.dir.mkdir(parents=True)
    kept.kept_file.touch()
    lock = tmp_path / "session.lock"

    def remaining() -> list[str]:
        pattern = f"name=^{sandbox_module.PODMAN_PREFIX}-{prefix}"
        listed = podman("ps", "-a", "--filter", pattern, "--format", "{{.Names}}")
        return sorted(listed.stdout.decode().split())

    try:
        # Another session holds the lock: its sandboxes are live, nothing is touched.
        with lock.open("w") as other:
            sandbox_module.fcntl.flock(other, sandbox_module.fcntl.LOCK_EX)
            assert sandbox_module.claim_session(lock, prefix) == (None, [])
            assert len(remaining()) == 3 and left.dir.is_dir()
        held, removed = sandbox_module.claim_session(lock, prefix)
        assert held is not None and removed == [left.name]
        assert remaining() == [kept.mirror_container]
        assert podman("network", "exists", left.network, check=False).returncode != 0
        assert not left.dir.exists()
        # While this session holds it, a second session's claim removes nothing.
        assert sandbox_module.claim_session(lock, prefix) == (None, [])
        held.close()
    finally:
        sandbox_module.remove_sandboxes([left, kept])


def test_unreachable_host_has_its_own_exit_code(fleet, tmp_path):
    node3 = fleet.host("node3")
    podman("stop", "-t", "0", node3.container)
    try:
        report_path = tmp_path / "report.json"
        code = cli.main(
            [
                "run",
                "-i",
                str(fleet.inventory_dir),
                "--playbook",
                PROBE,
                "-l",
                "node1,node3",
                "--report",
                str(report_path),
            ]
        )
        assert code == cli.EXIT_HOSTS_UNREACHABLE
        hosts = json.loads(report_path.read_text())["runs"][0]["hosts"]
        assert hosts["node3"]["state"] == "unreachable"
        assert hosts["node1"]["state"] == "ok"
    finally:
        podman("start", node3.container)
