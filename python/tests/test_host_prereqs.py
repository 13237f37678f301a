"""host_prereqs: the per-OS package lists (every supported release, no containers) and its probe's
reading of apt-cache; the sandbox tests in test_login_modes.py prove the stage on Debian hosts."""

from __future__ import annotations

import re

import pytest
import yaml

from p40fleet_dev.paths import REPO_ROOT
from tests.source_modules import load_module

ROLE = REPO_ROOT / "roles" / "host_prereqs"
SUPPORTED = ("Debian-11", "Debian-12", "Ubuntu-20.04", "Ubuntu-22.04", "Ubuntu-24.04")
# What the later stages run: git (verl), tar + xz-utils (cuDNN), libxml2 (the CUDA 11 installer exits
# 127 without it), a C/C++ toolchain with libc headers (Apex), CA certificates (TLS downloads), nft (Ray's
# firewall).
NEEDED = {
    *("ca-certificates", "git", "tar", "xz-utils", "libxml2", "procps", "make", "libc6-dev", "gcc", "g++", "nftables"),
}
# nvcc 11.8 rejects gcc > 11 ("unsupported GNU version").
NVCC_MAX_GCC = 11


def load(name: str) -> dict:
    return yaml.safe_load((ROLE / "vars" / f"{name}.yml").read_text())


def test_every_supported_release_has_a_vars_file_and_nothing_else_does():
    files = {p.stem for p in (ROLE / "vars").glob("*.yml")} - {"main"}
    assert files == set(SUPPORTED)
    listed = yaml.safe_load((ROLE / "vars" / "main.yml").read_text())["host_prereqs_supported_os"]
    assert sorted(name.replace(" ", "-") for name in listed) == sorted(SUPPORTED)


@pytest.mark.parametrize("release", SUPPORTED)
def test_release_lists_every_prerequisite_and_a_compiler_nvcc_accepts(release):
    data = load(release)
    assert set(data) == {
        "host_prereqs_os_packages",
        "host_prereqs_os_compiler_packages",
        "host_prereqs_os_package_components",
    }
    packages = data["host_prereqs_os_packages"]
    assert len(packages) == len(set(packages))
    assert set(packages) >= NEEDED, f"{release} lacks {NEEDED - set(packages)}"
    assert all(re.fullmatch(r"[a-z0-9][a-z0-9+.-]+", p) for p in packages)
    compilers = data["host_prereqs_os_compiler_packages"]
    majors = {int(re.fullmatch(r"(?:gcc|g\+\+)-(\d+)", c).group(1)) for c in compilers}
    assert len(majors) == 1 and majors.pop() <= NVCC_MAX_GCC
    assert {c.split("-")[0] for c in compilers} == {"gcc", "g++"}
    # Every compiler package names the component it lives in, for the refusal message.
    assert set(data["host_prereqs_os_package_components"]) == set(compilers)
    assert set(data["host_prereqs_os_package_components"].values()) <= {"main", "universe"}


def test_debian_and_ubuntu_share_one_list_of_base_packages():
    lists = {release: load(release)["host_prereqs_os_packages"] for release in SUPPORTED}
    assert len({tuple(sorted(v)) for v in lists.values()}) == 1, lists


def test_compilers_per_release_match_the_archives():
    # gcc-11: Debian 12 main (checked with apt-cache policy on bookworm), Ubuntu 22.04 main (its
    # default), Ubuntu 24.04 universe only; Debian 11 and Ubuntu 20.04 have none, and their default
    # gcc (10 and 9) is one nvcc 11.8 accepts.
    expected = {
        "Debian-11": ("gcc-10", "main"),
        "Debian-12": ("gcc-11", "main"),
        "Ubuntu-20.04": ("gcc-9", "main"),
        "Ubuntu-22.04": ("gcc-11", "main"),
        "Ubuntu-24.04": ("gcc-11", "universe"),
    }
    for release, (gcc, component) in expected.items():
        data = load(release)
        assert gcc in data["host_prereqs_os_compiler_packages"], release
        assert data["host_prereqs_os_package_components"][gcc] == component, release


def test_defaults_and_argument_specs_declare_the_same_prefixed_variables():
    defaults = yaml.safe_load((ROLE / "defaults" / "main.yml").read_text())
    spec = yaml.safe_load((ROLE / "meta" / "argument_specs.yml").read_text())["argument_specs"]["main"]["options"]
    assert set(defaults) == set(spec)
    for name, value in defaults.items():
        assert name.startswith("host_prereqs_")
        assert spec[name]["default"] == value
    for path in (ROLE / "vars").glob("*.yml"):
        assert all(name.startswith("host_prereqs_") for name in yaml.safe_load(path.read_text()))


def _probe_module():
    return load_module(REPO_ROOT / "plugins" / "modules" / "host_prereqs_packages.py", "host_prereqs_packages")


# `apt-cache policy gcc-11 git libxml2 nosuch` on Debian 12 (an unknown package prints nothing).
POLICY = """\
gcc-11:
  Installed: (none)
  Candidate: 11.3.0-12
  Version table:
     11.3.0-12 500
        500 http://deb.debian.org/debian bookworm/main amd64 Packages
git:
  Installed: 1:2.39.5-0+deb12u3
  Candidate: 1:2.39.5-0+deb12u3
  Version table:
 *** 1:2.39.5-0+deb12u3 500
        500 http://deb.debian.org/debian bookworm/main amd64 Packages
        100 /var/lib/dpkg/status
libxml2:
  Installed: (none)
  Candidate: (none)
  Version table:
"""


def test_probe_reads_candidates_from_apt_cache_policy():
    assert _probe_module().candidates(POLICY) == {"gcc-11", "git"}
    assert _probe_module().candidates("") == set()
