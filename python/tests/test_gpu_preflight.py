"""Role gpu_preflight against a sandbox fleet: one ansible-playbook run over many GPU setups.

Each host plays one case (P40 on a current and an old driver, drivers too old and past
R580, the NVML mismatch, no GPU, mixed GPUs, too little disk, V100/T4/A100 and Pascal siblings).
One run judges them all (forks); the tests then assert each host's exact outcome, that a refused
host was left untouched, and that a driver change is reported and changes nothing else.
"""

from __future__ import annotations

import json
import shlex
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from p40fleet_dev.paths import REPO_ROOT
from p40fleet_dev.sandbox import LOGIN_USER, Sandbox
from tests.source_modules import load_module

pytestmark = pytest.mark.sandbox

ROLE = REPO_ROOT / "roles" / "gpu_preflight"
STATE_FILE = "/etc/ansible/facts.d/p40fleet_preflight.fact"
PUBLISH_TASK = "Ensure the host is probed, judged and its GPU profile published for the later stages"
DEFAULTS = yaml.safe_load((ROLE / "defaults" / "main.yml").read_text())
REAL_HOSTS = REPO_ROOT / "python" / "tests" / "fixtures" / "real-hosts"
HUGE_DISK = [{"path": "/opt/p40fleet/conda", "min_free_gib": 100000, "purpose": "conda prefix"}]


def recorded_os_release(path: Path) -> str:
    """/etc/os-release exactly as a real host answered it (its recording's `cat /etc/os-release` block)."""
    block = path.read_text().split("$ cat /etc/os-release\n", 1)[1]
    return block.split("\n$ ", 1)[0] + "\n"


# host -> (sandbox GPU profile, host_vars for the run)
FLEET: dict[str, tuple[str, dict]] = {
    "node1": ("p40", {}),
    "node2": ("p40-old-smi", {}),
    "node3": ("p40-driver-too-old", {}),
    "node4": ("p40-driver-r590", {}),
    "node5": ("p40-upgraded-unloaded", {}),
    "node6": ("nogpu", {}),
    "node7": ("mixed-p40-v100", {}),
    "node8": ("mixed-p40-v100", {"gpu_preflight_gpu_select": "Tesla V100-SXM2-32GB"}),
    "node9": ("p40", {"gpu_preflight_disk_checks": HUGE_DISK}),
    "node10": ("p40", {"gpu_preflight_disk_checks": HUGE_DISK, "gpu_preflight_strict": False}),
    "node11": ("v100", {}),
    "node12": ("t4", {}),
    "node13": ("a100", {}),
    "node14": ("p4", {}),
    "node15": ("nogpu", {"gpu_preflight_no_gpu_compute_cap": "6.1"}),
    "node16": ("p40", {}),
    "node17": ("p40x2", {}),
    "node18": ("p100", {}),
    "node19": ("p40-old-smi", {"gpu_preflight_compute_cap_by_name": {}}),
    "node20": (
        "t4",
        {"gpu_preflight_profiles": [p for p in DEFAULTS["gpu_preflight_profiles"] if p["name"] == "pascal"]},
    ),
    "node21": ("p40", {}),
    "node22": ("p40", {}),
    "node23": ("p40", {}),
}

# Hosts that pretend to run another OS (their /etc/os-release is replaced before the run).
OS_RELEASE = {
    "node21": 'ID=rocky\nID_LIKE="rhel centos fedora"\nVERSION_ID="9.4"\nPRETTY_NAME="Rocky Linux 9.4 (Blue Onyx)"\n',
    "node22": 'ID=ubuntu\nID_LIKE=debian\nVERSION_ID="18.04"\nPRETTY_NAME="Ubuntu 18.04.6 LTS"\n',
    # Ubuntu 24.04 as a real host answers (h200-r580-open.txt), today's most common server release.
    "node23": recorded_os_release(REAL_HOSTS / "h200-r580-open.txt"),
}

