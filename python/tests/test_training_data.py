"""training_data without containers: the role over a local connection, the real pyarrow (wheels from upstream.txt,
in a venv made once) in the env, against the Hub stand-in on loopback.

Checks verl's GSM8K layout value by value, the model's verification, idempotence, a gated model that needs the
token, that the token is in no file and no process listing while the run goes, nor after it, that no process of the
env owner's sees it (a .pth in the env's site-packages records what each one gets), and that a file whose bytes do
not match the hub's listing is refused before the owner gets anything.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pwd
import secrets
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from p40fleet_dev.paths import CACHE_DIR, REPO_ROOT, STANDINS_DIR, UPSTREAM_DIR
from tests.local_hosts import ROOT_PLAYS_OWNER, account_exists, free_uid, throwaway_name
from tests.source_modules import load_module, load_owner_script

PLAYBOOK = REPO_ROOT / "python" / "tests" / "playbooks" / "training_data.yml"
TOOL = REPO_ROOT / "owner_scripts" / "training_data_tool.py"
HUB_SCRIPT = REPO_ROOT / "roles" / "training_data" / "files" / "training_data_hub.py"
HUB_SERVER = STANDINS_DIR / "hub_server.py"
HUB_CONTENT = STANDINS_DIR / "hub_content.py"
DATA_ENV_PACKAGES = ["pyarrow"]
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
    """A venv with the real pyarrow wheel (what verl's dependency set brings): the env's side needs no hub client."""
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


@contextlib.contextmanager
def serving_hub(root: Path, data_env: Path, tampered: bool = False, tls_cert: Path | None = None):
    """The Hub stand-in on loopback over a fresh copy of the content, its model gated by a fresh token. Large files
    redirect to `localhost` (another origin, as the Hub's CDN is), which refuses a request with a token. With
    TLS_CERT (PEM, key included) it serves https."""
    subprocess.run([str(data_env), str(HUB_CONTENT), str(root)], check=True)
    token = "hf_" + secrets.token_hex(16)
    (root / "models" / content.MODEL_REPO / ".gated-token").write_text(token)
    if tampered:
        (root / "models" / content.MODEL_REPO / ".tampered").write_text("")
    port = free_port()
    command = [sys.executable, str(HUB_SERVER), "--bind", "127.0.0.1", "--port", str(port)]
    command += ["--directory", str(root), "--hub-root", str(root), "--cdn-host", "localhost"]
    server = subprocess.Popen(command + (["--tls-cert", str(tls_cert)] if tls_cert else []))
    context = ssl.create_default_context(cafile=str(tls_cert)) if tls_cert else None
    try:
        url = f"{'https' if tls_cert else 'http'}://127.0.0.1:{port}"
        for _ in range(100):
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                    break
            except OSError:
                time.sleep(0.05)
        request = urllib.request.Request(
            f"{url}/api/models/{content.MODEL_REPO}", headers={"Authorization": f"Bearer {token}"}
        )
        model_commit = json.load(urllib.request.urlopen(request, context=context))["sha"]
        datasets = f"{url}/api/datasets/{content.GSM8K_REPO}"
        dataset_commit = json.load(urllib.request.urlopen(datasets, context=context))["sha"]
        yield {"url": url, "token": token, "model": model_commit, "dataset": dataset_commit, "root": root}
    finally:
        server.terminate()
        server.wait(timeout=10)


@pytest.fixture(scope="module")
def hub(tmp_path_factory, data_env):
    """The Hub stand-in for the module: (url, token, commits, root)."""
    with serving_hub(tmp_path_factory.mktemp("hub"), data_env) as served:
        yield served


def local_run(work: Path, host: dict) -> tuple[Path, dict]:
    """The inventory of the one local host, and the playbook's environment (root plays the owner)."""
    inventory = work / "hosts.yml"
    inventory.write_text(yaml.safe_dump({"all": {"hosts": {"node": host}}}))
    return inventory, {"ANSIBLE_CACHE_PLUGIN_CONNECTION": str(work / "facts"), **ROOT_PLAYS_OWNER}


def hub_host(work: Path, python: Path, hub: dict, account: str) -> dict:
    """A local host whose data set and model come from the hub stand-in, fetched by ACCOUNT."""
    return {
        "ansible_connection": "local",
        "ansible_python_interpreter": sys.executable,
        "ansible_become": False,
        "p40fleet_env_owner": pwd.getpwuid(os.getuid()).pw_name,
        "p40fleet_state_dir": str(work / "state"),
        "training_data_python": str(python),
        "training_data_root": str(work / "p40fleet"),
        "training_data_fetch_account": account,
        "training_data_fetch_account_uid": free_uid(),
        "training_data_hub_endpoint": hub["url"],
        "training_data_hub_token": hub["token"],
        "training_data_dataset_revision": hub["dataset"],
        "training_data_model_revision": hub["model"],
    }


# Put in the env's site-packages as a .pth, as the env owner could: it runs at the start of every process of the env's
# Python, -I or not, and records its arguments, its stdin (handed back to the process) and its environment.
PTH_SPY = r"""
import io, json, os, sys
data = sys.stdin.read() if sys.stdin is not None and not sys.stdin.isatty() else ""
sys.stdin = io.StringIO(data)
with open(os.environ.get("P40_SPY_OUT") or SPY_OUT, "a") as out:
    out.write(json.dumps({"argv": sys.argv[1:2], "stdin": data, "environ": dict(os.environ)}) + "\n")
"""


def owner_env_with_pth_spy(work: Path, data_env: Path) -> tuple[Path, Path]:
    """A venv of the env's Python whose site-packages hold the data env's packages and the owner's .pth spy."""
    env = work / "owner-env"
    subprocess.run([str(data_env), "-m", "venv", "--without-pip", str(env)], check=True)
    purelib = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site = Path(
        subprocess.run(
            [str(env / "bin" / "python"), "-c", purelib], capture_output=True, text=True, check=True
        ).stdout.strip()
    )
    packages = subprocess.run([str(data_env), "-c", purelib], capture_output=True, text=True, check=True).stdout
    (site / "data-env.pth").write_text(packages.strip() + "\n")
    seen = work / "pth-seen.jsonl"
    (site / "spy.py").write_text(PTH_SPY.replace("SPY_OUT", repr(str(seen))))
    (site / "zz-owner.pth").write_text("import spy\n")
    return env / "bin" / "python", seen


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
                          "listed": b"training_data_tool" in listing}) + "\n")
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
    owner_python, pth_seen = owner_env_with_pth_spy(work, data_env)
    spy = spied_python(work / "spy", owner_python, hub["token"], places, skip)
    account = throwaway_name()
    host = hub_host(work, spy, hub, account)
    (work / "p40fleet").mkdir()
    inventory, envvars = local_run(work, host)
    first = run_playbook(PLAYBOOK, inventory, envvars=envvars)
    second = run_playbook(PLAYBOOK, inventory, envvars=envvars)
    seen = [json.loads(line) for line in (work / "spy" / "seen.jsonl").read_text().splitlines()]
    pth = [json.loads(line) for line in pth_seen.read_text().splitlines()]
    return {
        "work": work,
        "first": first,
        "second": second,
        "inventory": inventory,
        "envvars": envvars,
        "seen": seen,
        "pth": pth,
        "account": account,
    }


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
    # people's code all day) for the whole download; it now reaches the throwaway account's download on its stdin
    # only. The search runs as each of the owner's steps starts (the conversion and the model's check, which the
    # downloads were part of): the staged files and the owner's copies hold no token.
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


