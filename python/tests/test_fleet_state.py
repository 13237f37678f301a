"""The state probe's decisions (roles/fleet_state), without hosts: drift, gates, records, identities, inputs."""

from __future__ import annotations

import glob
import json
import os
import threading

import pytest

from p40fleet_dev.paths import REPO_ROOT
from tests.pins import STAGES
from tests.source_modules import load_module

ROLE = REPO_ROOT / "roles" / "fleet_state"


probe_module = load_module(REPO_ROOT / "plugins" / "modules" / "fleet_state_probe.py", "fleet_state_probe")
specs_lookup = load_module(REPO_ROOT / "plugins" / "lookup" / "fleet_state_specs.py", "fleet_state_specs")


@pytest.fixture
def host(tmp_path):
    """A tiny host: a state dir and one stage's files."""
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "version.json").write_text('{"cuda": {"version": "11.8.20220929"}}')
    (tmp_path / "home" / "big.so").write_bytes(b"\0" * (probe_module.HASH_LIMIT + 1))
    os.symlink("cuda-11.8", tmp_path / "cuda")
    spec = {
        "inputs": {"cuda_toolkit_version": "11.8", "role_code_sha256": "abc"},
        "files": [str(tmp_path / "home" / "version.json"), str(tmp_path / "home" / "*.so"), str(tmp_path / "cuda")],
        "absent": [str(tmp_path / "installing")],
        "requires": [],
    }
    return tmp_path, spec


def run_probe(state_dir, stages, check_mode=False, preflight=None, run_tags=("all",), skip_tags=()):
    return probe_module.probe(
        {
            "state_dir": str(state_dir),
            "stages": stages,
            "preflight_state": preflight,
            "run_tags": list(run_tags),
            "skip_tags": list(skip_tags),
            "host": "node1",
        },
        check_mode,
    )


def record(state_dir, stages, stage, packages=()):
    return probe_module.record(
        {"state_dir": str(state_dir), "stages": stages, "stage": stage, "packages": list(packages)}, False
    )


def test_a_stage_without_a_record_drifts_and_converges_after_its_record(host):
    root, spec = host
    first = run_probe(root / "state", {"cuda_toolkit": spec})
    assert first["stages"]["cuda_toolkit"]["drift"] == [
        "no record of a completed cuda_toolkit run (first run, or the last one stopped before its checks)"
    ]
    assert first["gates"] == {"cuda_toolkit": "converge"}
    assert record(root / "state", {"cuda_toolkit": spec}, "cuda_toolkit")["recorded"] is True
    second = run_probe(root / "state", {"cuda_toolkit": spec})
    assert second["stages"]["cuda_toolkit"]["drift"] == []
    assert second["gates"] == {"cuda_toolkit": "none"}
    # Recording the same state again writes nothing (the timestamp alone does not count).
    assert record(root / "state", {"cuda_toolkit": spec}, "cuda_toolkit")["recorded"] is False


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (
            lambda root, spec: spec["inputs"].update(cuda_toolkit_version="12.1"),
            "inputs changed since the last converge: cuda_toolkit_version",
        ),
        (
            lambda root, spec: spec["inputs"].update(role_code_sha256="def"),
            "inputs changed since the last converge: role_code_sha256",
        ),
        (
            lambda root, spec: (root / "home" / "version.json").write_text("{}"),
            "{root}/home/version.json changed since the last converge",
        ),
        (lambda root, spec: (root / "home" / "version.json").unlink(), "{root}/home/version.json is missing"),
        (
            lambda root, spec: (root / "home" / "other.so").write_text("x"),
            "{root}/home/other.so appeared since the last converge",
        ),
        (
            lambda root, spec: os.truncate(root / "home" / "big.so", 10),
            "{root}/home/big.so changed since the last converge",
        ),
        (
            lambda root, spec: ((root / "cuda").unlink(), os.symlink("cuda-12.1", root / "cuda")),
            "{root}/cuda changed since the last converge",
        ),
        (
            lambda root, spec: os.chmod(root / "home" / "version.json", 0o666),
            "{root}/home/version.json changed since the last converge",
        ),
        (
            lambda root, spec: (root / "installing").write_text(""),
            "an unfinished earlier attempt left {root}/installing",
        ),
    ],
    ids=[
        "input",
        "role-code",
        "content",
        "missing",
        "new-glob-match",
        "large-file-size",
        "link-target",
        "mode",
        "unfinished-attempt",
    ],
)
def test_each_kind_of_drift_is_named(host, change, reason):
    root, spec = host
    record(root / "state", {"cuda_toolkit": spec}, "cuda_toolkit")
    change(root, spec)
    drift = run_probe(root / "state", {"cuda_toolkit": spec})["stages"]["cuda_toolkit"]["drift"]
    assert drift == [reason.format(root=root)]


