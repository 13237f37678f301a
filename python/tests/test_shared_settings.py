"""One name per shared setting: the env owner (p40fleet_env_owner), Miniconda's prefix (p40fleet_conda_prefix) and
the work directory (p40fleet_work_dir) live in roles/p40fleet_defaults, and every role derives its own variable from
them, so `qualify`, `train`, the cluster and site.yml act for the same owner (issues 58 and 59: the owner was both
p40fleet_env_owner and conda_env_owner, read back with three fallbacks, and `qualify` ran its load as `p40fleet`
for an inventory that set `conda_env_owner: trainer`). No containers: the roles are loaded on the controller.
"""

from __future__ import annotations

import re
import sys

import pytest
import yaml

from p40fleet import cli
from p40fleet.inputs import SHARED_SETTINGS, resolve_shared
from p40fleet.run import run_playbook
from p40fleet_dev.paths import REPO_ROOT
from tests.pins import DEFAULTS

ROLES = REPO_ROOT / "roles"
OWNER = DEFAULTS["p40fleet_env_owner"]
PREFIX = DEFAULTS["p40fleet_conda_prefix"]
# The owner's literal name where a role would restate it: a quoted or bare YAML value, or inside a home path.
OWNER_LITERAL = re.compile(
    rf"""(['"]){re.escape(OWNER)}\1|/home/{re.escape(OWNER)}\b|^\s*[\w-]+:\s+{re.escape(OWNER)}\s*$""", re.MULTILINE
)


def role_files():
    """Every role's defaults, vars and argument specs, but the shared settings' own home."""
    for role in sorted(ROLES.iterdir()):
        if role.name == "p40fleet_defaults":
            continue
        for pattern in ("defaults/*.yml", "vars/*.yml", "meta/argument_specs.yml"):
            yield from sorted(role.glob(pattern))


def test_no_role_restates_the_owner_the_prefix_or_the_work_dir():
    found = []
    for path in role_files():
        text = path.read_text()
        for match in OWNER_LITERAL.finditer(text):
            found.append(f"{path.relative_to(REPO_ROOT)}: the owner {match[0].strip()!r}")
        if PREFIX in text:
            found.append(f"{path.relative_to(REPO_ROOT)}: the prefix {PREFIX}")
        if "verl-runs" in text and "p40fleet_env_owner" not in text and "owner's home" not in text:
            found.append(f"{path.relative_to(REPO_ROOT)}: a work directory not derived from the owner")
    assert not found, "\n".join(found)


def test_the_scan_finds_a_restated_owner_and_prefix():
    # The scan's own proof: the forms the roles used to carry are caught.
    for text in (
        "launch_script_owner: \"{{ conda_env_owner | default('p40fleet') }}\"",
        "installed_marker: \"{{ launch_script_work_dir | default('/home/p40fleet/verl-runs', true) }}\"",
        "some_owner: p40fleet",
    ):
        assert OWNER_LITERAL.search(text), text
    assert not OWNER_LITERAL.search("conda_env_download_dir: /var/tmp/p40fleet\nname: p40fleet-ray")
    assert sum(1 for _ in role_files()) > 40


# --- How the owner is resolved: before contact (p40fleet's check of the inventory and -e) ---------------------

