#!/usr/bin/python3
"""gpu_preflight's probe: read what the host has, change nothing, print one JSON document.

An Ansible module (one round trip with pipelining, where a script would also be copied over), with
options nvidia_smi ("nvidia-smi" or a path), paths (the directories whose free space counts) and state_file
(the saved state of the last run). It only reads and returns the report under `report`; every decision
(thresholds, profiles, messages) is made by the role's filter plugin from this data.

It runs on every host on every run, so it is a plain script: Ansible writes the task's arguments into
ARGUMENTS below (its JSON-arguments module style) and pipes the script to the host's Python. Built on Ansible's
module library, the same probe costs several times the host's CPU, as that library is unpacked and imported on
every call (docs/benchmarks-code.md). So it is one of the two named exceptions to the collection's AnsibleModule
rule (docs/extending-modules.md): its action (plugins/action/gpu_preflight_probe.py) checks the task's options against
the module's argument_spec on the controller, and this script checks again what it reads.
"""

import glob
import json
import mmap
import os
import re
import shutil
import subprocess
import sys

DOCUMENTATION = r"""
module: gpu_preflight_probe
short_description: Probe a GPU host read-only, judge the report by gpu_preflight's rules, refuse or publish.
description:
  - On the host, reads the GPUs (nvidia-smi and PCI), the kernel module, the OS, CPUs, memory, free space under
    O(paths) and the saved state of the last run; changes nothing.
  - On the controller, its action of the same name judges that report by the rules in
    plugins/plugin_utils/gpu_preflight.py against O(settings) and fails the task with every finding, or sets the
    GPU profile and the facts later stages read.
author: p40fleet
options:
  nvidia_smi:
    description: The nvidia-smi command, a name looked up in the system's directories or a path.
    type: str
    default: nvidia-smi
  paths:
    description: Directories whose free space the rules check.
    type: list
    elements: str
    default: []
  present_paths:
    description: Paths whose existence the rules check (installed markers).
    type: list
    elements: str
    default: []
  state_file:
    description: The saved state of the last run (a local fact file); required unless O(report) is given.
    type: str
  settings:
    description: The rules' settings (gpu_preflight's variables, as roles/gpu_preflight/vars/main.yml gathers them).
    type: dict
    required: true
  report:
    description: A report taken before, judged instead of probing (the rules' table tests); the role never passes it.
    type: dict
"""

EXAMPLES = r"""
- name: Ensure the host is probed, judged and its GPU profile published
  p40fleet.fleet.gpu_preflight_probe:
    nvidia_smi: nvidia-smi
    paths: [/opt, /home]
    state_file: /etc/ansible/facts.d/p40fleet_preflight.fact
    settings: "{{ gpu_preflight_settings }}"
"""

RETURN = r"""
report:
  description: What the probe read on the host.
  type: dict
  returned: always
verdict:
  description: The rules' verdict, {errors, warnings, facts}.
  type: dict
  returned: always
"""

