"""driver_hold's decisions without containers: installed package sets of Debian, Ubuntu and NVIDIA's repository
(names and versions as those archives spell them), each paired with the exact plan; and the probe's reading of
dpkg-query. The sandbox test (test_driver_hold.py) proves the plan with real apt."""

from __future__ import annotations

import pytest

from p40fleet_dev.paths import REPO_ROOT
from tests.source_modules import load_module

RULES = load_module(REPO_ROOT / "plugins" / "filter" / "driver_hold.py", "driver_hold_rules")
PROBE = load_module(REPO_ROOT / "plugins" / "modules" / "driver_hold_packages.py", "driver_hold_packages")


def pkg(name: str, version: str, selection: str = "install") -> dict:
    return {"name": name, "version": version, "selection": selection}


def settings(**overrides) -> dict:
    return {"host": "gpu1", "state": "present", "max_branch": 580, "loaded_driver_version": "580.95.05", **overrides}


def plan(packages, record=None, unattended=False, **overrides) -> dict:
    found = {"packages": packages, "record": record, "unattended_upgrades": unattended, "files": {}}
    return RULES.driver_hold_plan(found, settings(**overrides))


# Ubuntu 24.04's own packages of R580 (branch-suffixed names, -0ubuntu versions), with the prebuilt module package
# that carries the kernel's version, and NVIDIA's container library (1.x): neither may be pinned to 580.*.
UBUNTU_580 = [
    pkg("libnvidia-compute-580", "580.95.05-0ubuntu0.24.04.2"),
    pkg("libnvidia-container1", "1.17.8-1"),
    pkg("linux-modules-nvidia-580-6.8.0-85-generic", "6.8.0-85.85+1"),
    pkg("nvidia-compute-utils-580", "580.95.05-0ubuntu0.24.04.2"),
    pkg("nvidia-driver-580", "580.95.05-0ubuntu0.24.04.2"),
    pkg("nvidia-kernel-common-580", "580.95.05-0ubuntu0.24.04.2"),
    pkg("nvidia-utils-580", "580.95.05-0ubuntu0.24.04.2"),
]
# Debian 12's non-free driver (branch-less names, Debian versions) and NVIDIA's CUDA repository meta-package.
DEBIAN_580 = [
    pkg("cuda-drivers-580", "580.95.05-1"),
    pkg("libcuda1", "580.95.05-1"),
    pkg("nvidia-cuda-toolkit", "11.8.89~11.8.0-5~deb12u1"),
    pkg("nvidia-driver", "580.95.05-1"),
    pkg("nvidia-kernel-dkms", "580.95.05-1"),
]


@pytest.mark.parametrize(
    ("packages", "loaded", "branch", "pinned", "hold"),
    [
        (
            UBUNTU_580,
            "580.95.05",
            "580",
            [
                "libnvidia-compute-580",
                "nvidia-compute-utils-580",
                "nvidia-driver-580",
                "nvidia-kernel-common-580",
                "nvidia-utils-580",
            ],
            [],
        ),
        (
            DEBIAN_580,
            "580.95.05",
            "580",
            ["cuda-drivers-580", "libcuda1", "nvidia-driver", "nvidia-kernel-dkms"],
            ["cuda-drivers-580"],
        ),
        # A 535 host (loaded 535) with a stray 580 library: the loaded branch is held, the stray left unpinned.
        (
            [pkg("nvidia-driver-535-server", "535.247.01-0ubuntu1"), pkg("libnvidia-gl-580", "580.95.05-0ubuntu1")],
            "535.247.01",
            "535",
            ["nvidia-driver-535-server"],
            [],
        ),
        # No loaded module known (a build host): the newest installed branch the profile allows.
        ([pkg("nvidia-driver", "535.247.01-1"), pkg("nvidia-smi", "580.95.05-1")], "", "580", ["nvidia-smi"], []),
        # Epochs are kept in the pin.
        ([pkg("nvidia-driver", "1:580.95.05-1")], "580.95.05", "580", ["nvidia-driver"], []),
        # The -open transitional packages and NVIDIA's unversioned metas are held.
        (
            [pkg("nvidia-driver-580-open", "580.95.05-1"), pkg("cuda-drivers", "580.95.05-1")],
            "580.95.05",
            "580",
            ["cuda-drivers", "nvidia-driver-580-open"],
            ["cuda-drivers", "nvidia-driver-580-open"],
        ),
    ],
)
def test_the_installed_driver_packages_and_branch(packages, loaded, branch, pinned, hold):
    result = plan(packages, loaded_driver_version=loaded)
    assert result["errors"] == []
    assert (result["branch"], result["pinned"], result["hold"]) == (branch, pinned, hold)
    assert result["held_by_role"] == hold
    assert result["record"] == {
        "schema": 1,
        "branch": branch,
        "pinned": pinned,
        "held": hold,
        "held_by_role": hold,
        "blacklisted": [],
    }