# given (a host's inventory variables with -e on top) -> (the shared settings resolved, refused role copies)
RESOLVED = {
    "nothing_set": ({}, {"p40fleet_env_owner": OWNER, "p40fleet_conda_prefix": PREFIX}, []),
    "the_shared_name": ({"p40fleet_env_owner": "trainer"}, {"p40fleet_env_owner": "trainer"}, []),
    # The role's copy agreeing with the shared name is harmless.
    "both_agree": (
        {"p40fleet_env_owner": "trainer", "conda_env_owner": "trainer"},
        {"p40fleet_env_owner": "trainer"},
        [],
    ),
    # README used to invite conda_env_owner: it moved the env only; qualify and train kept `p40fleet`.
    "the_old_name_alone": ({"conda_env_owner": "trainer"}, {"p40fleet_env_owner": OWNER}, ["conda_env_owner"]),
    "the_copies_disagree": (
        {"p40fleet_env_owner": "trainer", "conda_env_owner": "other", "launch_script_work_dir": "/srv/runs"},
        {"p40fleet_env_owner": "trainer", "p40fleet_work_dir": ""},
        ["conda_env_owner", "launch_script_work_dir"],
    ),
    "the_prefix": (
        {"conda_env_install_prefix": "/srv/conda"},
        {"p40fleet_conda_prefix": PREFIX},
        ["conda_env_install_prefix"],
    ),
    # The side CUDA: cuDNN, Apex, the launch script and preflight read p40fleet_cuda_home, never cuda_toolkit's copy.
    "the_cuda_home": (
        {"cuda_toolkit_home": "/opt/cuda"},
        {"p40fleet_cuda_home": "/usr/local/cuda-11.8"},
        ["cuda_toolkit_home"],
    ),
    # The env's name: the later stages find the env by p40fleet_conda_env_name, never conda_env's copy.
    "the_env_name": ({"conda_env_name": "other"}, {"p40fleet_conda_env_name": "verl-env"}, ["conda_env_name"]),
    # The env's Python: the torch and verl locks and Apex's builder follow p40fleet_python_version, never conda_env's.
    "the_python": (
        {"conda_env_python_version": "3.11"},
        {"p40fleet_python_version": DEFAULTS["p40fleet_python_version"]},
        ["conda_env_python_version"],
    ),
    "the_python_agrees": (
        {"p40fleet_python_version": "3.11", "conda_env_python_version": "3.11"},
        {"p40fleet_python_version": "3.11"},
        [],
    ),
    # The mirror: the pytorch, apex and verl mirror sources read p40fleet_mirror_base_url, never artifact_fetch's copy.
    "the_mirror": (
        {"artifact_fetch_mirror_base_url": "http://mirror.example.internal/b"},
        {"p40fleet_mirror_base_url": ""},
        ["artifact_fetch_mirror_base_url"],
    ),
    # Preflight's saved state: the state probe and the checklist read p40fleet_preflight_state_file, where
    # gpu_preflight saves it; neither role's copy.
    "the_preflight_state": (
        {"gpu_preflight_state_file": "/srv/preflight.fact", "fleet_state_preflight_state_file": "/srv/preflight.fact"},
        {"p40fleet_preflight_state_file": DEFAULTS["p40fleet_preflight_state_file"]},
        ["gpu_preflight_state_file", "fleet_state_preflight_state_file"],
    ),
    # The cluster: train and qualify group the hosts by p40fleet_cluster, never ray_cluster's copy.
    "the_cluster": ({"ray_cluster_name": "c1"}, {"p40fleet_cluster": ""}, ["ray_cluster_name"]),
    "the_cluster_agrees": ({"p40fleet_cluster": "c1", "ray_cluster_name": "c1"}, {"p40fleet_cluster": "c1"}, []),
    # The head: ray_cluster starts it and train starts a cluster job there, both by p40fleet_cluster_head.
    "the_head": ({"ray_cluster_head": "node2"}, {"p40fleet_cluster_head": ""}, ["ray_cluster_head"]),
    # verl's release: the launch script names p40fleet_verl_version, never the verl role's copy.
    "the_verl_release": (
        {"verl_pinned_version": "0.5.0"},
        {"p40fleet_verl_version": DEFAULTS["p40fleet_verl_version"]},
        ["verl_pinned_version"],
    ),
    # A value only the run can read (a template, a vaulted one) is left to the run.
    "a_template": ({"conda_env_owner": "{{ someone }}"}, {"p40fleet_env_owner": OWNER}, []),
}


@pytest.mark.parametrize("case", sorted(RESOLVED))
def test_the_shared_settings_resolve_and_a_disagreeing_copy_is_refused(case):
    given, expected, refused = RESOLVED[case]
    resolved, problems = resolve_shared(given)
    assert {name: resolved[name] for name in expected} == expected
    assert [problem.split(" ", 1)[0] for problem in problems] == refused
    for problem, old in zip(problems, refused, strict=True):
        assert f"set {SHARED_SETTINGS[old]}: {given[old]!r} instead" in problem, problem


# --- How the owner is resolved: in the plays (every role, as the playbooks load them) --------------------------

