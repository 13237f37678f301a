"""gpu_preflight's decisions: the probe's report and the role's settings in, one verdict out.

`gpu_preflight_assess(found, settings)` returns the findings (errors, warnings) and, for a host that passes, the
GPU profile and the facts the role publishes. plugins/action/gpu_preflight_probe.py calls it on the probe's
report, in the same task that probes the host; plugins/filter/gpu_preflight.py offers it as a filter. Both import
it as ansible_collections.p40fleet.fleet.plugins.plugin_utils.gpu_preflight. Standard library only.
`gpu_preflight_saved_facts(saved_b64)` reads the saved state back (slurp's base64; '' where there is none) into the
facts the later stages' inputs derive from, for a play that reads state without probing (playbooks/state.yml): the
same values a run that found the host unchanged publishes, so a refresh compares the same inputs.
Every message names what was found, what is required and what to do.
"""

import base64
import binascii
import json
import re

STRICT_HINT = "or set gpu_preflight_strict: false to proceed with a warning"


def open_module_fix(os_id: str, branch: str) -> str:
    """What to install in place of the open module: the proprietary package of the same branch, as the host's
    archive names it (Ubuntu: nvidia-driver-<branch>; Debian and NVIDIA's repository: nvidia-kernel-dkms)."""
    if os_id == "ubuntu":
        package = f"nvidia-driver-{branch or '<branch>'}"
        what = f"{package} (or {package}-server) in place of its -open variant"
    else:
        package = "nvidia-kernel-dkms"
        what = f"{package} in place of nvidia-kernel-open-dkms"
    return (
        f"install the proprietary kernel module of the same driver branch, {what} (apt-get install {package}), "
        "reboot, re-run"
    )


def kernel_warnings(kernels: list, has_driver: bool) -> list:
    """An installed kernel with no NVIDIA module built for it boots without a GPU: named, where the host has a
    driver at all (a GPU-less host's kernels need none)."""
    if not has_driver:
        return []
    return [
        f"installed kernel {k['release']} has no NVIDIA kernel module built for it (no nvidia*.ko under "
        f"/lib/modules/{k['release']}, no DKMS build): the next boot into it would come up without a GPU; do: "
        f"install linux-headers-{k['release']} and run `dkms autoinstall -k {k['release']}` (on Ubuntu the "
        f"prebuilt linux-modules-nvidia-<branch>-{k['release']} also does), or remove that kernel"
        for k in kernels
        if not k.get("nvidia_module")
    ]


CAP_PATTERN = re.compile(r"^[0-9]+[.][0-9]+$")
GIB = 1073741824


def version(text):
    return tuple(int(part) for part in re.findall(r"\d+", str(text)))


def smi_state(smi, ok):
    output = smi["output"]
    if not smi["path"]:
        return "absent"
    if ok:
        return "ok"
    if "Driver/library version mismatch" in output:
        return "nvml_mismatch"
    if smi["rc"] == 0 or "No devices were found" in output:
        return "no_devices"
    if "couldn't communicate with the NVIDIA driver" in output:
        return "driver_not_loaded"
    return "error"


def disk_shortfalls(found_disks, checks, present=None):
    """Per filesystem (device), the configured paths on it whose summed needs exceed its free space. A need
    whose stage is installed already (its installed_marker exists) is in use, not needed again."""
    present = present or {}
    rows = []
    for check in checks:
        if check.get("installed_marker") and present.get(check["installed_marker"]):
            continue
        disk = next(d for d in found_disks if d["path"] == check["path"])
        rows.append(dict(disk, **check))
    shortfalls = []
    for device in sorted({row["device"] for row in rows}):
        items = [row for row in rows if row["device"] == device]
        need = sum(item["min_free_gib"] for item in items)
        free = items[0]["free_bytes"] / GIB
        if free < need:
            parts = " + ".join(f"{i['path']} ({i['purpose']}, {i['min_free_gib']} GiB)" for i in items)
            shortfalls.append(
                f"{parts} on the filesystem of {items[0]['checked_path']}: {free:.1f} GiB free; "
                f"required: {need} GiB free there"
            )
    return shortfalls


