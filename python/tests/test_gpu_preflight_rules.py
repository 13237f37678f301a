"""gpu_preflight's decisions without containers: recorded and synthetic probe answers, one verdict each.

The probe (plugins/modules/gpu_preflight_probe.py) is imported and fed real hosts' recorded answers; the role's
judgement (plugins/action/gpu_preflight_probe.py, the task that also probes) runs in a local ansible-playbook
against fake hosts whose probe report is given, with the role's defaults and vars as their group's variables,
so every GPU, driver, kernel module, OS and disk situation is paired with its exact verdict.
"""

from __future__ import annotations

import base64
import json
import re
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from p40fleet.run import run_playbook
from p40fleet_dev.paths import REPO_ROOT
from tests.pins import CUDA_HOME
from tests.pins import DEFAULTS as PINS
from tests.source_modules import load_module

ROLE = REPO_ROOT / "roles" / "gpu_preflight"
REAL_HOSTS = REPO_ROOT / "python" / "tests" / "fixtures" / "real-hosts"
H200_OPEN = REAL_HOSTS / "h200-r580-open.txt"
JUDGE_TASK = "Judge the report"
GIB = 1 << 30


PROBE = load_module(REPO_ROOT / "plugins" / "modules" / "gpu_preflight_probe.py", "gpu_preflight_probe")


def recorded(path: Path, command: str) -> str:
    """The verbatim output of one command in a real-hosts recording ("$ command" then its output)."""
    blocks = re.split(r"^\$ ", path.read_text(), flags=re.MULTILINE)
    for block in blocks[1:]:
        head, _, output = block.partition("\n")
        if head == command:
            return output
    raise AssertionError(f"{path.name} has no recorded answer to {command!r}")


H200_OS_RELEASE = recorded(H200_OPEN, "cat /etc/os-release")
H200_NVRM = recorded(H200_OPEN, "cat /proc/driver/nvidia/version")
H200_QUERY = recorded(
    H200_OPEN,
    "nvidia-smi --query-gpu=index,name,compute_cap,memory.total,driver_version,pci.bus_id "
    "--format=csv,noheader,nounits; echo rc=$?",
)
PROPRIETARY_NVRM = (
    "NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.183.01  Sun May 12 19:39:15 UTC 2024\n"
    "GCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\n"
)


# --- The probe's parsers, on recorded answers --------------------------------------------------------


def test_open_kernel_module_line_is_parsed_as_open_with_its_version():
    assert H200_NVRM.startswith("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159.04")
    assert PROBE.kernel_module(H200_NVRM) == {"version": "580.159.04", "flavor": "open"}


def test_proprietary_kernel_module_line_is_parsed_as_proprietary():
    assert PROBE.kernel_module(PROPRIETARY_NVRM) == {"version": "535.183.01", "flavor": "proprietary"}


def test_no_kernel_module_reads_as_nothing():
    assert PROBE.kernel_module("") == {"version": "", "flavor": ""}


# `modinfo -F license nvidia` of either flavor (docs/facts-gpu.md: "license: NVIDIA" and "Dual MIT/GPL").
MODINFO_PROPRIETARY = "NVIDIA\n"
MODINFO_OPEN = "Dual MIT/GPL\n"


def test_modinfo_licenses_name_the_flavor():
    assert PROBE.module_license(MODINFO_PROPRIETARY) == "proprietary"
    assert PROBE.module_license(MODINFO_OPEN) == "open"
    assert PROBE.module_license("") == "" and PROBE.module_license("GPL\n") == ""


def test_installed_kernels_and_their_nvidia_modules_are_read_from_the_trees(tmp_path):
    boot, modules, dkms = tmp_path / "boot", tmp_path / "modules", tmp_path / "dkms"
    for release in ("6.1.0-26-amd64", "6.1.0-28-amd64", "6.8.0-85-generic"):
        (boot / f"vmlinuz-{release}").parent.mkdir(parents=True, exist_ok=True)
        (boot / f"vmlinuz-{release}").write_text("")
        (modules / release / "kernel").mkdir(parents=True)
    # A DKMS install (Debian names it nvidia-current), a prebuilt Ubuntu module, and a kernel without either.
    (modules / "6.1.0-26-amd64" / "updates" / "dkms").mkdir(parents=True)
    (modules / "6.1.0-26-amd64" / "updates" / "dkms" / "nvidia-current.ko.xz").write_text("")
    (modules / "6.8.0-85-generic" / "kernel" / "nvidia-580").mkdir(parents=True)
    (modules / "6.8.0-85-generic" / "kernel" / "nvidia-580" / "nvidia.ko").write_text("")
    found = PROBE.kernel_modules(str(boot), str(modules), str(dkms))
    assert [(k["release"], bool(k["nvidia_module"])) for k in found] == [
        ("6.1.0-26-amd64", True),
        ("6.1.0-28-amd64", False),
        ("6.8.0-85-generic", True),
    ]
    # A DKMS build for the new kernel (built, not yet installed into its tree) counts.
    (dkms / "nvidia-current" / "580.95.05" / "6.1.0-28-amd64").mkdir(parents=True)
    assert all(k["nvidia_module"] for k in PROBE.kernel_modules(str(boot), str(modules), str(dkms)))


