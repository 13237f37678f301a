"""No role reads another role's variables except a fact that role publishes (issue 59). Read from the files, no
containers.

A role's variables start with its name. The scan lists every Jinja read, in a role's tasks, templates, defaults,
vars and meta and in playbooks/*.yml, of a variable that starts with another role's name, and every write (a task's
`vars:` or a `set_fact`) into one outside a call of that role. A read is allowed when the owning role publishes the
variable as a fact: it sets it (set_fact, register, or its preflight plugin), names it in a `Publishes ...` line of
its meta/argument_specs.yml, and has no input, default or role var of that name (so the read cannot fall back to
the role's defaults). roles/p40fleet_defaults holds the shared settings every role reads; it is no role's here.

What is not clean yet is in ALLOWED, by reader and owner, each with its reason: the list only shrinks (an entry the
scan no longer finds fails, so a rework that removes a read must remove its entry too).
"""

from __future__ import annotations

import re
from functools import cache

import yaml

from p40fleet_dev.paths import REPO_ROOT

ROLES_DIR = REPO_ROOT / "roles"
SHARED = "p40fleet_defaults"
ROLES = sorted(p.name for p in ROLES_DIR.iterdir() if p.is_dir() and p.name != SHARED)
PARTS = ("tasks", "templates", "defaults", "vars", "meta", "handlers")
# Values that are Jinja expressions without braces.
BARE = {"when", "that", "failed_when", "changed_when", "until"}
SET_FACT = ("ansible.builtin.set_fact", "set_fact")
CALL_ROLE = ("ansible.builtin.include_role", "ansible.builtin.import_role", "include_role", "import_role")
BLOCK = re.compile(r"\{\{(.*?)\}\}|\{%(.*?)%\}", re.DOTALL)
QUOTED = re.compile(r"'[^']*'|\"[^\"]*\"")
# hostvars[h].name reads another host's copy of the variable: a read all the same.
# The host's name may itself be an index (hostvars[members[0]].name): one level of nested brackets.
HOSTVARS = re.compile(r"hostvars\[(?:[^\[\]]|\[[^\]]*\])+\]\.([a-z_][a-z0-9_]*)")
NAME = re.compile(r"(?<![\w.])([a-z_][a-z0-9_]*)")

# Why an entry is still here. Each names the issue that removes it.
APEX_INSTALLER = "apex's builder env comes from conda_env's installer (issue 59: a shared setting or plan fact)"
CUDA = "cuda_toolkit publishes cuda_toolkit_home under its input's name (issue 59: p40fleet_cuda_home or a plan fact)"
PREFLIGHT_DIRS = "gpu_preflight sizes the disk from the stages' download dirs (issue 59: a published plan of each)"
# launch_script_plan is built from the earlier stages' variables (launch_script's defaults read them), so the play
# that asks for it still lists those roles.
LAUNCH = "launch_script's plan reads the stages' variables (issue 59: their plan facts, then cluster.yml lists none)"
LAUNCH_INPUTS = "launch_script's inputs default to the stages' variables (issue 59: each stage's plan fact)"
# Not a shared setting: the checkout is verl_checkout_dir or verl_local_path as verl_source says, the verl role's
# own inputs; its release is p40fleet_verl_version, which verl_patches reads.
PATCH_INPUTS = "verl_patches' source dir defaults to the checkout the verl role derives (issue 59: a verl plan fact)"
PINS = "playbooks/pins.yml reports every role's pins from the roles' own variables, by design (it runs no task)"
CHECKLIST = "playbooks/verify.yml checks each stage's markers against the roles' own variables, by design"

