"""conda_env's decisions from its probe's findings: what must be installed, and whether the env is created.

`found | conda_env_plan(settings)` returns
- install_miniconda: the prefix was not made by the pinned installer, or its conda does not run;
- create_env: the env's Python is not the pinned one, or a create was left unfinished (its marker is there:
  an env whose python runs may still be half made);
- install_needed: either of those, or the owner, the .condarc or the env's owner is not as configured.
`found` holds the probe's key=value lines (strings; empty where a probe found nothing); `settings` holds
installer_sha256, python_version, condarc (the managed file's content) and owner. Unit-tested in
python/tests/test_conda_env_rules.py.

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


def conda_env_installer_python(miniconda_version):
    match = re.fullmatch(r"py(3)(1?[0-9])_\S+", str(miniconda_version))
    return f"{match.group(1)}.{match.group(2)}" if match else ""


class FilterModule:
    def filters(self):
        return {"conda_env_plan": conda_env_plan, "conda_env_installer_python": conda_env_installer_python}
