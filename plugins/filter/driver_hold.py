"""driver_hold's decisions: the installed packages and the role's settings in, one plan out.

`found | driver_hold_plan(settings)` decides which installed packages are the NVIDIA driver, which branch they
are held at, what the apt preferences file and the unattended-upgrades blacklist say, which meta-packages are
put on hold and, for `state: absent`, which holds this role added and must release. `found` is what
plugins/modules/driver_hold_packages.py read from the host; nothing here touches a host.

`found | driver_hold_unmet(plan)` lists how a host, read again after the role's tasks, differs from the plan:
the role's post-condition check.

Why each rule (docs/facts-gpu.md, "NVIDIA driver branches and kernel modules"):
- A package is part of the driver when its name says NVIDIA (or it is one of NVIDIA's driver libraries without
  the word, or a cuda-drivers meta-package) and its version is a driver branch's (580.95.05-1): that keeps out
  libnvidia-container1 (1.17), nvidia-cuda-toolkit (12.x) and Ubuntu's prebuilt linux-modules-nvidia-580-<kernel>
  (versioned by the kernel), whose pins would break them.
- One branch is held: the loaded module's where packages of it are installed, otherwise the newest installed
  branch the profile allows. Packages of a branch past the profile's last one (installed, not yet booted) refuse
  the host: the next boot would lose the GPU.
- The pin gives the held branch's versions priority 1000 (newer releases of that branch still install: fixes)
  and every other version of those packages priority -1 (never installed, not even when asked for by version).
- Meta-packages whose dependencies reach past a branch (cuda-drivers-580 depends on >= 580 and has pulled in
  590; -open transitional packages have switched to the open module) are also on hold.
- GPUs older than Turing never run NVIDIA's open module: its packages are pinned at -1 as well.
- unattended-upgrades would replace the libraries under a loaded module: every held package is blacklisted there
  where it is installed.
"""

from __future__ import annotations

import re

# Names that are NVIDIA's driver whatever their version scheme says; `nvidia` in a name is matched separately.
DRIVER_NAMES = re.compile(r"^(cuda-drivers(-\d+)?|libcuda1|libnvcuvid1|libnvoptix1|libxnvctrl0)$")
# Packages with `nvidia` in their name and a driver-like version that are not the driver.
NOT_DRIVER = re.compile(r"^(libnvidia-container.*|nvidia-container-.*|linux-(modules|objects|signatures)-nvidia-.*)$")
# Meta-packages that follow "the newest" of something rather than one branch's files.
HOLD_NAMES = re.compile(r"^(cuda-drivers(-\d+)?|nvidia-open(-\d+)?|nvidia-driver-\d+(-server)?-open)$")
# NVIDIA's open kernel module, in Debian's, Ubuntu's and NVIDIA's repository names.
OPEN_MODULE_PATTERNS = [
    "nvidia-kernel-open-dkms",
    "nvidia-open",
    "nvidia-open-*",
    "nvidia-driver-*-open",
    "nvidia-dkms-*-open",
    "nvidia-kernel-source-*-open",
    "linux-modules-nvidia-*-open-*",
]
# A driver branch is a three-digit release series (470, 535, 580, 590): the first number of the upstream version.
BRANCH = re.compile(r"^(?:(\d+):)?(\d{3})\.")
PIN_PRIORITY = 1000
BLOCK_PRIORITY = -1


def branch_of(version: str) -> tuple[str, str] | None:
    """(epoch prefix, branch) of a Debian version string, or None where it is no driver branch's."""
    match = BRANCH.match(version or "")
    if not match:
        return None
    return (f"{match.group(1)}:" if match.group(1) else "", match.group(2))


def is_driver_package(name: str, version: str) -> bool:
    if NOT_DRIVER.match(name) or branch_of(version) is None:
        return False
    return "nvidia" in name or bool(DRIVER_NAMES.match(name))


def _blacklist_entry(name: str) -> str:
    # unattended-upgrades matches each entry as a regular expression from the start of the name: anchor it, and
    # write the characters a regex reads specially as classes (no backslashes, which apt.conf strings escape).
    return "^" + re.sub(r"([.+])", r"[\1]", name) + "$"


def preferences_text(host: str, branch: str, epochs: list[str], pinned: list[str], block_open: bool) -> str:
    names = " ".join(pinned)
    lines = [
        f"# Written by p40fleet (roles/driver_hold) on {host}: keeps the NVIDIA driver on branch R{branch}.",
        "# Releases of that branch still install (fixes); any other version of these packages never does, not",
        "# even when asked for by version. To change the branch on purpose, run the role with",
        "# driver_hold_state: absent first (README, After a driver upgrade). Rewritten by every converge.",
        "",
    ]
    for epoch in epochs:
        lines += [f"Package: {names}", f"Pin: version {epoch}{branch}.*", f"Pin-Priority: {PIN_PRIORITY}", ""]
    lines += [f"Package: {names}", "Pin: version *", f"Pin-Priority: {BLOCK_PRIORITY}", ""]
    if block_open:
        lines += [
            "# NVIDIA's open kernel module drives Turing and newer only: never install it on this host.",
            f"Package: {' '.join(OPEN_MODULE_PATTERNS)}",
            "Pin: version *",
            f"Pin-Priority: {BLOCK_PRIORITY}",
            "",
        ]
    return "\n".join(lines)


def unattended_text(host: str, branch: str, names: list[str]) -> str:
    entries = "\n".join(f'    "{_blacklist_entry(name)}";' for name in names)
    return (
        f"// Written by p40fleet (roles/driver_hold) on {host}: unattended-upgrades leaves the NVIDIA driver (branch\n"
        f"// R{branch}) alone, as it would replace its libraries under the loaded kernel module.\n"
        f"Unattended-Upgrade::Package-Blacklist {{\n{entries}\n}};\n"
    )