# reader (a role, or a playbook's path) -> owner role -> (the variables it reads or writes, why).
ALLOWED: dict[str, dict[str, tuple[tuple[str, ...], str]]] = {
    "apex": {
        "conda_env": (
            (
                "conda_env_installer_path",
                "conda_env_installer_sha256",
                "conda_env_installer_url",
            ),
            APEX_INSTALLER,
        ),
        "pytorch": (
            (
                "pytorch_lock_content",
                "pytorch_lock_digest",
                "pytorch_lock_file",
                "pytorch_lock_pip_environment",
                "pytorch_lock_pip_options",
            ),
            "apex builds against pytorch's lock, read from pytorch's variables (issue 59: a pytorch plan fact)",
        ),
    },
    "gpu_preflight": {
        "conda_env": (("conda_env_download_dir",), PREFLIGHT_DIRS),
        "cuda_toolkit": (("cuda_toolkit_download_dir", "cuda_toolkit_tmpdir"), PREFLIGHT_DIRS),
        "cudnn": (("cudnn_download_dir", "cudnn_prefix"), PREFLIGHT_DIRS),
    },
    "launch_script": {
        "training_data": (
            ("training_data_model_path", "training_data_test_file", "training_data_train_file"),
            LAUNCH_INPUTS,
        ),
    },
    "playbooks/pins.yml": {
        role: (names, PINS)
        for role, names in {
            "apex": ("apex_build_requirements", "apex_enabled", "apex_find_links", "apex_git_commit", "apex_git_repo"),
            "artifact_fetch": ("artifact_fetch_controller_cache_dir",),
            "conda_env": ("conda_env_installer_sha256", "conda_env_installer_url"),
            "cuda_toolkit": (
                "cuda_toolkit_runfile_sha256",
                "cuda_toolkit_runfile_size_bytes",
                "cuda_toolkit_runfile_url",
            ),
            "cudnn": ("cudnn_tarball_sha256", "cudnn_tarball_url"),
            "pytorch": (
                "pytorch_extra_index_urls",
                "pytorch_index_url",
                "pytorch_lock_file",
                "pytorch_pip_find_links",
                "pytorch_pip_no_index",
                "pytorch_requirements",
            ),
            "verl": (
                "verl_expected_commit",
                "verl_find_links",
                "verl_git_ref",
                "verl_git_repo",
                "verl_install_vllm",
                "verl_lock_file",
                "verl_source",
            ),
        }.items()
    },
    "playbooks/verify.yml": {
        role: (names, CHECKLIST)
        for role, names in {
            "apex": ("apex_enabled",),
            "conda_env": ("conda_env_owner",),
            "cuda_toolkit": ("cuda_toolkit_default_link", "cuda_toolkit_home", "cuda_toolkit_version"),
            "cudnn": ("cudnn_prefix", "cudnn_version"),
            "pytorch": ("pytorch_cuda_tag", "pytorch_cuda_version", "pytorch_torch_version"),
            "verl": ("verl_checkout_dir", "verl_local_path", "verl_pinned_version", "verl_source"),
            "verl_patches": ("verl_patches_state_dir",),
        }.items()
    },
    "verl_patches": {
        "verl": (("verl_source_dir",), PATCH_INPUTS),
    },
}

# reader -> owner role -> (the variables it sets for that role outside a call of it, why).
ALLOWED_WRITES: dict[str, dict[str, tuple[tuple[str, ...], str]]] = {}

# playbook -> the roles it lists with `tags: [never]` only so that their variables are known.
ALLOWED_NEVER_ROLES: dict[str, tuple[tuple[str, ...], str]] = {
    "playbooks/cluster.yml": (("training_data",), LAUNCH),
    "playbooks/state.yml": (
        (
            "apex",
            "conda_env",
            "cuda_toolkit",
            "cudnn",
            "driver_hold",
            "host_prereqs",
            "launch_script",
            "pytorch",
            "training_data",
            "verl",
            "verl_patches",
        ),
        "the state probe reads each stage's markers from its role vars (issue 59: each stage's plan fact)",
    ),
}


def jinja_names(expression: str) -> set[str]:
    names = set(HOSTVARS.findall(expression))
    return names | set(NAME.findall(QUOTED.sub("''", expression)))


def template_names(text: str) -> set[str]:
    names = set()
    for match in BLOCK.finditer(text):
        names |= jinja_names(match[1] if match[1] is not None else match[2])
    return names


def walk(node, reads: set[str], writes: set[str], called: frozenset = frozenset()):
    """The names a YAML file's Jinja reads, and the variables its tasks set (outside calls of their own role)."""
    if isinstance(node, list):
        for item in node:
            walk(item, reads, writes, called)
    elif isinstance(node, dict):
        calls = frozenset((node[key] or {}).get("name") for key in CALL_ROLE if isinstance(node.get(key), dict)) | {
            node.get("role")
        }
        for key, value in node.items():
            if key in ("vars", *SET_FACT) and isinstance(value, dict):
                writes.update((name, calls) for name in value if name != "cacheable")
            if key in BARE:
                for item in value if isinstance(value, list) else [value]:
                    if isinstance(item, str):
                        reads.update(jinja_names(item))
            else:
                walk(value, reads, writes, calls)
    elif isinstance(node, str):
        reads.update(template_names(node))


