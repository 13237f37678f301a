"""The Python stack's roles (conda_env, pytorch, apex, verl) on conftest's site_fleet: one P40 and one 2x P40 host
that site.yml took from fresh through the whole pipeline (node1 built Apex, node2 installed the same wheel: a third
host would show nothing the second does not, at a converge's cost). The stack's own playbook then runs there
without fleet_state, so every stage goes through its own detailed probe on every run.

The tests assert the hosts' real state through `podman exec`; the last ones break things on purpose (a pip install
failing midway, an env of another Python, a tampered wheel) and check that the roles report or repair them, each
leaving the stack as it found it. The module runs last of site_fleet's.
"""

from __future__ import annotations

import hashlib
import json
import re
import shlex
import shutil
import zipfile

import pytest
import yaml

from p40fleet_dev.paths import REPO_ROOT
from tests.pins import CUDA_HOME

# converge: site_fleet takes fresh hosts through the pipeline (minutes).
pytestmark = [pytest.mark.sandbox, pytest.mark.converge]

PLAYBOOK = "python/tests/playbooks/python_stack.yml"
HOSTS = ("node1", "node2")
ENV = "/opt/miniconda3/envs/verl-env"
PY = f"{ENV}/bin/python"
OWNER = "p40fleet"
BUILD_ACCOUNT = "p40fleet-build"
UP_TO_TORCH = "gpu_preflight,conda_env,pytorch"
# The stand-in torch's BuildExtension logs each build here on the building host.
EXTENSION_BUILDS = "/var/tmp/p40fleet-standin-extension-builds.log"
# Root's own Python and torch the build runs (apex_builder_prefix), on the builder host only.
BUILDER = "/var/lib/p40fleet/apex-builder"
APEX_DEFAULTS = yaml.safe_load((REPO_ROOT / "roles" / "apex" / "defaults" / "main.yml").read_text())
APEX_MODULES = APEX_DEFAULTS["apex_cpp_extension_modules"] + APEX_DEFAULTS["apex_cuda_extension_modules"]
BUILD_TOOLS = dict(line.split(" ", 1)[0].split("==") for line in APEX_DEFAULTS["apex_build_requirements"])


@pytest.fixture(scope="module")
def fleet(converged_site_fleet):
    """conftest's site_fleet after its two runs (this module's fixtures and tests build on it as `fleet`)."""
    return converged_site_fleet


@pytest.fixture(scope="module")
def sandbox_vars(fleet) -> dict:
    return yaml.safe_load((fleet.inventory_dir / "group_vars" / "p40_sandbox.yml").read_text())


@pytest.fixture(scope="module")
def apex_cache(fleet):
    return fleet.apex_cache


@pytest.fixture(scope="module")
def play(fleet, run_playbook, apex_cache):
    """Run the stack playbook on the fleet, with site_fleet's controller wheel cache."""

    def run(**kwargs):
        extra = {"apex_controller_cache_dir": str(apex_cache), **kwargs.pop("extra_vars", {})}
        return run_playbook(PLAYBOOK, fleet.inventory_dir, extra_vars=extra, **kwargs)

    return run


@pytest.fixture(scope="module")
def converged(play):
    """The stack playbook on hosts site.yml converged: each role's own probe must find its stage done."""
    return play()


def fleet_commit(fleet) -> str:
    return yaml.safe_load((fleet.inventory_dir / "group_vars" / "p40_sandbox.yml").read_text())["apex_git_commit"]


def sh(fleet, host, command, user=OWNER):
    return fleet.exec(host, command, user=user)


def test_each_role_s_own_probe_finds_what_site_yml_converged(fleet, converged):
    # site.yml installed the stack on both hosts (its first run changed them, its second nothing: test_checklist.py).
    assert all(fleet.first.stats[h]["changed"] > 0 for h in HOSTS)
    assert converged.rc == 0, [f"{f.host}: {f.task}: {f.message}" for f in converged.failures]
    assert set(converged.stats) == set(HOSTS)
    assert {h: converged.stats[h]["changed"] for h in HOSTS} == dict.fromkeys(HOSTS, 0)


