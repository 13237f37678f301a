"""conda_env's decisions from its probe's findings: what must be installed, and whether the env is created.

`found | conda_env_plan(settings)` returns
- install_miniconda: the prefix was not made by the pinned installer, or its conda does not run;
- create_env: the env's Python is not the pinned one, or a create was left unfinished (its marker is there:
  an env whose python runs may still be half made);
- install_needed: either of those, or the owner, the .condarc or the env's owner is not as configured.
`found` holds the probe's key=value lines (strings; empty where a probe found nothing); `settings` holds
installer_sha256, python_version, condarc (the managed file's content) and owner. Unit-tested in
python/tests/test_conda_env_rules.py.

`owner_lines | conda_env_owner_found` reads the owner's probe (its conda and its env's Python run as the owner, so
their output is the owner's to write): only its `conda=` and `env_python=` lines, each kept only in the shape
conda and Python print (otherwise '': does not run, as a broken install reads). No other key comes from it, so it
can never stand in for what root's probe found (the installer's marker, the .condarc, the env's owner).

`found | conda_env_owner_refusal(owner, prefix, host)` is why a host provisioned for another env owner is refused
('' where it is not): the prefix or the env belongs to another account than the configured one. Decided from root's
probe alone, before the install step makes any account, so a refused owner change leaves nothing behind.

`miniconda_version | conda_env_installer_python` returns the Python a Miniconda release's installer carries
(py310_23.3.1-0 -> 3.10), or '' for a name that does not say: the env is cloned from that Python.
"""

import hashlib
import re


def conda_env_plan(found, settings):
    install_miniconda = found["installed_sha256"] != settings["installer_sha256"].lower() or found["conda"] == ""
    create_env = found["env_python"] != settings["python_version"] or found["creating"] == "yes"
    condarc_sha1 = hashlib.sha1(settings["condarc"].encode()).hexdigest()
    install_needed = (
        install_miniconda
        or create_env
        or found["owner"] != "yes"
        or found["condarc_sha1"] != condarc_sha1
        or found["env_owner"] != settings["owner"]
    )
    return {"install_miniconda": install_miniconda, "create_env": create_env, "install_needed": install_needed}


def conda_env_owner_refusal(found, owner, prefix, host="this host"):
    """The refusal for a host provisioned for another env owner (naming both and what to do), or '' where the
    prefix and the env are this owner's or root's."""
    # root's own prefix (made by hand, empty) is not another owner's: the install step makes it the owner's.
    others = sorted({found.get(key) or "" for key in ("prefix_owner", "env_owner")} - {"", "root", owner})
    if not others:
        return ""
    return (
        f"{host}: {prefix} was provisioned for the env owner '{others[0]}', but the env owner is now '{owner}' "
        "(p40fleet_env_owner). A provisioned host does not change owners: nothing was changed and no account was "
        f"made. Do: set p40fleet_env_owner back to '{others[0]}', or remove {prefix} (and what '{others[0]}' keeps "
        f"in its home) to provision the host anew for '{owner}'."
    )


OWNER_FIELDS = {"conda": re.compile(r"conda [0-9][0-9A-Za-z.+-]{0,31}"), "env_python": re.compile(r"3\.[0-9]{1,2}")}


def conda_env_owner_found(lines):
    found = dict.fromkeys(OWNER_FIELDS, "")
    seen = set()
    for line in lines if isinstance(lines, list) else []:
        key, _, value = str(line).partition("=")
        if key in OWNER_FIELDS and key not in seen:
            seen.add(key)
            found[key] = value if OWNER_FIELDS[key].fullmatch(value) else ""
    return found


def conda_env_installer_python(miniconda_version):
    match = re.fullmatch(r"py(3)(1?[0-9])_\S+", str(miniconda_version))
    return f"{match.group(1)}.{match.group(2)}" if match else ""


class FilterModule:
    def filters(self):
        return {
            "conda_env_plan": conda_env_plan,
            "conda_env_owner_found": conda_env_owner_found,
            "conda_env_installer_python": conda_env_installer_python,
            "conda_env_owner_refusal": conda_env_owner_refusal,
        }
