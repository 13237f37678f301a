"""apex's reading of the owner's probe (plugins/filter/apex.py), without hosts.

The probe runs as the env owner, so its report is whatever that account prints. Each case is a report the owner
could forge: a build key field that would name another directory, a count that would set MAX_JOBS to anything, a
report of the wrong shape. Root must refuse each, naming the host and the field, and derive the key and MAX_JOBS
only from fields of the expected shape; a genuine report keeps the key converged hosts were recorded with.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import yaml
from ansible.errors import AnsibleFilterError

from p40fleet_dev.paths import REPO_ROOT
from tests.source_modules import load_module
from tests.test_owner_boundary import tasks_of

ROLE = REPO_ROOT / "roles" / "apex"
PROBE = REPO_ROOT / "owner_scripts" / "apex_probe.py"
rules = load_module(REPO_ROOT / "plugins" / "filter" / "apex.py", "apex_filters")
state_rules = load_module(REPO_ROOT / "plugins" / "filter" / "fleet_state.py", "fleet_state_filters")
COMMIT = "0123456789abcdef0123456789abcdef01234567"
GENUINE = {
    "python": "3.10",
    "torch": "2.6.0+cu118",
    "nvcc": "11.8",
    "apex": "0.1",
    "marker": {"key": "py3.10-torch2.6.0+cu118-cuda11.8-arch6.1-cpp1cuda1-apex0123456789ab"},
    "cpus": 16,
    "mem_gib": 62,
}


def reading(report, rc=0):
    return rules.apex_probe_reading(json.dumps(report) if not isinstance(report, str) else report, rc, "node7")


def key(found):
    return rules.apex_build_key(found, "6.1", True, True, COMMIT)


def test_a_genuine_report_keeps_the_key_converged_hosts_recorded():
    found = reading(GENUINE)
    assert key(found) == GENUINE["marker"]["key"] == found["marker_key"]
    assert rules.apex_build_jobs(found, 0, 6) == 10  # 62 GiB / 6 per job, under 16 cores


def test_a_probe_that_failed_reads_as_unknown_with_the_keys_question_marks():
    found = reading("Traceback (most recent call last): ...", rc=1)
    assert found["known"] is False
    assert key(found) == "py_-torch_-cuda_-arch6.1-cpp1cuda1-apex0123456789ab"
    assert rules.apex_build_jobs(found, 0, 6) == 1


def test_an_env_without_torch_or_nvcc_reads_as_empty_fields():
    found = reading({**GENUINE, "torch": "", "nvcc": "", "apex": "", "marker": {}})
    assert (found["torch"], found["nvcc"], found["apex"], found["marker_key"]) == ("", "", "", "")
    assert key(found) == "py3.10-torch-cuda-arch6.1-cpp1cuda1-apex0123456789ab"


@pytest.mark.parametrize(
    ("forged", "field"),
    [
        ({"python": "3.10/../../../etc"}, "python"),
        ({"python": ""}, "python"),
        ({"torch": "2.6.0+cu118/../../x"}, "torch"),
        ({"torch": ["2.6.0"]}, "torch"),
        ({"nvcc": "11.8; rm -rf /"}, "nvcc"),
        ({"apex": "0.1\n"}, "apex"),
        ({"marker": {"key": "../../../etc/cron.d"}}, "the installed build key"),
        ({"marker": "py3.10"}, "marker"),
        ({"cpus": 10**9}, "cpus"),
        ({"cpus": 0}, "cpus"),
        ({"cpus": True}, "cpus"),
        ({"cpus": "16"}, "cpus"),
        ({"mem_gib": -1}, "mem_gib"),
        ({"mem_gib": 2.5}, "mem_gib"),
    ],
)
def test_a_forged_field_is_refused_naming_the_host_and_the_field(forged, field):
    with pytest.raises(AnsibleFilterError) as refused:
        reading({**GENUINE, **forged})
    assert str(refused.value).startswith(f"node7: the env's Apex probe reported {field} ")


@pytest.mark.parametrize("stdout", ["not json", "[1, 2]", '"3.10"', ""])
def test_a_report_of_another_shape_is_refused(stdout):
    with pytest.raises(AnsibleFilterError, match=r"^node7: the env's Apex probe reported "):
        reading(stdout)


@pytest.mark.parametrize(
    ("max_jobs", "cpus", "mem_gib", "jobs"),
    [(0, 16, 62, 10), (0, 4, 62, 4), (0, 16, 3, 1), (0, 1, 0, 1), (3, 4096, 65536, 3)],
)
def test_max_jobs_is_the_inventorys_or_what_cores_and_ram_allow(max_jobs, cpus, mem_gib, jobs):
    found = reading({**GENUINE, "cpus": cpus, "mem_gib": mem_gib})
    assert rules.apex_build_jobs(found, max_jobs, 6) == jobs


def test_the_real_probes_report_is_read():
    # The probe as the role runs it (an isolated Python), here with no torch, no nvcc and no marker.
    printed = subprocess.run(
        [sys.executable, "-I", str(PROBE), "/nonexistent", "/nonexistent/marker.json"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    found = reading(printed)
    assert found["known"] and found["python"] == "{}.{}".format(*sys.version_info[:2])
    assert found["cpus"] >= 1 and found["marker_key"] == ""


def test_the_role_reads_the_probe_only_through_the_filter():
    tasks = yaml.safe_load((ROLE / "tasks" / "probe.yml").read_text())
    text = json.dumps(tasks)
    assert "apex_probe_reading" in text and "apex_build_key" in text and "apex_build_jobs" in text
    assert "apex_probe.stdout | from_json" not in text


# --- The controller cache: a wheel is installed only as its build recorded it -------------------------------------
WHEEL = "apex-0.1-cp310-cp310-linux_x86_64.whl"
WHEEL_SHA = "a" * 64
CACHE_KEY = GENUINE["marker"]["key"]
RECORD_PATH = f"/ctl/apex-wheels/{CACHE_KEY}/record.json"
RECORD = {
    "key": CACHE_KEY,
    "wheel": WHEEL,
    "sha256": WHEEL_SHA,
    "builder": "node1",
    "build_account": "p40fleet-build",
    "commit": COMMIT,
    "date": "2026-12-05T13:00:00Z",
}


def verdict(record, sha=WHEEL_SHA, wheel=WHEEL):
    text = record if isinstance(record, str) else json.dumps(record)
    return rules.apex_cache_verdict(text, wheel, sha, CACHE_KEY, RECORD_PATH, "p40fleet-build")


def test_the_wheel_its_build_recorded_is_accepted_with_its_record():
    assert verdict(RECORD) == {"problem": "", "record": RECORD}


@pytest.mark.parametrize(
    ("case", "record", "sha", "wheel"),
    [
        # A malicious builder's wheel: its bytes are not the ones the controller recorded.
        ("tampered_wheel", RECORD, "b" * 64, WHEEL),
        ("record_for_another_key", {**RECORD, "key": "py3.11-other"}, WHEEL_SHA, WHEEL),
        ("record_for_another_file", {**RECORD, "wheel": "apex-0.2-py3-none-any.whl"}, WHEEL_SHA, WHEEL),
        ("sum_that_is_no_sha256", {**RECORD, "sha256": "A" * 64}, "A" * 64, WHEEL),
        ("record_without_a_sum", {k: v for k, v in RECORD.items() if k != "sha256"}, WHEEL_SHA, WHEEL),
        ("no_sum_read", RECORD, "", WHEEL),
    ],
)
def test_a_wheel_its_record_does_not_vouch_for_is_refused(case, record, sha, wheel):
    judged = verdict(record, sha, wheel)
    assert judged["record"] == {}
    # The words test_python_stack.py's sandbox run asserts on every host.
    assert judged["problem"].startswith(f"has sha256 {sha or '?'}, but its build recorded ")
    assert f"(built by {record.get('builder', '?')} on {record.get('date', '?')})" in judged["problem"]


@pytest.mark.parametrize(
    ("case", "record", "named"),
    [
        # What the env owner's build recorded before the build account: its sum is whatever that owner produced.
        ("entry_built_by_the_env_owner", {k: v for k, v in RECORD.items() if k != "build_account"}, "?"),
        ("entry_naming_another_account", {**RECORD, "build_account": "p40fleet"}, "p40fleet"),
        ("entry_naming_no_string", {**RECORD, "build_account": ["p40fleet-build"]}, '["p40fleet-build"]'),
    ],
)
def test_a_cache_entry_the_build_account_did_not_build_is_refused(case, record, named):
    judged = verdict(record)
    assert judged == {
        "problem": f"was not built by the throwaway build account p40fleet-build: its record ({RECORD_PATH}) names "
        f"{named} (built by node1 on 2026-12-05T13:00:00Z)",
        "record": {},
    }


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("", f"has no build record ({RECORD_PATH})"),
        ("{}", f"has no build record ({RECORD_PATH})"),
        ("not json", f"has a build record that is no JSON object ({RECORD_PATH})"),
        ('["a"]', f"has a build record that is no JSON object ({RECORD_PATH})"),
    ],
)
def test_a_cache_entry_without_a_record_is_refused(text, problem):
    assert verdict(text) == {"problem": problem, "record": {}}


def test_a_forged_records_text_reaches_the_message_without_control_characters():
    judged = verdict({**RECORD, "sha256": "x", "builder": "node1\x1b[2J\x07"})
    assert "\x1b" not in judged["problem"] and "\x07" not in judged["problem"]
    assert "(built by node1[2J on " in judged["problem"]


def test_the_role_installs_only_through_the_verdict():
    text = (ROLE / "tasks" / "install.yml").read_text()
    assert "apex_cache_verdict(" in text and 'apex_wheel_record: "{{ apex_cache_judged.record }}"' in text
    assert "b64decode | from_json" not in text


# --- The throwaway build account ---------------------------------------------------------------------------------
COMMENT = "p40fleet throwaway Apex build account"
OURS = ["x", "998", "998", COMMENT, "/var/lib/p40fleet/apex-build", "/usr/sbin/nologin"]


@pytest.mark.parametrize(
    ("entry", "state"),
    [(None, "absent"), (OURS, "ours"), ([*OURS[:5], "/bin/false"], "ours")],
)
def test_the_build_account_is_made_afresh_when_absent_or_left_by_an_interrupted_build(entry, state):
    found = state_rules.fleet_state_throwaway_found(
        entry, "p40fleet-build", "p40fleet", COMMENT, "apex_build_account", "an Apex build", "node7"
    )
    assert found == state


@pytest.mark.parametrize(
    ("account", "entry", "message"),
    [
        # Someone's account of that name: p40fleet would remove it after the build.
        ("p40fleet-build", ["x", "1001", "1001", "Ann", "/home/ann", "/bin/bash"], "an account p40fleet-build exists"),
        ("p40fleet-build", [*OURS[:5], "/bin/bash"], "an account p40fleet-build exists"),
        ("p40fleet", None, "apex_build_account is 'p40fleet'. Required: a plain account name of its own"),
        ("root", None, "apex_build_account is 'root'."),
        ("../etc", None, "apex_build_account is '../etc'."),
        ("", None, "apex_build_account is ''."),
    ],
)
def test_an_account_root_did_not_make_for_the_build_is_refused(account, entry, message):
    with pytest.raises(AnsibleFilterError) as raised:
        state_rules.fleet_state_throwaway_found(
            entry, account, "p40fleet", COMMENT, "apex_build_account", "an Apex build", "node7"
        )
    assert str(raised.value).startswith(f"node7: {message}")


@pytest.mark.parametrize(
    ("listed", "count"),
    [
        ("", 0),
        (f"{WHEEL}\napex-0.1-cp310-cp310-linux_aarch64.whl\n", 2),
        # A name the account chose to make root write elsewhere, or that is no wheel.
        ("../../etc/cron.d/apex-0.1-cp310-cp310-linux_x86_64.whl\n", 1),
        ("apex-0.1.tar.gz\n", 1),
        ("apex-0.1-cp310-cp310-linux_x86_64.whl\x1b[2J\n", 1),
    ],
)
def test_the_build_leaves_one_wheel_of_the_expected_name_or_is_refused(listed, count):
    assert rules.apex_built_wheel_name(f"{WHEEL}\n", "node7", "/b/wheels") == WHEEL
    with pytest.raises(AnsibleFilterError) as raised:
        rules.apex_built_wheel_name(listed, "node7", "/b/wheels")
    assert str(raised.value).startswith(f"node7: the Apex build left {count} file(s) in /b/wheels (")
    assert "\x1b" not in str(raised.value)


def test_the_env_owner_runs_nothing_of_the_build_and_the_account_is_always_removed():
    tasks = yaml.safe_load((ROLE / "tasks" / "build.yml").read_text())
    (build,) = [t for t in tasks if "block" in t]
    steps = [*tasks, *build["block"], *build["always"]]
    runs = [t["p40fleet.fleet.fleet_state_owner_run"] for t in steps if "p40fleet.fleet.fleet_state_owner_run" in t]
    assert len(runs) >= 5 and {run["owner"] for run in runs} == {"{{ apex_build_account }}"}
    # fleet_state's shared throwaway tasks make the account and its fresh 0700 directory first and remove both last.
    made, removed = tasks[tasks.index(build) - 2]["ansible.builtin.include_role"], build["always"][-1]
    assert made["tasks_from"] == "throwaway_account"
    assert removed["ansible.builtin.include_role"]["tasks_from"] == "throwaway_account_remove"
    throwaway = tasks[tasks.index(build) - 2]["vars"]
    assert removed["vars"] == throwaway
    assert throwaway["fleet_state_throwaway_account"] == "{{ apex_build_account }}"
    assert throwaway["fleet_state_throwaway_home"] == "{{ apex_build_dir }}"
    shared = yaml.safe_load((REPO_ROOT / "roles" / "fleet_state" / "tasks" / "throwaway_account.yml").read_text())
    home = shared[-1]["p40fleet.fleet.fleet_state_path"]["batch"][-1]
    assert home == {
        "path": "{{ fleet_state_throwaway_home }}",
        "owner": "{{ fleet_state_throwaway_account }}",
        "mode": "0700",
    }


def apex_tasks():
    """Every task of the role's task files, blocks opened, with its file's name."""
    for path in sorted((ROLE / "tasks").glob("*.yml")):
        yield from tasks_of(yaml.safe_load(path.read_text()), path.name)


def test_the_build_runs_root_s_builder_env_never_the_env_s_python_or_torch():
    # The env's owner can change the env's torch (torch.utils.cpp_extension compiles every extension): nothing the
    # build account runs, nor its environment, names the env; what Python it runs is the builder env's.
    account_runs = [
        (name, task["p40fleet.fleet.fleet_state_owner_run"])
        for task, name in apex_tasks()
        if task.get("p40fleet.fleet.fleet_state_owner_run", {}).get("owner") == "{{ apex_build_account }}"
    ]
    assert {name for name, _ in account_runs} == {"build.yml"} and len(account_runs) >= 5
    for _, run in account_runs:
        text = yaml.safe_dump(run)
        assert "conda_env" not in text, text
    pythons = [run["argv"] for _, run in account_runs if "python" in yaml.safe_dump(run["argv"])]
    assert len(pythons) == 2  # the torch load check and pip wheel
    assert pythons[0][0] == "{{ apex_builder_python }}"
    assert "{{ apex_builder_python | quote }} -I -m pip wheel --no-build-isolation" in pythons[1][2]
    variables = yaml.safe_load((ROLE / "vars" / "main.yml").read_text())
    assert variables["apex_builder_python"] == "{{ apex_builder_prefix }}/bin/python"
    assert "conda_env" not in variables["apex_build_environment"]
    assert "apex_builder_prefix ~ '/bin:'" in variables["apex_build_environment"]
    # The builder env is root's: made by root alone (no account runs anything there), in root's state tree.
    builder = [task for task, name in apex_tasks() if name == "builder_env.yml"]
    assert builder and not [t for t in builder if "p40fleet.fleet.fleet_state_owner_run" in t or "become_user" in t]
    # Its Python is checked against the env's pin (p40fleet_python_version), never run from the env.
    assert not re.search(r"conda_env_(python(?!_version)|prefix)", (ROLE / "tasks" / "builder_env.yml").read_text())
    assert yaml.safe_load((ROLE / "defaults" / "main.yml").read_text())["apex_builder_prefix"].startswith(
        "{{ p40fleet_state_dir }}/"
    )
    # Made first in the build's block: the account is removed however it ends.
    (build,) = [t for t in yaml.safe_load((ROLE / "tasks" / "build.yml").read_text()) if "block" in t]
    assert build["block"][0]["ansible.builtin.include_tasks"] == "builder_env.yml"


def test_the_builder_env_installs_the_torch_lock_from_wheels_with_hashes_as_root():
    tasks = yaml.safe_load((ROLE / "tasks" / "builder_env.yml").read_text())
    (made,) = [t for t in tasks if "block" in t]
    commands = [t["ansible.builtin.command"]["argv"] for t in made["block"] if "ansible.builtin.command" in t]
    installer, pip_install, _check = commands
    # The verified installer (artifact_fetch's), batch, into the builder prefix, with a clean environment.
    assert installer[:2] == ["/usr/bin/env", "-i"]
    assert installer[-5:] == ["{{ conda_env_installer_path }}", "-b", "-u", "-p", "{{ apex_builder_prefix }}"]
    for flag in ("'--require-hashes'", "'--no-deps'", "'--only-binary', ':all:'", "pytorch_lock_pip_options"):
        assert flag in pip_install
    variables = yaml.safe_load((ROLE / "vars" / "main.yml").read_text())
    assert variables["apex_builder_requirements_content"] == (
        "{{ pytorch_lock_content ~ apex_build_requirements_content }}"
    )
    for pin in ("conda_env_installer_sha256", "pytorch_lock_digest", "apex_build_requirements_content"):
        assert pin in variables["apex_builder_digest"]
    # The marker is the last thing made: an interrupted builder env has none and is made afresh.
    assert "p40fleet.fleet.fleet_state_path" in made["block"][-1] and made["block"][-1][
        "p40fleet.fleet.fleet_state_path"
    ]["content"] == ("{{ apex_builder_digest }}")