def test_check_mode_on_converged_fleet_changes_nothing(converged, play):
    result = play(check=True, diff=True)
    assert result.rc == 0, [f"{f.host}: {f.task}: {f.message}" for f in result.failures]
    assert {h: result.stats[h]["changed"] for h in HOSTS} == dict.fromkeys(HOSTS, 0)


def test_env_is_owned_by_the_unprivileged_user_with_pinned_python(converged, fleet):
    for host in HOSTS:
        assert sh(fleet, host, f"stat -c %U {ENV} /opt/miniconda3").stdout.split() == [OWNER, OWNER]
        envs = json.loads(sh(fleet, host, "/opt/miniconda3/bin/conda env list --json").stdout)["envs"]
        assert ENV in envs
        # The sandbox inventory sets p40fleet_python_version 3.11 (the stand-in conda gives the host's Python).
        version = sh(fleet, host, f"{PY} -c 'import sys; print(sys.version_info[:2])'").stdout.strip()
        assert version == "(3, 11)"
        # Cloned offline from the installer's own Python: no channel was solved against.
        history = sh(fleet, host, f"cat {ENV}/conda-meta/history").stdout
        assert "create --yes --quiet --name verl-env --clone base --offline" in history, history
        condarc = sh(fleet, host, "cat /opt/miniconda3/.condarc").stdout
        assert "always_yes: true" in condarc and "- conda-forge" in condarc


def test_torch_is_the_cu118_build_and_the_constraint_keeps_it(converged, fleet, sandbox_vars):
    for host in HOSTS:
        seen = sh(
            fleet,
            host,
            f"{PY} -c 'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.is_available())'",
        ).stdout.split()
        assert seen == ["2.6.0+cu118", "11.8", "True"]
    # The index holds a newer CUDA 12 torch: without the env's pip.conf, an upgrade would take it ...
    links = sandbox_vars["p40fleet_sandbox_mirror_url"] + "/torch_wheels/"
    host = links.split("/")[2].split(":")[0]
    bare = sh(
        fleet,
        "node1",
        f"PIP_CONFIG_FILE=/dev/null {PY} -m pip install --dry-run --no-index --find-links {links} "
        f"--trusted-host {host} --upgrade torch",
    )
    assert "Would install torch-2.7.0" in bare.stdout, bare.stdout + bare.stderr
    # ... with it (as every later pip call in the env has it), the cu118 build stays.
    upgrade = sh(fleet, "node1", f"{PY} -m pip install --upgrade torch")
    assert upgrade.returncode == 0, upgrade.stderr
    assert "Requirement already satisfied: torch" in upgrade.stdout
    assert sh(fleet, "node1", f"{PY} -c 'import torch; print(torch.__version__)'").stdout.strip() == "2.6.0+cu118"