def ecc_state(gpus: list, inband: list) -> tuple[str, str]:
    """(state, note) of the chosen GPUs' ECC: on, off, mixed, or "" (no ECC, or not reported). The note says what the
    state costs and what the other one would give; p40fleet never changes it (a reboot, and the operator's call).
    inband: GPU names whose ECC lives in their GDDR memory (it keeps 1/16 of the memory and, per NVIDIA's CUDA Best
    Practices Guide, about 20% of its bandwidth); HBM cards keep it beside the data (docs/facts-gpu.md)."""
    states = sorted({g.get("ecc", "") for g in gpus})
    if not gpus or states == [""]:
        return "", ""
    name, memory = gpus[0]["name"], min(g["memory_mib"] for g in gpus)
    in_band = name in inband or re.sub("^NVIDIA ", "", name) in inband
    pending = sorted({g.get("ecc_pending", "") for g in gpus if g.get("ecc_pending", "") not in ("", g.get("ecc"))})
    after = f"; ECC is to be {pending[0]} after the next reboot, and the reported memory with it" if pending else ""
    if len(states) > 1:
        split = ", ".join(f"GPU {g['index']} {g.get('ecc') or 'n/a'} ({g['memory_mib']} MiB)" for g in gpus)
        return "mixed", (
            f"ECC differs between the GPUs ({split}): the launch settings follow the smallest, {memory} MiB; do: set "
            f"one ECC state on every GPU (nvidia-smi -e, then a reboot){after}"
        )
    state = states[0]
    if not in_band:
        return state, f"ECC {state}: {name} reports {memory} MiB; its ECC costs no memory (not GDDR){after}"
    if state == "on":
        return state, (
            f"ECC on: {name} reports {memory} MiB; ECC keeps about {memory // 15} MiB (1/16 of the memory) and about "
            f"20% of its bandwidth. Off (nvidia-smi -e 0 and a reboot: the operator's call, never p40fleet's) it "
            f"would report about {memory * 16 // 15} MiB; the launch defaults fit either state, so that buys "
            f"bandwidth, not a larger batch, and memory errors would go uncorrected{after}"
        )
    return state, (
        f"ECC off: {name} reports {memory} MiB; memory errors are neither corrected nor counted. On (the Tesla "
        f"default) it would report about {memory * 15 // 16} MiB, which the launch defaults also fit, with about 20% "
        f"less bandwidth{after}"
    )