def test_no_process_of_the_env_owners_sees_the_token(provisioned, hub):
    # A regression: the download ran in the env's Python as the owner with the token on its stdin, where a .pth of
    # the owner's read it. The owner's processes now get no token: the throwaway account downloads.
    pth = provisioned["pth"]
    assert {"dataset", "model", "probe"} <= {p["argv"][0] for p in pth if p["argv"]}, pth
    leaks = [p["argv"] for p in pth if hub["token"] in json.dumps(p)]
    assert leaks == []


def test_the_throwaway_account_and_roots_staging_are_gone(provisioned):
    assert not account_exists(provisioned["account"])
    assert not (provisioned["work"] / "state" / "training-data-fetch").exists()
    assert not (provisioned["work"] / "p40fleet" / ".controller-staging").exists()


def hub_script(*args: str, stdin: str = "") -> subprocess.CompletedProcess:
    """training_data_hub.py as the role runs it: root's Python, isolated; bytes out."""
    return subprocess.run(
        ["/usr/bin/python3", "-I", str(HUB_SCRIPT), *args], input=stdin.encode(), capture_output=True, check=False
    )


def test_a_gated_model_without_the_token_fails_with_the_hubs_error(hub):
    listed = hub_script("list", hub["url"], "", "model", content.MODEL_REPO, hub["model"])
    assert listed.returncode == 1 and b"HTTP 401 GatedRepo" in listed.stderr, listed.stderr
    got = hub_script("get", hub["url"], "", "model", content.MODEL_REPO, hub["model"], "config.json", "100000")
    assert got.returncode == 1 and b"HTTP 401 GatedRepo" in got.stderr and got.stdout == b""