def test_apex_is_built_once_and_the_same_wheel_is_installed_everywhere(converged, fleet, apex_cache):
    builds = {h: sh(fleet, h, f"cat {EXTENSION_BUILDS}", user="root") for h in HOSTS}
    # Exactly one build in the whole fleet, on the first host, even after the second run.
    assert len(builds["node1"].stdout.splitlines()) == 1
    assert builds["node2"].returncode != 0
    build = json.loads(builds["node1"].stdout)
    # The real setup.py of the pinned commit, asked with --cpp_ext --cuda_ext, built every extension, with ninja.
    assert build["extensions"] == APEX_MODULES
    assert (build["ninja"], build["torch_cuda_arch_list"], build["nvcc_release"]) == (True, "6.1", "11.8")
    assert build["cuda_home"] == CUDA_HOME
    assert build["cc"] == "gcc" and int(build["max_jobs"]) >= 1
    # Root's builder env's torch, not the env's; it is root's, and on the builder host only.
    assert build["torch"] == f"{BUILDER}/lib/python3.11/site-packages/torch"
    assert sh(fleet, "node1", f"stat -c '%U %a' {BUILDER} {BUILDER}/lib", user="root").stdout.split() == [
        "root",
        "755",
        "root",
        "755",
    ]
    assert sh(fleet, "node2", f"test -e {BUILDER}", user="root").returncode == 1
    cached = list(apex_cache.rglob("apex-*.whl"))
    assert len(cached) == 1
    hashes = {h: sh(fleet, h, "sha256sum /var/lib/p40fleet/apex-wheels/*/apex-*.whl").stdout.split()[0] for h in HOSTS}
    assert len(set(hashes.values())) == 1
    modules = ", ".join(APEX_MODULES)
    load_all = f"import json, torch, {modules}; "
    load_all += f"print(json.dumps([json.loads(m.__p40fleet_standin_build__) for m in ({modules})]))"
    for host in HOSTS:
        loaded = sh(fleet, host, f"cd /tmp && {PY} -c {shlex.quote(load_all)}")
        assert loaded.returncode == 0, loaded.stderr
        stubs = json.loads(loaded.stdout)
        assert {stub["host"] for stub in stubs} == {"node1"}
        assert [stub["arch_list"] for stub in stubs] == [None] + ["6.1"] * 11
        marker = json.loads(sh(fleet, host, f"cat {ENV}/.p40fleet-apex.json").stdout)
        assert marker["built_by"] == "node1" and marker["key"] == cached[0].parent.name
        assert marker["sha256"] == hashes[host]
        assert marker["commit"] == fleet_commit(fleet)
        tools = sh(fleet, host, f"{PY} -m pip list --format=json").stdout
        versions = {d["name"].lower(): d["version"] for d in json.loads(tools)}
        assert {name: versions.get(name) for name in BUILD_TOOLS} == BUILD_TOOLS