class Host:
    """What the probe found, read the way the checks need it."""

    def __init__(self, found, settings):
        self.found = found
        self.s = settings
        smi = found["nvidia_smi"]
        self.smi = smi
        self.all_gpus = smi["gpus"]
        select = settings["gpu_select"]
        self.gpus = [g for g in self.all_gpus if g["name"] == select] if select else list(self.all_gpus)
        first_name = self.gpus[0]["name"] if self.gpus else ""
        table = settings["compute_cap_by_name"]
        cap_from_smi = self.gpus[0]["compute_cap"] if self.gpus else ""
        cap_from_table = table.get(first_name, table.get(re.sub("^NVIDIA ", "", first_name), ""))
        smi_ok = smi["rc"] == 0 and len(self.all_gpus) > 0
        self.smi_state = smi_state(smi, smi_ok)
        self.models = list(dict.fromkeys(g["name"] for g in self.all_gpus))
        self.has_gpu = smi_ok and len(self.gpus) > 0
        self.driver_version = self.all_gpus[0]["driver_version"] if self.all_gpus else ""
        if smi_ok:
            self.compute_cap = str(cap_from_smi or cap_from_table)
            self.compute_cap_source = (
                "nvidia-smi"
                if cap_from_smi
                else "the GPU name table; this driver's nvidia-smi has no compute_cap field"
            )
        else:
            self.compute_cap = str(settings["no_gpu_compute_cap"])
            self.compute_cap_source = "gpu_preflight_no_gpu_compute_cap"
        self.cap_valid = bool(CAP_PATTERN.match(self.compute_cap))
        self.memory_mib = min(g["memory_mib"] for g in self.gpus) if self.has_gpu else 0
        self.ecc, self.ecc_note = ecc_state(self.gpus if self.has_gpu else [], settings["ecc_inband"])
        self.profile = {}
        if self.cap_valid:
            cap = version(self.compute_cap)
            for profile in settings["profiles"]:
                if version(profile["min_compute_cap"]) <= cap <= version(profile["max_compute_cap"]):
                    self.profile = profile
                    break
        self.module = found.get("kernel_module") or {"version": "", "flavor": ""}
        self.open_module = self.module.get("flavor") == "open"
        # Where the flavor was read: the loaded module's line, or `modinfo nvidia` (installed, not loaded).
        self.module_seen = (
            f'modinfo nvidia names its license "{self.module.get("license", "")}"'
            if self.module.get("source") == "modinfo nvidia"
            else '/proc/driver/nvidia/version names the "Open Kernel Module"'
        )
        self.open_name = " ".join(part for part in ("NVIDIA's open kernel module", self.module.get("version")) if part)
        self.module_state = "is installed" if self.module.get("source") == "modinfo nvidia" else "is loaded"
        self.pci_devices = int(found["nvidia_pci_devices"])
        self.gpu_name = self.gpus[0]["name"] if self.gpus else ""

    def checks(self):
        """(hard, failed, message) for every rule, in the order a reader would fix them."""
        s, found, smi = self.s, self.found, self.smi
        os_found = found["os"]
        os_name = f"{os_found['pretty_name']} (ID={os_found['id']}, VERSION_ID={os_found['version_id']})"
        debian_family = os_found["id"] in ("debian", "ubuntu") or "debian" in os_found["id_like"]
        supported = s["supported_os"]
        tested = os_found["version_id"] in [str(v) for v in supported.get(os_found["id"], [])]
        tested_list = "; ".join(
            f"{family} {', '.join(str(v) for v in releases)}" for family, releases in supported.items()
        )
        smi_output = re.sub(r"\s*\n\s*", " / ", smi["output"])
        min_driver = s["driver_min_version"]
        min_branch = min_driver.split(".")[0]
        driver_major = int(self.driver_version.split(".")[0]) if self.driver_version else 0
        max_branch = int(self.profile.get("driver_max_branch", 0) or 0)
        gpu_list = ", ".join(f"{g['index']}: {g['name']}" for g in self.all_gpus)
        models = ", ".join(f'"{m}"' for m in self.models)
        ranges = ", ".join(f"{p['name']} {p['min_compute_cap']}-{p['max_compute_cap']}" for p in s["profiles"])
        ram_mib = int(found["mem_total_mib"])
        shortfalls = disk_shortfalls(found["disks"], s["disk_checks"], found.get("present"))
        loaded = (
            f" (loaded kernel module {found['kernel_module_version']})" if found.get("kernel_module_version") else ""
        )
        open_unbound = self.open_module and self.pci_devices > 0
        module_branch = (self.module.get("version") or self.driver_version).split(".")[0]
        open_fix = open_module_fix(os_found["id"], module_branch)
        no_gpu_cap = str(s["no_gpu_compute_cap"])
        branch_range = f" and <= R{max_branch} for {self.gpu_name or 'this GPU'}" if max_branch > 0 else ""
        upgrade_to = f"to a release of branch {min_branch} to {max_branch} " if max_branch > 0 else ""
        no_gpu_do = (
            "install the NVIDIA driver (branch 520 to 580 for Pascal)"
            if self.pci_devices > 0
            else "remove the host from p40-hosts"
        )
        no_gpu_seen = "no nvidia-smi" if self.smi_state == "absent" else f'nvidia-smi: "{smi_output}"'
        return [
            (
                True,
                not debian_family,
                f"found {os_name}, which is not supported; required: Debian or Ubuntu (the later stages install "
                "with apt); do: reinstall the host with Debian 12 or Ubuntu 22.04, or remove it from p40-hosts",
            ),
            (
                False,
                debian_family and not tested,
                f"found {os_name}, a release p40fleet has not been tested on; tested: {tested_list}; do: use a "
                f"tested release, or add it to gpu_preflight_supported_os, {STRICT_HINT}",
            ),
            (
                True,
                self.smi_state == "nvml_mismatch",
                f'nvidia-smi answers "{smi_output}"{loaded}: the NVIDIA driver package was upgraded but the old '
                "kernel module is still loaded; required: driver library and kernel module of the same version; "
                "do: reboot the host (or unload and reload the nvidia kernel modules) so the upgraded driver takes "
                "effect, then re-run",
            ),
            (
                True,
                self.smi_state == "driver_not_loaded",
                f'nvidia-smi answers "{smi_output}": the NVIDIA kernel module is not loaded; required: a loaded '
                f"NVIDIA driver >= {min_driver}; do: "
                + (
                    f"the installed module is NVIDIA's open one ({self.module_seen}), which drives Turing and newer "
                    f"only; for an older GPU {open_fix}"
                    if self.open_module
                    else "load it (modprobe nvidia) or reboot, check dmesg for why it failed, then re-run"
                ),
            ),
            (
                True,
                self.smi_state == "error",
                f'{smi["path"]} failed (rc {smi["rc"]}): "{smi_output}"; required: a working nvidia-smi; do: fix '
                "the NVIDIA driver installation, then re-run",
            ),
            (
                True,
                open_unbound and self.smi_state == "no_devices",
                f"nvidia-smi finds no GPU while {self.pci_devices} NVIDIA display device(s) sit on the PCI bus and "
                f"{self.open_name} {self.module_state}; required: the "
                f"proprietary NVIDIA kernel module for GPUs older than Turing (a P40 is Pascal); do: {open_fix}",
            ),
            (
                True,
                self.open_module
                and self.has_gpu
                and self.cap_valid
                and version(self.compute_cap) < version(s["open_module_min_compute_cap"]),
                f"found {self.open_name} ({self.module_seen}) with "
                f"{self.gpu_name} (compute capability {self.compute_cap}); "
                "required: the proprietary NVIDIA kernel module, as the open one supports Turing (compute "
                f"capability {s['open_module_min_compute_cap']}) and newer only; do: {open_fix}",
            ),
            (
                True,
                self.smi_state in ("absent", "no_devices") and not no_gpu_cap and not open_unbound,
                f"found no NVIDIA GPU ({no_gpu_seen}, {self.pci_devices} NVIDIA display device(s) on the PCI bus): "
                f"nothing to provision; required: an NVIDIA GPU with a driver >= {min_driver}; do: {no_gpu_do}, "
                'or set gpu_preflight_no_gpu_compute_cap (e.g. "6.1") to provision it as a CPU-only build host',
            ),
            (
                True,
                bool(no_gpu_cap) and not self.has_gpu and not self.cap_valid,
                f'gpu_preflight_no_gpu_compute_cap is "{no_gpu_cap}"; required: a compute capability such as '
                '"6.1"; do: correct it',
            ),
            (
                True,
                self.smi_state == "ok" and len(self.models) > 1 and not s["gpu_select"],
                f"found {len(self.models)} GPU models ({gpu_list}); required: one GPU model per host, as one "
                "profile drives dtype, attention and batch sizes; do: set gpu_preflight_gpu_select for "
                f"{s['host']} to one of {models} (the other GPUs are then hidden with CUDA_VISIBLE_DEVICES)",
            ),
            (
                True,
                self.smi_state == "ok" and bool(s["gpu_select"]) and not self.gpus,
                f'gpu_preflight_gpu_select is "{s["gpu_select"]}" but the host has {gpu_list}; required: the exact '
                f"name of one of its GPUs; do: set gpu_preflight_gpu_select to one of {models}",
            ),
            (
                True,
                self.has_gpu and not self.compute_cap,
                f'nvidia-smi of driver {self.driver_version} has no compute_cap field and "{self.gpu_name}" is not '
                "in gpu_preflight_compute_cap_by_name; required: the GPU's compute capability; do: add "
                f'"{self.gpu_name}" with its compute capability to gpu_preflight_compute_cap_by_name, or upgrade '
                "the driver to a release whose nvidia-smi knows compute_cap",
            ),
            (
                True,
                self.cap_valid and not self.profile,
                f"found {self.gpu_name or 'no GPU'} with compute capability {self.compute_cap}, which no GPU profile "
                f"covers; required: compute capability within a profile of gpu_preflight_profiles ({ranges}); do: "
                "add a tested profile for it to gpu_preflight_profiles, or remove the host from p40-hosts",
            ),
            (
                True,
                self.has_gpu and version(self.driver_version) < version(min_driver),
                f"found NVIDIA driver {self.driver_version}; required: >= {min_driver} for "
                f"{s['driver_min_reason']}{branch_range}; do: upgrade the driver {upgrade_to}(e.g. 535 or 550), "
                "reboot, re-run",
            ),
            (
                True,
                self.has_gpu and max_branch > 0 and driver_major > max_branch,
                f"found NVIDIA driver {self.driver_version} (branch R{driver_major}) with {self.gpu_name} "
                f"({self.profile.get('name', '')}, compute capability {self.compute_cap}); required: branch <= "
                f"R{max_branch}, the last branch that supports this GPU; do: install a driver of branch "
                f"{min_branch} to {max_branch} (e.g. 535 or 550) and hold the package so upgrades keep that branch, "
                "reboot, re-run",
            ),
            (
                False,
                int(found["cpu_count"]) < int(s["min_cpus"]),
                f"found {found['cpu_count']} CPU(s); required: >= {s['min_cpus']} (gpu_preflight_min_cpus); do: "
                f"add CPUs, {STRICT_HINT}",
            ),
            (
                False,
                ram_mib < int(s["min_ram_gib"]) * 1024,
                f"found {ram_mib / 1024:.1f} GiB RAM; required: >= {s['min_ram_gib']} GiB (gpu_preflight_min_ram_gib); "
                f"do: add RAM, {STRICT_HINT}",
            ),
            (
                False,
                bool(shortfalls),
                f"too little disk: {'; '.join(shortfalls)}; do: free space there, point the install paths elsewhere "
                f"(gpu_preflight_disk_checks and the later roles' paths), {STRICT_HINT}",
            ),
        ]

    def published(self):
        """The profile and facts of a host that passed, and what changed since the saved state."""
        found, profile = self.found, self.profile
        previous = (found["state"] or {}).get("content") or {}
        count = len(self.gpus) if self.has_gpu else 0
        name = self.gpu_name if self.has_gpu else "none"
        hidden = [g["name"] for g in self.all_gpus if g["name"] != name]
        gpu_names = [g["name"] for g in self.all_gpus]
        reasons = [
            f"profile {profile['name']}: "
            + (f"{count}x {name}" if self.has_gpu else "no GPU on this host")
            + f", compute capability {self.compute_cap} (from {self.compute_cap_source}) is within "
            f"{profile['min_compute_cap']}-{profile['max_compute_cap']}"
        ]
        if hidden:
            reasons.append(f"GPU model {name} chosen by gpu_preflight_gpu_select; hidden: {', '.join(hidden)}")
        reasons += list(profile["reasons"])
        if self.ecc_note:
            reasons.append(self.ecc_note)
        new_profile = {
            "name": profile["name"],
            "compute_cap": self.compute_cap,
            "compute_cap_source": self.compute_cap_source,
            "gpu_name": name,
            "gpu_count": count,
            "cuda_visible_devices": ",".join(str(g["index"]) for g in self.gpus) if self.has_gpu else "",
            "memory_mib": self.memory_mib,
            "ecc": self.ecc,
            "dtype": profile["dtype"],
            "attn_implementation": profile["attn_implementation"],
            "vllm_supported": profile["vllm_supported"],
            "rollout_name": "vllm" if profile["vllm_supported"] else "hf",
            "torch_compile": profile["torch_compile"],
            "torch_cuda_arch_list": profile["torch_cuda_arch_list"] or self.compute_cap,
            "shared_memory_per_block": profile["shared_memory_per_block"],
            "driver_max_branch": profile["driver_max_branch"],
            "needs_patches": profile["needs_patches"],
            "reasons": reasons,
        }
        changes = []
        driver_changed = bool(previous) and previous.get("driver_version", "") != self.driver_version
        if driver_changed:
            changes.append(
                f"driver {previous.get('driver_version') or 'none'} -> {self.driver_version or 'none'}: "
                "re-verifying the stack"
            )
        if previous and previous.get("gpus", []) != gpu_names:
            changes.append(f"GPUs {', '.join(previous.get('gpus', []))} -> {', '.join(gpu_names)}")
        if previous and (previous.get("profile") or {}).get("name", "") != new_profile["name"]:
            changes.append(f"profile {(previous.get('profile') or {}).get('name', '?')} -> {new_profile['name']}")
        gcc = found["gcc"]
        return {
            "gpu_preflight_profile": new_profile,
            "gpu_preflight_previous_driver_version": previous.get("driver_version", ""),
            "gpu_preflight_driver_changed": driver_changed,
            "gpu_preflight_driver_version": self.driver_version,
            "gpu_preflight_changes": changes,
            "gpu_preflight_has_gpu": self.has_gpu,
            "gpu_preflight_gcc11_available": bool(gcc["gcc11_path"] or gcc["gcc11_candidate"]),
            "gpu_preflight_gcc11_installed": bool(gcc["gcc11_path"]),
            "gpu_preflight_cpu_count": int(found["cpu_count"]),
            "gpu_preflight_ram_mib": int(found["mem_total_mib"]),
            "gpu_preflight_os": found["os"],
            "gpu_preflight_state_content": {
                "schema": 1,
                "driver_version": self.driver_version,
                # The loaded module (flavor and version): a module change re-verifies the stack (fleet_state).
                "kernel_module": " ".join(v for v in (self.module["flavor"], self.module["version"]) if v),
                "has_gpu": self.has_gpu,
                "gpus": gpu_names,
                "os": f"{found['os']['id']} {found['os']['version_id']}",
                "profile": new_profile,
            },
        }


