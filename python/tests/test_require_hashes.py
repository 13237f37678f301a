"""No `pip install` on a host runs without --require-hashes: a static look at every task of every role.

A pip install is found wherever a task's command (argv list, templated argv or shell line) runs `pip install`, or
uses Ansible's pip module. Two installs of local source trees cannot be hashed by pip (an editable install and a
directory have no single file to hash); they are listed below with what pins them instead, and must install
nothing else (--no-deps, --no-build-isolation: no index is asked for anything).
"""

from __future__ import annotations

import re

import yaml

from p40fleet_dev.paths import REPO_ROOT

TASK_FILES = sorted(REPO_ROOT.glob("roles/*/tasks/*.yml"))
# Task name -> what pins what it installs.
LOCAL_TREES = {
    "Ensure verl is installed editable from the checkout": "the checkout, refused unless HEAD is verl_expected_commit",
    "Ensure the flash_attn shim is installed in the env": "the role's own files (roles/verl/files/flash_attn_shim)",
}


def tasks(node):
    """Every task dict in a tasks file, blocks included."""
    if isinstance(node, list):
        for item in node:
            yield from tasks(item)
    elif isinstance(node, dict):
        if "name" in node and not any(key in node for key in ("block", "rescue", "always")):
            yield node
        for key in ("block", "rescue", "always"):
            yield from tasks(node.get(key) or [])


def command_text(task: dict) -> str | None:
    """The task's command as one string (argv joined, a template as written), None for a task running none."""
    for module in (
        "ansible.builtin.command",
        "ansible.builtin.shell",
        "command",
        "shell",
        "p40fleet.fleet.fleet_state_owner_run",
    ):
        if module in task:
            value = task[module]
            if isinstance(value, str):
                return value
            argv = value.get("argv")
            if isinstance(argv, list):
                return " ".join(str(word) for word in argv)
            return str(argv if argv is not None else value.get("cmd", ""))
    return None


def pip_installs() -> list[tuple[str, str, str]]:
    found = []
    for path in TASK_FILES:
        for task in tasks(yaml.safe_load(path.read_text()) or []):
            text = command_text(task)
            if text is None:
                continue
            words = re.sub(r"[\[\],'\"]", " ", text).split()
            if any(words[i] == "pip" and words[i + 1] == "install" for i in range(len(words) - 1)):
                found.append((str(path.relative_to(REPO_ROOT)), task["name"], text))
    return found


def test_the_scan_sees_every_role_that_installs_with_pip():
    roles = {path.split("/")[1] for path, _, _ in pip_installs()}
    assert {"pytorch", "apex", "verl"} <= roles, roles


def test_no_pip_install_runs_without_require_hashes():
    unhashed = [
        f"{path}: {name}"
        for path, name, text in pip_installs()
        if "--require-hashes" not in text and name not in LOCAL_TREES
    ]
    assert not unhashed, "pip install without --require-hashes:\n" + "\n".join(unhashed)


def test_the_local_tree_installs_install_nothing_else():
    seen = {name: text for _, name, text in pip_installs() if name in LOCAL_TREES}
    assert set(seen) == set(LOCAL_TREES), f"listed but gone: {set(LOCAL_TREES) - set(seen)}"
    for name, text in seen.items():
        assert "--no-deps" in text and "--no-build-isolation" in text, name


def test_no_role_uses_the_pip_module():
    users = [
        str(path.relative_to(REPO_ROOT))
        for path in TASK_FILES
        for task in tasks(yaml.safe_load(path.read_text()) or [])
        if "ansible.builtin.pip" in task or "pip" in task
    ]
    assert not users, users


def test_the_apex_wheel_check_runs_with_the_system_python_not_the_owners():
    build = yaml.safe_load((REPO_ROOT / "roles" / "apex" / "tasks" / "build.yml").read_text())
    (task,) = [t for t in tasks(build) if t["name"] == "List the extension modules in the built wheel"]
    # A root-side module, run by the host's system Python (apex_system_python), never the env owner's.
    assert task["vars"]["ansible_python_interpreter"] == "{{ apex_system_python }}"
    assert "p40fleet_conda_python" not in str(task)
    # As root, on root's own copies of the wheel and the log (in directories only root writes), never the owner's.
    assert task["become"] is True and "become_user" not in task
    check = task["p40fleet.fleet.apex_wheel_check"]
    assert check["wheel"].startswith("{{ apex_built_stage_dir }}/")
    assert check["build_log"] == "{{ apex_build_log_path }}"