# role variable -> the shared setting it must follow
FOLLOWERS = {
    "conda_env_owner": "owner",
    "launch_script_owner": "owner",
    "train_run_owner": "owner",
    "training_data_owner": "owner",
    "ray_cluster_owner": "owner",
    "gpu_qualify_load_user": "owner",
    "apex_owner": "owner",
    "verl_patches_source_owner": "owner",
    "launch_script_cuda_home": "cuda_home",
    "conda_env_install_prefix": "prefix",
    "launch_script_work_dir": "work_dir",
    "conda_env_python_version": "python",
    "pytorch_lock_python_version": "python",
    "verl_lock_python_version": "python",
    "gpu_preflight_state_file": "preflight_state_file",
    "fleet_state_preflight_state_file": "preflight_state_file",
    "verl_patches_verl_version": "verl_version",
    "launch_script_verl_version": "verl_version",
}
# Each role alone in its play, as qualify.yml, train.yml and smoke.yml load them (without conda_env, whose copy
# used to be the fallback): role -> the variables it resolves (the load command's first word is the Python).
ROLE_NAMES = {
    "conda_env": ["conda_env_owner", "conda_env_install_prefix", "conda_env_python_version"],
    "pytorch": ["pytorch_lock_python_version"],
    "verl": ["verl_lock_python_version"],
    "launch_script": [
        "launch_script_owner",
        "launch_script_work_dir",
        "launch_script_python",
        "launch_script_cuda_home",
        "launch_script_verl_version",
    ],
    "training_data": ["training_data_owner", "training_data_python"],
    "apex": ["apex_owner"],
    "verl_patches": ["verl_patches_source_owner", "verl_patches_python", "verl_patches_verl_version"],
    "train_run": ["train_run_owner"],
    "ray_cluster": ["ray_cluster_owner", "ray_cluster_ray_bin"],
    "gpu_qualify": ["gpu_qualify_load_user", "gpu_qualify_load_command[0]"],
    "fleet_state": ["fleet_state_preflight_state_file"],
    "gpu_preflight": ["gpu_preflight_disk_checks", "gpu_preflight_state_file"],
}
# Each play loads one role for its variables only, as the playbooks list a role with `tags: [never]`;
# gpu_preflight (whose probe runs whatever the tags) through its read-only entry point instead.
PLAY = """\
- name: Resolve the shared settings with {role} alone
  hosts: p40-hosts
  gather_facts: false
  roles:
    - {{role: {role}, tags: [never]}}
  tasks:
    - name: Show what {role} resolved
      ansible.builtin.set_fact:
        resolved_{role}: "{{{{ {{{names}}} }}}}"
      tags: [always]
"""
PREFLIGHT_PLAY = """\
- name: Resolve the shared settings with gpu_preflight alone
  hosts: p40-hosts
  gather_facts: false
  tasks:
    - name: Load gpu_preflight's variables
      ansible.builtin.include_role:
        name: gpu_preflight
        tasks_from: saved
        public: true
      tags: [always]

    - name: Show what gpu_preflight resolved
      ansible.builtin.set_fact:
        resolved_gpu_preflight: "{{{{ {{{names}}} }}}}"
      tags: [always]
"""


def resolve_in_a_play(tmp_path, extra: dict) -> dict:
    inventory = tmp_path / "hosts.yml"
    host = {"ansible_connection": "local", "ansible_python_interpreter": sys.executable}
    inventory.write_text(yaml.safe_dump({"all": {"children": {"p40-hosts": {"hosts": {"node1": host}}}}}))
    playbook = tmp_path / "resolve.yml"
    plays = [
        (PREFLIGHT_PLAY if role == "gpu_preflight" else PLAY).format(
            role=role, names=", ".join(f"'{name.split('[')[0]}': {name}" for name in names)
        )
        for role, names in ROLE_NAMES.items()
    ]
    playbook.write_text("---\n" + "\n".join(plays))
    envvars = {
        "ANSIBLE_CACHE_PLUGIN": "memory",
        "ANSIBLE_ROLES_PATH": str(ROLES),
        "ANSIBLE_FILTER_PLUGINS": str(REPO_ROOT / "plugins" / "filter"),
        "ANSIBLE_LOOKUP_PLUGINS": str(REPO_ROOT / "plugins" / "lookup"),
    }
    result = run_playbook(playbook, inventory, extravars=extra, envvars=envvars)
    assert result.rc == 0, result.stdout[-3000:]
    resolved = {}
    for event in result.events:
        facts = event.get("event_data", {}).get("res", {}).get("ansible_facts", {})
        if event.get("event") == "runner_on_ok":
            for key, value in facts.items():
                if key.startswith("resolved_"):
                    resolved.update(value)
    assert len(resolved) == sum(map(len, ROLE_NAMES.values())), resolved
    return resolved