def test_recorded_os_release_and_gpu_query_are_read():
    os_release = PROBE.parse_os_release(H200_OS_RELEASE)
    assert (os_release["id"], os_release["version_id"], os_release["id_like"]) == ("ubuntu", "24.04", ["debian"])
    output = H200_QUERY.rsplit("rc=", 1)[0].strip()
    fields = ["index", "name", "compute_cap", "memory.total", "driver_version", "pci.bus_id"]
    gpus = PROBE.parse_gpus(fields, output)
    assert gpus == [
        {
            "index": 0,
            "name": "NVIDIA H200",
            "compute_cap": "9.0",
            "memory_mib": 143771,
            "driver_version": "580.159.04",
            "pci_bus_id": "00000000:00:06.0",
            "ecc": "",
            "ecc_pending": "",
        }
    ]


# --- Synthetic probe reports -------------------------------------------------------------------------

DEBIAN12 = 'PRETTY_NAME="Debian GNU/Linux 12 (bookworm)"\nID=debian\nVERSION_ID="12"\n'
P40 = {"name": "Tesla P40", "compute_cap": "6.1", "memory_mib": 24576}
T4 = {"name": "Tesla T4", "compute_cap": "7.5", "memory_mib": 15360}

# Filesystems of the fake hosts: mount point -> free GiB. Paths resolve to their longest mount prefix.
ONE_DISK = {"/": 500}
SMALL_ROOT_BIG_SCRATCH = {"/": 40, "/scratch": 500}
# Every path any case configures (the fake probe reports all of them; the role picks its own).
PATHS = [
    CUDA_HOME,
    "/usr/local/cudnn-8.9.7-cuda11",
    "/var/tmp/p40fleet",
    "/opt/miniconda3",
    "/scratch/tmp",
    "/scratch/miniconda3",
    "/scratch/downloads",
    "/home",
]


CUDA_MARKER = f"{CUDA_HOME}/version.json"
CUDNN_MARKER = "/usr/local/cudnn-8.9.7-cuda11/include/cudnn_version.h"
CONDA_MARKER = "/opt/miniconda3/.p40fleet-installer.sha256"
CHECKPOINT_MARKER = "/home/p40fleet/verl-runs/checkpoints"


def disks(filesystems: dict[str, float]) -> list[dict]:
    out = []
    for path in PATHS:
        mount = max((m for m in filesystems if path == m or path.startswith(m.rstrip("/") + "/")), key=len)
        out.append(
            {
                "path": path,
                "checked_path": mount,
                "device": sorted(filesystems).index(mount) + 2049,
                "free_bytes": int(filesystems[mount] * GIB),
            }
        )
    return out


def report(
    gpus=(P40,),
    driver="535.183.01",
    os_release=DEBIAN12,
    nvrm=PROPRIETARY_NVRM,
    filesystems=ONE_DISK,
    smi_rc=0,
    smi_output=None,
    pci_devices=None,
    present=None,
    modinfo=None,
):
    rows = [
        {**gpu, "index": index, "driver_version": driver, "pci_bus_id": f"00000000:0{index}:00.0"}
        for index, gpu in enumerate(gpus)
    ]
    return {
        "os": PROBE.parse_os_release(os_release),
        "cpu_count": 8,
        "mem_total_mib": 65536,
        "disks": disks(filesystems),
        "present": dict(present or {}),
        "gcc": {"gcc11_path": "/usr/bin/gcc-11", "gcc11_candidate": "", "default_version": "12.2.0"},
        "nvidia_smi": {
            "path": "/usr/bin/nvidia-smi",
            "rc": smi_rc,
            "output": smi_output if smi_output is not None else "(csv rows)",
            "missing_fields": [],
            "gpus": rows if smi_rc == 0 else [],
        },
        "nvidia_pci_devices": len(gpus) if pci_devices is None else pci_devices,
        "kernel_module_version": PROBE.kernel_module(nvrm)["version"],
        "kernel_module": module_found(nvrm, modinfo),
        "state": {"exists": False, "content": None, "error": ""},
    }


def module_found(nvrm: str, modinfo: str | None) -> dict:
    """The probe's kernel_module entry: the /proc line's reading, or (no module loaded) modinfo's license."""
    found = PROBE.kernel_module(nvrm)
    if found["flavor"] or modinfo is None:
        return found
    flavor = PROBE.module_license(modinfo)
    return {**found, "flavor": flavor, "license": modinfo.strip(), "source": "modinfo nvidia" if flavor else ""}


def h200_report():
    output = H200_QUERY.rsplit("rc=", 1)[0].strip()
    gpus = PROBE.parse_gpus(PROBE.QUERY_FIELDS, output)
    found = report(os_release=H200_OS_RELEASE, nvrm=H200_NVRM)
    found["nvidia_smi"].update(output=output, gpus=gpus)
    found["nvidia_pci_devices"] = 1
    found["gcc"] = {"gcc11_path": "", "gcc11_candidate": "", "default_version": "13.3.0"}
    return found


def os_release(pretty: str, os_id: str, version: str, like: str = "debian") -> str:
    return f'PRETTY_NAME="{pretty}"\nID={os_id}\nID_LIKE={like}\nVERSION_ID="{version}"\n'


SCRATCH_PATHS = {
    "cuda_toolkit_tmpdir": "/scratch/tmp",
    "cuda_toolkit_download_dir": "/scratch/downloads",
    "cudnn_download_dir": "/scratch/downloads",
    "conda_env_download_dir": "/scratch/downloads",
    "p40fleet_conda_prefix": "/scratch/miniconda3",
}