# Refused hosts and exact fragments of their one failure message.
REFUSED = {
    "node3": [
        "found NVIDIA driver 470.256.02; required: >= 520.61.05 for CUDA 11.8 and <= R580 for Tesla P40;",
        "do: upgrade the driver to a release of branch 520 to 580",
    ],
    "node4": [
        "found NVIDIA driver 590.44.01 (branch R590) with Tesla P40 (pascal, compute capability 6.1);",
        "required: branch <= R580, the last branch that supports this GPU;",
        "do: install a driver of branch 520 to 580",
    ],
    "node5": [
        'nvidia-smi answers "Failed to initialize NVML: Driver/library version mismatch',
        "the NVIDIA driver package was upgraded but the old kernel module is still loaded;",
        "do: reboot the host (or unload and reload the nvidia kernel modules)",
    ],
    "node6": [
        "found no NVIDIA GPU (no nvidia-smi, 0 NVIDIA display device(s) on the PCI bus): nothing to provision;",
        "do: remove the host from p40-hosts, or set gpu_preflight_no_gpu_compute_cap",
    ],
    "node7": [
        "found 2 GPU models (0: Tesla P40, 1: Tesla V100-SXM2-32GB); required: one GPU model per host",
        'do: set gpu_preflight_gpu_select for node7 to one of "Tesla P40", "Tesla V100-SXM2-32GB"',
    ],
    "node9": [
        "too little disk: /opt/p40fleet/conda (conda prefix, 100000 GiB) on the filesystem of /opt: ",
        "GiB free; required: 100000 GiB free there;",
        "or set gpu_preflight_strict: false to proceed with a warning",
    ],
    "node19": [
        'nvidia-smi of driver 520.61.05 has no compute_cap field and "Tesla P40" is not in '
        "gpu_preflight_compute_cap_by_name;",
        'do: add "Tesla P40" with its compute capability to gpu_preflight_compute_cap_by_name',
    ],
    "node20": [
        "found Tesla T4 with compute capability 7.5, which no GPU profile covers; required: compute "
        "capability within a profile of gpu_preflight_profiles (pascal 6.0-6.2);",
    ],
    "node21": [
        "found Rocky Linux 9.4 (Blue Onyx) (ID=rocky, VERSION_ID=9.4), which is not supported; required: "
        "Debian or Ubuntu",
    ],
    "node22": [
        "found Ubuntu 18.04.6 LTS (ID=ubuntu, VERSION_ID=18.04), a release p40fleet has not been tested on; "
        "tested: debian 11, 12; ubuntu 20.04, 22.04, 24.04;",
    ],
}

# Accepted hosts and the profile keys they must publish.
ACCEPTED = {
    "node1": {
        "name": "pascal",
        "gpu_name": "Tesla P40",
        "gpu_count": 1,
        "compute_cap": "6.1",
        "compute_cap_source": "nvidia-smi",
        "dtype": "float32",
        "attn_implementation": "eager",
        "vllm_supported": False,
        "rollout_name": "hf",
        "torch_compile": False,
        "torch_cuda_arch_list": "6.1",
        "shared_memory_per_block": 49152,
        "needs_patches": True,
        "memory_mib": 23040,
        "ecc": "on",
        "cuda_visible_devices": "0",
    },
    "node2": {
        "name": "pascal",
        "compute_cap": "6.1",
        "dtype": "float32",
        "compute_cap_source": "the GPU name table; this driver's nvidia-smi has no compute_cap field",
    },
    "node8": {
        "name": "volta",
        "gpu_name": "Tesla V100-SXM2-32GB",
        "gpu_count": 1,
        "cuda_visible_devices": "1",
        "dtype": "float16",
        "memory_mib": 32768,
    },
    "node10": {"name": "pascal", "gpu_name": "Tesla P40"},
    "node11": {
        "name": "volta",
        "compute_cap": "7.0",
        "dtype": "float16",
        "attn_implementation": "sdpa",
        "vllm_supported": True,
        "rollout_name": "vllm",
        "torch_cuda_arch_list": "7.0",
        "shared_memory_per_block": 98304,
        "needs_patches": True,
    },
    "node12": {
        "name": "turing",
        "compute_cap": "7.5",
        "dtype": "float16",
        "attn_implementation": "sdpa",
        "vllm_supported": True,
        "shared_memory_per_block": 65536,
        "needs_patches": True,
    },
    "node13": {
        "name": "modern",
        "compute_cap": "8.0",
        "dtype": "bfloat16",
        # p40fleet's flash_attn is a shim: no FlashAttention-2 on the CUDA 11.8 stack.
        "attn_implementation": "sdpa",
        "vllm_supported": True,
        "torch_compile": True,
        "needs_patches": True,
    },
    "node14": {"name": "pascal", "gpu_name": "Tesla P4", "memory_mib": 7680},
    "node15": {
        "name": "pascal",
        "gpu_name": "none",
        "gpu_count": 0,
        "compute_cap": "6.1",
        "torch_cuda_arch_list": "6.1",
        "cuda_visible_devices": "",
    },
    "node16": {"name": "pascal"},
    "node23": {"name": "pascal", "gpu_name": "Tesla P40"},
    "node17": {"name": "pascal", "gpu_count": 2, "cuda_visible_devices": "0,1"},
    "node18": {
        "name": "pascal",
        "compute_cap": "6.0",
        "torch_cuda_arch_list": "6.0",
        "gpu_name": "Tesla P100-PCIE-16GB",
    },
}