@pytest.mark.parametrize(
    "shared",
    [
        {
            "owner": OWNER,
            "prefix": PREFIX,
            "work_dir": "",
            "cuda_home": DEFAULTS["p40fleet_cuda_home"],
            "python": DEFAULTS["p40fleet_python_version"],
            "preflight_state_file": DEFAULTS["p40fleet_preflight_state_file"],
            "verl_version": DEFAULTS["p40fleet_verl_version"],
        },
        {
            "owner": "trainer",
            "prefix": "/srv/conda",
            "work_dir": "/srv/runs",
            "cuda_home": "/opt/cuda-11.8",
            "python": "3.11",
            "preflight_state_file": "/srv/facts/p40fleet_preflight.fact",
            "verl_version": "0.5.0",
        },
    ],
    ids=["defaults", "set"],
)
def test_every_role_follows_the_shared_settings(tmp_path, shared):
    extra = (
        {}
        if shared["owner"] == OWNER
        else {
            "p40fleet_env_owner": shared["owner"],
            "p40fleet_conda_prefix": shared["prefix"],
            "p40fleet_work_dir": shared["work_dir"],
            "p40fleet_cuda_home": shared["cuda_home"],
            "p40fleet_python_version": shared["python"],
            "p40fleet_preflight_state_file": shared["preflight_state_file"],
            "p40fleet_verl_version": shared["verl_version"],
        }
    )
    resolved = resolve_in_a_play(tmp_path, extra)
    assert {name: resolved[name] for name in FOLLOWERS} == {name: shared[kind] for name, kind in FOLLOWERS.items()}
    assert resolved["gpu_qualify_load_command"] == f"{shared['prefix']}/envs/verl-env/bin/python"
    # The stages after conda_env find its Python by the shared names, with conda_env not in the play.
    for name in ("launch_script_python", "training_data_python", "verl_patches_python"):
        assert resolved[name] == f"{shared['prefix']}/envs/verl-env/bin/python", name
    assert resolved["ray_cluster_ray_bin"] == f"{shared['prefix']}/envs/verl-env/bin/ray"
    disk = {check["purpose"].rsplit(", ", 1)[-1]: check for check in resolved["gpu_preflight_disk_checks"]}
    assert disk["p40fleet_conda_prefix"]["path"] == shared["prefix"]
    work_dir = shared["work_dir"] or f"/home/{shared['owner']}/verl-runs"
    assert disk["p40fleet_work_dir"]["installed_marker"] == f"{work_dir}/checkpoints"


# --- qualify: a failed owner lookup fails the host, with a clear message and a non-zero exit -------------------


def test_qualify_refuses_a_host_without_the_owners_account(tmp_path, capsys):
    inventory = tmp_path / "hosts.yml"
    host = {"ansible_connection": "local", "ansible_python_interpreter": sys.executable}
    inventory.write_text(yaml.safe_dump({"all": {"children": {"p40-hosts": {"hosts": {"node1": host}}}}}))
    owner = "p40fleet-no-such-owner"
    code = cli.main(
        ["qualify", "-i", str(inventory), "--state-dir", str(tmp_path / "state"), "-e", f"p40fleet_env_owner={owner}"]
    )
    captured = capsys.readouterr()
    out = captured.out + captured.err
    assert code == cli.EXIT_HOSTS_FAILED, out
    out = " ".join(out.split())
    assert 'node1: qualify stopped at "Refuse a host without the env owner\'s account"' in out, out
    assert f"the env owner '{owner}' (p40fleet_env_owner), who runs the qualification's load, has no account" in out


def test_train_refuses_a_role_copy_of_the_owner_before_contact(tmp_path, capsys):
    # `train start` used to start the runs as p40fleet (train_run_owner's fallback) on an env made for trainer.
    inventory = tmp_path / "hosts.yml"
    # Port 9 (discard) on loopback: a run that contacted the host would end unreachable (exit 3), not refused.
    host = {"ansible_host": "127.0.0.1", "ansible_port": 9, "conda_env_owner": "trainer"}
    inventory.write_text(yaml.safe_dump({"all": {"children": {"p40-hosts": {"hosts": {"node1": host}}}}}))
    code = cli.main(["train", "start", "-i", str(inventory), "--state-dir", str(tmp_path / "state")])
    captured = capsys.readouterr()
    out = " ".join((captured.out + captured.err).split())
    assert code == cli.EXIT_BAD_INPUT, out
    assert (
        "p40fleet train: host node1: conda_env_owner is 'trainer' but p40fleet_env_owner is 'p40fleet': "
        "set p40fleet_env_owner: 'trainer' instead"
    ) in out, out
