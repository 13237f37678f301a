"""Cases 4 and 6 through site.yml: hosts preflight must stop, in one run beside a host that carries on.

Case 4: a driver too old (node2), a branch past R580 (node3), the NVML mismatch of a driver upgraded but not
reloaded (node4), no GPU (node5). Case 6: node6's cuda_toolkit_tmpdir is on a 64 MB filesystem of its own.
node7 is fit and runs on into host_prereqs in the same run, so the refused hosts are seen to drop out of the
pipeline, not merely to fail first. Each refused host gets its one message, and a `find -newer` over its whole
filesystem shows the run wrote nothing there; case 6 also shows no download started anywhere.
(test_gpu_preflight.py proves every refusal of the role on its own, on 23 hosts, and the driver upgrade.)
"""

from __future__ import annotations

import pytest
from tests.faults.tools import written_since

from p40fleet_dev.sandbox import podman

pytestmark = pytest.mark.sandbox

MARKER = "/tmp/p40fleet-faults-marker"
REFUSED = ("node2", "node3", "node4", "node5", "node6")
FIT = "node7"
# The one finding each host must be refused with, word for word.
FINDINGS = {
    "node2": (
        "found NVIDIA driver 470.256.02; required: >= 520.61.05 for CUDA 11.8 and <= R580 for Tesla P40; do: upgrade"
        " the driver to a release of branch 520 to 580 (e.g. 535 or 550), reboot, re-run"
    ),
    "node3": (
        "found NVIDIA driver 590.44.01 (branch R590) with Tesla P40 (pascal, compute capability 6.1); required:"
        " branch <= R580, the last branch that supports this GPU; do: install a driver of branch 520 to 580 (e.g."
        " 535 or 550) and hold the package so upgrades keep that branch, reboot, re-run"
    ),
    "node4": (
        'nvidia-smi answers "Failed to initialize NVML: Driver/library version mismatch / NVML library version:'
        ' 550.127": the NVIDIA driver package was upgraded but the old kernel module is still loaded; required:'
        " driver library and kernel module of the same version; do: reboot the host (or unload and reload the nvidia"
        " kernel modules) so the upgraded driver takes effect, then re-run"
    ),
    "node5": (
        "found no NVIDIA GPU (no nvidia-smi, 0 NVIDIA display device(s) on the PCI bus): nothing to provision;"
        " required: an NVIDIA GPU with a driver >= 520.61.05; do: remove the host from p40-hosts, or set"
        ' gpu_preflight_no_gpu_compute_cap (e.g. "6.1") to provision it as a CPU-only build host'
    ),
    # Case 6: the temp dir the inventory moved onto the host's 64 MB filesystem.
    "node6": (
        "too little disk: /srv/small/p40fleet (CUDA runfile extraction, cuda_toolkit_tmpdir, 10 GiB) on the"
        " filesystem of /srv/small: 0.1 GiB free; required: 10 GiB free there; do: free space there, point the"
        " install paths elsewhere (gpu_preflight_disk_checks and the later roles' paths), or set"
        " gpu_preflight_strict: false to proceed with a warning"
    ),
}


def written_since_marker(fleet, host: str) -> list[str]:
    return written_since(fleet.sandbox, host, MARKER)


def mirror_gets(fleet) -> int:
    logs = podman("logs", fleet.sandbox.mirror_container, check=False)
    return sum(1 for line in (logs.stdout + logs.stderr).decode(errors="replace").splitlines() if '"GET /' in line)


@pytest.fixture(scope="module")
def refused_run(fleet):
    for host in (*REFUSED, FIT):
        # A host reused from an interrupted session may carry saved state: start from a fresh one.
        fleet.sh(host, f"rm -rf /etc/ansible && touch {MARKER}")
    gets = mirror_gets(fleet)
    result = fleet.play(",".join((*REFUSED, FIT)), upto="host_prereqs")
    return result, mirror_gets(fleet) - gets


def the_one_message(result, host: str) -> str:
    failures = result.host_failures(host)
    assert len(failures) == 1, [f.message for f in failures]
    prefix = f"gpu_preflight refused {host} (nothing was changed on it):\n- "
    assert failures[0].message.startswith(prefix), failures[0].message
    finding = failures[0].message.removeprefix(prefix)
    assert "\n- " not in finding  # one finding, no other
    return finding


@pytest.mark.fault_case(4)
@pytest.mark.parametrize("host", ["node2", "node3", "node4", "node5"])
def test_preflight_stops_a_host_whose_driver_or_gpu_cannot_serve_and_writes_nothing_there(fleet, refused_run, host):
    result, _ = refused_run
    assert the_one_message(result, host) == FINDINGS[host]
    assert result.stats[host]["changed"] == 0
    assert written_since_marker(fleet, host) == []


@pytest.mark.fault_case(4)
def test_the_fit_host_carries_on_while_the_refused_ones_drop_out(fleet, refused_run):
    result, _ = refused_run
    assert result.stats[FIT]["failures"] == 0 and result.stats[FIT]["changed"] > 0, result.host_failures(FIT)
    assert fleet.exists(FIT, "/usr/bin/git")  # host_prereqs ran there
    for host in REFUSED:
        # Not one task of the next stage reached a refused host.
        tasks = {
            e["event_data"].get("role")
            for e in result.events
            if e.get("event", "").startswith("runner_on_") and e["event_data"].get("host") == host
        }
        # Preflight's, and before it the argument check of the defaults role every role depends on.
        assert tasks <= {"gpu_preflight", "p40fleet_defaults"}, (host, tasks)
        assert not fleet.exists(host, "/usr/bin/git")


@pytest.mark.fault_case(6)
def test_a_temp_dir_too_small_for_the_runfile_is_refused_in_preflight_before_any_download(fleet, refused_run):
    result, downloads = refused_run
    free = fleet.sh("node6", "df -BM --output=avail /srv/small | tail -1").rstrip("M")
    assert int(free) < 65  # the host's own small filesystem, where the inventory put the temp dir
    assert the_one_message(result, "node6") == FINDINGS["node6"]
    # Before any download: the mirror served nothing during the run, and nothing landed on the host.
    assert downloads == 0
    assert written_since_marker(fleet, "node6") == []
    assert not fleet.exists("node6", "/srv/small/p40fleet")
    assert not fleet.exists("node6", "/var/tmp/p40fleet")
