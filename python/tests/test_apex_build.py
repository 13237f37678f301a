"""Apex's real setup.py (the pinned commit's archive) against the stand-in torch, on the controller.

The role's module lists must be what the pinned setup.py builds for --cpp_ext and --cuda_ext; the
environment-variable form must build nothing at that commit; and the stand-in torch's BuildExtension
must refuse what real torch refuses. The full build on the hosts is in test_python_stack.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
import yaml

from p40fleet_dev.paths import REPO_ROOT, STANDINS_DIR
from tests.source_modules import load_module

ARTIFACTS = STANDINS_DIR / "artifacts"
DEFAULTS = yaml.safe_load((REPO_ROOT / "roles" / "apex" / "defaults" / "main.yml").read_text())
NVCC = ARTIFACTS / "apex_repo" / "nvcc"


def load_builder(name: str):
    return load_module(ARTIFACTS / f"{name}.py", f"p40fleet_test_{name}")


@pytest.fixture(scope="module")
def standin_torch(tmp_path_factory) -> Path:
    """The stand-in torch 2.6.0+cu118 wheel, unpacked as a directory to put on PYTHONPATH."""
    out = tmp_path_factory.mktemp("torch")
    load_builder("torch_wheels").build(out, out)
    site = out / "site"
    with zipfile.ZipFile(next((out / "torch_wheels").glob("torch-2.6.0+cu118-*.whl"))) as wheel:
        wheel.extractall(site)
    return site


@pytest.fixture(scope="module")
def apex_source(tmp_path_factory) -> Path:
    apex_repo = load_builder("apex_repo")
    out = tmp_path_factory.mktemp("apex")
    with tarfile.open(apex_repo.shared_archive()) as tar:
        tar.extractall(out, filter="data")
    return out / f"apex-{apex_repo.UPSTREAM_COMMIT}"


def cuda_home(root: Path, release: str = "11.8") -> Path:
    (root / "bin").mkdir(parents=True, exist_ok=True)
    (root / "lib64").mkdir(exist_ok=True)
    nvcc = root / "bin" / "nvcc"
    nvcc.write_text(NVCC.read_text().replace("11.8", release))
    nvcc.chmod(0o755)
    return root


def run_python(code: str, cwd: Path, site: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    full_env = {
        "PATH": os.environ["PATH"],
        "PYTHONPATH": str(site),
        "HOME": str(cwd),
        "P40FLEET_STANDIN_BUILD_LOG": str(cwd / "standin-builds.log"),
        **env,
    }
    return subprocess.run(
        [sys.executable, "-c", code, *args], cwd=cwd, env=full_env, capture_output=True, text=True, check=False
    )


# Runs setup.py as pip would, but prints the extension names instead of building them.
LIST_EXTENSIONS = """
import json, runpy, sys, setuptools
setuptools.setup = lambda **kw: print("EXTENSIONS=" + json.dumps([e.name for e in kw.get("ext_modules", [])]))
sys.argv = ["setup.py", *sys.argv[1:]]
runpy.run_path("setup.py", run_name="__main__")
"""


def extensions(apex_source, standin_torch, tmp_path, *flags, env=None) -> list[str]:
    home = cuda_home(tmp_path / "cuda")
    done = run_python(
        LIST_EXTENSIONS, apex_source, standin_torch, {"CUDA_HOME": str(home), **(env or {})}, *flags, "bdist_wheel"
    )
    assert done.returncode == 0, done.stdout + done.stderr
    line = next(x for x in done.stdout.splitlines() if x.startswith("EXTENSIONS="))
    return json.loads(line.removeprefix("EXTENSIONS="))


def test_role_module_lists_are_what_the_pinned_setup_py_builds(apex_source, standin_torch, tmp_path):
    cpp = DEFAULTS["apex_cpp_extension_modules"]
    cuda = DEFAULTS["apex_cuda_extension_modules"]
    assert extensions(apex_source, standin_torch, tmp_path, "--cpp_ext") == cpp
    assert extensions(apex_source, standin_torch, tmp_path, "--cuda_ext") == cuda
    assert extensions(apex_source, standin_torch, tmp_path, "--cpp_ext", "--cuda_ext") == cpp + cuda
    assert len(cpp + cuda) == 12


def test_environment_switches_build_nothing_at_the_pinned_commit(apex_source, standin_torch, tmp_path):
    env = {"APEX_CPP_EXT": "1", "APEX_CUDA_EXT": "1"}
    assert extensions(apex_source, standin_torch, tmp_path, env=env) == []


def test_pinned_setup_py_refuses_nvcc_of_another_release(apex_source, standin_torch, tmp_path):
    home = cuda_home(tmp_path / "cuda", release="12.1")
    done = run_python(LIST_EXTENSIONS, apex_source, standin_torch, {"CUDA_HOME": str(home)}, "--cuda_ext")
    assert done.returncode != 0
    assert "Cuda extensions are being compiled with a version of Cuda that does not match" in done.stderr


# A one-extension project built by the stand-in BuildExtension with setuptools, as a setup.py would.
TINY_SETUP = """
import sys
from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CUDAExtension
setup(name="tiny", version="0", ext_modules=[CUDAExtension("tiny_cuda", ["tiny.cpp", "tiny_kernel.cu"])],
      cmdclass={"build_ext": BuildExtension}, script_args=["build_ext", "--inplace"])
