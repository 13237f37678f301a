"""Privilege boundaries of the whole pipeline (README.md, "Privilege model"), on the fault suite's converged node1
(faults/conftest.py).

Real fleets log in as an ordinary user with sudo: site.yml must converge and be idempotent that way and
with root login (root login: conftest's site_fleet, test_checklist.py). Password-less sudo is what the role
fleets and the demo use; here the ordinary user must type a sudo password, given as a file: node1's first
converge is `p40fleet run --become-password-file` (the fault suite's first_converge), a one-host P40 converge
this module would otherwise repeat on a fleet of its own.
Root must never run code the env owner can write: a `.pth` file and a `sitecustomize.py`
planted in the env's site-packages by the owner run whenever the env's Python starts, and each leaves a
marker naming the uid it ran as. A re-run of every stage that touches the env may leave the owner's
markers, never root's. (The CUDA runfile swapped after its download is in test_cuda_toolkit.py.)
"""

from __future__ import annotations

import base64
import json
import re
import threading

import pytest

from p40fleet_dev.sandbox import Sandbox

# converge: the fault suite's fixture takes node1 through the pipeline (minutes).
pytestmark = [pytest.mark.sandbox, pytest.mark.converge]

LOGIN = "sudo-password"
HOST = "node1"
OWNER = "p40fleet"
ENV = "/opt/miniconda3/envs/verl-env"
PY = f"{ENV}/bin/python"
ENV_STAGES = "gpu_preflight,conda_env,pytorch,apex,verl,verl_patches"
MARKERS = "/tmp/p40fleet-planted"
# Each planted file appends to a marker named after the uid the env's Python runs as.
PTH_LINE = f"import os; open('{MARKERS}-pth-uid%d' % os.getuid(), 'a').write('ran\\n')\n"
SITE_PACKAGES_FIRST = "import sys; sys.path.insert(0, {!r})\n"
SITECUSTOMIZE = f"import os\nopen('{MARKERS}-sitecustomize-uid%d' % os.getuid(), 'a').write('ran\\n')\n"


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def failures(result) -> list[str]:
    return [f"{f.host}: {f.task}: {f.message}" for f in result.failures]


def owner_sh(fleet: Sandbox, command: str) -> str:
    result = fleet.exec(HOST, command, user=OWNER)
    assert result.returncode == 0, f"{command}: {result.stderr}"
    return result.stdout.strip()


@pytest.fixture(scope="module")
def converged(module_node1, first_converge):
    """node1 logging in as an ordinary user with a sudo password (given as a file), converged by its first run
    and by site.yml once more. (Root login is site_fleet's: the owner's plants below catch a task that runs the
    env's Python as root or as the login user under either login, so one fleet serves.) The tests break node1 on
    purpose and put back what they broke, yet not every stage's record: it stays counted dirty, so the next case
    that needs it converges it first."""
    fleet = module_node1

    def play(**kwargs):
        return fleet.play(HOST, **kwargs)

    second = play()
    return fleet.sandbox, play, first_converge, second


def test_site_converges_and_a_rerun_changes_nothing(converged):
    fleet, _, first, second = converged
    assert {host.name: host.login for host in fleet.hosts()}[HOST] == LOGIN
    report = json.loads(first.report_path.read_text())["runs"][-1]
    assert report["hosts"][HOST]["state"] == "changed"
    assert second.rc == 0, failures(second)
    assert second.stats[HOST]["changed"] == 0, second.stdout[-3000:]