# host -> (probe report, host_vars, verdict). A verdict is ("accepted", profile name) or
# ("refused", [exact fragments of the one finding]).
CASES: dict[str, tuple[dict, dict, tuple]] = {
    # Bug: the recorded H200 on the open module and Ubuntu 24.04 is a valid modern host.
    "h200_recorded": (h200_report(), {}, ("accepted", "modern")),
    "p40_proprietary": (report(), {}, ("accepted", "pascal")),
    "t4_open_module": (
        report(gpus=(T4,), nvrm=H200_NVRM.replace("580.159.04", "535.183.01")),
        {},
        ("accepted", "turing"),
    ),
    # A Pascal GPU cannot run the open module (docs/facts-gpu.md): refused, naming the module line.
    "p40_open_module": (
        report(nvrm=H200_NVRM.replace("580.159.04", "535.183.01")),
        {},
        (
            "refused",
            [
                "found NVIDIA's open kernel module 535.183.01 (/proc/driver/nvidia/version names the \"Open Kernel "
                'Module") with Tesla P40 (compute capability 6.1); required: the proprietary NVIDIA kernel module, '
                "as the open one supports Turing (compute capability 7.5) and newer only;",
                "do: install the proprietary kernel module of the same driver branch, nvidia-kernel-dkms in place "
                "of nvidia-kernel-open-dkms (apt-get install nvidia-kernel-dkms), reboot, re-run",
            ],
        ),
    ),
    # On Ubuntu the fix names Ubuntu's proprietary package of the same branch.
    "p40_open_module_ubuntu": (
        report(
            os_release=os_release("Ubuntu 24.04.3 LTS", "ubuntu", "24.04"),
            nvrm=H200_NVRM.replace("580.159.04", "580.95.05"),
            driver="580.95.05",
        ),
        {},
        (
            "refused",
            [
                "do: install the proprietary kernel module of the same driver branch, nvidia-driver-580 (or "
                "nvidia-driver-580-server) in place of its -open variant (apt-get install nvidia-driver-580), reboot",
            ],
        ),
    ),
    # No /proc line to read (a container, a restricted /proc): modinfo's license says which module it is.
    "p40_open_module_by_modinfo": (
        report(nvrm="", modinfo=MODINFO_OPEN),
        {},
        (
            "refused",
            [
                'found NVIDIA\'s open kernel module (modinfo nvidia names its license "Dual MIT/GPL") with Tesla '
                "P40 (compute capability 6.1); required: the proprietary NVIDIA kernel module",
                "apt-get install nvidia-kernel-dkms",
            ],
        ),
    ),
    "p40_proprietary_by_modinfo": (report(nvrm="", modinfo=MODINFO_PROPRIETARY), {}, ("accepted", "pascal")),
    # The module is not loaded and the installed one is open: loading it would not help a Pascal GPU.
    "pascal_open_module_not_loaded": (
        report(
            gpus=(),
            nvrm="",
            modinfo=MODINFO_OPEN,
            smi_rc=9,
            smi_output="NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. Make sure "
            "that the latest NVIDIA driver is installed and running.",
            pci_devices=1,
        ),
        {},
        (
            "refused",
            [
                "the NVIDIA kernel module is not loaded;",
                'the installed module is NVIDIA\'s open one (modinfo nvidia names its license "Dual MIT/GPL"), '
                "which drives Turing and newer only; for an older GPU install the proprietary kernel module",
            ],
        ),
    ),
    # What a Pascal host on the open module really shows: the open module does not bind the GPU.
    "pascal_unbound_by_open_module": (
        report(gpus=(), nvrm=H200_NVRM, smi_output="No devices were found", pci_devices=1),
        {},
        (
            "refused",
            [
                "nvidia-smi finds no GPU while 1 NVIDIA display device(s) sit on the PCI bus and NVIDIA's open "
                "kernel module 580.159.04 is loaded; required: the proprietary NVIDIA kernel module for GPUs "
                "older than Turing (a P40 is Pascal);",
            ],
        ),
    ),
    # OS matrix: Debian 11, 12 and Ubuntu 20.04, 22.04, 24.04 pass; others get a clear refusal.
    "debian11": (
        report(os_release=os_release("Debian GNU/Linux 11 (bullseye)", "debian", "11", "")),
        {},
        ("accepted", "pascal"),
    ),
    "ubuntu2004": (report(os_release=os_release("Ubuntu 20.04.6 LTS", "ubuntu", "20.04")), {}, ("accepted", "pascal")),
    "ubuntu2204": (report(os_release=os_release("Ubuntu 22.04.4 LTS", "ubuntu", "22.04")), {}, ("accepted", "pascal")),
    "ubuntu2404": (report(os_release=os_release("Ubuntu 24.04.1 LTS", "ubuntu", "24.04")), {}, ("accepted", "pascal")),
    "ubuntu1804": (
        report(os_release=os_release("Ubuntu 18.04.6 LTS", "ubuntu", "18.04")),
        {},
        (
            "refused",
            [
                "found Ubuntu 18.04.6 LTS (ID=ubuntu, VERSION_ID=18.04), a release p40fleet has not been tested "
                "on; tested: debian 11, 12; ubuntu 20.04, 22.04, 24.04;",
                "or set gpu_preflight_strict: false to proceed with a warning",
            ],
        ),
    ),
    "rocky9": (
        report(os_release=os_release("Rocky Linux 9.4 (Blue Onyx)", "rocky", "9.4", '"rhel centos fedora"')),
        {},
        (
            "refused",
            [
                "found Rocky Linux 9.4 (Blue Onyx) (ID=rocky, VERSION_ID=9.4), which is not supported; required: "
                "Debian or Ubuntu (the later stages install with apt);",
            ],
        ),
    ),
    # Disks: the configured paths, summed per filesystem.
    "small_root_defaults": (
        report(filesystems=SMALL_ROOT_BIG_SCRATCH),
        {},
        (
            "refused",
            [
                f"too little disk: {CUDA_HOME} (CUDA 11.8 toolkit, p40fleet_cuda_home, 7 GiB) + "
                "/var/tmp/p40fleet (CUDA runfile extraction, cuda_toolkit_tmpdir, 10 GiB) + ",
                "/opt/miniconda3 (Miniconda and the verl env, p40fleet_conda_prefix, 20 GiB)",
                "/home (PPO checkpoints, 2 kept of about 12 GiB, p40fleet_work_dir, 24 GiB)",
                " on the filesystem of /: 40.0 GiB free; required: 71 GiB free there;",
            ],
        ),
    ),
    # A converged host: the space its stages use is in use already, not needed again.
    "converged_host_on_a_full_disk": (
        report(
            filesystems={"/": 2},
            present={CUDA_MARKER: True, CUDNN_MARKER: True, CONDA_MARKER: True, CHECKPOINT_MARKER: True},
        ),
        {},
        ("accepted", "pascal"),
    ),
    # Provisioned but never trained: its checkpoints still need their space.
    "converged_host_without_room_for_checkpoints": (
        report(filesystems={"/": 20}, present={CUDA_MARKER: True, CUDNN_MARKER: True, CONDA_MARKER: True}),
        {},
        (
            "refused",
            [
                "too little disk: /home (PPO checkpoints, 2 kept of about 12 GiB, p40fleet_work_dir, 24 GiB) "
                "on the filesystem of /: 20.0 GiB free; required: 24 GiB free there;",
            ],
        ),
    ),
    # Only the toolkit is there: cuDNN and the env still need their space.
    "toolkit_installed_rest_needs_space": (
        report(filesystems={"/": 20}, present={CUDA_MARKER: True}),
        {},
        (
            "refused",
            [
                "too little disk: /usr/local/cudnn-8.9.7-cuda11 (cuDNN 8.9.7, cudnn_prefix, 3 GiB) + /var/tmp/p40fleet "
                "(cuDNN tarball download, cudnn_download_dir, 1 GiB) + /opt/miniconda3 (Miniconda and the verl env, "
                "p40fleet_conda_prefix, 20 GiB) + /var/tmp/p40fleet (Miniconda installer download, "
                "conda_env_download_dir, 1 GiB) + /home (PPO checkpoints, 2 kept of about 12 GiB, "
                "p40fleet_work_dir, 24 GiB) on the filesystem of /: 20.0 GiB free; required: 49 GiB free there;",
            ],
        ),
    ),
    # A host that moves its temp dir, downloads and conda prefix to a big disk passes.
    "small_root_scratch_paths": (report(filesystems=SMALL_ROOT_BIG_SCRATCH), SCRATCH_PATHS, ("accepted", "pascal")),
    "scratch_too_small_for_the_sum": (
        report(filesystems={"/": 40, "/scratch": 30}),
        SCRATCH_PATHS,
        (
            "refused",
            [
                "too little disk: /scratch/tmp (CUDA runfile extraction, cuda_toolkit_tmpdir, 10 GiB) + "
                "/scratch/downloads (CUDA runfile download, cuda_toolkit_download_dir, 5 GiB) + ",
                " on the filesystem of /scratch: 30.0 GiB free; required: 37 GiB free there;",
            ],
        ),
    ),
    # Soft finding with strict off (a real bool): warned, accepted.
    "ubuntu1804_not_strict": (
        report(os_release=os_release("Ubuntu 18.04.6 LTS", "ubuntu", "18.04")),
        {"gpu_preflight_strict": False},
        ("accepted", "pascal"),
    ),
    # Strict off as a string, as `-e gpu_preflight_strict=false` or a quoted YAML value gives it.
    "ubuntu1804_not_strict_string": (
        report(os_release=os_release("Ubuntu 18.04.6 LTS", "ubuntu", "18.04")),
        {"gpu_preflight_strict": "false"},
        ("accepted", "pascal"),
    ),
}