# Ansible replaces the placeholder with the task's arguments as JSON (ASCII, quotes escaped: safe in this literal).
ARGUMENTS = r"""<<INCLUDE_ANSIBLE_MODULE_JSON_ARGS>>"""
# ecc.mode.current/pending: "Enabled", "Disabled", or "[N/A]" where a card has no ECC (GeForce); the reported
# memory.total already has ECC's share taken off (docs/facts-gpu.md).
QUERY_FIELDS = [
    "index",
    "name",
    "compute_cap",
    "memory.total",
    "driver_version",
    "pci.bus_id",
    "ecc.mode.current",
    "ecc.mode.pending",
]
INVALID_FIELD = re.compile(r'Field "([^"]+)" is not a valid field to query')
SYSTEM_BIN_DIRS = ["/usr/bin", "/usr/local/bin", "/usr/sbin", "/bin", "/usr/local/nvidia/bin"]
NVIDIA_PCI_VENDOR = "0x10de"
NVRM_LINE = re.compile(
    r"^NVRM version: NVIDIA UNIX (?P<open>Open )?(?:\S+ )?Kernel Module(?: for \S+)?\s+(?P<version>\d+(?:\.\d+)+)",
    re.MULTILINE,
)
# A hung driver can block nvidia-smi for minutes; preflight should say so, not hang.
NVIDIA_SMI_TIMEOUT = 60
# `modinfo nvidia`'s license field names the module's flavor (docs/facts-gpu.md): asked only where /proc does not say.
MODULE_LICENSES = {"NVIDIA": "proprietary", "Dual MIT/GPL": "open"}
MODINFO_PATHS = ["/usr/sbin/modinfo", "/sbin/modinfo", "/usr/bin/modinfo", "/bin/modinfo"]
# Where an NVIDIA module lands under /lib/modules/<kernel>/: DKMS builds (updates/dkms, Debian's nvidia-current
# too), NVIDIA's runfile (kernel/drivers/video), Ubuntu's prebuilt linux-modules-nvidia-* (kernel/nvidia-<branch>).
MODULE_GLOBS = (
    "updates/dkms/nvidia*.ko*",
    "updates/nvidia*.ko*",
    "extra/nvidia*.ko*",
    "misc/nvidia*.ko*",
    "kernel/drivers/video/nvidia*.ko*",
    "kernel/nvidia*/nvidia*.ko*",
)


def run(argv):
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT, check=False)
    except subprocess.TimeoutExpired:
        return 124, f"timed out after {NVIDIA_SMI_TIMEOUT} s"
    except OSError as error:
        return 126, str(error)
    return done.returncode, (done.stdout + done.stderr).strip()


def parse_os_release(text):
    values = {}
    for line in text.splitlines():
        key, sep, value = line.strip().partition("=")
        if sep:
            values[key] = value.strip().strip('"')
    return {
        "id": values.get("ID", "unknown"),
        "id_like": values.get("ID_LIKE", "").split(),
        "version_id": values.get("VERSION_ID", ""),
        "pretty_name": values.get("PRETTY_NAME", "unknown OS"),
    }


def os_release():
    try:
        with open("/etc/os-release", encoding="utf-8") as handle:
            return parse_os_release(handle.read())
    except OSError:
        return parse_os_release("")


def mem_total_mib():
    with open("/proc/meminfo", encoding="utf-8") as handle:
        for line in handle:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) // 1024
    return 0


def disk(path):
    checked = os.path.abspath(path)
    while not os.path.exists(checked):
        checked = os.path.dirname(checked)
    stat = os.statvfs(checked)
    return {
        "path": path,
        "checked_path": checked,
        "device": os.stat(checked).st_dev,
        "free_bytes": stat.f_bavail * stat.f_frsize,
    }


def apt_lists_offer(package):
    """Whether apt's package lists offer a package, read without writing apt's caches.

    `apt-cache policy` would rebuild /var/cache/apt/*.bin on a stale cache (a change to the host);
    scanning the plain lists is read-only and fast. Compressed lists fall back to apt-cache with
    its on-disk caches disabled.
    """
    needle = ("\nPackage: " + package + "\n").encode()
    lists = glob.glob("/var/lib/apt/lists/*_Packages*")
    compressed = False
    for path in lists:
        if not path.endswith("_Packages"):
            compressed = True
            continue
        try:
            with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
                if data[: len(needle) - 1] == needle[1:] or data.find(needle) >= 0:
                    return path
        except (OSError, ValueError):
            continue
    if compressed and shutil.which("apt-cache"):
        rc, out = run(["apt-cache", "-o", "Dir::Cache::pkgcache=", "-o", "Dir::Cache::srcpkgcache=", "policy", package])
        match = re.search(r"Candidate:\s*(\S+)", out) if rc == 0 else None
        if match and match.group(1) != "(none)":
            return "apt-cache candidate " + match.group(1)
    return ""


def gcc():
    installed = shutil.which("gcc-11") or ""
    default = ""
    if shutil.which("gcc"):
        rc, out = run(["gcc", "-dumpfullversion"])
        default = out if rc == 0 else ""
    return {
        "gcc11_path": installed,
        "gcc11_candidate": "" if installed else apt_lists_offer("gcc-11"),
        "default_version": default,
    }