def test_a_symlink_is_never_followed(host, tmp_path):
    root, _ = host
    secret = tmp_path / "secret"
    secret.write_text("root only")
    os.symlink(secret, root / "home" / "planted.so")
    found = probe_module.expand([str(root / "home" / "*.so")])
    assert found[str(root / "home" / "planted.so")] == {"link": str(secret), "uid": os.getuid()}


def test_packages_recorded_by_a_stage_must_stay_installed(tmp_path):
    status = tmp_path / "status"
    status.write_text(
        "Package: git\nStatus: install ok installed\n\nPackage: libxml2\nStatus: deinstall ok config-files\n\n"
    )
    assert probe_module.installed_packages(str(status)) == {"git"}
    spec = {"inputs": {}, "packages": True}
    record(tmp_path / "state", {"host_prereqs": spec}, "host_prereqs", packages=["git", "libxml2"])
    stored = json.loads((tmp_path / "state" / "stages" / "host_prereqs.json").read_text())
    drift = probe_module.stage_drift("host_prereqs", spec, {}, stored, {"git"})
    assert drift == ["packages no longer installed: libxml2"]


@pytest.mark.parametrize(
    ("drift", "ready", "reverify", "tags", "check", "gate"),
    [
        ([], True, False, ["all"], False, "none"),
        ([], True, True, ["all"], False, "verify"),
        ([], True, False, ["verify"], False, "verify"),
        (["x"], True, False, ["verify"], False, "verify"),
        (["x"], False, False, ["all"], False, "converge"),
        (["x"], True, False, ["all"], True, "converge"),
        (["x"], False, False, ["all"], True, "plan"),
        (["x"], False, True, ["all"], True, "plan"),
        ([], False, True, ["all"], True, "verify"),
        ([], True, False, ["cuda_toolkit"], False, "none"),
    ],
)
def test_gates(drift, ready, reverify, tags, check, gate):
    assert probe_module.gate(drift, ready, reverify, tags, check) == gate


def test_check_mode_plans_a_stage_whose_prerequisites_are_absent(host):
    root, spec = host
    spec["requires"] = [str(root / "env" / "bin" / "python")]
    result = run_probe(root / "state", {"pytorch": spec}, check_mode=True)
    assert result["gates"] == {"pytorch": "plan"}
    assert result["planned"] == ["pytorch"]
    assert result["stages"]["pytorch"]["plan"].startswith("pytorch would be converged: no record of a completed")
    # A real run never plans: the stage converges.
    assert run_probe(root / "state", {"pytorch": spec})["planned"] == []


@pytest.mark.parametrize(
    ("run_tags", "skip_tags", "planned"),
    [
        (["all"], [], ["conda_env", "pytorch"]),
        (["pytorch"], [], ["pytorch"]),
        (["gpu_preflight", "conda_env"], [], ["conda_env"]),
        (["all"], ["conda_env"], ["pytorch"]),
        (["cuda_toolkit"], [], []),
    ],
)
def test_the_dry_run_reports_the_plans_of_the_stages_its_tags_select(host, run_tags, skip_tags, planned):
    """A dry run reports the plans of the stages its tags select, as they select the stage's own tasks (each
    tagged with its stage's name in site.yml)."""
    root, spec = host
    spec["requires"] = [str(root / "env" / "bin" / "python")]
    stages = {"conda_env": spec, "pytorch": spec}
    result = run_probe(root / "state", stages, check_mode=True, run_tags=run_tags, skip_tags=skip_tags)
    assert result["planned"] == planned


def test_reverify_follows_the_preflight_state_the_stack_was_verified_on(tmp_path):
    preflight = {"driver_version": "535.183.01", "gpus": ["Tesla P40"]}
    assert run_probe(tmp_path, {}, preflight=preflight)["reverify"] is True  # never verified
    probe_module.verified_record({"state_dir": str(tmp_path), "preflight_state": preflight}, False)
    assert run_probe(tmp_path, {}, preflight=preflight)["reverify"] is False
    upgraded = {**preflight, "driver_version": "550.144.03"}
    after_upgrade = run_probe(tmp_path, {}, preflight=upgraded)
    assert (after_upgrade["reverify"], after_upgrade["converged"]) == (True, False)
    assert after_upgrade["warnings"] == [
        "node1: the preflight state changed since the stack was last verified (535.183.01 -> 550.144.03): "
        "re-verifying every stage"
    ]
    assert run_probe(tmp_path, {}, preflight=None)["reverify"] is False  # no preflight in the play: nothing to compare
    settled = run_probe(tmp_path, {}, preflight=preflight)
    assert (settled["converged"], "warnings" in settled) == (True, False)