def run_assess(tmp_path: Path, cases: dict, cmdline: tuple[str, ...] = ()) -> dict:
    """Judge each case's report with the role's action on fake local hosts; return {host: [(task, result)]}."""
    hosts = {}
    for host, (found, host_vars, _) in cases.items():
        hosts[host] = {
            "ansible_connection": "local",
            "ansible_python_interpreter": sys.executable,
            "recorded_report": found,
            **host_vars,
        }
    # The role's defaults and vars as the group's variables: below the cases' host variables, as role defaults are.
    role_vars = {**PINS, **ROLE_DEFAULTS, **ROLE_VARS}
    inventory = tmp_path / "hosts.yml"
    inventory.write_text(yaml.safe_dump({"all": {"children": {"p40-hosts": {"hosts": hosts, "vars": role_vars}}}}))
    playbook = tmp_path / "assess.yml"
    playbook.write_text(
        textwrap.dedent(
            f"""\
            ---
            - name: Judge fake hosts' probe reports
              hosts: p40-hosts
              gather_facts: false
              tasks:
                - name: {JUDGE_TASK}
                  p40fleet.fleet.gpu_preflight_probe:
                    report: "{{{{ recorded_report }}}}"
                    settings: "{{{{ gpu_preflight_settings }}}}"
            """
        )
    )
    envvars = {
        "ANSIBLE_CACHE_PLUGIN": "memory",  # nothing of these fake hosts may reach a fact cache
    }
    result = run_playbook(playbook, inventory, cmdline=cmdline, envvars=envvars)
    results: dict[str, list] = {host: [] for host in cases}
    for event in result.events:
        data = event.get("event_data", {})
        if event.get("event") in ("runner_on_ok", "runner_on_failed") and data.get("host") in results:
            results[data["host"]].append(
                (data["task"], {**data["res"], "failed": event["event"] == "runner_on_failed"})
            )
    assert all(results.values()), result.stdout[-3000:]
    return results