def test_code_the_env_owner_plants_never_runs_as_root(converged):
    # A task that runs the env's Python without becoming its owner runs it as root (become) or as the login user:
    # the markers must name the owner alone (under root login, both would be root).
    fleet, play, _, _ = converged
    # Where the env's packages really are: beside torch.
    site_packages = owner_sh(
        fleet, f"{PY} -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))'"
    )
    fleet.exec(HOST, f"rm -f {MARKERS}-*", user="root")
    planted = fleet.exec(
        HOST,
        f"echo {b64(PTH_LINE)} | base64 -d > {site_packages}/zz-planted.pth"
        f" && echo {b64(SITECUSTOMIZE)} | base64 -d > {site_packages}/sitecustomize.py"
        # The stand-in env is a venv of Debian's Python, whose own sitecustomize.py comes first on sys.path;
        # a real conda env has none. Put site-packages first, so the planted one is the one imported.
        f" && echo {b64(SITE_PACKAGES_FIRST.format(site_packages))} | base64 -d > {site_packages}/aa-first.pth",
        user=OWNER,
    )
    assert planted.returncode == 0, planted.stderr
    # The plants are live: the env's Python runs them for anyone who starts it.
    owner_sh(fleet, f"{PY} -c pass")
    uid = owner_sh(fleet, "id -u")
    assert owner_sh(fleet, f"ls {MARKERS}-*").split() == [
        f"{MARKERS}-pth-uid{uid}",
        f"{MARKERS}-sitecustomize-uid{uid}",
    ]
    fleet.exec(HOST, f"rm -f {MARKERS}-*", user="root")

    # Work for every env stage, not only their probes and checks: markers gone, so each installs again.
    fleet.exec(
        HOST,
        f"rm -f {ENV}/pip.conf {ENV}/.p40fleet-apex.json {ENV}/.p40fleet-verl-requirements.sha1"
        " /var/lib/p40fleet/verl_patches/applied.json",
        user="root",
    )
    rerun = play(tags=ENV_STAGES)
    assert rerun.rc == 0, failures(rerun)
    assert rerun.stats[HOST]["changed"] > 0

    seen = fleet.exec(HOST, f"ls {MARKERS}-* 2>/dev/null", user="root").stdout.split()
    # The owner's Python ran (probes, pip, checks), so the plants fired, and never as root.
    assert f"{MARKERS}-sitecustomize-uid{uid}" in seen
    assert f"{MARKERS}-pth-uid{uid}" in seen
    assert [m for m in seen if m.endswith("-uid0")] == []
    # Nor as the login user: the env's Python is the owner's alone.
    assert {m.rsplit("-uid", 1)[1] for m in seen} == {uid}

    for planted_file in ("zz-planted.pth", "aa-first.pth", "sitecustomize.py"):
        fleet.exec(HOST, f"rm -f {site_packages}/{planted_file}", user="root")


# --- No module result the owner writes ---------------------------------------------------------------------
# The owner's hook in its user site rewrites every Ansible module result printed in its Python: a fact naming a
# root directory as the conda prefix, and a conda probe saying conda does not run. Today's main ran the owner's
# modules in /usr/bin/python3 as the owner (become_user), took the fact and gave the owner /srv/canary.

CANARY = "/srv/canary"
FORGED = "/tmp/p40fleet-forged"
FORGE = f"""import builtins, json, os
_print = builtins.print
def _forged(*args, **kwargs):
    text = args[0] if len(args) == 1 and isinstance(args[0], str) else ""
    if text.strip().startswith("{{") and '"invocation"' in text:
        try:
            result = json.loads(text)
        except ValueError:
            result = None
        if isinstance(result, dict):
            result.setdefault("ansible_facts", {{}})["conda_env_install_prefix"] = "{CANARY}"
            if "conda=" in str(result.get("stdout", "")):
                result["stdout"] = "conda=\\nenv_python="
                result.pop("stdout_lines", None)
            args = ("\\n" + json.dumps(result),)
            open("{FORGED}-uid%d" % os.getuid(), "a").write("forged\\n")
    return _print(*args, **kwargs)
builtins.print = _forged
"""