def owner(name: str) -> str | None:
    return max((role for role in ROLES if name.startswith(role + "_")), key=len, default=None)


def sources():
    """(reader, path) for every file the scan reads."""
    for role in ROLES:
        for part in PARTS:
            for path in sorted((ROLES_DIR / role / part).rglob("*")):
                if path.is_file() and path.suffix in (".yml", ".yaml", ".j2"):
                    yield role, path
    for path in sorted((REPO_ROOT / "playbooks").glob("*.yml")):
        yield str(path.relative_to(REPO_ROOT)), path


@cache
def published(role: str) -> frozenset[str]:
    """The facts `role` publishes: named in a Publishes line, set by the role, and no input or role variable."""
    spec = yaml.safe_load((ROLES_DIR / role / "meta" / "argument_specs.yml").read_text())["argument_specs"]
    said, inputs = set(), set()
    for entry in spec.values():
        lines = entry.get("description") or []
        for line in [lines] if isinstance(lines, str) else lines:
            if "ublishes" in line:
                said |= {name for name in re.findall(r"\b[a-z_][a-z0-9_]*\b", line) if owner(name) == role}
        inputs |= set(entry.get("options") or {})
    for part in ("defaults", "vars"):
        for path in (ROLES_DIR / role / part).rglob("*.yml"):
            inputs |= set(yaml.safe_load(path.read_text()) or {})
    set_here = set()
    for path in (ROLES_DIR / role / "tasks").rglob("*.yml"):
        text = path.read_text()
        set_here |= set(re.findall(r"^\s*register:\s*([a-z_][a-z0-9_]*)", text, re.MULTILINE))
        reads, writes = set(), set()
        walk(yaml.safe_load(text), reads, writes)
        set_here |= {name for name, _ in writes}
    for plugin in (REPO_ROOT / "plugins").glob(f"*/{role}*.py"):
        set_here |= set(re.findall(r"[\"']([a-z_][a-z0-9_]*)[\"']", plugin.read_text()))
    return frozenset((said & set_here) - inputs)


def scan() -> tuple[dict, dict]:
    """reader -> owner -> names: the reads that are not of a published fact, and the writes."""
    reads_found: dict[str, dict[str, set[str]]] = {}
    writes_found: dict[str, dict[str, set[str]]] = {}
    for reader, path in sources():
        reads, writes = set(), set()
        if path.suffix == ".j2":
            reads = template_names(path.read_text())
        else:
            walk(yaml.safe_load(path.read_text()), reads, writes)
        for name in reads:
            role = owner(name)
            if role and role != reader and name not in published(role):
                reads_found.setdefault(reader, {}).setdefault(role, set()).add(name)
        for name, calls in writes:
            role = owner(name)
            if role and role != reader and role not in calls:
                writes_found.setdefault(reader, {}).setdefault(role, set()).add(name)
    return reads_found, writes_found


def flatten(table) -> dict[tuple[str, str], set[str]]:
    return {(reader, role): set(names) for reader, owners in table.items() for role, names in owners.items()}


def compare(found: dict, allowed: dict) -> list[str]:
    """What the scan found beyond the allowlist, and allowlist entries it no longer finds (the list only shrinks)."""
    found, allowed = flatten(found), {key: set(names) for key, (names, _) in flatten_allowed(allowed).items()}
    problems = [
        f"{reader} reads {role}'s {sorted(names - allowed.get((reader, role), set()))}"
        for (reader, role), names in sorted(found.items())
        if names - allowed.get((reader, role), set())
    ]
    problems += [
        f"{reader} no longer reads {role}'s {sorted(names - found.get((reader, role), set()))}: remove it from the list"
        for (reader, role), names in sorted(allowed.items())
        if names - found.get((reader, role), set())
    ]
    return problems