def verdict(results: list) -> tuple:
    for name, result in results:
        if result["failed"]:
            return ("refused", result.get("msg", ""))
        if name == JUDGE_TASK:
            return ("accepted", result["ansible_facts"]["gpu_preflight_profile"]["name"])
    raise AssertionError(f"neither refused nor published: {results}")


@pytest.fixture(scope="module")
def judged(tmp_path_factory):
    return run_assess(tmp_path_factory.mktemp("assess"), CASES)


@pytest.mark.parametrize("host", sorted(CASES))
def test_each_situation_gets_its_verdict(judged, host):
    kind, expected = CASES[host][2]
    got_kind, got = verdict(judged[host])
    if kind == "accepted":
        assert (got_kind, got) == ("accepted", expected), got
        return
    assert got_kind == "refused", got
    assert got.startswith(f"gpu_preflight refused {host} (nothing was changed on it):\n- "), got
    assert got.count("\n- ") == 1, got  # exactly one finding
    for fragment in expected:
        assert fragment in got, got


def test_a_soft_finding_turned_off_by_a_string_false_is_warned_about(judged):
    (name, result), *_ = judged["ubuntu1804_not_strict_string"]
    assert name == JUDGE_TASK and not result["failed"], result
    assert any(w.startswith("found Ubuntu 18.04.6 LTS") for w in result["verdict"]["warnings"]), result["verdict"]


def test_strict_false_from_the_command_line_turns_soft_findings_into_warnings(tmp_path):
    cases = {host: CASES[host] for host in ("ubuntu1804", "small_root_defaults", "p40_open_module")}
    results = run_assess(tmp_path, cases, cmdline=("-e", "gpu_preflight_strict=false"))
    assert verdict(results["ubuntu1804"]) == ("accepted", "pascal")
    assert verdict(results["small_root_defaults"]) == ("accepted", "pascal")
    # A hard finding stays hard whatever strictness says.
    assert verdict(results["p40_open_module"])[0] == "refused"


def test_disk_checks_follow_the_other_roles_defaults():
    """The fallbacks preflight uses when the inventory sets nothing are the roles' own defaults."""
    defaults = {}
    for role in ("cuda_toolkit", "cudnn", "conda_env", "launch_script"):
        defaults.update(yaml.safe_load((REPO_ROOT / "roles" / role / "defaults" / "main.yml").read_text()))
    checks = yaml.safe_load((ROLE / "defaults" / "main.yml").read_text())["gpu_preflight_disk_checks"]
    # A shared setting (p40fleet_conda_prefix, p40fleet_work_dir) is read by its one name, not a role's copy.
    shared = [FLEET_FACT.fullmatch(check["path"]) for check in checks]
    fallbacks = [FALLBACK.fullmatch(check["path"]) for check in checks]
    assert all(a or b for a, b in zip(shared, fallbacks, strict=True)), [check["path"] for check in checks]
    for match in filter(None, fallbacks):
        role_default = PINS[match[1]] if match[1] in PINS else fleet_value(defaults[match[1]])
        assert role_default == ("" if match[4] else fallback(match)), match[0]
    assert {m[1] for m in filter(None, shared + fallbacks)} >= {
        "p40fleet_cuda_home",
        "cuda_toolkit_tmpdir",
        "cuda_toolkit_download_dir",
        "p40fleet_conda_prefix",
        "cudnn_download_dir",
        "conda_env_download_dir",
        "p40fleet_work_dir",
    }


# --- The rules themselves, called directly (plugins/plugin_utils/gpu_preflight.py) ----------------------