@pytest.mark.parametrize("hook", ["usercustomize", "pth"])
def test_a_forged_module_result_from_the_owners_python_hands_nothing_to_the_owner(converged, hook):
    fleet, play, _, _ = converged
    user_site = owner_sh(fleet, "/usr/bin/python3 -c 'import site; print(site.getusersitepackages())'")
    # The hook as usercustomize.py, or as a module a .pth file in the user site imports.
    plant = (
        {"usercustomize.py": FORGE}
        if hook == "usercustomize"
        else {"p40fleet_forge.py": FORGE, "zz-forge.pth": "import p40fleet_forge\n"}
    )
    fleet.exec(HOST, f"rm -rf {CANARY} {FORGED}-* && mkdir -m 0755 {CANARY} && touch {CANARY}/root-file", "root")
    commands = [f"mkdir -p {user_site}"] + [
        f"echo {b64(text)} | base64 -d > {user_site}/{name}" for name, text in plant.items()
    ]
    owner_sh(fleet, " && ".join(commands))
    try:
        # The hook is live in the owner's system Python: a module run as the owner would print a forged result.
        owner_sh(fleet, '/usr/bin/python3 -c \'print("\\n{\\"invocation\\": {}}")\'')
        uid = owner_sh(fleet, "id -u")
        assert owner_sh(fleet, f"ls {FORGED}-*") == f"{FORGED}-uid{uid}"
        fleet.exec(HOST, f"rm -f {FORGED}-*", "root")
        # The env's Python gone: the next run re-opens conda_env, whose probes the hook answers.
        owner_sh(fleet, f"rm -f {ENV}/bin/python*")
        rerun = play()
        canary = fleet.exec(HOST, f"stat -c '%U %a' {CANARY} {CANARY}/root-file; ls -A {CANARY}", "root").stdout
        assert canary.split("\n")[:3] == ["root 755", "root 644", "root-file"], canary
        # No result the hook wrote reached Ansible: no p40fleet process imported it.
        assert fleet.exec(HOST, f"ls {FORGED}-* 2>/dev/null", "root").stdout.strip() == ""
        assert rerun.rc == 0, failures(rerun)
        assert fleet.exec(HOST, f"stat -c %U {ENV}/bin/python", "root").stdout.strip() == OWNER
    finally:
        owner_sh(fleet, "rm -f " + " ".join(f"{user_site}/{name}" for name in plant))
        fleet.exec(HOST, f"rm -rf {CANARY} {FORGED}-*", "root")


# --- The env owner cannot become root ---------------------------------------------------------------------
# Each attack is what the env owner (or another account) can do on a converged host; the next run must refuse,
# naming the host, the path and what it found, and leave every system file's owner and content as they were.
# They reuse the converged fleet above.

SYSTEM_FILES = ["/etc/hostname", "/usr/local/sbin", "/etc/sudoers.d", "/etc/passwd", "/var/lib/p40fleet"]
SECRET = "wandb-s3cr3t-issue20"


def system_state(fleet: Sandbox) -> str:
    """Owner, mode and content digest of the files an attack aims at, as root sees them."""
    listing = " ".join(SYSTEM_FILES)
    return fleet.exec(
        HOST, f"stat -c '%n %U %a' {listing}; sha256sum /etc/hostname /etc/passwd; ls -lA /usr/local/sbin", "root"
    ).stdout


def test_the_owner_cannot_swap_a_directory_root_made_for_a_link(converged):
    # The first attack: /opt/p40fleet/data/gsm8k replaced by a link to /usr/local/sbin, then a re-run.
    fleet, _, _, _ = converged
    owners = fleet.exec(HOST, "stat -c '%n %U %a' /opt/p40fleet /opt/p40fleet/data /opt/p40fleet/models", "root")
    assert owners.stdout.split("\n")[:3] == [
        "/opt/p40fleet root 755",
        "/opt/p40fleet/data root 755",
        "/opt/p40fleet/models root 755",
    ], owners.stdout
    swap = fleet.exec(
        HOST, "mv /opt/p40fleet/data/gsm8k /tmp/gsm8k-moved && ln -s /usr/local/sbin /opt/p40fleet/data/gsm8k", OWNER
    )
    assert swap.returncode != 0 and "Permission denied" in swap.stderr
    assert fleet.exec(HOST, "stat -c %U /usr/local/sbin", "root").stdout.strip() == "root"