def gpu_preflight_assess(found, settings):
    """{'errors': [...], 'warnings': [...], 'facts': {...} or None (refused)} for one host."""
    host = Host(found, settings)
    checks = host.checks()
    strict = settings["strict"]
    errors = [msg for hard, failed, msg in checks if failed and (hard or strict)]
    warnings = (
        [] if strict else [msg.replace(", " + STRICT_HINT, "") for hard, failed, msg in checks if failed and not hard]
    )
    gcc = found["gcc"]
    if not (gcc["gcc11_path"] or gcc["gcc11_candidate"]):
        warnings.append(
            "gcc-11 is neither installed nor installable from the configured apt sources (default gcc "
            f"{gcc['default_version'] or 'none'}); nvcc 11.8 rejects gcc > 11, so building Apex needs gcc-11 from "
            "elsewhere (the cuda_toolkit role decides)"
        )
    kernels = found.get("kernels") or []
    has_driver = bool(host.module.get("flavor")) or host.smi_state == "ok" or any(k["nvidia_module"] for k in kernels)
    warnings += kernel_warnings(kernels, has_driver)
    state = found["state"]
    if state.get("error"):
        warnings.append(
            f"the saved state {settings['state_file']} is unreadable ({state['error']}); it will be rewritten"
        )
    facts = None
    if not errors:
        facts = host.published()
        # One boolean for the tasks that show, record and read back the state: comparing the two contents in a
        # `when` would template both on every run, converged hosts included.
        facts["gpu_preflight_state_changed"] = facts["gpu_preflight_state_content"] != state.get("content")
    return {"errors": errors, "warnings": warnings, "facts": facts}


def gpu_preflight_saved_facts(saved_b64):
    """The published facts a saved state holds (profile, has_gpu, driver_version), or {} where the state is
    missing or not one preflight wrote: the stages' inputs then fall back to their defaults, as on a fresh host."""
    try:
        content = json.loads(base64.b64decode(str(saved_b64 or ""), validate=True) or b"null")
    except (binascii.Error, ValueError):
        return {}
    if not (
        isinstance(content, dict)
        and isinstance(content.get("profile"), dict)
        and isinstance(content.get("has_gpu"), bool)
        and isinstance(content.get("driver_version"), str)
    ):
        return {}
    return {
        "gpu_preflight_profile": content["profile"],
        "gpu_preflight_has_gpu": content["has_gpu"],
        "gpu_preflight_driver_version": content["driver_version"],
    }