ASSESS = load_module(
    REPO_ROOT / "plugins" / "plugin_utils" / "gpu_preflight.py", "gpu_preflight_filter"
).gpu_preflight_assess
ROLE_DEFAULTS = yaml.safe_load((ROLE / "defaults" / "main.yml").read_text())
ROLE_VARS = yaml.safe_load((ROLE / "vars" / "main.yml").read_text())
# `{{ var | default('literal') }}` or `{{ var | default(p40fleet_fact) }}` (roles/p40fleet_defaults).
# `, true`: the role's default is empty ("derive it"), and preflight checks the literal where it is.
FALLBACK = re.compile(r"\{\{ (\w+) \| default\(('([^']+)'|p40fleet_\w+)(, true)?\) \}\}")
FLEET_FACT = re.compile(r"\{\{ (p40fleet_\w+) \}\}")
# The checkpoints' marker: the work dir, else the env owner's home (`'/home/' ~ p40fleet_env_owner ~ '/verl-runs'`).
OWNER_FALLBACK = re.compile(r"\{\{ (p40fleet_\w+) \| default\('([^']*)' ~ (p40fleet_\w+) ~ '([^']*)', true\) \}\}")


def fallback(match: re.Match) -> str:
    """The value a FALLBACK match falls back to."""
    return match[3] if match[3] is not None else PINS[match[2]]


def fleet_value(value):
    """A role default that only names a p40fleet_ fact, as that fact's value."""
    found = FLEET_FACT.fullmatch(value) if isinstance(value, str) else None
    return PINS[found[1]] if found else value


def as_bool(value) -> bool:
    """Ansible's | bool for the values -e and YAML give."""
    return value if isinstance(value, bool) else str(value).strip().lower() in ("true", "yes", "on", "1", "y", "t")


def settings(host: str, host_vars: dict) -> dict:
    """The settings the role passes to the rules (vars/main.yml, gpu_preflight_settings): role defaults, host_vars
    on top, paths rendered."""
    values = {**ROLE_DEFAULTS, **ROLE_VARS, **host_vars}

    def shared(name: str) -> str:
        return str(host_vars.get(name, PINS[name]))

    def render(path: str) -> str:
        path = FALLBACK.sub(lambda match: str(host_vars.get(match[1], fallback(match))), path)
        path = FLEET_FACT.sub(lambda match: shared(match[1]), path)
        return OWNER_FALLBACK.sub(lambda m: host_vars.get(m[1]) or m[2] + shared(m[3]) + m[4], path)

    return {
        "host": host,
        "strict": as_bool(values["gpu_preflight_strict"]),
        "gpu_select": values["gpu_preflight_gpu_select"],
        "no_gpu_compute_cap": values["gpu_preflight_no_gpu_compute_cap"],
        "compute_cap_by_name": values["gpu_preflight_compute_cap_by_name"],
        "ecc_inband": values["gpu_preflight_ecc_inband"],
        "profiles": values["gpu_preflight_profiles"],
        "driver_min_version": values["gpu_preflight_driver_min_version"],
        "driver_min_reason": values["gpu_preflight_driver_min_reason"],
        "open_module_min_compute_cap": values["gpu_preflight_open_module_min_compute_cap"],
        "supported_os": values["gpu_preflight_supported_os"],
        "min_cpus": values["gpu_preflight_min_cpus"],
        "min_ram_gib": values["gpu_preflight_min_ram_gib"],
        "disk_checks": [
            {**c, "path": render(c["path"]), "installed_marker": render(c["installed_marker"])}
            for c in values["gpu_preflight_disk_checks"]
        ],
        "state_file": render(values["gpu_preflight_state_file"]),
    }


def direct_verdict(host: str, found: dict, host_vars: dict) -> tuple:
    result = ASSESS(found, settings(host, host_vars))
    if result["errors"]:
        return (
            "refused",
            "gpu_preflight refused " + host + " (nothing was changed on it):\n- " + "\n- ".join(result["errors"]),
        )
    return ("accepted", result["facts"]["gpu_preflight_profile"]["name"])


def sandbox_report(profile_name: str) -> dict:
    """What the probe reads on a sandbox host of this GPU profile (the nvidia-smi stand-in's answers)."""
    profiles = yaml.safe_load((REPO_ROOT / "python/tests/fixtures/standins/host/gpu_profiles.yml").read_text())
    spec = profiles[profile_name]
    found = report(gpus=[dict(g) for g in spec["gpus"]], driver=spec["driver_version"] or "")
    smi = found["nvidia_smi"]
    for gpu in smi["gpus"]:
        if "compute_cap" in spec.get("missing_fields", []):
            gpu["compute_cap"] = ""
        # As the probe reads the stand-in's ecc.mode.current and ecc.mode.pending.
        raw = gpu.get("ecc", "[N/A]")
        gpu["ecc"], gpu["ecc_pending"] = PROBE.ecc_state(raw), PROBE.ecc_state(gpu.pop("ecc_pending", raw))
    if spec["driver_version"] is None:
        found.update(nvidia_pci_devices=0, kernel_module_version="", kernel_module={"version": "", "flavor": ""})
        smi.update(path="", rc=None, output="", gpus=[])
    elif spec.get("nvml_mismatch"):
        branch = spec["driver_version"].rsplit(".", 1)[0]
        output = f"Failed to initialize NVML: Driver/library version mismatch\nNVML library version: {branch}"
        smi.update(rc=18, output=output, gpus=[])
    return found