def test_a_host_is_converged_only_when_every_gate_is_none(host):
    root, spec = host
    stages = {"cudnn": spec}
    assert run_probe(root / "state", stages)["converged"] is False  # no record yet
    record(root / "state", stages, "cudnn")
    assert run_probe(root / "state", stages)["converged"] is True
    assert run_probe(root / "state", stages, run_tags=("verify",))["converged"] is False


def test_check_mode_writes_no_record(host):
    root, spec = host
    result = probe_module.record(
        {"state_dir": str(root / "state"), "stages": {"cudnn": spec}, "stage": "cudnn", "packages": []}, True
    )
    assert result["recorded"] is True
    assert not (root / "state").exists()


def test_role_inputs_leave_secrets_out_and_the_code_digest_follows_the_role(tmp_path):
    assert "training_data_hub_token" not in specs_lookup.declared_inputs(str(REPO_ROOT / "roles" / "training_data"))
    assert "training_data_model_repo" in specs_lookup.declared_inputs(str(REPO_ROOT / "roles" / "training_data"))
    role = tmp_path / "role"
    (role / "tasks" / "__pycache__").mkdir(parents=True)
    (role / "tasks" / "main.yml").write_text("---\n")
    before = specs_lookup.role_code_sha256(str(role))
    (role / "tasks" / "__pycache__" / "x.pyc").write_bytes(b"cache")
    assert specs_lookup.role_code_sha256(str(role)) == before
    (role / "tasks" / "main.yml").write_text("---\n# changed\n")
    assert specs_lookup.role_code_sha256(str(role)) != before


def test_every_stage_role_declares_its_markers_and_records_after_converging():
    """Each stage of fleet_state_stages has markers, a main.yml that lists its steps, each an include of a file of
    the role (a stage its gate skips costs one skipped task a step; the first, tagged verify, lets --tags verify
    reach the checks, and verify.yml's tasks carry the verify tag), and records last. No step file holds the rest
    of the role's steps (converge.yml)."""
    import yaml

    stages = STAGES
    assert stages[0] == "driver_hold" and stages[-1] == "launch_script"
    for stage in stages:
        role = REPO_ROOT / "roles" / stage
        # vars/main.yml, or vars/main/ (a directory of them: verl_patches keeps its patch sets there)
        role_vars = [role / "vars" / "main.yml", *sorted((role / "vars" / "main").glob("*.yml"))]
        declared = {k for path in role_vars if path.exists() for k in yaml.safe_load(path.read_text())}
        assert f"{stage}_state_markers" in declared, stage
        assert not (role / "tasks" / "converge.yml").exists(), stage
        main = yaml.safe_load((role / "tasks" / "main.yml").read_text())
        assert len(main) >= 2, stage
        includes = ("ansible.builtin.include_tasks", "ansible.builtin.include_role")
        assert all(any(key in step for key in includes) for step in main), stage
        assert "verify" in main[0]["tags"], stage
        files = [step["ansible.builtin.include_tasks"] for step in main if "ansible.builtin.include_tasks" in step]
        files = [entry if isinstance(entry, str) else entry["file"] for entry in files]
        assert all((role / "tasks" / name).is_file() for name in files), (stage, files)
        for step in main:
            entry = step.get("ansible.builtin.include_tasks")
            if isinstance(entry, dict) and entry["file"] == "verify.yml":
                assert entry["apply"]["tags"] == ["verify"] and "verify" in step["tags"], stage
        assert ("verify.yml" in files) == (role / "tasks" / "verify.yml").is_file(), stage
        assert main[-1]["ansible.builtin.include_role"] == {"name": "fleet_state", "tasks_from": "record"}, stage
        assert main[-1]["vars"]["fleet_state_record_stage"] == stage


