"""Credentials in an index URL: the torch lock's index reaches pip in its environment, not on its command
line (`ps` shows every account a command line), and the env's pip.conf, which names the same URLs, is the owner's
alone (0600). The role's values are rendered on the controller (python/tests/playbooks/mirror_sources.yml)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import yaml

from p40fleet.run import run_playbook
from p40fleet_dev.paths import REPO_ROOT

INDEX = "https://fleet:pa55w0rd@mirror.example.internal/whl/cu118"


def rendered(tmp_path, variables):
    inventory = tmp_path / "inventory"
    (inventory / "host_vars").mkdir(parents=True)
    (inventory / "hosts.yml").write_text(
        yaml.safe_dump({"all": {"children": {"p40-hosts": {"hosts": {"h": {"ansible_host": "192.0.2.1"}}}}}})
    )
    (inventory / "host_vars" / "h.yml").write_text(yaml.safe_dump(variables))
    result = run_playbook(REPO_ROOT / "python" / "tests" / "playbooks" / "mirror_sources.yml", inventory / "hosts.yml")
    assert result.rc == 0, result.stdout
    return next(e["event_data"]["res"]["msg"] for e in result.events if e["event"] == "runner_on_ok")


def lock_digest(found):
    """The marker's digest: the lock's text (as the file lookup reads it, trailing whitespace stripped, then one
    newline), then pip's sources (its environment, then its options) as one line."""
    content = Path(found["lock_source"]).read_text().rstrip() + "\n" if found["lock_source"] else ""
    sources = [f"{k}={v}" for k, v in sorted(found["lock_pip_environment"].items())] + found["lock_pip_options"]
    return hashlib.sha1((content + " ".join(sources)).encode()).hexdigest()


def test_the_index_and_its_credentials_stay_off_pips_command_line(tmp_path):
    found = rendered(tmp_path, {"pytorch_index_url": INDEX})
    assert not any("pa55w0rd" in word or "mirror.example.internal" in word for word in found["lock_pip_options"])
    # The torch lock reads the cu118 index and PyPI (either may serve a locked file), both from the environment.
    assert found["lock_pip_environment"] == {
        "PIP_CONFIG_FILE": "/dev/null",
        "PIP_INDEX_URL": INDEX,
        "PIP_EXTRA_INDEX_URL": "https://pypi.org/simple",
    }
    # The marker's digest covers the lock (found: the play resolves the env's Python without conda_env) and the
    # sources in the environment: another index installs the lock again.
    assert found["lock_source"].endswith(".lock.txt"), found["lock_source"]
    assert found["lock_digest"] == lock_digest(found)
    other = rendered(tmp_path / "other", {"pytorch_index_url": INDEX.replace("pa55w0rd", "other")})
    assert other["lock_digest"] != found["lock_digest"]


def test_no_index_reads_its_find_links_from_the_environment(tmp_path):
    found = rendered(tmp_path, {"pytorch_no_index": True, "pytorch_find_links": ["/srv/wheels", "/srv/more"]})
    assert found["lock_pip_options"][0] == "--no-index"
    assert found["lock_pip_environment"] == {"PIP_CONFIG_FILE": "/dev/null", "PIP_FIND_LINKS": "/srv/wheels /srv/more"}
    assert found["lock_digest"] == lock_digest(found)


def test_credentials_in_find_links_stay_off_every_pip_command_line(tmp_path):
    # A regression: --find-links went on the command line of the torch lock's, Apex's build tools' and verl's pip.
    links = ["https://fleet:pa55w0rd@mirror.example.internal/wheels/"]
    found = rendered(
        tmp_path,
        {"pytorch_no_index": True, "pytorch_find_links": links, "apex_find_links": links, "verl_find_links": links},
    )
    assert not any("pa55w0rd" in word for word in found["lock_pip_options"])
    assert found["lock_pip_environment"]["PIP_FIND_LINKS"] == links[0]
    # Apex's and verl's pip read them from their requirements files, the owner's alone (0600).
    assert found["apex_build_requirements"].splitlines()[0] == f"--find-links {links[0]}"
    assert found["apex_build_requirements"].splitlines()[1].startswith("pip==")
    assert found["verl_lock_file"].splitlines()[0] == f"--find-links {links[0]}"