# Every sandbox GPU profile, as the fixtures describe it, with its verdict.
SANDBOX_PROFILES = {
    "p40": ("accepted", "pascal"),
    "p40-r580": ("accepted", "pascal"),
    "p40-old-smi": ("accepted", "pascal"),
    "p40-upgraded": ("accepted", "pascal"),
    "p40-upgraded-unloaded": (
        "refused",
        [
            'nvidia-smi answers "Failed to initialize NVML: Driver/library version '
            'mismatch / NVML library version: 550.127" (loaded kernel module 535.183.01): the NVIDIA driver '
            "package was upgraded but the old kernel module is still loaded;"
        ],
    ),
    "p40-driver-too-old": (
        "refused",
        [
            "found NVIDIA driver 470.256.02; required: >= 520.61.05 for CUDA 11.8 and "
            "<= R580 for Tesla P40; do: upgrade the driver to a release of branch 520 to "
            "580 (e.g. 535 or 550), reboot, re-run"
        ],
    ),
    "p40-driver-r590": (
        "refused",
        [
            "found NVIDIA driver 590.44.01 (branch R590) with Tesla P40 (pascal, compute "
            "capability 6.1); required: branch <= R580, the last branch that supports this "
            "GPU; do: install a driver of branch 520 to 580 (e.g. 535 or 550) and hold the "
            "package so upgrades keep that branch, reboot, re-run"
        ],
    ),
    "p40x2": ("accepted", "pascal"),
    "p40-ecc-off": ("accepted", "pascal"),
    "p40x3": ("accepted", "pascal"),
    "p4": ("accepted", "pascal"),
    "p100": ("accepted", "pascal"),
    "gtx1080ti": ("accepted", "pascal"),
    "v100": ("accepted", "volta"),
    "t4": ("accepted", "turing"),
    "a100": ("accepted", "modern"),
    "mixed-p40-v100": (
        "refused",
        [
            "found 2 GPU models (0: Tesla P40, 1: Tesla V100-SXM2-32GB); required: one GPU "
            "model per host, as one profile drives dtype, attention and batch sizes; do: set "
            'gpu_preflight_gpu_select for host to one of "Tesla P40", "Tesla V100-SXM2-32GB" '
            "(the other GPUs are then hidden with CUDA_VISIBLE_DEVICES)"
        ],
    ),
    "nogpu": (
        "refused",
        [
            "found no NVIDIA GPU (no nvidia-smi, 0 NVIDIA display device(s) on the PCI bus): nothing "
            "to provision; required: an NVIDIA GPU with a driver >= 520.61.05; do: remove the host "
            'from p40-hosts, or set gpu_preflight_no_gpu_compute_cap (e.g. "6.1") to provision it as '
            "a CPU-only build host"
        ],
    ),
}

# Refusals that need settings rather than a GPU setup, called directly.
SETTINGS_CASES = {
    "gpu_select_unknown": (
        "mixed-p40-v100",
        {"gpu_preflight_gpu_select": "Tesla K80"},
        [
            'gpu_preflight_gpu_select is "Tesla K80" but the host has 0: Tesla P40, 1: Tesla V100-SXM2-32GB; required: '
            'the exact name of one of its GPUs; do: set gpu_preflight_gpu_select to one of "Tesla P40", '
            '"Tesla V100-SXM2-32GB"'
        ],
    ),
    "no_gpu_bad_cap": (
        "nogpu",
        {"gpu_preflight_no_gpu_compute_cap": "sm61"},
        ['gpu_preflight_no_gpu_compute_cap is "sm61"; required: a compute capability such as "6.1"; do: correct it'],
    ),
    "old_smi_unknown_name": (
        "p40-old-smi",
        {"gpu_preflight_compute_cap_by_name": {}},
        [
            'nvidia-smi of driver 520.61.05 has no compute_cap field and "Tesla P40" is not in '
            "gpu_preflight_compute_cap_by_name; required: the GPU's compute capability;"
        ],
    ),
    "no_profile": (
        "t4",
        {"gpu_preflight_profiles": [p for p in ROLE_DEFAULTS["gpu_preflight_profiles"] if p["name"] == "pascal"]},
        [
            "found Tesla T4 with compute capability 7.5, which no GPU profile covers; required: compute capability "
            "within a profile of gpu_preflight_profiles (pascal 6.0-6.2); do: add a tested profile for it to "
            "gpu_preflight_profiles, or remove the host from p40-hosts"
        ],
    ),
    "few_cpus": (
        "p40",
        {"gpu_preflight_min_cpus": 64},
        [
            "found 8 CPU(s); required: >= 64 (gpu_preflight_min_cpus); do: add CPUs, or set gpu_preflight_strict: "
            "false to proceed with a warning"
        ],
    ),
    "little_ram": (
        "p40",
        {"gpu_preflight_min_ram_gib": 128},
        [
            "found 64.0 GiB RAM; required: >= 128 GiB (gpu_preflight_min_ram_gib); do: add RAM, or set "
            "gpu_preflight_strict: false to proceed with a warning"
        ],
    ),
}


@pytest.mark.parametrize("profile", sorted(SANDBOX_PROFILES))
def test_every_sandbox_gpu_profile_gets_its_verdict(profile):
    all_profiles = yaml.safe_load((REPO_ROOT / "python/tests/fixtures/standins/host/gpu_profiles.yml").read_text())
    assert set(SANDBOX_PROFILES) == set(all_profiles)
    kind, expected = SANDBOX_PROFILES[profile]
    got_kind, got = direct_verdict("host", sandbox_report(profile), {})
    assert got_kind == kind, got
    if kind == "accepted":
        assert got == expected
    else:
        assert got.count("\n- ") == 1, got
        for fragment in expected:
            assert fragment in got, got