def flatten_allowed(table):
    return {(reader, role): entry for reader, owners in table.items() for role, entry in owners.items()}


def report(title: str, found: dict) -> None:
    print(f"\n{title}:")
    for (reader, role), names in sorted(flatten(found).items()):
        print(f"  {reader} -> {role}: {', '.join(sorted(names))}")


def test_no_role_reads_another_roles_variables_but_a_published_fact():
    reads, _ = scan()
    report("Reads of another role's variables that are not a published fact", reads)
    assert compare(reads, ALLOWED) == []


def test_no_role_sets_another_roles_variables():
    _, writes = scan()
    report("Variables set for another role outside a call of it", writes)
    assert compare(writes, ALLOWED_WRITES) == []


def test_no_play_lists_a_role_only_for_its_variables():
    found = {}
    for path in sorted((REPO_ROOT / "playbooks").glob("*.yml")):
        for play in yaml.safe_load(path.read_text()) or []:
            for entry in play.get("roles") or []:
                if isinstance(entry, dict) and entry.get("tags") in (["never"], "never"):
                    found.setdefault(str(path.relative_to(REPO_ROOT)), set()).add(entry["role"])
    allowed = {key: set(names) for key, (names, _) in ALLOWED_NEVER_ROLES.items()}
    assert found == allowed


def test_every_allowed_entry_says_why_and_names_its_issue_or_design():
    for table in (ALLOWED, ALLOWED_WRITES):
        for (reader, role), (names, why) in flatten_allowed(table).items():
            assert names and all(owner(name) == role for name in names), (reader, role)
            assert "issue 59" in why or "by design" in why or "preflight" in why, (reader, role, why)
    for playbook, (roles, why) in ALLOWED_NEVER_ROLES.items():
        assert roles and "issue 59" in why, playbook


def test_the_scan_finds_reads_and_writes_in_every_form():
    # The scan's own proof, on the forms the roles use: braces, bare conditions, hostvars, templates' blocks,
    # a task's vars and set_fact; quoted text and full filter names are no reads.
    task = yaml.safe_load(
        """
- name: x
  ansible.builtin.template: {src: "{{ launch_script_template }}", dest: /x}
  when: gpu_qualify_ready | bool
  vars:
    launch_script_nnodes: 2
- ansible.builtin.assert:
    that: ["hostvars[h].verl_version is defined", "hostvars[members[0]].ray_cluster_head == ''"]
    fail_msg: "{{ 'conda_env_quoted' ~ x | p40fleet.fleet.train_run_state }}"
- ansible.builtin.set_fact: {pytorch_thing: 1, cacheable: true}
- ansible.builtin.include_role: {name: apex, tasks_from: x}
  vars: {apex_input: 1}
"""
    )
    reads, writes = set(), set()
    walk(task, reads, writes)
    assert {"launch_script_template", "gpu_qualify_ready", "verl_version", "ray_cluster_head"} <= reads
    assert not {"conda_env_quoted", "train_run_state"} & reads
    assert {name for name, calls in writes if owner(name) not in calls} == {"launch_script_nnodes", "pytorch_thing"}
    assert template_names("{% for o in ray_cluster_x %}{{ o }}{# launch_script_y #}{% endfor %}") >= {"ray_cluster_x"}
    assert "launch_script_y" not in template_names("{# launch_script_y #}")
    # gpu_preflight publishes its profile; a role's input is never a published fact.
    assert "gpu_preflight_profile" in published("gpu_preflight")
    assert "gpu_preflight_strict" not in published("gpu_preflight")


def test_the_allowlist_only_shrinks():
    # A read the list allows but the scan no longer finds fails, as does one the list does not hold.
    allowed = {"cudnn": {"cuda_toolkit": (("cuda_toolkit_home",), CUDA)}}
    assert compare({}, allowed) == [
        "cudnn no longer reads cuda_toolkit's ['cuda_toolkit_home']: remove it from the list"
    ]
    assert compare({"cudnn": {"cuda_toolkit": {"cuda_toolkit_home"}}}, allowed) == []
    assert compare({"cudnn": {"cuda_toolkit": {"cuda_toolkit_home", "cuda_toolkit_x"}}}, allowed) == [
        "cudnn reads cuda_toolkit's ['cuda_toolkit_x']"
    ]