def test_the_preferences_pin_the_branch_block_other_versions_and_the_open_module():
    text = plan(DEBIAN_580)["preferences"]
    stanzas = [block.splitlines() for block in text.split("\n\n") if "Package:" in block]
    names = "Package: cuda-drivers-580 libcuda1 nvidia-driver nvidia-kernel-dkms"
    assert stanzas[0][-3:] == [names, "Pin: version 580.*", "Pin-Priority: 1000"]
    assert stanzas[1] == [names, "Pin: version *", "Pin-Priority: -1"]
    assert stanzas[2][-3:] == [
        "Package: " + " ".join(RULES.OPEN_MODULE_PATTERNS),
        "Pin: version *",
        "Pin-Priority: -1",
    ]
    assert len(stanzas) == 3
    # A profile without a last branch (nothing past which to block the open module) gets no open-module stanza.
    assert "nvidia-kernel-open-dkms" not in plan(DEBIAN_580, max_branch=0)["preferences"]
    epoch = plan([pkg("nvidia-driver", "1:580.95.05-1")])["preferences"]
    assert "Pin: version 1:580.*\n" in epoch


def test_unattended_upgrades_is_told_only_where_it_is_installed():
    assert plan(DEBIAN_580)["unattended"] == ""
    with_uu = plan(DEBIAN_580, unattended=True)
    assert with_uu["record"]["blacklisted"] == ["cuda-drivers-580", "libcuda1", "nvidia-driver", "nvidia-kernel-dkms"]
    lines = with_uu["unattended"].splitlines()
    assert "Unattended-Upgrade::Package-Blacklist {" in lines
    assert '    "^nvidia-driver$";' in lines and lines[-1] == "};"
    assert RULES._blacklist_entry("libstdc++6.x") == "^libstdc[+][+]6[.]x$"


def test_driver_packages_past_the_last_branch_refuse_the_host_by_name():
    result = plan([*DEBIAN_580, pkg("libnvidia-ml1", "590.44.01-1")])
    assert result["preferences"] == "" and result["record"] is None
    (error,) = result["errors"]
    assert "gpu1" in error and "R590: libnvidia-ml1 590.44.01-1" in error and "past R580" in error
    assert "nothing was changed" in error
    # A profile without a last branch holds whatever is installed.
    assert (
        plan([pkg("nvidia-driver", "590.44.01-1")], max_branch=0, loaded_driver_version="590.44.01")["branch"] == "590"
    )


def test_a_host_without_apt_driver_packages_gets_no_files_and_says_so():
    result = plan([pkg("libnvidia-container1", "1.17.8-1")])
    assert (result["preferences"], result["unattended"], result["hold"]) == ("", "", [])
    assert result["record"]["pinned"] == [] and "nothing to pin" in result["notes"][0]


def test_holds_the_administrator_placed_are_not_the_role_s_and_absent_keeps_them():
    packages = [pkg("cuda-drivers-580", "580.95.05-1", "hold"), pkg("cuda-drivers", "580.95.05-1")]
    first = plan(packages)
    assert first["hold"] == ["cuda-drivers", "cuda-drivers-580"]
    assert first["held_by_role"] == ["cuda-drivers"]
    # The next run sees both on hold: the record still says which one the role placed.
    held = [pkg("cuda-drivers-580", "580.95.05-1", "hold"), pkg("cuda-drivers", "580.95.05-1", "hold")]
    again = plan(held, record=first["record"])
    assert again["held_by_role"] == ["cuda-drivers"] and again["record"] == first["record"]
    absent = plan(held, record=first["record"], state="absent")
    assert absent["unhold"] == ["cuda-drivers"]
    assert (absent["preferences"], absent["unattended"], absent["record"]) == ("", "", None)
    # Absent with no record releases nothing.
    assert plan(held, state="absent")["unhold"] == []


@pytest.mark.parametrize(
    ("files", "packages", "unmet"),
    [
        ({"preferences": "P", "unattended": None}, [pkg("cuda-drivers", "580.1-1", "hold")], []),
        ({"preferences": None, "unattended": None}, [pkg("cuda-drivers", "580.1-1", "hold")], ["file is missing"]),
        ({"preferences": "old", "unattended": None}, [pkg("cuda-drivers", "580.1-1", "hold")], ["planned pins"]),
        ({"preferences": "P", "unattended": "U"}, [pkg("cuda-drivers", "580.1-1", "hold")], ["still there"]),
        ({"preferences": "P", "unattended": None}, [pkg("cuda-drivers", "580.1-1")], ["not on hold: cuda-drivers"]),
    ],
)
def test_the_post_condition_names_what_is_not_in_place(files, packages, unmet):
    wanted = {"preferences": "P", "unattended": "", "hold": ["cuda-drivers"], "unhold": []}
    found = RULES.driver_hold_unmet({"files": files, "packages": packages}, wanted)
    assert len(found) == len(unmet) and all(want in got for want, got in zip(unmet, found, strict=True)), found


def test_the_probe_reads_dpkg_query_selections_and_statuses():
    out = (
        "nvidia-driver\t580.95.05-1\tii \n"
        "cuda-drivers-580\t580.95.05-1\thi \n"
        "nvidia-kernel-dkms\t535.247.01-1\trc \n"
        "unattended-upgrades\t2.9.1+nmu3\tii \n"
        "bash\t5.2.15-2+b7\tii \n"
        "libcuda1\t580.95.05-1\tiU \n"
    )
    packages, unattended = PROBE.parse(out)
    assert unattended is True
    assert packages == [pkg("cuda-drivers-580", "580.95.05-1", "hold"), pkg("nvidia-driver", "580.95.05-1")]
