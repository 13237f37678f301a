"""No Ansible module runs as the env owner (docs/privileges.md), read from the roles' and playbooks' own files.

A task with `become_user: <owner>` runs its module in the system Python as the owner, which imports the owner's
~/.local usercustomize and .pth files: the owner can then write the module's result, ansible_facts included, and
Ansible makes them host facts. The owner's work goes through fleet_state_owner_run (run as root; the owner's
process is its child and returns rc and output as data). The forged result on a real host:
faults/test_privileges.py::test_a_forged_module_result_from_the_owners_python_hands_nothing_to_the_owner.
"""

from __future__ import annotations

import pytest
import yaml

from p40fleet_dev.paths import REPO_ROOT

# Keywords that hold tasks, and the ones that only include other files (their tasks are read where they live).
NESTED = ("block", "rescue", "always")
PLAY_LISTS = ("pre_tasks", "tasks", "post_tasks", "handlers")
INCLUDES = {
    f"{prefix}{name}"
    for prefix in ("", "ansible.builtin.")
    for name in ("include_tasks", "import_tasks", "include_role", "import_role", "meta")
}
OWNER_RUN = "p40fleet.fleet.fleet_state_owner_run"


def tasks_of(items, where: str):
    """Every task in a list, blocks opened, with where it is."""
    for item in items or []:
        if not isinstance(item, dict):
            continue
        yield item, where
        for key in NESTED:
            yield from tasks_of(item.get(key), where)


def task_files():
    for path in sorted(REPO_ROOT.glob("roles/*/tasks/*.yml")) + sorted(REPO_ROOT.glob("roles/*/handlers/*.yml")):
        yield from tasks_of(yaml.safe_load(path.read_text()), str(path.relative_to(REPO_ROOT)))
    for path in [REPO_ROOT / "site.yml", *sorted(REPO_ROOT.glob("playbooks/*.yml"))]:
        for play in yaml.safe_load(path.read_text()) or []:
            if not isinstance(play, dict):
                continue
            where = str(path.relative_to(REPO_ROOT))
            yield play, where
            for key in PLAY_LISTS:
                yield from tasks_of(play.get(key), where)


def module_of(task: dict) -> str | None:
    keys = set(task) - {"name", "vars", "when", "tags", "register", "loop", "loop_control", "become", "become_user"}
    modules = [key for key in keys if "." in key or key in {"command", "shell", "copy", "file", OWNER_RUN}]
    return modules[0] if modules else None


def violations(entries) -> list[str]:
    """Tasks (or plays) that would run a module as an account other than root, or misuse fleet_state_owner_run."""
    found = []
    for task, where in entries:
        name = task.get("name", "(unnamed)")
        variables = task.get("vars") or {}
        if "become_user" in task or "ansible_become_user" in variables:
            user = task.get("become_user", variables.get("ansible_become_user"))
            nested = any(key in task for key in (*NESTED, *PLAY_LISTS, "roles"))
            module = module_of(task)
            if str(user).strip() != "root" and (nested or module not in INCLUDES):
                runs = module or "its tasks"
                found.append(f"{where}: {name}: become_user {user} runs {runs} in that account's Python")
        if OWNER_RUN in task:
            # `environment:` would reach root's module, not the owner's child: it goes in the module's options.
            if "environment" in task:
                found.append(f"{where}: {name}: environment belongs in {OWNER_RUN}'s options")
            if task.get("become") is not True:
                found.append(f"{where}: {name}: {OWNER_RUN} runs as root (become: true)")
    return found


def test_no_task_runs_a_module_as_the_env_owner():
    entries = list(task_files())
    assert sum(OWNER_RUN in task for task, _ in entries) >= 30, "the owner's tasks were not found"
    assert violations(entries) == []


@pytest.mark.parametrize(
    ("task", "message"),
    [
        (
            {"name": "probe", "ansible.builtin.command": {"argv": ["x"]}, "become": True, "become_user": "{{ o }}"},
            "become_user {{ o }} runs ansible.builtin.command",
        ),
        ({"name": "read", "ansible.builtin.slurp": {"src": "/x"}, "become_user": "p40fleet"}, "runs ansible.builtin"),
        ({"name": "blk", "block": [], "become_user": "p40fleet"}, "runs its tasks"),
        ({"name": "v", "ansible.builtin.git": {}, "vars": {"ansible_become_user": "p40fleet"}}, "become_user p40fleet"),
        ({"name": "e", OWNER_RUN: {}, "become": True, "environment": {"A": "1"}}, "environment belongs"),
        ({"name": "r", OWNER_RUN: {}}, "runs as root (become: true)"),
    ],
)
def test_the_check_catches_each_way_a_module_reaches_the_owner(task, message):
    (found,) = violations([(task, "roles/x/tasks/main.yml")])
    assert message in found


def test_root_tasks_and_includes_pass():
    fine = [
        {"name": "root", "ansible.builtin.command": {"argv": ["x"]}, "become": True},
        {"name": "as root", "ansible.builtin.command": {"argv": ["x"]}, "become": True, "become_user": "root"},
        {"name": "owner", OWNER_RUN: {"owner": "p40fleet", "argv": ["x"]}, "become": True},
    ]
    assert violations([(task, "roles/x/tasks/main.yml") for task in fine]) == []