"""


def build_tiny(tmp_path: Path, standin_torch: Path, release: str = "11.8", **env: str) -> subprocess.CompletedProcess:
    project = tmp_path / "tiny"
    project.mkdir(exist_ok=True)
    (project / "tiny.cpp").write_text("// real sources are never compiled by the stand-in\n")
    (project / "tiny_kernel.cu").write_text("// ditto\n")
    home = cuda_home(tmp_path / f"cuda-{release}", release=release)
    base = {"CUDA_HOME": str(home), "TORCH_CUDA_ARCH_LIST": "6.1", "MAX_JOBS": "1"}
    return run_python(TINY_SETUP, project, standin_torch, {**base, **env})


def test_standin_build_ext_compiles_an_importable_module(tmp_path, standin_torch):
    done = build_tiny(tmp_path, standin_torch)
    assert done.returncode == 0, done.stdout + done.stderr
    built = list((tmp_path / "tiny").glob("tiny_cuda*.so"))
    assert len(built) == 1
    code = "import sys, torch; sys.path.insert(0, '.'); import tiny_cuda; print(tiny_cuda.__p40fleet_standin_build__)"
    loaded = run_python(code, tmp_path / "tiny", standin_torch, {})
    assert json.loads(loaded.stdout)["arch_list"] == "6.1", loaded.stderr
    # Like a real extension (it links libc10.so), it does not load before torch.
    alone = run_python("import sys; sys.path.insert(0, '.'); import tiny_cuda", tmp_path / "tiny", standin_torch, {})
    assert "libc10.so: cannot open shared object file" in alone.stderr


def test_standin_build_ext_refuses_what_real_torch_refuses(tmp_path, standin_torch):
    other_major = build_tiny(tmp_path, standin_torch, release="12.1")
    assert other_major.returncode != 0
    assert "The detected CUDA version (12.1) mismatches the version that was used to compile" in other_major.stderr
    bad_arch = build_tiny(tmp_path, standin_torch, TORCH_CUDA_ARCH_LIST="6.1;10.0")
    assert bad_arch.returncode != 0
    assert "Unknown CUDA arch (10.0) or GPU not supported" in bad_arch.stderr
    (tmp_path / "tiny" / "tiny_kernel.cu").unlink()
    project = tmp_path / "tiny"
    missing = run_python(
        TINY_SETUP, project, standin_torch, {"CUDA_HOME": str(tmp_path / "cuda-11.8"), "TORCH_CUDA_ARCH_LIST": "6.1"}
    )
    assert missing.returncode != 0 and "tiny_kernel.cu" in missing.stderr


def test_standin_build_ext_without_ninja_warns_and_builds_serially(tmp_path, standin_torch):
    no_ninja = tmp_path / "bin"
    no_ninja.mkdir()
    for tool in ("gcc", "g++", "cc", "c++", "as", "ld"):
        found = shutil.which(tool)
        if found:
            (no_ninja / tool).symlink_to(found)
    assert not (no_ninja / "ninja").exists()
    done = build_tiny(tmp_path, standin_torch, PATH=str(no_ninja))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Attempted to use ninja as the BuildExtension backend but we could not find ninja." in done.stderr