def test_the_token_goes_to_the_hub_and_not_to_the_cdn_it_redirects_to(hub):
    # The stand-in's CDN (localhost, another origin) answers 400 to a request that brings the token, as S3 does for a
    # presigned URL: the download succeeding means the redirect was followed without it.
    listed = hub_script("list", hub["url"], "", "model", content.MODEL_REPO, hub["model"], stdin=hub["token"] + "\n")
    assert listed.returncode == 0, listed.stderr
    sibling = {s["rfilename"]: s for s in json.loads(listed.stdout)["siblings"]}["model.safetensors"]
    model = ("model", content.MODEL_REPO, hub["model"], "model.safetensors")
    got = hub_script("get", hub["url"], "", *model, str(sibling["size"]), stdin=hub["token"] + "\n")
    assert got.returncode == 0, got.stderr
    assert hashlib.sha256(got.stdout).hexdigest() == sibling["lfs"]["sha256"]
    # More bytes than the listing gives are refused.
    short = hub_script("get", hub["url"], "", *model, "10", stdin=hub["token"] + "\n")
    assert short.returncode == 1 and b"more than the 10 bytes" in short.stderr


def test_a_mirror_over_tls_is_used_with_its_ca_and_refused_without(tmp_path, data_env):
    # The certificate of a private mirror (its own CA, self-signed here) for 127.0.0.1 and localhost, its CDN.
    cert = tmp_path / "mirror.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-days",
            "2",
            "-subj",
            "/CN=p40fleet test mirror",
            "-addext",
            "subjectAltName=IP:127.0.0.1,DNS:localhost",
            "-keyout",
            str(tmp_path / "key.pem"),
            "-out",
            str(tmp_path / "crt.pem"),
        ],
        check=True,
        capture_output=True,
    )
    cert.write_text((tmp_path / "crt.pem").read_text() + (tmp_path / "key.pem").read_text())
    ca = (tmp_path / "crt.pem").read_text()
    with serving_hub(tmp_path / "hub", data_env, tls_cert=cert) as served:
        assert served["url"].startswith("https://")
        args = (served["url"], "model", content.MODEL_REPO, served["model"])
        refused = hub_script("list", args[0], "", *args[1:], stdin=served["token"] + "\n")
        assert refused.returncode == 1 and b"CERTIFICATE_VERIFY_FAILED" in refused.stderr, refused.stderr
        listed = hub_script("list", args[0], ca, *args[1:], stdin=served["token"] + "\n")
        assert listed.returncode == 0, listed.stderr
        sibling = {s["rfilename"]: s for s in json.loads(listed.stdout)["siblings"]}["model.safetensors"]
        got = hub_script(
            "get", args[0], ca, *args[1:], "model.safetensors", str(sibling["size"]), stdin=served["token"] + "\n"
        )
        assert got.returncode == 0 and hashlib.sha256(got.stdout).hexdigest() == sibling["lfs"]["sha256"]


@pytest.mark.parametrize("endpoint", ["http://example.org", "ftp://127.0.0.1", "http://10.0.0.1:8080"])
def test_only_https_or_loopback_http_is_used(endpoint):
    done = hub_script("list", endpoint, "", "model", content.MODEL_REPO, "0" * 40, stdin="hf_x\n")
    assert done.returncode == 1 and b"only https" in done.stderr, done.stderr


def test_a_file_that_differs_from_the_hubs_listing_is_refused_and_the_next_run_redoes_it(
    tmp_path, run_playbook, data_env
):
    with serving_hub(tmp_path / "hub", data_env, tampered=True) as served:
        account = throwaway_name()
        host = hub_host(tmp_path, data_env, served, account)
        (tmp_path / "p40fleet").mkdir()
        inventory, envvars = local_run(tmp_path, host)
        refused = run_playbook(PLAYBOOK, inventory, envvars=envvars)
        assert refused.rc != 0
        (failure,) = refused.failures
        assert failure.task == "Ensure every staged file has the hash the hub lists for it at the pinned commit"
        assert "model/config.json: blob " in failure.message and "the hub lists blob" in failure.message
        root = tmp_path / "p40fleet"
        # Nothing reached the owner's directories, the data set's good files neither; the account and staging went.
        assert [p for p in (root / "models").rglob("*") if p.is_file()] == []
        assert [p for p in (root / "data").rglob("*") if p.is_file()] == []
        assert not (root / ".controller-staging").exists() and not account_exists(account)
        (served["root"] / "models" / content.MODEL_REPO / ".tampered").unlink()
        redone = run_playbook(PLAYBOOK, inventory, envvars=envvars)
        assert redone.rc == 0, redone.stdout[-4000:]
    assert tool.verify_model(root / "models" / "Qwen2.5-0.5B-Instruct")["problems"] == []
    assert (root / "data" / "gsm8k" / "train.parquet").is_file()


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
    inventory, envvars = local_run(tmp_path, host)
    result = run_playbook(PLAYBOOK, inventory, envvars=envvars)
    assert result.rc == 0, result.stdout[-4000:]
    root = tmp_path / "p40fleet"
    assert (root / "data" / "gsm8k" / "train.parquet").is_file()
    assert (root / "models" / "Qwen2.5-0.5B-Instruct" / "model.safetensors").is_file()
    assert not (root / ".controller-staging").exists()