def test_one_gate_per_stage():
    """Whether a stage runs is decided once, by site.yml's `when` on the probe's gate: no role's tasks read the
    probe's verdict again (a role used alone, without fleet_state, runs its steps), and site.yml gates every
    stage, in fleet_state_stages' order, on its own gate, running it for converge or verify."""
    import yaml

    stages = list(STAGES)  # fleet_state_stages derives from p40fleet_stages
    regated = [
        str(path.relative_to(REPO_ROOT))
        for path in sorted((REPO_ROOT / "roles").glob("*/tasks/**/*.yml"))
        if not path.is_relative_to(ROLE) and "fleet_state_found" in path.read_text()
    ]
    assert regated == [], "a role's tasks gate on fleet_state_found again: site.yml's `when` is the stage's gate"
    play = yaml.safe_load((REPO_ROOT / "site.yml").read_text())[-1]
    gated = [entry for entry in play["roles"] if entry["role"] in stages]
    assert [entry["role"] for entry in gated] == stages
    for entry in gated:
        stage = entry["role"]
        assert entry["tags"] == [stage], stage
        assert entry["when"] == f"fleet_state_found.gates.{stage} | default('converge') in ['converge', 'verify']"


def test_a_stage_is_templated_against_the_variables_it_references_transitively():
    variables = {
        "cudnn_prefix": "{{ cudnn_root }}/cudnn-{{ cudnn_version | default('8.9.7') }}",
        "cudnn_root": "{% if cudnn_side_path %}/opt{% else %}/usr/local{% endif %}",
        "cudnn_side_path": True,
        "cudnn_version": "8.9.7.29",
        "cudnn_markers": {"files": ["{{ cudnn_prefix }}/include/cudnn_version.h"], "note": "cudnn_unrelated as text"},
        "cudnn_unrelated": "{{ cudnn_version }}",
        "other_role_var": "x",
    }
    found = specs_lookup.referenced(variables, ["cudnn_markers", "not_defined"])
    assert sorted(found) == ["cudnn_markers", "cudnn_prefix", "cudnn_root", "cudnn_side_path", "cudnn_version"]
    assert found["cudnn_markers"] is variables["cudnn_markers"]


@pytest.mark.parametrize(
    "template",
    [
        "{{ hostvars[inventory_hostname].cudnn_version }}",
        "{{ vars['cudnn_' ~ 'version'] }}",
        "{{ query('ansible.builtin.vars', *query('ansible.builtin.varnames', '^cudnn_')) }}",
        "{{ lookup('ansible.builtin.template', 'cudnn.conf.j2') }}",
        "{% include 'cudnn.j2' %}",
        "{% from 'macros.j2' import path %}{{ path() }}",
    ],
)
def test_a_stage_that_reaches_variables_by_a_computed_name_is_templated_against_all(template):
    variables = {"cudnn_markers": {"files": ["{{ cudnn_prefix }}"]}, "cudnn_prefix": template, "cudnn_version": "8"}
    assert specs_lookup.referenced(variables, ["cudnn_markers"]) is None


# --- What the env owner can plant among the markers --------------------------------------


def test_a_directory_link_among_globbed_markers_is_not_descended(tmp_path):
    # The owner swaps a dist-info directory of its env for a link to root's files: glob.glob followed it.
    env = tmp_path / "env" / "lib" / "python3.10" / "site-packages"
    env.mkdir(parents=True)
    (env / "torch-2.6.0.dist-info").mkdir()
    (env / "torch-2.6.0.dist-info" / "METADATA").write_text("Name: torch\n")
    secret = tmp_path / "root-only"
    secret.mkdir()
    (secret / "METADATA").write_text("root's\n")
    os.symlink(secret, env / "torch-2.5.1.dist-info")
    pattern = str(tmp_path / "env" / "lib" / "python*" / "site-packages" / "torch*.dist-info" / "METADATA")
    found = probe_module.expand([pattern])
    assert list(found) == [str(env / "torch-2.6.0.dist-info" / "METADATA")]
    # A link to a directory of the owner's in the middle of the pattern: not walked either.
    os.rename(env.parent, tmp_path / "env" / "lib" / "elsewhere")
    os.symlink(tmp_path / "env" / "lib" / "elsewhere", env.parent)
    assert probe_module.expand([pattern]) == {}
    assert probe_module.safe_glob(str(tmp_path / "env" / "lib" / "python*")) == [str(env.parent)]