# The launch script's memory tier (min_memory_mib) each accepted host's published memory per GPU must select.
LAUNCH = load_module(REPO_ROOT / "plugins" / "filter" / "launch_script.py", "launch_script_tier_of_sandbox")
LAUNCH_TIERS = yaml.safe_load((REPO_ROOT / "roles" / "launch_script" / "defaults" / "main.yml").read_text())[
    "launch_script_memory_tiers"
]
TIERS = {
    "node1": 22500,
    "node8": 22500,
    "node11": 22500,
    "node12": 15000,
    "node13": 40000,
    "node14": 0,
    "node15": 0,
    "node17": 22500,
    "node18": 15000,
}

# Files an SSH login and Ansible's own remote tmp touch (root's or the ordinary login user's home, whichever
# the sandbox logs in as); anything else written is the role's doing.
LOGIN_HOMES = ("/root", f"/home/{LOGIN_USER}")
TOUCHED_BY_LOGIN = ("/root/.ansible", f"/home/{LOGIN_USER}/.ansible", "/var/log/", "/run/", "/tmp/p40fleet-marker")


def published_facts(result, host: str) -> dict:
    for event in result.events:
        data = event.get("event_data", {})
        if event.get("event") == "runner_on_ok" and data.get("host") == host and data.get("task") == PUBLISH_TASK:
            return data["res"]["ansible_facts"]
    raise AssertionError(f"{host}: no facts published\n{result.stdout[-3000:]}")


def saved_state(sandbox, host: str) -> dict | None:
    read = sandbox.exec(host, f"cat {STATE_FILE}")
    return json.loads(read.stdout) if read.returncode == 0 else None


def make_fresh(sandbox, host: str) -> None:
    """No saved preflight state on the host, and a marker that dates what the next run writes."""
    done = sandbox.exec(host, "rm -rf /etc/ansible && touch /tmp/p40fleet-marker")
    assert done.returncode == 0, f"{host}: {done.stderr}"


def written_since_marker(sandbox, host: str) -> list[str]:
    found = sandbox.exec(
        host, "find / -xdev -newer /tmp/p40fleet-marker -not -path '/proc/*' -not -path '/sys/*' -print"
    )
    assert found.returncode == 0, found.stderr
    return [
        p
        for p in found.stdout.split()
        if not p.startswith(TOUCHED_BY_LOGIN) and p not in (*LOGIN_HOMES, "/tmp", "/run")
    ]


def write_preflight_playbook(path: Path) -> None:
    path.write_text(
        textwrap.dedent(
            f"""\
            ---
            - name: Run only the preflight stage
              hosts: p40-hosts
              gather_facts: false
              roles:
                - role: {ROLE}
            """
        )
    )


@dataclass
class Fleet:
    sandbox: Sandbox
    playbook: Path


@pytest.fixture(scope="module")
def fleet(make_sandbox, tmp_path_factory):
    sandbox = make_sandbox("gpu-preflight", [profile for profile, _ in FLEET.values()])
    for host, os_release in OS_RELEASE.items():
        done = sandbox.exec(host, f"rm -f /etc/os-release && printf '%s' {shlex.quote(os_release)} > /etc/os-release")
        assert done.returncode == 0, done.stderr
    for host in FLEET:
        # A sandbox kept from an interrupted session may carry saved state: start clean.
        make_fresh(sandbox, host)
    play_dir: Path = tmp_path_factory.mktemp("gpu_preflight")
    write_preflight_playbook(play_dir / "preflight.yml")
    (play_dir / "host_vars").mkdir()
    for host, (_, host_vars) in FLEET.items():
        if host_vars:
            (play_dir / "host_vars" / f"{host}.yml").write_text("---\n" + yaml.safe_dump(host_vars))
    return Fleet(sandbox, play_dir / "preflight.yml")


@pytest.fixture(scope="module")
def preflight(fleet, run_playbook):
    """preflight(limit=None, **kwargs): run the preflight-only playbook on the fleet."""

    def run(limit: str | None = None, **kwargs):
        return run_playbook(fleet.playbook, fleet.sandbox.inventory_dir, limit=limit, **kwargs)

    return run


@pytest.fixture(scope="module")
def first_check(preflight):
    """--check --diff on fresh hosts, before anything was written."""
    return preflight("node1,node3,node15", check=True, diff=True)


@pytest.fixture(scope="module")
def first_run(preflight, first_check):
    result = preflight()
    assert set(result.stats) == set(FLEET), result.stdout[-3000:]
    return result