def owner_run_argvs() -> list[tuple[str, str]]:
    """(task file, argv as text) of every task that runs a command, in every role."""
    found = []
    for path in sorted((REPO_ROOT / "roles").glob("*/tasks/*.yml")):
        for task in walk_tasks(yaml.safe_load(path.read_text()) or []):
            for module in ("p40fleet.fleet.fleet_state_owner_run", "ansible.builtin.command", "ansible.builtin.shell"):
                if isinstance(task.get(module), dict):
                    found.append((str(path.relative_to(REPO_ROOT)), str(task[module].get("argv", task[module]))))
    return found


def walk_tasks(tasks):
    for task in tasks:
        yield task
        for key in ("block", "rescue", "always"):
            yield from walk_tasks(task.get(key) or [])


def path_requests(tasks):
    """Every request of fleet_state_path in the tasks, as the module acts on it: a task's options, or each item of
    its `batch` (a plain path, or a dict of options over the task's own)."""
    for task in walk_tasks(tasks):
        options = task.get("p40fleet.fleet.fleet_state_path")
        if not isinstance(options, dict):
            continue
        batch = options.get("batch")
        if batch is None:
            yield options
            continue
        common = {key: value for key, value in options.items() if key != "batch"}
        if not isinstance(batch, list):
            # A batch a template computes (a role's list of directories): its task's own options, by that template.
            yield {**common, "path": batch}
            continue
        for item in batch:
            yield {**common, **({"path": item} if isinstance(item, str) else item)}


def written_at(role: str, tasks_file: str, path: str) -> dict:
    """The one request of ROLE's TASKS_FILE that acts on PATH."""
    tasks = yaml.safe_load((REPO_ROOT / "roles" / role / "tasks" / tasks_file).read_text())
    (written,) = [options for options in path_requests(tasks) if options.get("path") == path]
    return written


def test_no_role_puts_find_links_or_an_index_on_a_command_line():
    argvs = owner_run_argvs()
    assert any("pip" in argv for _, argv in argvs)  # the scan sees pip's calls
    assert [(path, argv) for path, argv in argvs if "find-links" in argv or "index-url" in argv] == []


def test_the_files_holding_find_links_are_the_owners_alone():
    for role, path in (("apex", "{{ apex_build_requirements_path }}"), ("verl", "{{ verl_lock_path }}")):
        assert written_at(role, "install.yml", path)["mode"] == "0600", role


def test_the_envs_pip_conf_is_the_owners_alone():
    assert written_at("pytorch", "install.yml", "{{ pytorch_pip_conf_path }}")["mode"] == "0600"


def test_the_apex_builder_envs_pip_reads_its_sources_from_a_file_of_roots_alone(tmp_path):
    """A task's own `environment:` is prepended to the command line sudo runs (`ps` shows it every account): the
    builder env's pip gets the torch lock's index, credentials included, from a 0600 file of root's, by path."""
    found = rendered(tmp_path, {"pytorch_index_url": INDEX, "pytorch_find_links": ["/srv/wheels"]})
    assert found["apex_builder_pip_conf"].splitlines()[1:] == [
        "[global]",
        "extra-index-url = https://pypi.org/simple",
        "find-links = /srv/wheels",
        f"index-url = {INDEX}",
    ]
    written = written_at("apex", "builder_env.yml", "{{ apex_builder_pip_conf_path }}")
    assert written["mode"] == "0600" and written["owner"] == "root"


def test_no_task_hands_pip_its_sources_in_the_tasks_own_environment():
    """Every task of every role whose `environment:` keyword (not a module's option) names a pip source."""
    named = ("pip_environment", "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "index_url", "find_links")
    found = []
    for path in sorted((REPO_ROOT / "roles").glob("*/tasks/*.yml")):
        for task in walk_tasks(yaml.safe_load(path.read_text()) or []):
            if any(name in str(task.get("environment", "")) for name in named):
                found.append((str(path.relative_to(REPO_ROOT)), task.get("name")))
    assert found == []


def test_every_file_written_as_secret_is_its_owners_alone():
    """A file p40fleet marks secret (credentials may be in it: the launch environment, pip's sources, conda's
    channels) is 0600, whoever owns it."""
    written = []
    for path in sorted((REPO_ROOT / "roles").glob("*/tasks/*.yml")):
        for options in path_requests(yaml.safe_load(path.read_text()) or []):
            if options.get("secret"):
                written.append((str(path.relative_to(REPO_ROOT)), options["path"], options.get("mode")))
    assert any(p == "{{ conda_env_condarc_path }}" for _, p, _ in written)  # the scan sees the .condarc
    assert [w for w in written if w[2] != "0600"] == []