ATTACKS = {
    # stage: (what the owner runs, the path root must refuse, what it points at)
    "pytorch": (f"rm -f {ENV}/pip.conf && ln -s /etc/hostname {ENV}/pip.conf", f"{ENV}/pip.conf", "/etc/hostname"),
    "conda_env": (
        "rm -f /opt/miniconda3/.condarc && ln -s /etc/hostname /opt/miniconda3/.condarc",
        "/opt/miniconda3/.condarc",
        "/etc/hostname",
    ),
    "verl": (
        f"rm -f {ENV}/.p40fleet-verl-requirements.sha1 {ENV}/p40fleet-verl-dependencies.lock.txt"
        f" && ln -s /etc/hostname {ENV}/p40fleet-verl-dependencies.lock.txt",
        f"{ENV}/p40fleet-verl-dependencies.lock.txt",
        "/etc/hostname",
    ),
    "apex": (
        f"rm -f {ENV}/.p40fleet-apex.json && key=$(ls /opt/p40fleet/apex-wheels | grep -v build-req)"
        " && rm -rf /opt/p40fleet/apex-wheels/$key && ln -s /usr/local/sbin /opt/p40fleet/apex-wheels/$key",
        "/opt/p40fleet/apex-wheels/",
        "/usr/local/sbin",
    ),
    "launch_script": (
        "rm -f ~/train_gsm8k_ppo.sh && ln -s /etc/hostname ~/train_gsm8k_ppo.sh",
        f"/home/{OWNER}/train_gsm8k_ppo.sh",
        "/etc/hostname",
    ),
}


@pytest.mark.parametrize("stage", list(ATTACKS))
def test_a_link_the_owner_plants_where_root_writes_is_refused(converged, stage):
    fleet, play, _, _ = converged
    plant, path, target = ATTACKS[stage]
    before = system_state(fleet)
    owner_sh(fleet, plant)
    try:
        rerun = play(tags=stage)
        assert rerun.rc != 0, f"{stage}: the planted link was not refused"
        # A looped task's failure says only that an item failed: the item's message is in the run's output, whole
        # on Ansible's "[ERROR]: Task failed" line.
        messages = [f.message for f in rerun.failures if f.host == HOST]
        messages += re.sub(r"\x1b\[[0-9;]*m", "", rerun.stdout).splitlines()
        assert any(
            f"{HOST}: {path}" in m and f"is a symlink owned by {OWNER}" in m and f"to {target}" in m for m in messages
        ), messages[:3]
        assert system_state(fleet) == before
    finally:
        # The planted link itself (for apex: the key directory's link inside apex-wheels/), never its target.
        fleet.exec(HOST, f"find {path.rstrip('/')} -maxdepth 1 -type l -delete", "root")


def test_a_staging_directory_another_account_made_first_is_refused_before_cudnn_unpacks(converged):
    fleet, play, _, _ = converged
    before = system_state(fleet)
    # Another account made /var/tmp/p40fleet first (it is everyone's /var/tmp); cuDNN must be unpacked again.
    fleet.exec(
        HOST,
        "rm -rf /var/tmp/p40fleet && mkdir -m 777 /var/tmp/p40fleet && chown nobody /var/tmp/p40fleet"
        " && rm -f /var/lib/p40fleet/stages/cudnn.json && rm -rf /usr/local/cudnn-*",
        "root",
    )
    try:
        rerun = play(tags="cudnn")
        assert rerun.rc != 0
        messages = [f.message for f in rerun.failures if f.host == HOST]
        assert any(
            m.startswith(f"{HOST}: /var/tmp/p40fleet is a directory owned by nobody, mode 0777") for m in messages
        ), messages
        assert fleet.exec(HOST, "ls -A /var/tmp/p40fleet", "root").stdout.strip() == ""
        assert system_state(fleet) == before
    finally:
        fleet.exec(HOST, "rm -rf /var/tmp/p40fleet", "root")
    again = play(tags="cudnn")
    assert again.rc == 0, failures(again)
    assert fleet.exec(HOST, "stat -c '%U %a' /var/tmp/p40fleet", "root").stdout.strip() == "root 755"