def test_check_mode_on_fresh_hosts_shows_the_write_and_changes_nothing(fleet, first_check):
    assert first_check.stats["node1"]["changed"] == 2  # facts.d directory and the state file
    assert first_check.stats["node15"]["failures"] == 0
    assert first_check.stats["node3"]["failures"] == 1
    assert '+    "driver_version": "535.183.01",' in first_check.stdout
    for host in ("node1", "node3", "node15"):
        assert fleet.sandbox.exec(host, "test -e /etc/ansible").returncode == 1, host


@pytest.mark.parametrize("host", sorted(REFUSED))
def test_refused_host_gets_one_exact_message_and_is_left_untouched(fleet, first_run, host):
    failures = first_run.host_failures(host)
    assert len(failures) == 1, [f.message for f in failures]
    message = failures[0].message
    assert message.startswith(f"gpu_preflight refused {host} (nothing was changed on it):\n- ")
    for fragment in REFUSED[host]:
        assert fragment in message
    assert message.count("\n- ") == 1, message  # exactly one finding on each of these hosts
    assert first_run.stats[host]["changed"] == 0
    assert saved_state(fleet.sandbox, host) is None
    assert written_since_marker(fleet.sandbox, host) == []


@pytest.mark.parametrize("host", sorted(ACCEPTED))
def test_accepted_host_publishes_and_saves_its_profile(fleet, first_run, host):
    stats = first_run.stats[host]
    assert (stats["failures"], stats["changed"]) == (0, 2), first_run.host_failures(host)
    facts = published_facts(first_run, host)
    profile = facts["gpu_preflight_profile"]
    for key, value in ACCEPTED[host].items():
        assert profile[key] == value, (host, key, profile[key])
    # The tiers are the launch script's (launch_script_memory_tiers): preflight publishes the memory they are read by.
    assert "launch" not in profile
    if host in TIERS:
        assert LAUNCH.memory_tier(profile["memory_mib"], LAUNCH_TIERS)["min_memory_mib"] == TIERS[host]
    assert profile["reasons"][0].startswith(f"profile {profile['name']}: ")
    assert facts["gpu_preflight_driver_changed"] is False
    assert facts["gpu_preflight_has_gpu"] is (host != "node15")
    saved = saved_state(fleet.sandbox, host)
    assert saved["profile"] == profile
    assert saved["driver_version"] == facts["gpu_preflight_driver_version"]
    assert f"{host}: profile {profile['name']} (" in first_run.stdout
    assert facts["gpu_preflight_changes"] == []


def test_reasons_name_the_choices(first_run):
    node1 = published_facts(first_run, "node1")["gpu_preflight_profile"]["reasons"]
    assert node1[0] == "profile pascal: 1x Tesla P40, compute capability 6.1 (from nvidia-smi) is within 6.0-6.2"
    assert "rollout hf: vLLM requires compute capability 7.0+" in node1
    assert not any(reason.startswith("launch defaults") for reason in node1)
    assert node1[-1].startswith("ECC on: Tesla P40 reports 23040 MiB; ECC keeps about 1536 MiB")
    node8 = published_facts(first_run, "node8")["gpu_preflight_profile"]["reasons"]
    assert node8[1] == "GPU model Tesla V100-SXM2-32GB chosen by gpu_preflight_gpu_select; hidden: Tesla P40"


def test_non_strict_host_proceeds_with_a_warning(first_run):
    assert "WARNING node10: too little disk: /opt/p40fleet/conda (conda prefix, 100000 GiB)" in first_run.stdout
    assert "WARNING node1: " not in first_run.stdout


def test_gcc11_availability_is_reported(first_run):
    facts = published_facts(first_run, "node1")
    # Debian 12 carries gcc-11 (11.3) in bookworm/main: installable, not installed in the sandbox image.
    assert facts["gpu_preflight_gcc11_installed"] is False
    assert facts["gpu_preflight_gcc11_available"] is True


def test_converged_rerun_changes_nothing_and_refuses_the_same_hosts(preflight, first_run):
    accepted = ["node1", "node2", "node8", "node10", "node13", "node15", "node17"]
    refused = ["node3", "node7"]
    again = preflight(",".join(accepted + refused))
    for host in accepted:
        assert (again.stats[host]["changed"], again.stats[host]["failures"]) == (0, 0), host
    assert {f.host for f in again.failures} == set(refused)
    assert "re-verifying the stack" not in again.stdout
    check = preflight("node1,node13,node15", check=True, diff=True)
    assert {h: s["changed"] for h, s in check.stats.items()} == {"node1": 0, "node13": 0, "node15": 0}