def test_the_safe_glob_matches_what_glob_does_without_links(tmp_path):
    for rel in ("a/x.json", "a/.hidden.json", "b/c/y.json", "b/z.txt"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("{}")
    for pattern in ("*/*.json", "**/*.json", "a/.*.json", "b/*", "*/c/*.json", "nothing/*"):
        full = str(tmp_path / pattern)
        assert sorted(probe_module.safe_glob(full)) == sorted(glob.glob(full, recursive=True)), pattern


def test_a_fifo_among_the_markers_does_not_hang_the_probe(host):
    root, spec = host
    fifo = root / "home" / "marker.json"
    os.mkfifo(fifo)
    spec = {**spec, "files": [*spec["files"], str(fifo)], "json": {"marker": str(fifo)}, "text": {"m": str(fifo)}}
    done = []
    worker = threading.Thread(
        target=lambda: done.append(run_probe(root / "state", {"cuda_toolkit": spec})), daemon=True
    )
    worker.start()
    worker.join(10)
    assert done, "the probe hung on a FIFO"
    found = done[0]["stages"]["cuda_toolkit"]["found"]
    assert found["files"][str(fifo)]["special"] is True
    assert found["json"]["marker"] is None and found["text"]["m"] is None
    # A FIFO where a record belongs is no record.
    os.makedirs(root / "state" / "stages")
    os.mkfifo(root / "state" / "stages" / "cuda_toolkit.json")
    worker = threading.Thread(
        target=lambda: done.append(run_probe(root / "state", {"cuda_toolkit": spec})), daemon=True
    )
    worker.start()
    worker.join(10)
    assert len(done) == 2, "the probe hung on a FIFO record"
    assert done[1]["gates"] == {"cuda_toolkit": "converge"}


def test_a_record_keeps_digests_of_the_inputs_and_an_earlier_record_is_written_again(host):
    root, spec = host
    spec = {**spec, "inputs": {**spec["inputs"], "pytorch_index_url": "https://user:pa55@mirror.example/simple"}}
    record(root / "state", {"cuda_toolkit": spec}, "cuda_toolkit")
    path = root / "state" / "stages" / "cuda_toolkit.json"
    assert "pa55" not in path.read_text()
    assert path.stat().st_mode & 0o777 == 0o600
    assert run_probe(root / "state", {"cuda_toolkit": spec})["gates"] == {"cuda_toolkit": "none"}
    # A record an earlier p40fleet wrote holds the values (0644): the stage converges once more and is recorded
    # again; a changed input is still named.
    old = json.loads(path.read_text())
    old["inputs"] = spec["inputs"]
    del old["input_sha256"]
    path.write_text(json.dumps(old))
    assert run_probe(root / "state", {"cuda_toolkit": spec})["stages"]["cuda_toolkit"]["drift"] == [
        "its record holds the inputs' values (an earlier p40fleet wrote it): it is recorded again"
    ]
    changed = {**spec, "inputs": {**spec["inputs"], "pytorch_index_url": "https://mirror.example/simple"}}
    assert run_probe(root / "state", {"cuda_toolkit": changed})["stages"]["cuda_toolkit"]["drift"][1:] == [
        "inputs changed since the last converge: pytorch_index_url"
    ]
    record(root / "state", {"cuda_toolkit": spec}, "cuda_toolkit")
    assert "pa55" not in path.read_text()
    assert run_probe(root / "state", {"cuda_toolkit": spec})["gates"] == {"cuda_toolkit": "none"}


def test_a_link_in_the_middle_of_a_marker_path_is_not_followed(host):
    # The attack: the owner swaps a directory of its tree (envs/) for a link to root's; the probe hashed and read
    # what the link led to, through any component but the last.
    root, spec = host
    secret = root / "root-only"
    secret.mkdir()
    (secret / "marker.json").write_text('{"key": "root\'s"}')
    os.symlink(secret, root / "home" / "envs")
    marker = str(root / "home" / "envs" / "marker.json")
    spec = {**spec, "files": [*spec["files"], marker], "json": {"marker": marker}, "text": {"m": marker}}
    found = run_probe(root / "state", {"cuda_toolkit": spec})["stages"]["cuda_toolkit"]["found"]
    assert "sha256" not in found["files"][marker] and found["files"][marker]["error"]
    assert found["json"]["marker"] is None and found["text"]["m"] is None
    # Through real directories the same file is read.
    os.unlink(root / "home" / "envs")
    os.rename(secret, root / "home" / "envs")
    found = run_probe(root / "state", {"cuda_toolkit": spec})["stages"]["cuda_toolkit"]["found"]
    assert found["json"]["marker"] == {"key": "root's"} and "sha256" in found["files"][marker]
