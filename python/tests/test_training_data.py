"""training_data without containers: the role over a local connection, the real huggingface_hub and
pyarrow (wheels from upstream.txt, in a venv made once) against the Hub stand-in on loopback.

Checks verl's GSM8K layout value by value, the model's verification, idempotence, a gated model that
needs the token, and that the token is in no file and no process listing while the run goes, nor after it.
"""

from __future__ import annotations

import hashlib
import json
import os
import pwd
import secrets
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from p40fleet_dev.paths import CACHE_DIR, REPO_ROOT, STANDINS_DIR, UPSTREAM_DIR
from tests.local_hosts import ROOT_PLAYS_OWNER
from tests.source_modules import load_module, load_owner_script, owner_script_text

PLAYBOOK = REPO_ROOT / "python" / "tests" / "playbooks" / "training_data.yml"
TOOL = REPO_ROOT / "roles" / "training_data" / "files" / "training_data_tool.py"
HUB_SERVER = STANDINS_DIR / "hub_server.py"
HUB_CONTENT = STANDINS_DIR / "hub_content.py"
DATA_ENV_PACKAGES = ["pyarrow", "huggingface_hub"]
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'


tool = load_owner_script(TOOL, "training_data_tool")
content = load_module(HUB_CONTENT, "hub_content")


@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        ("1200 + 34 = 1234\n#### 1,234", "1234"),
        ("#### -5", "-5"),
        ("#### -3,000", "-3000"),
        ("#### 2.5", "2.5"),
        ("#### 999,999", "999999"),
    ],
)
def test_the_number_after_hashes_is_extracted_as_verl_does(answer, expected):
    assert tool.extract_solution(answer) == expected


def test_an_answer_without_a_number_is_refused():
    with pytest.raises(ValueError, match="no '#### <number>'"):
        tool.extract_solution("no final answer here")