@pytest.mark.parametrize("case", sorted(SETTINGS_CASES))
def test_each_settings_refusal_gets_its_message(case):
    profile, host_vars, fragments = SETTINGS_CASES[case]
    got_kind, got = direct_verdict("host", sandbox_report(profile), host_vars)
    assert got_kind == "refused" and got.count("\n- ") == 1, got
    for fragment in fragments:
        assert fragment in got, got


@pytest.mark.parametrize("host", sorted(CASES))
def test_the_rules_called_directly_give_the_same_verdicts(host):
    found, host_vars, (kind, expected) = CASES[host]
    got_kind, got = direct_verdict(host, found, host_vars)
    assert got_kind == kind, got
    if kind == "accepted":
        assert got == expected
    else:
        for fragment in expected:
            assert fragment in got, got


def test_soft_findings_become_warnings_without_the_strict_hint():
    result = ASSESS(
        sandbox_report("p40"), settings("host", {"gpu_preflight_min_cpus": 64, "gpu_preflight_strict": "no"})
    )
    assert result["errors"] == []
    assert result["warnings"] == ["found 8 CPU(s); required: >= 64 (gpu_preflight_min_cpus); do: add CPUs"]


def test_a_driver_change_since_the_saved_state_is_reported():
    found = sandbox_report("p40")
    first = ASSESS(found, settings("host", {}))["facts"]
    assert first["gpu_preflight_state_changed"] is True
    found["state"] = {"exists": True, "error": "", "content": first["gpu_preflight_state_content"]}
    again = ASSESS(found, settings("host", {}))["facts"]
    assert (again["gpu_preflight_changes"], again["gpu_preflight_state_changed"]) == ([], False)
    upgraded = sandbox_report("p40")
    for gpu in upgraded["nvidia_smi"]["gpus"]:
        gpu["driver_version"] = "550.127.05"
    upgraded["state"] = found["state"]
    facts = ASSESS(upgraded, settings("host", {}))["facts"]
    assert facts["gpu_preflight_changes"] == ["driver 535.183.01 -> 550.127.05: re-verifying the stack"]
    assert facts["gpu_preflight_state_changed"] is True
    assert (facts["gpu_preflight_driver_changed"], facts["gpu_preflight_previous_driver_version"]) == (
        True,
        "535.183.01",
    )


def test_an_installed_kernel_without_an_nvidia_module_is_named_in_a_warning():
    found = sandbox_report("p40")
    found["kernels"] = [
        {"release": "6.1.0-26-amd64", "running": True, "nvidia_module": "/lib/modules/6.1.0-26-amd64/updates/dkms/x"},
        {"release": "6.1.0-28-amd64", "running": False, "nvidia_module": ""},
    ]
    result = ASSESS(found, settings("host", {}))
    assert result["errors"] == []
    kernel = [w for w in result["warnings"] if "kernel 6.1" in w]
    assert kernel == [
        "installed kernel 6.1.0-28-amd64 has no NVIDIA kernel module built for it (no nvidia*.ko under "
        "/lib/modules/6.1.0-28-amd64, no DKMS build): the next boot into it would come up without a GPU; do: install "
        "linux-headers-6.1.0-28-amd64 and run `dkms autoinstall -k 6.1.0-28-amd64` (on Ubuntu the prebuilt "
        "linux-modules-nvidia-<branch>-6.1.0-28-amd64 also does), or remove that kernel"
    ]
    # A host without any NVIDIA driver (a CPU-only build host) needs no module for its kernels.
    cpu_only = sandbox_report("nogpu")
    cpu_only["kernels"] = found["kernels"][1:]
    result = ASSESS(cpu_only, settings("host", {"gpu_preflight_no_gpu_compute_cap": "6.1"}))
    assert result["errors"] == [] and not [w for w in result["warnings"] if "kernel" in w]


SAVED_FACTS = load_module(REPO_ROOT / "plugins" / "filter" / "gpu_preflight.py", "gpu_preflight_filter")
SAVED_PROFILE = {"name": "p40", "driver_max_branch": 580, "gpu_count": 1}


def b64json(value) -> str:
    return base64.b64encode(json.dumps(value).encode()).decode()


@pytest.mark.parametrize(
    ("saved", "facts"),
    [
        # What record.yml writes: the facts a run that found the host unchanged publishes.
        (
            b64json({"schema": 1, "driver_version": "580.95.05", "has_gpu": True, "profile": SAVED_PROFILE}),
            {
                "gpu_preflight_profile": SAVED_PROFILE,
                "gpu_preflight_has_gpu": True,
                "gpu_preflight_driver_version": "580.95.05",
            },
        ),
        # No saved state (a host preflight never passed), or not one preflight wrote: nothing is published.
        ("", {}),
        (None, {}),
        ("not base64!", {}),
        (base64.b64encode(b"{torn").decode(), {}),
        (b64json([1, 2]), {}),
        (b64json({"driver_version": "580.95.05", "has_gpu": "yes", "profile": SAVED_PROFILE}), {}),
        (b64json({"driver_version": "580.95.05", "has_gpu": True, "profile": "p40"}), {}),
        (b64json({"has_gpu": False, "profile": {}}), {}),
    ],
)
def test_the_saved_state_publishes_the_facts_a_refresh_templates_inputs_with(saved, facts):
    assert SAVED_FACTS.gpu_preflight_saved_facts(saved) == facts