def test_a_fifo_and_a_directory_link_among_the_markers_neither_hang_nor_mislead_the_probe(converged, run_playbook):
    fleet, _, _, _ = converged
    site = owner_sh(fleet, f"ls -d {ENV}/lib/python*/site-packages")
    vision = owner_sh(fleet, f"ls -d {site}/torch-*.dist-info")
    fleet.exec(HOST, "mkdir -p /root/p40fleet-secret && echo root-only > /root/p40fleet-secret/METADATA", "root")
    owner_sh(
        fleet,
        "mv /opt/p40fleet/data/gsm8k/.p40fleet-gsm8k.json /tmp/gsm8k-marker.json"
        " && mkfifo /opt/p40fleet/data/gsm8k/.p40fleet-gsm8k.json"
        f" && mv {vision} /tmp/vision-dist-info && ln -s /root/p40fleet-secret {vision}",
    )
    try:
        done = []
        worker = threading.Thread(
            target=lambda: done.append(
                run_playbook(
                    "playbooks/state.yml", fleet.inventory_dir, become_password_file=fleet.become_password_file
                )
            ),
            daemon=True,
        )
        worker.start()
        worker.join(600)
        assert done, "the state probe hung on the FIFO"
        assert done[0].rc == 0, failures(done[0])
    finally:
        owner_sh(
            fleet,
            f"rm -f /opt/p40fleet/data/gsm8k/.p40fleet-gsm8k.json {vision}"
            " && mv /tmp/gsm8k-marker.json /opt/p40fleet/data/gsm8k/.p40fleet-gsm8k.json"
            f" && mv /tmp/vision-dist-info {vision}",
        )
        fleet.exec(HOST, "rm -rf /root/p40fleet-secret", "root")


def test_a_secret_in_the_launch_environment_is_readable_by_the_owner_alone(converged):
    fleet, play, _, _ = converged
    rerun = play(tags="launch_script", extra_vars={"launch_script_environment": {"WANDB_API_KEY": SECRET}})
    assert rerun.rc == 0, failures(rerun)
    assert SECRET not in rerun.stdout
    script = f"/home/{OWNER}/train_gsm8k_ppo.sh"
    assert fleet.exec(HOST, f"stat -c '%U %a' /home/{OWNER}/train_gsm8k_ppo.env", "root").stdout.strip() == (
        f"{OWNER} 600"
    )
    assert owner_sh(fleet, f". /home/{OWNER}/train_gsm8k_ppo.env && echo $WANDB_API_KEY") == SECRET
    leaks = fleet.exec(HOST, f"grep -rl {SECRET} {script} /var/lib/p40fleet", "root")
    assert leaks.stdout.strip() == "", leaks.stdout
    stage_records = fleet.exec(HOST, "stat -c '%a' /var/lib/p40fleet/stages/launch_script.json", "root")
    assert stage_records.stdout.strip() == "600"
    # Another account (the login user) reads neither.
    other = fleet.exec(HOST, f"cat /home/{OWNER}/train_gsm8k_ppo.env", "ops")
    assert other.returncode != 0


def test_a_token_file_a_killed_download_left_is_found_and_removed(converged):
    # What a run killed between the model download and the token cleanup leaves: the 0600 token file. (The kill
    # itself is not reproduced here: its leftover is, the way the role writes it.)
    fleet, play, _, _ = converged
    token = f"/opt/p40fleet/.hf-token-{OWNER}"
    fleet.exec(HOST, f"echo hf_leftover > {token} && chown {OWNER} {token} && chmod 600 {token}", "root")
    rerun = play()
    assert rerun.rc == 0, failures(rerun)
    assert rerun.stats[HOST]["changed"] > 0
    assert fleet.exec(HOST, f"test -e {token}", "root").returncode == 1