def test_the_controller_records_the_apex_build_as_it_finishes(converged, fleet, apex_cache):
    (wheel,) = apex_cache.rglob("apex-*.whl")
    record = json.loads((wheel.parent / "record.json").read_text())
    assert record["sha256"] == hashlib.sha256(wheel.read_bytes()).hexdigest()
    assert (record["wheel"], record["key"], record["builder"]) == (wheel.name, wheel.parent.name, "node1")
    # Built by the throwaway account, not the env owner; the account and its directory are gone after the build.
    assert record["build_account"] == BUILD_ACCOUNT
    assert sh(fleet, "node1", f"getent passwd {BUILD_ACCOUNT}", user="root").returncode == 2
    assert sh(fleet, "node1", "test -e /var/lib/p40fleet/apex-build", user="root").returncode == 1
    built_by = sh(fleet, "node1", f"stat -c %u {EXTENSION_BUILDS}", user="root").stdout.strip()
    assert built_by not in ("0", sh(fleet, "node1", f"id -u {OWNER}").stdout.strip())
    log_path = f"/var/lib/p40fleet/apex-wheels/{wheel.parent.name}/build.log"
    log = sh(fleet, "node1", f"stat -c '%U %a' {log_path}", user="root")
    assert log.stdout.split() == ["root", "600"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", record["date"]), record["date"]


def test_a_tampered_or_unrecorded_apex_wheel_in_the_controller_cache_is_refused_on_every_host(
    converged, fleet, play, apex_cache
):
    (wheel,) = apex_cache.rglob("apex-*.whl")
    record_path = wheel.parent / "record.json"
    genuine, record = wheel.read_bytes(), record_path.read_text()
    installed = {h: sh(fleet, h, f"{PY} -m pip show -f apex").stdout for h in HOSTS}
    marker = f"{ENV}/.p40fleet-apex.json"
    try:
        # Every host must look at the cache again: its marker of the installed build is moved aside.
        for host in HOSTS:
            assert sh(fleet, host, f"mv {marker} {marker}.aside").returncode == 0
        wheel.write_bytes(genuine + b"\0tampered")
        tampered = play(tags="apex")
        assert tampered.rc != 0
        for host in HOSTS:
            (failure,) = tampered.host_failures(host)
            assert failure.task == "Ensure the cached wheel is the one its build recorded"
            assert failure.message.startswith(f"{host}: the Apex wheel {wheel} in the controller cache has sha256 ")
            assert "but its build recorded" in failure.message and "(built by node1 on" in failure.message
            assert "Refused: it was not installed on any host." in failure.message
            assert sh(fleet, host, f"{PY} -m pip show -f apex").stdout == installed[host]
        wheel.write_bytes(genuine)
        record_path.unlink()
        unrecorded = play(tags="apex")
        assert unrecorded.rc != 0
        for host in HOSTS:
            (failure,) = unrecorded.host_failures(host)
            assert f"in the controller cache has no build record ({record_path})" in failure.message
        # A malicious builder's entry: the env owner built it (as before the build account) and its sum is right.
        record_path.write_text(json.dumps({k: v for k, v in json.loads(record).items() if k != "build_account"}))
        owners = play(tags="apex")
        assert owners.rc != 0
        for host in HOSTS:
            (failure,) = owners.host_failures(host)
            assert failure.message.startswith(
                f"{host}: the Apex wheel {wheel} in the controller cache was not built by the throwaway build "
                f"account {BUILD_ACCOUNT}: its record ({record_path}) names ?"
            )
            assert sh(fleet, host, f"{PY} -m pip show -f apex").stdout == installed[host]
    finally:
        wheel.write_bytes(genuine)
        record_path.write_text(record)
        for host in HOSTS:
            sh(fleet, host, f"test -e {marker}.aside && mv {marker}.aside {marker}")
    again = play(tags="apex")
    assert again.rc == 0, [f"{f.host}: {f.task}: {f.message}" for f in again.failures]


def test_apex_built_with_only_the_environment_switches_fails_the_wheel_check(converged, fleet, play, apex_cache):
    # A new key (arch 6.0) makes node2 build; APEX_CPP_EXT/APEX_CUDA_EXT alone are ignored by the pinned commit.
    result = play(
        limit="node2",
        tags="apex",
        extra_vars={"apex_extension_switches": "environment", "apex_torch_cuda_arch_list": "6.0"},
    )
    assert result.rc != 0
    failures = result.host_failures("node2")
    assert [f.task for f in failures] == [
        "Ensure the wheel holds every extension module the pinned setup.py builds, built in parallel"
    ]
    message = failures[0].message
    assert message.startswith("node2: the Apex build of commit")
    assert "lacks the extension modules " + ", ".join(APEX_MODULES) + " (built: none)" in message
    # Nothing reached the controller cache, and the installed Apex is still the fleet's.
    assert [p.parent.name for p in apex_cache.rglob("apex-*.whl")] == [
        json.loads(sh(fleet, "node2", f"cat {ENV}/.p40fleet-apex.json").stdout)["key"]
    ]


# Planted by the env owner: whoever imports the env's torch to build Apex writes a trace of its account and adds a
# module to the wheel it builds (setup.py's directory holds the apex package).
POISON = """
import os as _p40fleet_os, pwd as _p40fleet_pwd
_p40fleet_who = _p40fleet_pwd.getpwuid(_p40fleet_os.getuid()).pw_name
open(f"/var/tmp/p40fleet-poisoned-{_p40fleet_who}", "a").write(_p40fleet_os.getcwd() + "\\n")
if _p40fleet_os.path.isfile("setup.py") and _p40fleet_os.path.isdir("apex"):
    open(_p40fleet_os.path.join("apex", "p40fleet_poisoned.py"), "w").write("POISONED = True\\n")
"""
PTH = "import pwd, os; open('/var/tmp/p40fleet-poisoned-pth-' + pwd.getpwuid(os.getuid()).pw_name, 'a').write('x')\n"


def test_the_env_owner_s_torch_never_reaches_a_build(converged, fleet, play, apex_cache):
    """The owner edits the env's torch.utils.cpp_extension (what Apex's setup.py imports to compile every extension)
    and plants a .pth in the env's site-packages; a new key (arch 7.0) makes node1 build again. The build runs
    root's builder env: its wheel carries nothing of the edit, and neither the build account nor root ran it."""
    site = f"{ENV}/lib/python3.11/site-packages"
    extension = f"{site}/torch/utils/cpp_extension.py"
    (fleet_key,) = [p.parent.name for p in apex_cache.rglob("apex-*.whl")]
    traces = "/var/tmp/p40fleet-poisoned-*"
    owners_traces = [f"/var/tmp/p40fleet-poisoned-{OWNER}", f"/var/tmp/p40fleet-poisoned-pth-{OWNER}"]
    plant = f"cp -p {extension} {extension}.aside && printf %s {shlex.quote(POISON)} >> {extension}"
    plant += f" && printf %s {shlex.quote(PTH)} > {site}/p40fleet-poison.pth"
    try:
        planted = sh(fleet, "node1", plant)
        assert planted.returncode == 0, planted.stderr
        # The poison is live in the env: the owner's own import of it leaves the owner's traces.
        live = sh(fleet, "node1", f"cd /tmp && {PY} -c 'import torch.utils.cpp_extension'")
        assert live.returncode == 0, live.stderr
        assert sorted(sh(fleet, "node1", f"ls {traces}", user="root").stdout.split()) == owners_traces
        # This build's own log line (the stand-in's log belongs to the first build's account).
        sh(fleet, "node1", f"mv {EXTENSION_BUILDS} {EXTENSION_BUILDS}.aside", user="root")
        rebuilt = play(limit="node1", tags="apex", extra_vars={"apex_torch_cuda_arch_list": "7.0"})
        assert rebuilt.rc == 0, [f"{f.task}: {f.message}" for f in rebuilt.failures]
        (wheel,) = [p for p in apex_cache.rglob("apex-*.whl") if p.parent.name != fleet_key]
        with zipfile.ZipFile(wheel) as built:
            names = built.namelist()
        assert "amp_C.cpython-311-x86_64-linux-gnu.so" in names
        assert not [name for name in names if "poison" in name], names
        build = json.loads(sh(fleet, "node1", f"cat {EXTENSION_BUILDS}", user="root").stdout)
        assert (build["torch_cuda_arch_list"], build["torch"]) == (
            "7.0",
            f"{BUILDER}/lib/python3.11/site-packages/torch",
        )
        # Only the owner's own runs (its probe, its install of the new wheel) imported the planted files.
        assert sorted(sh(fleet, "node1", f"ls {traces}", user="root").stdout.split()) == owners_traces
        assert BUILD_ACCOUNT not in sh(fleet, "node1", f"cat {traces}", user="root").stdout
    finally:
        sh(fleet, "node1", f"test -e {extension}.aside && mv {extension}.aside {extension}; rm -f {site}/*poison*.pth")
        aside = f"test -e {EXTENSION_BUILDS}.aside && mv {EXTENSION_BUILDS}.aside {EXTENSION_BUILDS}"
        sh(fleet, "node1", f"rm -f {traces}; {aside}", user="root")
        for key in {p.name for p in apex_cache.iterdir()} - {fleet_key}:
            shutil.rmtree(apex_cache / key)
            sh(fleet, "node1", f"rm -rf /var/lib/p40fleet/apex-wheels/{key}", user="root")
    # node1 goes back to the fleet's wheel of its own key.
    again = play(limit="node1", tags="apex")
    assert again.rc == 0, [f"{f.task}: {f.message}" for f in again.failures]
    assert json.loads(sh(fleet, "node1", f"cat {ENV}/.p40fleet-apex.json").stdout)["key"] == fleet_key


def test_apex_switch_off_skips_the_stage(converged, play):
    bad_pin = {"apex_git_commit": "not-a-commit"}
    # From -e the switch is a string; "false" must skip the stage before its input checks.
    skipped = play(tags="apex", extra_vars={"apex_enabled": "false", **bad_pin})
    assert skipped.rc == 0, [f"{f.host}: {f.task}: {f.message}" for f in skipped.failures]
    assert {h: skipped.stats[h]["changed"] for h in HOSTS} == dict.fromkeys(HOSTS, 0)
    enabled = play(limit="node1", tags="apex", extra_vars={"apex_enabled": "true", **bad_pin})
    assert enabled.rc != 0
    failed_tasks = [f.task for f in enabled.host_failures("node1")]
    assert failed_tasks == ["Ensure the Apex inputs and the env they need are usable"]


def test_verl_is_installed_editable_at_the_pinned_release(converged, fleet, sandbox_vars):
    for host in HOSTS:
        show = sh(fleet, host, f"{PY} -m pip show verl").stdout
        assert "Version: 0.4.1" in show and "Editable project location: /opt/p40fleet/verl" in show
        head = sh(fleet, host, "git -C /opt/p40fleet/verl rev-parse HEAD").stdout.strip()
        assert head == sandbox_vars["verl_expected_commit"]
        where = sh(fleet, host, f"cd /tmp && {PY} -c 'import importlib.util as u; print(u.find_spec(\"verl\").origin)'")
        assert where.stdout.strip() == "/opt/p40fleet/verl/verl/__init__.py"
        shim = sh(
            fleet,
            host,
            f"{PY} -c 'from flash_attn.bert_padding import unpad_input, pad_input; "
            'import importlib.metadata as m; print(m.version("p40fleet-flash-attn-shim"))\'',
        )
        assert shim.stdout.strip() == "2.7.4.post1+p40fleet.shim", shim.stderr


def test_env_of_another_python_is_reported_not_reused(converged, fleet, play):
    # An installer of that Python (by its release name; the stand-in's bytes and sum stay what is installed).
    asked = {"p40fleet_python_version": "3.10", "conda_env_miniconda_version": "py310_standin"}
    result = play(limit="node2", tags="conda_env", extra_vars=asked)
    assert result.rc != 0
    messages = [f.message for f in result.host_failures("node2")]
    assert any(
        m.startswith(f"node2: the env {ENV} exists with Python 3.11, but Python 3.10 is required") for m in messages
    ), messages
    assert result.stats["node2"]["changed"] == 0
    assert sh(fleet, "node2", f"{PY} -c 'import torch, hydra' && echo intact").stdout.strip() == "intact"


def test_pip_install_failing_midway_is_redone_next_run(converged, fleet, play, sandbox_vars):
    removed = sh(fleet, "node2", f"{PY} -m pip uninstall -y torch triton")
    assert removed.returncode == 0, removed.stderr
    broken = sandbox_vars["p40fleet_sandbox_mirror_url"] + "/torch_wheels_broken/"
    # The broken index comes with its own lock (the broken triton's sha256): pip gets past the hash check.
    broken_lock = sandbox_vars["p40fleet_sandbox_mirror_dir"] + "/locks/torch-sandbox-broken.lock.txt"
    failed = play(
        limit="node2", tags=UP_TO_TORCH, extra_vars={"pytorch_find_links": [broken], "pytorch_lock_file": broken_lock}
    )
    assert failed.rc != 0
    assert [f.task for f in failed.host_failures("node2")] == [
        "Ensure the torch builds and their dependencies are installed from the hash-pinned lock"
    ]
    # Midway: pip installs the lock's packages one by one (--no-deps: in an order of its own); the broken triton
    # ships a file `torch` where torch's package goes, so whichever of the two pip took first went in, the other not.
    installed = [d for d in ("torch", "triton") if sh(fleet, "node2", f"{PY} -m pip show {d}").returncode == 0]
    assert len(installed) == 1, installed
    redone = play(limit="node2", tags=UP_TO_TORCH)
    assert redone.rc == 0, [f"{f.task}: {f.message}" for f in redone.failures]
    assert redone.stats["node2"]["changed"] > 0
    versions = sh(
        fleet, "node2", f"{PY} -c 'import torch, triton, sympy; print(torch.__version__, triton.__version__)'"
    )
    assert versions.stdout.split() == ["2.6.0+cu118", "3.2.0"]
    again = play(limit="node2", tags=UP_TO_TORCH)
    assert again.rc == 0 and again.stats["node2"]["changed"] == 0