@pytest.fixture(scope="module")
def data_env() -> Path:
    """A venv with the real pyarrow and huggingface_hub wheels (what verl's dependency set brings)."""
    wheels = UPSTREAM_DIR / "wheel"
    key = hashlib.sha256("\n".join(sorted(p.name for p in wheels.glob("*.whl"))).encode()).hexdigest()[:12]
    env = CACHE_DIR / "test-envs" / f"training-data-{key}"
    python = env / "bin" / "python"
    if not (env / ".complete").exists():
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(env)], check=True)
        done = subprocess.run(
            [str(python), "-m", "pip", "install", "-q", "--no-index", "--find-links", str(wheels), *DATA_ENV_PACKAGES],
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            pytest.fail(f"cannot build the data env from {wheels} (run `make fixtures`): {done.stderr}")
        (env / ".complete").write_text("")
    return python


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def hub(tmp_path_factory, data_env):
    """The Hub stand-in on loopback, its model gated by a fresh token: (url, token, commits)."""
    root = tmp_path_factory.mktemp("hub")
    subprocess.run([str(data_env), str(HUB_CONTENT), str(root)], check=True)
    token = "hf_" + secrets.token_hex(16)
    (root / "models" / content.MODEL_REPO / ".gated-token").write_text(token)
    port = free_port()
    server = subprocess.Popen(
        [
            sys.executable,
            str(HUB_SERVER),
            "--bind",
            "127.0.0.1",
            "--port",
            str(port),
            "--directory",
            str(root),
            "--hub-root",
            str(root),
        ]
    )
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(100):
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                    break
            except OSError:
                time.sleep(0.05)
        request = urllib.request.Request(
            f"{url}/api/models/{content.MODEL_REPO}", headers={"Authorization": f"Bearer {token}"}
        )
        model_commit = json.load(urllib.request.urlopen(request))["sha"]
        dataset_commit = json.load(urllib.request.urlopen(f"{url}/api/datasets/{content.GSM8K_REPO}"))["sha"]
        yield {"url": url, "token": token, "model": model_commit, "dataset": dataset_commit, "root": root}
    finally:
        server.terminate()
        server.wait(timeout=10)


# Runs in front of the env's python during each download, while the token is in use: every process's arguments
# and environment (`ps e`, root sees all) and every file in the places a run writes are searched for the token.
SPY = r"""
import json, os, pathlib, subprocess, sys
spy = pathlib.Path(sys.argv[1])
token = (spy / "token").read_bytes()
listing = subprocess.run(["ps", "axww", "e", "-o", "args="], capture_output=True, check=True).stdout
files = []
places, skip = json.loads((spy / "places.json").read_text())
for place in places:
    for top, dirs, names in os.walk(place):
        dirs[:] = [d for d in dirs if os.path.join(top, d) not in skip]
        for name in names:
            path = os.path.join(top, name)
            try:
                if path in skip:
                    continue
                if os.path.isfile(path) and not os.path.islink(path) and token in open(path, "rb").read():
                    files.append(path)
            except OSError:
                pass
with open(spy / "seen.jsonl", "a") as out:
    out.write(json.dumps({"action": sys.argv[2], "ps": token in listing, "files": files,
                          "listed": b"training_data_tool" in listing or b"snapshot_download" in listing}) + "\n")
"""


def spied_python(spy: Path, python: Path, token: str, places: list[Path], skip: list[Path]) -> Path:
    """A stand-in for the env's python: the real one, with the token search of SPY run before each download."""
    spy.mkdir()
    (spy / "token").write_text(token)
    (spy / "places.json").write_text(json.dumps([[str(p) for p in places], [str(p) for p in [spy, *skip]]]))
    (spy / "spy.py").write_text(SPY)
    wrapper = spy / "python"
    wrapper.write_text(
        "#!/bin/sh\n"
        f'case "$4" in dataset|model) {sys.executable} {spy / "spy.py"} {spy} "$4" ;; esac\n'
        f'exec {python} "$@"\n'
    )
    wrapper.chmod(0o755)
    return wrapper


@pytest.fixture(scope="module")
def provisioned(tmp_path_factory, run_playbook, data_env, hub):
    work = tmp_path_factory.mktemp("training-data")
    # Skipped: the token's own homes (the hub stand-in's copy, the inventory that gives it) and the login account's
    # 0700 module directory, where Ansible writes every module's arguments while it runs (the admin's, who gave it).
    home = Path.home()
    places = [tmp_path_factory.getbasetemp(), home / ".ansible", home / ".cache" / "huggingface", Path("/var/tmp")]
    places.append(Path("/dev/shm"))
    skip = [hub["root"], work / "hosts.yml", home / ".ansible" / "tmp"]
    spy = spied_python(work / "spy", data_env, hub["token"], places, skip)
    host = {
        "ansible_connection": "local",
        "ansible_python_interpreter": sys.executable,
        "ansible_become": False,
        "p40fleet_env_owner": os.environ.get("USER") or "root",
        "training_data_python": str(spy),
        "training_data_root": str(work / "p40fleet"),
        "training_data_hub_endpoint": hub["url"],
        "training_data_hub_token": hub["token"],
        "training_data_dataset_revision": hub["dataset"],
        "training_data_model_revision": hub["model"],
    }
    import pwd

    host["p40fleet_env_owner"] = pwd.getpwuid(os.getuid()).pw_name
    (work / "p40fleet").mkdir()
    inventory = work / "hosts.yml"
    inventory.write_text(yaml.safe_dump({"all": {"hosts": {"node": host}}}))
    envvars = {"ANSIBLE_CACHE_PLUGIN_CONNECTION": str(work / "facts"), **ROOT_PLAYS_OWNER}
    first = run_playbook(PLAYBOOK, inventory, envvars=envvars)
    second = run_playbook(PLAYBOOK, inventory, envvars=envvars)
    seen = [json.loads(line) for line in (work / "spy" / "seen.jsonl").read_text().splitlines()]
    return {"work": work, "first": first, "second": second, "inventory": inventory, "envvars": envvars, "seen": seen}


def read_parquet(python: Path, path: Path) -> dict:
    script = (
        "import json, sys, pyarrow.parquet as pq; t = pq.read_table(sys.argv[1]);"
        "print(json.dumps({'schema': str(t.schema), 'rows': t.to_pylist()}))"
    )
    return json.loads(
        subprocess.run([str(python), "-c", script, str(path)], capture_output=True, text=True, check=True).stdout
    )


def test_first_run_converges_and_second_changes_nothing(provisioned):
    first, second = provisioned["first"], provisioned["second"]
    assert first.rc == 0, first.stdout[-4000:]
    assert first.stats["node"]["changed"] > 0
    assert second.rc == 0, second.stdout[-4000:]
    assert second.stats["node"]["changed"] == 0, second.stdout[-4000:]


def test_gsm8k_is_in_verls_layout_value_by_value(provisioned, data_env):
    data_dir = provisioned["work"] / "p40fleet" / "data" / "gsm8k"
    for split, rows in content.GSM8K_ROWS.items():
        table = read_parquet(data_env, data_dir / f"{split}.parquet")
        assert [f.split(":")[0] for f in table["schema"].splitlines() if not f.startswith(" ")][:5] == [
            "data_source",
            "prompt",
            "ability",
            "reward_model",
            "extra_info",
        ]
        assert len(table["rows"]) == len(rows)
        for index, (row, (question, answer)) in enumerate(zip(table["rows"], rows, strict=True)):
            assert row == {
                "data_source": "openai/gsm8k",
                "prompt": [{"role": "user", "content": question + " " + INSTRUCTION}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": answer.rsplit("#### ", 1)[1].replace(",", "")},
                "extra_info": {"split": split, "index": index, "answer": answer, "question": question},
            }
    grounds = [r["reward_model"]["ground_truth"] for r in read_parquet(data_env, data_dir / "train.parquet")["rows"]]
    assert "1234" in grounds and "-5" in grounds and "-3000" in grounds


def test_the_model_is_downloaded_and_verified(provisioned):
    model_dir = provisioned["work"] / "p40fleet" / "models" / "Qwen2.5-0.5B-Instruct"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "vocab.json"):
        assert (model_dir / name).is_file(), name
    verified = tool.verify_model(model_dir)
    assert verified["problems"] == [] and verified["model_type"] == "qwen2" and verified["tensors"] > 10


def test_the_token_is_in_no_file_the_run_left(provisioned, hub):
    token = hub["token"].encode()
    places = [provisioned["work"] / "p40fleet"]
    places += [provisioned[run].artifact_dir.parent.parent for run in ("first", "second")]
    found = []
    for place in places:
        for path in place.rglob("*"):
            if path.is_file() and token in path.read_bytes():
                found.append(str(path))
    assert found == []
    assert provisioned["first"].stdout and token.decode() not in provisioned["first"].stdout
    assert not (provisioned["work"] / "p40fleet" / f".hf-token-{os.environ.get('USER', 'root')}").exists()


def test_while_the_downloads_run_the_token_is_in_no_file_and_no_process_listing(provisioned):
    # A regression: the token was handed over as a file of the owner's (readable by the account that runs other
    # people's code all day) for the whole download; it now reaches the download's process on its stdin only.
    seen = provisioned["seen"]
    assert sorted(s["action"] for s in seen) == ["dataset", "model"], seen
    assert all(s["listed"] for s in seen), "the search did not see the download's own process"
    assert [(s["action"], s["files"], s["ps"]) for s in seen] == [("dataset", [], False), ("model", [], False)]


def test_a_truncated_model_is_refused(tmp_path):
    repo = content.make_model(tmp_path)
    weights = repo / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    problems = tool.verify_model(repo)["problems"]
    assert any("truncated" in p for p in problems), problems
    (repo / "config.json").write_text("{not json")
    assert any("config.json" in p for p in tool.verify_model(repo)["problems"])


def test_a_gated_model_without_the_token_fails_with_the_hubs_error(data_env, hub, tmp_path):
    spec = {
        "model_dir": str(tmp_path / "m"),
        "model_source": "hub",
        "model_repo": content.MODEL_REPO,
        "model_revision": hub["model"],
        "endpoint": hub["url"],
        "model_allow_patterns": [],
        "model_identity": "x",
    }
    # No token on stdin; one stored where huggingface_hub looks by default is not used either.
    stored = tmp_path / "stored-token"
    stored.write_text(hub["token"])
    env = {**os.environ, "HF_TOKEN_PATH": str(stored), "HF_HUB_DISABLE_TELEMETRY": "1"}
    done = subprocess.run(
        [str(data_env), "-I", "-c", owner_script_text(TOOL), "model", json.dumps(spec)],
        input="",
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    assert done.returncode != 0
    assert "GatedRepoError" in done.stderr or "401" in done.stderr


def test_files_from_the_controller_reach_the_owners_directories_through_roots_staging(
    tmp_path, run_playbook, hub, data_env
):
    # A regression: root copied the controller's files straight into the owner's directories (a planted link there
    # redirected the write); they are staged in root's directory and copied on by the owner.
    host = {
        "ansible_connection": "local",
        "ansible_python_interpreter": sys.executable,
        "ansible_become": False,
        "p40fleet_env_owner": pwd.getpwuid(os.getuid()).pw_name,
        "training_data_python": str(data_env),
        "training_data_root": str(tmp_path / "p40fleet"),
        "training_data_dataset_source": "controller",
        "training_data_dataset_local_path": str(hub["root"] / "datasets" / content.GSM8K_REPO),
        "training_data_model_source": "controller",
        "training_data_model_local_path": str(hub["root"] / "models" / content.MODEL_REPO),
    }
    inventory = tmp_path / "hosts.yml"
    inventory.write_text(yaml.safe_dump({"all": {"hosts": {"node": host}}}))
    result = run_playbook(
        PLAYBOOK, inventory, envvars={"ANSIBLE_CACHE_PLUGIN_CONNECTION": str(tmp_path / "f"), **ROOT_PLAYS_OWNER}
    )
    assert result.rc == 0, result.stdout[-4000:]
    root = tmp_path / "p40fleet"
    assert (root / "data" / "gsm8k" / "train.parquet").is_file()
    assert (root / "models" / "Qwen2.5-0.5B-Instruct" / "model.safetensors").is_file()
    assert not (root / ".controller-staging").exists()
