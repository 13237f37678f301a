"""Bad input is found before any host is touched (exit code 4): -e parsed as ansible-playbook parses
it, the inventory parsed by ansible-inventory, and every literal value given to a role variable
checked against the role's argument spec. The hosts here are loopback port 9: contacting one would
make it unreachable, never pass."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from p40fleet import api, cli, inputs
from p40fleet.paths import SITE_PLAYBOOK
from p40fleet.run import ansible_env
from p40fleet.state import StateDir
from p40fleet_dev.paths import REPO_ROOT
from tests.source_modules import load_module

NOWHERE = {"ansible_host": "127.0.0.1", "ansible_port": 9}


@pytest.mark.parametrize(
    ("argument", "parsed"),
    [
        ("gpu_preflight_strict=false", {"gpu_preflight_strict": "false"}),
        ('a=1 b="two words" c=x=y', {"a": "1", "b": "two words", "c": "x=y"}),
        ('{"apex_enabled": false, "n": 3}', {"apex_enabled": False, "n": 3}),
        ("{apex_enabled: false, list: [1, 2]}", {"apex_enabled": False, "list": [1, 2]}),
    ],
)
def test_extra_vars_parse_as_ansible_playbook_parses_them(argument, parsed):
    extra = inputs.parse_extra_vars([argument])
    assert (extra.items, extra.problems) == ([parsed], [])


@pytest.mark.parametrize(
    ("argument", "problem"),
    [
        ("justaword", "'justaword' is not key=value"),
        ("{not: [closed", "not valid JSON/YAML"),
        ("[1, 2]", "expected a mapping"),
        ("@/no/such/file.yml", "/no/such/file.yml is not a file"),
        ('{"t": !vault "x"}', "can only be given in @FILE"),
    ],
)
def test_bad_extra_vars_are_named(argument, problem):
    extra = inputs.parse_extra_vars([argument])
    assert extra.items == [] and len(extra.problems) == 1 and problem in extra.problems[0]


def test_extra_var_files_pass_through_and_later_arguments_win(tmp_path):
    vaulted = tmp_path / "vault.yml"
    vaulted.write_text("$ANSIBLE_VAULT;1.1;AES256\n6162\n")
    plain = tmp_path / "vars.yml"
    plain.write_text("apex_enabled: maybe\ntoken: !vault |\n  $ANSIBLE_VAULT;1.1;AES256\n  6162\n")
    extra = inputs.parse_extra_vars([f"@{plain}", "apex_enabled=no", f"@{vaulted}"])
    assert extra.items == [plain, {"apex_enabled": "no"}, vaulted]
    merged = extra.for_validation()
    assert merged["apex_enabled"] == "no" and isinstance(merged["token"], inputs.Opaque)


def write_inventory(path: Path, hosts: dict, group_vars: dict | None = None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "hosts.yml").write_text(yaml.safe_dump({"all": {"children": {"p40-hosts": {"hosts": hosts}}}}))
    if group_vars:
        (path / "group_vars").mkdir()
        (path / "group_vars" / "p40-hosts.yml").write_text(yaml.safe_dump(group_vars))
    return path


def check(inventory: Path, arguments=(), limit=None, playbook=SITE_PLAYBOOK) -> inputs.CheckedInputs:
    return inputs.check_inputs(
        inventory.resolve(),
        ansible_env(inventory.resolve()),
        playbook,
        limit=limit,
        extra=inputs.parse_extra_vars(list(arguments)),
    )


def test_the_projects_own_inventory_and_defaults_pass():
    checked = check(REPO_ROOT / "inventory" / "hosts.example.yml")
    assert checked.problems == []
    assert checked.hosts == ["gpu-lab-07", "gpu-rack1-01", "gpu-rack1-02", "gpu-rack2-01"]
    specs = inputs.role_variable_specs()
    assert {"gpu_preflight_strict", "apex_enabled", "cuda_toolkit_installer_timeout"} <= set(specs)
    defaults = {}
    for path in (REPO_ROOT / "roles").glob("*/defaults/main.yml"):
        defaults.update(yaml.safe_load(path.read_text()) or {})
    literal = {k: v for k, v in defaults.items() if k in specs and inputs._is_literal(v)}
    assert len(literal) > 40
    assert {k: inputs.check_value(k, v, specs[k][1]) for k, v in literal.items()} == dict.fromkeys(literal)


def test_bad_values_name_the_host_the_variable_what_was_found_and_what_is_expected(tmp_path):
    inventory = write_inventory(
        tmp_path / "inv",
        {
            "node1": {**NOWHERE, "gpu_preflight_strict": "perhaps", "cuda_toolkit_installer_timeout": "{{ 60 * 5 }}"},
            "node2": {**NOWHERE, "apex_enabled": "sometimes"},
            "node3": dict(NOWHERE),
        },
        group_vars={"gpu_preflight_min_cpus": "many", "conda_env_python_version": "3.10"},
    )
    problems = check(inventory).problems
    assert len(problems) == 3, problems
    strict = next(p for p in problems if "gpu_preflight_strict" in p)
    assert strict.startswith("host node1: gpu_preflight_strict in the inventory: found 'perhaps'; expected a bool")
    assert "roles/gpu_preflight/meta/argument_specs.yml" in strict and "not a valid boolean" in strict
    # A group variable: one message naming every host that has it.
    cpus = next(p for p in problems if "gpu_preflight_min_cpus" in p)
    assert cpus.startswith("hosts node1, node2, node3: gpu_preflight_min_cpus in the inventory: found 'many'")
    assert "expected an int" in cpus
    assert any(p.startswith("host node2: apex_enabled") for p in problems)

    # -e wins over the inventory, and a string "false" is the bool it means.
    assert (
        check(inventory, ["gpu_preflight_strict=false", "apex_enabled=no", "gpu_preflight_min_cpus=2"]).problems == []
    )
    bad = check(inventory, ["gpu_preflight_min_cpus=2", "verl_patches_state=gone", "apex_enabled=0", "x=1"])
    assert len(bad.problems) == 2
    assert bad.problems[0].startswith("-e verl_patches_state: found 'gone'; expected a str, one of: present, absent")


def test_a_nested_value_is_checked_against_its_suboptions(tmp_path):
    profile = {"name": "x", "min_compute_cap": "6.0", "max_compute_cap": "6.2", "dtype": "bf16"}
    inventory = write_inventory(tmp_path / "inv", {"node1": {**NOWHERE, "gpu_preflight_profiles": [profile]}})
    (problem,) = check(inventory).problems
    assert (
        "gpu_preflight_profiles" in problem and "value of dtype must be one of: float32, float16, bfloat16" in problem
    )


def test_inventory_limit_and_play_target_problems(tmp_path):
    broken = tmp_path / "broken.yml"
    broken.write_text("all:\n  hosts:\n   node1: [\n")
    (problem,) = check(broken).problems
    assert problem.startswith(f"inventory {broken.resolve()} cannot be parsed:") and "YAML" in problem

    inventory = write_inventory(tmp_path / "inv", {"node1": dict(NOWHERE)})
    (problem,) = check(inventory, limit="node9").problems
    assert problem == (
        f"the limit 'node9' matches no host of {inventory.resolve()}: name a host or group it has "
        f"(`ansible-inventory -i {inventory.resolve()} --graph` lists them)"
    )

    elsewhere = tmp_path / "elsewhere.yml"
    elsewhere.write_text(yaml.safe_dump({"all": {"children": {"gpus": {"hosts": {"node1": NOWHERE}}}}}))
    (problem,) = check(elsewhere).problems
    assert "is in p40-hosts, which site.yml runs on: put the hosts in that group" in problem


def test_the_command_exits_4_before_any_host_is_touched(tmp_path, capsys):
    inventory = write_inventory(tmp_path / "inv", {"node1": {**NOWHERE, "apex_enabled": "sometimes"}})
    state = tmp_path / "state"
    report = tmp_path / "report.json"
    argv = ["run", "-i", str(inventory), "--state-dir", str(state), "--report", str(report)]
    assert cli.main([*argv, "-e", "verl_patches_state=gone"]) == cli.EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert "bad input, nothing was run and no host was contacted (2 problem(s))" in err
    assert "host node1: apex_enabled in the inventory: found 'sometimes'" in err
    assert "-e verl_patches_state: found 'gone'" in err
    # No run was started: no runner private dir, no last report; the report says why.
    assert StateDir(state).inventory(inventory).runs() == []
    assert StateDir(state).inventory(inventory).read_last_report() is None
    run = json.loads(report.read_text())["runs"][0]
    assert (run["exit_code"], run["status"], run["rc"], run["hosts"]) == (4, "bad-input", None, {})
    assert len(run["problems"]) == 2


@pytest.mark.parametrize("value", ["0", "-8"])
def test_a_batch_size_under_its_minimum_is_refused_before_contact(tmp_path, capsys, value):
    inventory = write_inventory(tmp_path / "inv", {"node1": dict(NOWHERE)})
    argv = ["run", "-i", str(inventory), "--state-dir", str(tmp_path / "state")]
    assert cli.main([*argv, "-e", f"launch_script_train_batch_size={value}"]) == cli.EXIT_BAD_INPUT
    err = " ".join(capsys.readouterr().err.split())
    assert f"-e launch_script_train_batch_size: found '{value}'; expected an int of at least 1" in err
    assert "must be at least 1 (plugins/plugin_utils/verl_batches.py, BATCH_MINIMUMS)" in err
    assert StateDir(tmp_path / "state").inventory(inventory).runs() == []


def test_the_minimums_are_the_filters_and_name_declared_int_variables():
    specs = inputs.role_variable_specs()
    filters = load_module(REPO_ROOT / "plugins" / "plugin_utils" / "verl_batches.py", "launch_minimums")
    assert inputs.minimums() == {f"launch_script_{k}": v for k, v in filters.BATCH_MINIMUMS.items()}
    for name in inputs.minimums():
        assert name in specs, name
    assert specs["launch_script_train_batch_size"][1]["type"] == "int"


def test_a_misspelled_role_variable_is_refused_with_the_names_it_is_closest_to(tmp_path, capsys):
    inventory = write_inventory(tmp_path / "inv", {"node1": {**NOWHERE, "verl_patches_profle": "p40"}})
    argv = ["run", "-i", str(inventory), "--state-dir", str(tmp_path / "state")]
    assert cli.main([*argv, "-e", "launch_script_train_batch_sise=64"]) == cli.EXIT_BAD_INPUT
    err = " ".join(capsys.readouterr().err.split())
    assert (
        "-e launch_script_train_batch_sise: no role declares it (roles/*/meta/argument_specs.yml), so no role would"
        " read it: did you mean launch_script_train_batch_size" in err
    )
    assert "host node1: verl_patches_profle in the inventory: no role declares it" in err
    assert "did you mean verl_patches_profile" in err


def test_names_the_roles_use_and_names_without_a_role_prefix_pass():
    specs = inputs.role_variable_specs()
    # conda_env_prefix: a fact the conda_env role publishes (an -e may pin it); the others are no role's.
    for name in ("conda_env_prefix", "launch_script_train_batch_size", "p40fleet_env_owner", "ansible_host", "x"):
        assert inputs.unknown_variable(name, specs) is None, name
    assert "check its name" in inputs.unknown_variable("cudnn_zzzz_qqqq", specs)


def test_a_moved_variable_is_refused_with_its_new_name(tmp_path, capsys):
    # The memory tiers moved from gpu_preflight to launch_script: an inventory that still sets the old name would
    # have its tiers ignored.
    assert inputs.RENAMED["gpu_preflight_launch_tiers"] in inputs.role_variable_specs()
    inventory = write_inventory(tmp_path / "inv", {"node1": {**NOWHERE, "gpu_preflight_launch_tiers": []}})
    assert cli.main(["run", "-i", str(inventory), "--state-dir", str(tmp_path / "state")]) == cli.EXIT_BAD_INPUT
    err = " ".join(capsys.readouterr().err.split())
    assert (
        "host node1: gpu_preflight_launch_tiers in the inventory: no role reads it any more: it is now"
        " launch_script_memory_tiers" in err
    )


def test_the_listing_is_reused_only_while_what_it_was_made_from_is_unchanged(tmp_path, monkeypatch):
    inventory = write_inventory(tmp_path / "inv", {"node1": dict(NOWHERE)}, group_vars={"apex_enabled": True})
    inventory = inventory.resolve()
    env, cache = ansible_env(inventory), tmp_path / "listings"
    started = []
    real_run = inputs.subprocess.run
    monkeypatch.setattr(inputs.subprocess, "run", lambda *a, **k: started.append(a) or real_run(*a, **k))

    def load(limit=None):
        return inputs.load_inventory(inventory, env, limit, playbook_dir=SITE_PLAYBOOK.parent, cache_dir=cache)

    assert load().hostvars["node1"]["apex_enabled"] is True and len(started) == 1
    assert load().hostvars["node1"]["apex_enabled"] is True and len(started) == 1
    (listing,) = cache.glob("listing-*.json")
    assert listing.stat().st_mode & 0o777 == 0o600
    # Another limit, a changed group_vars file, a changed environment: each is listed anew.
    assert load(limit="node1").hosts == ["node1"] and len(started) == 2
    (inventory / "group_vars" / "p40-hosts.yml").write_text("apex_enabled: false\n")
    assert load().hostvars["node1"]["apex_enabled"] is False and len(started) == 3
    env["ANSIBLE_TIMEOUT"] = "30"
    assert load().hostvars["node1"]["apex_enabled"] is False and len(started) == 4
    assert load().hostvars["node1"]["apex_enabled"] is False and len(started) == 4
    # What is more than files' text is never reused: a plugin's config, a script, a vaulted file.
    assert inputs.listing_key(inventory, [], env, None) is not None
    plugin = inventory / "more.yml"
    plugin.write_text("plugin: ansible.builtin.constructed\n")
    assert inputs.listing_key(inventory, [], env, None) is None
    plugin.write_text("all:\n  vars:\n    token: !vault |\n      $ANSIBLE_VAULT;1.1;AES256\n      6162\n")
    assert inputs.listing_key(inventory, [], env, None) is None
    plugin.write_text("all: {}\n")
    plugin.chmod(0o755)
    assert inputs.listing_key(inventory, [], env, None) is None


def test_kept_specs_are_the_specs_and_follow_the_files(tmp_path):
    roles = tmp_path / "roles"
    for role in ("a", "b"):
        (roles / role / "meta").mkdir(parents=True)
        (roles / role / "meta" / "argument_specs.yml").write_text(
            yaml.safe_dump({"argument_specs": {"main": {"options": {f"{role}_x": {"type": "int"}}}}})
        )
    fresh = inputs.role_variable_specs(roles)
    assert fresh == {"a_x": ("a", {"type": "int"}), "b_x": ("b", {"type": "int"})}
    assert (
        inputs.role_variable_specs(roles, tmp_path / "c") == fresh == inputs.role_variable_specs(roles, tmp_path / "c")
    )
    (roles / "b" / "meta" / "argument_specs.yml").write_text("argument_specs: {main: {options: {b_y: {type: str}}}}\n")
    assert inputs.role_variable_specs(roles, tmp_path / "c") == {
        "a_x": ("a", {"type": "int"}),
        "b_y": ("b", {"type": "str"}),
    }
    assert len(list((tmp_path / "c").glob("specs-*.json"))) == 1


def test_a_check_with_nothing_changed_imports_no_ansible(tmp_path):
    """Importing Ansible cost a run about a quarter of a second; with nothing changed the check needs none of it."""
    inventory = write_inventory(tmp_path / "inv", {"node1": {**NOWHERE, "apex_enabled": True}}).resolve()
    code = "\n".join(
        [
            "import sys",
            "from pathlib import Path",
            "from p40fleet import inputs, run",
            "from p40fleet.paths import SITE_PLAYBOOK",
            f"inventory, cache = Path({str(inventory)!r}), Path({str(tmp_path / 'c')!r})",
            "extra = inputs.parse_extra_vars([])",
            "checked = inputs.check_inputs(inventory, run.ansible_env(inventory), SITE_PLAYBOOK, extra=extra,"
            " cache_dir=cache)",
            "inputs.typed(extra)",
            "print(checked.problems, 'ansible' in sys.modules)",
        ]
    )

    def check_in_a_process() -> str:
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()

    assert check_in_a_process() == "[] True"  # the first check validates, with Ansible's validator
    assert check_in_a_process() == "[] False"


def test_verdicts_are_kept_by_value_and_spec(tmp_path, monkeypatch):
    inventory = write_inventory(tmp_path / "inv", {"node1": {**NOWHERE, "apex_enabled": "sometimes"}})
    checked = []
    real_check = inputs.check_value
    monkeypatch.setattr(inputs, "check_value", lambda *a: checked.append(a[0]) or real_check(*a))

    def problems():
        return inputs.check_inputs(
            inventory.resolve(), ansible_env(inventory.resolve()), SITE_PLAYBOOK, cache_dir=tmp_path / "c"
        ).problems

    (first,) = problems()
    assert "apex_enabled" in first and "apex_enabled" in checked
    checked.clear()
    assert problems() == [first] and checked == []
    # A changed value is checked again.
    write_inventory(tmp_path / "inv", {"node1": {**NOWHERE, "apex_enabled": True}})
    assert problems() == [] and checked == ["apex_enabled"]


@pytest.mark.parametrize(
    ("given", "value"),
    [(5, 5), ("5", 5), ("25%", "25%"), ("1,10%,50%", [1, "10%", "50%"]), ([1, "5"], [1, 5])],
)
def test_serial_takes_counts_percentages_and_lists(given, value):
    assert api._serial_value(given) == value


@pytest.mark.parametrize("given", ["0", "x", "150%", "", "1,,y"])
def test_a_bad_serial_is_refused(given):
    with pytest.raises(ValueError, match="--serial"):
        api._serial_value(given)


def test_batches_and_forks_reach_the_play(tmp_path):
    inventory = tmp_path / "hosts.yml"
    inventory.write_text(
        "all:\n  hosts:\n    localhost:\n      ansible_connection: local\n"
        "      ansible_python_interpreter: '{{ ansible_playbook_python }}'\n"
    )
    out = tmp_path / "batches.json"
    playbook = REPO_ROOT / "python" / "tests" / "playbooks" / "local_batches.yml"
    result = api.provision(
        inventory,
        playbook=playbook,
        extra_vars=[f"p40fleet_test_out={out}"],
        serial="1,50%",
        max_fail_percentage=30,
        forks=3,
        state_dir=tmp_path / "state",
    )
    assert result.exit_code == api.EXIT_OK, result.run.stdout
    assert json.loads(out.read_text()) == {"serial": [1, "50%"], "max_fail_percentage": 30}
    command = json.loads((result.artifact_dir / "command").read_text())["command"]
    assert command[command.index("--forks") + 1] == "3"

    refused = api.provision(
        inventory, playbook=playbook, serial="many", max_fail_percentage=101, forks=0, state_dir=tmp_path / "state"
    )
    assert refused.exit_code == api.EXIT_BAD_INPUT and len(refused.problems) == 3, refused.problems


def test_key_value_strings_become_the_type_the_role_variable_has():
    extra = inputs.parse_extra_vars(
        [
            "apex_enabled=false cuda_toolkit_installer_timeout=60 verl_pinned_version=0.5.0 other=1",
            '{"apex_enabled": "no"}',
            "gpu_preflight_min_cpus=many",
        ]
    )
    assert inputs.typed(extra) == [
        {"apex_enabled": False, "cuda_toolkit_installer_timeout": 60, "verl_pinned_version": "0.5.0", "other": "1"},
        {"apex_enabled": "no"},  # JSON/YAML values are passed as they were typed
        {"gpu_preflight_min_cpus": "many"},  # refused before the run, never guessed at
    ]