def test_verify_alone_checks_the_saved_state(preflight, first_run):
    verify = preflight("node1", tags="verify")
    assert (verify.stats["node1"]["failures"], verify.stats["node1"]["changed"]) == (0, 0)
    assert "Ensure the saved preflight state matches this run's findings" in verify.stdout


def test_driver_change_is_reported_and_changes_only_the_saved_state(fleet, preflight, first_run):
    host = "node16"
    assert saved_state(fleet.sandbox, host)["driver_version"] == "535.183.01"
    # The driver package is upgraded, the old module still loaded: refused, saved state kept.
    fleet.sandbox.set_profile(host, "p40-upgraded-unloaded")
    pending = preflight(host)
    assert "Driver/library version mismatch" in pending.host_failures(host)[0].message
    assert saved_state(fleet.sandbox, host)["driver_version"] == "535.183.01"
    # The host is rebooted: the new driver loads (the stand-in then stops reporting the mismatch).
    reboot = fleet.sandbox.exec(
        host,
        "python3 -c \"import json; p='/etc/p40fleet-sandbox/gpu.json'; d=json.load(open(p)); "
        "d.pop('nvml_mismatch'); json.dump(d, open(p, 'w'))\" && touch /tmp/p40fleet-marker",
    )
    assert reboot.returncode == 0, reboot.stderr
    changed = preflight(host)
    assert changed.stats[host]["failures"] == 0, changed.host_failures(host)
    assert changed.stats[host]["changed"] == 1  # the saved state, nothing else
    assert "driver 535.183.01 -> 550.127.05: re-verifying the stack" in changed.stdout
    facts = published_facts(changed, host)
    assert facts["gpu_preflight_driver_changed"] is True
    assert facts["gpu_preflight_changes"] == ["driver 535.183.01 -> 550.127.05: re-verifying the stack"]
    assert facts["gpu_preflight_previous_driver_version"] == "535.183.01"
    assert facts["gpu_preflight_driver_version"] == "550.127.05"
    assert saved_state(fleet.sandbox, host)["driver_version"] == "550.127.05"
    # The state file, replaced atomically (so its directory's mtime moves too), and nothing else.
    assert written_since_marker(fleet.sandbox, host) == [str(Path(STATE_FILE).parent), STATE_FILE]
    settled = preflight(host)
    assert settled.stats[host]["changed"] == 0
    assert published_facts(settled, host)["gpu_preflight_driver_changed"] is False
    assert "re-verifying the stack" not in settled.stdout


def test_preflight_works_for_an_ordinary_login_user_with_sudo(fleet, run_playbook):
    """Hosts as a real fleet has them: Ansible logs in as an ordinary user with password-less sudo (the sandbox's
    default login). node16 (a P40) and node4 (an R590 driver) start as fresh hosts: their saved state goes and a
    marker dates what the run writes."""
    sandbox, fit, refused = fleet.sandbox, "node16", "node4"
    assert (
        yaml.safe_load((sandbox.inventory_dir / "group_vars" / "p40_sandbox.yml").read_text())["ansible_user"] == "ops"
    )
    for host in (fit, refused):
        make_fresh(sandbox, host)
    first = run_playbook(fleet.playbook, sandbox.inventory_dir, limit=f"{fit},{refused}")
    assert (first.stats[fit]["failures"], first.stats[fit]["changed"]) == (0, 2), first.host_failures(fit)
    assert "required: branch <= R580" in first.host_failures(refused)[0].message
    # Only the saved state needs root: it is root's and readable by all; nothing else was written
    # (but the login user's own home and sudo's timestamps).
    assert sandbox.exec(fit, f"stat -c '%U %G %a' {STATE_FILE}").stdout.split() == ["root", "root", "644"]
    assert saved_state(sandbox, fit)["profile"]["name"] == "pascal"
    by_us = {
        host: [p for p in written_since_marker(sandbox, host) if not p.startswith(("/home/ops", "/var/lib/sudo"))]
        for host in (fit, refused)
    }
    assert by_us == {fit: ["/etc", "/etc/ansible", "/etc/ansible/facts.d", STATE_FILE], refused: []}
    again = run_playbook(fleet.playbook, sandbox.inventory_dir, limit=fit)
    assert (again.stats[fit]["failures"], again.stats[fit]["changed"]) == (0, 0)
    verify = run_playbook(fleet.playbook, sandbox.inventory_dir, limit=fit, tags="verify")
    assert (verify.stats[fit]["failures"], verify.stats[fit]["changed"]) == (0, 0)