def nvidia_pci_devices():
    """Count NVIDIA display/3D controllers, so 'no driver' and 'no GPU' read differently."""
    count = 0
    base = "/sys/bus/pci/devices"
    try:
        entries = os.listdir(base)
    except OSError:
        return 0
    for entry in entries:
        try:
            with open(os.path.join(base, entry, "vendor"), encoding="ascii") as vendor:
                if vendor.read().strip() != NVIDIA_PCI_VENDOR:
                    continue
            with open(os.path.join(base, entry, "class"), encoding="ascii") as klass:
                if klass.read().strip().startswith("0x03"):
                    count += 1
        except OSError:
            continue
    return count


def kernel_module(text):
    """The loaded module's version and flavor from /proc/driver/nvidia/version's NVRM line.

    Proprietary: "NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.183.01  ...";
    open: "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release Build ...".
    """
    match = NVRM_LINE.search(text)
    if not match:
        return {"version": "", "flavor": ""}
    return {"version": match.group("version"), "flavor": "open" if match.group("open") else "proprietary"}


def module_license(text):
    """The flavor `modinfo -F license nvidia` names ("NVIDIA": proprietary, "Dual MIT/GPL": open), or ""."""
    return MODULE_LICENSES.get(text.strip().splitlines()[0].strip() if text.strip() else "", "")


def read_kernel_module():
    try:
        with open("/proc/driver/nvidia/version", encoding="utf-8") as handle:
            text = handle.read()
    except OSError:
        text = ""
    found = dict(kernel_module(text), line=text.splitlines()[0].strip() if text.strip() else "", license="")
    found["source"] = "/proc/driver/nvidia/version" if found["flavor"] else ""
    # No loaded module to read: the installed one's license says which flavor the next load brings.
    modinfo = next((path for path in MODINFO_PATHS if os.access(path, os.X_OK)), "")
    if not found["flavor"] and modinfo:
        rc, out = run([modinfo, "-F", "license", "nvidia"])
        found["license"] = out.strip() if rc == 0 else ""
        found["flavor"] = module_license(found["license"])
        found["source"] = "modinfo nvidia" if found["flavor"] else ""
    return found


def kernel_modules(boot="/boot", modules="/lib/modules", dkms="/var/lib/dkms"):
    """Each installed kernel (a /boot/vmlinuz-<version>) and where an NVIDIA module is built for it: a module
    file in its module tree, or a DKMS build of an nvidia* module for it ("" where neither)."""
    found = []
    running = os.uname().release
    for image in sorted(glob.glob(os.path.join(boot, "vmlinuz-*"))):
        release = os.path.basename(image)[len("vmlinuz-") :]
        tree = os.path.join(modules, release)
        built = [path for pattern in MODULE_GLOBS for path in glob.glob(os.path.join(tree, pattern))]
        built += glob.glob(os.path.join(dkms, "nvidia*", "*", release))
        found.append({"release": release, "running": release == running, "nvidia_module": min(built, default="")})
    return found


def find_nvidia_smi(name):
    if os.sep in name:
        return name if os.access(name, os.X_OK) else ""
    path = os.environ.get("PATH", "") + os.pathsep + os.pathsep.join(SYSTEM_BIN_DIRS)
    return shutil.which(name, path=path) or ""


def query_gpus(smi):
    """Query the GPUs; on drivers that lack a field (compute_cap), ask again without it."""
    fields = list(QUERY_FIELDS)
    missing = []
    while True:
        rc, out = run([smi, "--query-gpu=" + ",".join(fields), "--format=csv,noheader,nounits"])
        invalid = INVALID_FIELD.search(out)
        if rc != 0 and invalid and invalid.group(1) in fields and invalid.group(1) not in ("index", "name"):
            missing.append(invalid.group(1))
            fields.remove(invalid.group(1))
            continue
        break
    result = {"path": smi, "rc": rc, "output": out, "missing_fields": missing, "gpus": []}
    if rc == 0:
        result["gpus"] = parse_gpus(fields, out)
    return result


