"""Privilege boundaries of the whole pipeline (issue 9), on one-host sandboxes running site.yml.

Real fleets log in as an ordinary user with sudo: site.yml must converge and be idempotent that way and
with root login. Password-less sudo is what molecule's default scenario and the demo use; here the ordinary
user must type a sudo password (given as a file, as `p40fleet run --become-password-file` does).
Root must never run code the env owner can write: a `.pth` file and a `sitecustomize.py`
planted in the env's site-packages by the owner run whenever the env's Python starts, and each leaves a
marker naming the uid it ran as. A re-run of every stage that touches the env may leave the owner's
markers, never root's. (The CUDA runfile swapped after its download is in test_cuda_toolkit.py.)
"""

from __future__ import annotations

import base64

import pytest

from p40fleet.sandbox import Sandbox

pytestmark = pytest.mark.sandbox

PLAYBOOK = "site.yml"
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


@pytest.fixture(scope="module", params=["sudo-password", "root"])
def converged(request, make_sandbox, run_playbook, tmp_path_factory):
    """A one-host P40 sandbox logging in as `request.param`, converged by site.yml twice."""
    fleet = make_sandbox(f"privileges-{request.param}", ["p40"], login=request.param)
    cache = tmp_path_factory.mktemp(f"apex-cache-{request.param}")

    password = fleet.become_password_file if request.param == "sudo-password" else None

    def play(**kwargs):
        extra = {"apex_controller_cache_dir": str(cache), **kwargs.pop("extra_vars", {})}
        return run_playbook(PLAYBOOK, fleet.inventory_dir, extra_vars=extra, become_password_file=password, **kwargs)

    first = play()
    second = play()
    return request.param, fleet, play, first, second


def test_site_converges_and_a_rerun_changes_nothing(converged):
    login, fleet, _, first, second = converged
    assert fleet.exec(HOST, "id -un", user="root").returncode == 0
    assert first.rc == 0, failures(first)
    assert first.stats[HOST]["changed"] > 0
    assert second.rc == 0, failures(second)
    assert second.stats[HOST]["changed"] == 0, (login, second.stdout[-3000:])


def test_code_the_env_owner_plants_never_runs_as_root(converged):
    # With root login every task not told to become the owner runs as root: the stricter of the two.
    _, fleet, play, _, _ = converged
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