def driver_hold_plan(found: dict, settings: dict) -> dict:
    """What the host should look like: {state, branch, pinned, hold, unhold, held_by_role, preferences,
    unattended, record, errors, notes}. preferences/unattended are "" where the file must not exist."""
    host = settings["host"]
    state = settings["state"]
    max_branch = int(settings.get("max_branch") or 0)
    loaded = branch_of(str(settings.get("loaded_driver_version") or "") + ".")
    loaded_branch = loaded[1] if loaded else ""
    record = found.get("record") if isinstance(found.get("record"), dict) else {}
    recorded_held = [name for name in record.get("held_by_role") or [] if isinstance(name, str)]
    packages = found.get("packages") or []
    held_now = {p["name"] for p in packages if p.get("selection") == "hold"}
    installed = {p["name"] for p in packages}
    plan = {
        "state": state,
        "branch": "",
        "pinned": [],
        "hold": [],
        "unhold": [],
        "held_by_role": [],
        "preferences": "",
        "unattended": "",
        "record": None,
        "errors": [],
        "notes": [],
    }
    if state == "absent":
        # Exactly what present added: its files (the caller removes them) and the holds it placed.
        plan["unhold"] = sorted(name for name in recorded_held if name in held_now)
        plan["notes"].append(
            "hold removed: the driver packages upgrade like any other again"
            + (f"; released the holds on {', '.join(plan['unhold'])}" if plan["unhold"] else "")
        )
        return plan
    driver = [p for p in packages if is_driver_package(p["name"], p["version"])]
    by_branch: dict[str, list[dict]] = {}
    for package in driver:
        by_branch.setdefault(branch_of(package["version"])[1], []).append(package)
    too_new = sorted(b for b in by_branch if max_branch and int(b) > max_branch)
    if too_new:
        listed = "; ".join(f"R{b}: " + ", ".join(f"{p['name']} {p['version']}" for p in by_branch[b]) for b in too_new)
        plan["errors"].append(
            f"driver_hold refused {host}: installed NVIDIA driver packages of a branch past R{max_branch}, the last "
            f"that supports this GPU ({listed}); the loaded module is "
            f"{settings.get('loaded_driver_version') or 'unknown'}, and the next boot would load the newer branch and "
            f"lose the GPU; do: install the R{max_branch} packages again (apt-get install with =<version> of branch "
            f"{max_branch} for each package named), then re-run; nothing was changed"
        )
        return plan
    if not by_branch:
        plan["notes"].append(
            "no NVIDIA driver package is installed through apt (a runfile driver, or none): nothing to pin"
        )
        plan["record"] = {"schema": 1, "branch": "", "pinned": [], "held": [], "held_by_role": [], "blacklisted": []}
        return plan
    branch = loaded_branch if loaded_branch in by_branch else max(by_branch, key=int)
    chosen = by_branch[branch]
    pinned = sorted({p["name"] for p in chosen})
    epochs = sorted({branch_of(p["version"])[0] for p in chosen})
    others = sorted(b for b in by_branch if b != branch)
    if others:
        plan["notes"].append(
            "left unpinned, of another branch: "
            + ", ".join(f"{p['name']} {p['version']}" for b in others for p in by_branch[b])
        )
    hold = sorted(name for name in installed if HOLD_NAMES.match(name))
    # Holds this role placed: those of earlier runs it still keeps, and those it places now (a hold that was
    # there before the first run is the administrator's, and absent leaves it).
    held_by_role = sorted({n for n in recorded_held if n in hold} | {n for n in hold if n not in held_now})
    blacklisted = pinned if found.get("unattended_upgrades") else []
    plan.update(
        branch=branch,
        pinned=pinned,
        hold=hold,
        held_by_role=held_by_role,
        preferences=preferences_text(host, branch, epochs, pinned, bool(max_branch)),
        unattended=unattended_text(host, branch, blacklisted) if blacklisted else "",
        record={
            "schema": 1,
            "branch": branch,
            "pinned": pinned,
            "held": hold,
            "held_by_role": held_by_role,
            "blacklisted": blacklisted,
        },
    )
    plan["notes"].append(
        f"held at R{branch}: {', '.join(pinned)} pinned"
        + (f"; {', '.join(hold)} on hold" if hold else "")
        + ("; blacklisted in unattended-upgrades" if blacklisted else "")
    )
    return plan


def driver_hold_unmet(found: dict, plan: dict) -> list[str]:
    """How the host (read again) differs from the plan; empty when the role's work is in place."""
    files = found.get("files") or {}
    unmet = []
    for key, label in (("preferences", "the apt preferences file"), ("unattended", "the unattended-upgrades file")):
        wanted, current = plan.get(key) or "", files.get(key)
        if wanted and current != wanted:
            unmet.append(f"{label} does not hold the planned pins" if current else f"{label} is missing")
        if not wanted and current is not None:
            unmet.append(f"{label} is still there")
    held = {p["name"] for p in found.get("packages") or [] if p.get("selection") == "hold"}
    missing = [name for name in plan.get("hold") or [] if name not in held]
    if missing:
        unmet.append(f"not on hold: {', '.join(missing)}")
    still = [name for name in plan.get("unhold") or [] if name in held]
    if still:
        unmet.append(f"still on hold: {', '.join(still)}")
    return unmet


class FilterModule:
    def filters(self):
        return {"driver_hold_plan": driver_hold_plan, "driver_hold_unmet": driver_hold_unmet}