def ecc_state(value):
    """on, off, or "" (no ECC on this card, or a driver that does not say) from an ecc.mode field."""
    return {"enabled": "on", "disabled": "off"}.get(value.strip().lower(), "")


def parse_gpus(fields, out):
    """One dict per GPU from `nvidia-smi --query-gpu=<fields> --format=csv,noheader,nounits`."""
    gpus = []
    for line in out.splitlines():
        if not line.strip():
            continue
        row = dict(zip(fields, (cell.strip() for cell in line.split(","))))
        memory = row.get("memory.total", "")
        gpus.append(
            {
                "index": int(row["index"]) if row.get("index", "").isdigit() else len(gpus),
                "name": row.get("name", ""),
                "compute_cap": row.get("compute_cap", ""),
                "memory_mib": int(memory) if memory.isdigit() else 0,
                "driver_version": row.get("driver_version", ""),
                "pci_bus_id": row.get("pci.bus_id", ""),
                "ecc": ecc_state(row.get("ecc.mode.current", "")),
                "ecc_pending": ecc_state(row.get("ecc.mode.pending", "")),
            }
        )
    return gpus


def saved_state(path):
    if not os.path.exists(path):
        return {"exists": False, "content": None, "error": ""}
    try:
        with open(path, encoding="utf-8") as handle:
            return {"exists": True, "content": json.load(handle), "error": ""}
    except (OSError, ValueError) as error:
        return {"exists": True, "content": None, "error": str(error)}


def probe(request):
    smi = find_nvidia_smi(request["nvidia_smi"])
    nvidia = query_gpus(smi) if smi else {"path": "", "rc": None, "output": "", "missing_fields": [], "gpus": []}
    module = read_kernel_module()
    report = {
        "os": os_release(),
        "cpu_count": len(os.sched_getaffinity(0)),
        "mem_total_mib": mem_total_mib(),
        "disks": [disk(path) for path in request["paths"]],
        "present": {path: os.path.lexists(path) for path in request.get("present_paths") or []},
        "gcc": gcc(),
        "nvidia_smi": nvidia,
        "nvidia_pci_devices": nvidia_pci_devices(),
        "kernel_module": module,
        "kernel_module_version": module["version"],
        "kernels": kernel_modules(),
        "state": saved_state(request["state_file"]),
    }
    return report


OPTION_NAMES = ("nvidia_smi", "paths", "present_paths", "state_file")


def options(arguments):
    """The task's options, checked as the module's documentation says; a bad option is a ValueError."""
    unknown = sorted(key for key in arguments if not key.startswith("_ansible_") and key not in OPTION_NAMES)
    if unknown:
        raise ValueError(f"unsupported option(s) {', '.join(unknown)}; supported: {', '.join(OPTION_NAMES)}")
    nvidia_smi = arguments.get("nvidia_smi", "nvidia-smi")
    state_file = arguments.get("state_file")
    lists = {key: arguments.get(key) or [] for key in ("paths", "present_paths")}
    if not isinstance(nvidia_smi, str) or not nvidia_smi:
        raise ValueError(f"nvidia_smi must be a command name or path, got {nvidia_smi!r}")
    if not isinstance(state_file, str) or not state_file:
        raise ValueError(f"state_file (a path) is required, got {state_file!r}")
    for key, value in lists.items():
        if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
            raise ValueError(f"{key} must be a list of paths, got {value!r}")
    expand = lambda path: os.path.expanduser(os.path.expandvars(path))  # noqa: E731 (as Ansible's path type)
    return {
        "nvidia_smi": nvidia_smi,
        "state_file": expand(state_file),
        **{key: [expand(path) for path in value] for key, value in lists.items()},
    }


def main():
    try:
        request = options(json.loads(ARGUMENTS))
    except ValueError as error:
        print(json.dumps({"failed": True, "msg": f"gpu_preflight_probe: {error}"}))
        sys.exit(1)
    print(json.dumps({"changed": False, "report": probe(request)}))


if __name__ == "__main__":
    main()
