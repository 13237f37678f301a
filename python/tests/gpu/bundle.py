"""Build what the GPU check carries to a CUDA machine that has no network (Makefile `gpu-bundle`).

Made here, from the project's own code and pinned upstream files:
- the launch script of every case in tests/gpu/cases.py, rendered by the launch_script role (tests/launch_render.py);
  a case the role refuses is listed with its refusal and carries no script;
- verl 0.4.1's source (the PyPI sdist of fixtures/upstream.txt) patched by the verl_patches role for each case's
  profile, as a host's run patches it, with the role's applied record;
- the flash_attn shim the verl role installs, and training_data's converter (training_data_tool.py);
- wheels for the GPU machine's Python of the packages verl imports that it lacks or has in another version: the
  versions of the verl lock (roles/verl/files/verl-0.4.1-py311.lock.txt), each file's sha256 checked against the
  lock's hashes before use; the two sdist-only packages are built into wheels from their checked sdists; ray's
  wheel is repacked without its Java jars, RLlib and the dashboard's web client (the GPU check starts a local
  cluster only) so that one call can carry it.

usage: python -m tests.gpu.bundle [--out .gpu] [--python-version 3.12]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pwd
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

import yaml

from p40fleet.run import run_playbook
from p40fleet_dev.paths import CACHE_DIR, REPO_ROOT, UPSTREAM_DIR
from tests.gpu.cases import CASES
from tests.launch_render import overrides_digest, render
from tests.local_hosts import ROOT_PLAYS_OWNER
from tests.source_modules import owner_script_text

VERL_VERSION = "0.4.1"
LOCK = REPO_ROOT / "roles" / "verl" / "files" / f"verl-{VERL_VERSION}-py311.lock.txt"
PATCH_PLAYBOOK = REPO_ROOT / "python" / "tests" / "playbooks" / "verl_patches.yml"
SHIM = REPO_ROOT / "roles" / "verl" / "files" / "flash_attn_shim" / "flash_attn"
DATA_TOOL = REPO_ROOT / "owner_scripts" / "training_data_tool.py"
RUN_CHECK = Path(__file__).with_name("run_check.py")
WHEEL_CACHE = CACHE_DIR / "gpu-wheels"

# What `python -m verl.trainer.main_ppo` imports that the GPU machine's image lacks, or holds in a version verl 0.4.1
# does not run with (its transformers 5.x, tokenizers 0.23, huggingface_hub 1.x): the GPU machine's own notes list
# the image's packages. numpy, torch, pandas and pyarrow stay the image's (built against each other).
CARRIED = [
    "ray",
    "jsonschema",
    "jsonschema-specifications",
    "referencing",
    "rpds-py",
    "tensordict",
    "orjson",
    "torchdata",
    "hydra-core",
    "omegaconf",
    "antlr4-python3-runtime",
    "codetiming",
    "datasets",
    "dill",
    "multiprocess",
    "fsspec",
    "transformers",
    "tokenizers",
    "huggingface-hub",
    "peft",
    "accelerate",
    "pylatexenc",
]
# Published as sdists only: built here into wheels, after the sdist's own hash is checked.
SDIST_ONLY = {"antlr4-python3-runtime", "pylatexenc"}
# Left out of ray's wheel: nothing of a local cluster started by ray.init() needs them.
RAY_STRIP = re.compile(r"^ray/(jars/|rllib/|dashboard/client/|core/src/ray/raylet/raylet\.debug|.*\.debug$)")
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64"]


def lock_pins() -> dict[str, tuple[str, set[str]]]:
    """{normalized name: (version, {sha256, ...})} from the verl lock."""
    pins: dict[str, tuple[str, set[str]]] = {}
    current = None
    for line in LOCK.read_text().splitlines():
        found = re.match(r"^([A-Za-z0-9_.-]+)==([^ ;\\]+)", line)
        if found:
            current = re.sub(r"[-_.]+", "-", found.group(1)).lower()
            pins[current] = (found.group(2), set())
            continue
        digest = re.search(r"--hash=sha256:([0-9a-f]{64})", line)
        if digest and current:
            pins[current][1].add(digest.group(1))
    return pins


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def fetch(name: str, version: str, hashes: set[str], python_version: str) -> Path:
    """The file pip picks for the GPU machine, from the cache or the index; refused unless the lock lists its hash."""
    target = WHEEL_CACHE / f"{name}-{version}-py{python_version}"
    target.mkdir(parents=True, exist_ok=True)
    if not any(target.iterdir()):
        argv = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(target)]
        if name in SDIST_ONLY:
            argv += ["--no-binary", ":all:", f"{name}=={version}"]
        else:
            argv += ["--only-binary", ":all:", "--python-version", python_version, "--implementation", "cp"]
            argv += [a for p in PLATFORMS for a in ("--platform", p)] + [f"{name}=={version}"]
        subprocess.run(argv, check=True)
    files = sorted(target.iterdir())
    if len(files) != 1:
        raise SystemExit(f"gpu bundle: expected one file for {name}=={version} in {target}, found {files}")
    got = sha256(files[0])
    if got not in hashes:
        raise SystemExit(
            f"gpu bundle: {files[0].name} has sha256 {got}, which the verl lock does not list for {name}=={version}:"
            f" refusing it. Remove {target} to fetch it again."
        )
    return files[0]


def build_wheel(sdist: Path, out: Path) -> Path:
    with tempfile.TemporaryDirectory() as work:
        subprocess.run(
            [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", work, str(sdist)],
            check=True,
        )
        (wheel,) = Path(work).glob("*.whl")
        return Path(shutil.copy2(wheel, out / wheel.name))


def strip_ray(wheel: Path, out: Path) -> Path:
    """ray's wheel without what a local cluster never loads; RECORD rewritten so pip installs what is left."""
    target = out / wheel.name
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as dst:
        kept = [i for i in src.infolist() if not RAY_STRIP.match(i.filename)]
        record_name = next(i.filename for i in kept if i.filename.endswith(".dist-info/RECORD"))
        names = {i.filename for i in kept}
        for info in kept:
            if info.filename == record_name:
                lines = [ln for ln in src.read(info).decode().splitlines() if ln.split(",")[0] in names]
                dst.writestr(info, "\n".join(lines) + "\n")
            else:
                dst.writestr(info, src.read(info))
    return target


def wheels(out: Path, python_version: str) -> list[dict]:
    pins = lock_pins()
    out.mkdir(parents=True, exist_ok=True)
    listed = []
    for name in CARRIED:
        key = re.sub(r"[-_.]+", "-", name).lower()
        if key not in pins:
            raise SystemExit(f"gpu bundle: {name} is not in {LOCK.name}")
        version, hashes = pins[key]
        fetched = fetch(key, version, hashes, python_version)
        if key in SDIST_ONLY:
            carried = build_wheel(fetched, out)
        elif key == "ray":
            carried = strip_ray(fetched, out)
        else:
            carried = Path(shutil.copy2(fetched, out / fetched.name))
        listed.append({"name": key, "version": version, "checked": fetched.name, "sha256": sha256(fetched)})
        print(f"  {carried.name} ({carried.stat().st_size // 1024} KiB)")
    return listed


def profiles_of(names) -> dict[str, dict]:
    """The GPU profiles of these cases, by name, each as the first of them rendered with it has it (the patches
    follow the profile, not the card): what the bundle patches for, and so what a record's run imported."""
    profiles = {}
    for name in names:
        profiles.setdefault(CASES[name].profile["name"], CASES[name].profile)
    return profiles


def patched_sha256s(applied: dict) -> dict[str, str]:
    """{file: sha256} of the files verl_patches changed, from its applied record."""
    return {rel: item["patched_sha256"] for rel, item in applied.get("files", {}).items()}


def patched_verl(profiles: dict[str, dict], work: Path) -> dict[str, tuple[Path, dict]]:
    """verl's sdist patched by the verl_patches role for each profile, over a local connection, in one playbook run
    (one local host per profile, side by side): {profile name: (the patched verl/ package, the applied record)}."""
    hosts = {}
    for name, profile in profiles.items():
        with tarfile.open(UPSTREAM_DIR / "sdist" / f"verl-{VERL_VERSION}.tar.gz") as sdist:
            sdist.extractall(work / name, filter="data")
        hosts[name] = {
            "ansible_connection": "local",
            "ansible_python_interpreter": sys.executable,
            "ansible_become": False,
            "verl_patches_source_dir": str(work / name / f"verl-{VERL_VERSION}"),
            "verl_patches_state_dir": str(work / name / "state"),
            "verl_patches_python": sys.executable,
            "verl_patches_profile": profile,
            # The sdist is this process's own, in its temporary directory: its account plays the checkout's owner
            # (root in CI, where no env owner account exists).
            "verl_patches_source_owner": pwd.getpwuid(os.geteuid()).pw_name,
        }
    inventory = work / "hosts.yml"
    inventory.write_text(yaml.safe_dump({"all": {"hosts": hosts}}))
    envvars = {"ANSIBLE_CACHE_PLUGIN_CONNECTION": str(work / "f"), **ROOT_PLAYS_OWNER}
    result = run_playbook(PATCH_PLAYBOOK, inventory, envvars=envvars)
    if result.rc != 0:
        raise SystemExit(f"gpu bundle: verl_patches failed for {', '.join(profiles)}:\n{result.stdout[-3000:]}")
    return {
        name: (
            work / name / f"verl-{VERL_VERSION}" / "verl",
            json.loads((work / name / "state" / "applied.json").read_text()),
        )
        for name in profiles
    }


def place_verl(tree: Path, out: Path, profile: str) -> str:
    """Copy a patched verl/ package into the bundle at out; return the PYTHONPATH entry, relative to the bundle, that
    run_check.py puts first for the profile's cases: the directory holding `verl/`, not the package itself."""
    entry = f"verl/{profile}"
    shutil.copytree(tree, out / entry / "verl")
    return entry


def build(out: Path, python_version: str) -> dict:
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        print("Rendering the launch script for every case")
        rendered, _ = render({name: case.host() for name, case in CASES.items()}, work / "render")
        cases = {}
        profiles = profiles_of(name for name in CASES if not rendered[name].refused)
        print(f"Patching verl {VERL_VERSION} for the {', '.join(profiles)} profiles")
        patched = patched_verl(profiles, work / "patched")
        verl_trees = {profile: place_verl(tree, out, profile) for profile, (tree, _) in patched.items()}
        for name, case in CASES.items():
            item = rendered[name]
            entry = {
                "gpu_name": case.gpu_name,
                "memory_mib": case.memory_mib,
                "gpu_count": case.gpu_count,
                "cap_gib": case.cap_gib,
                "profile": case.profile["name"],
                "dtype": case.profile["dtype"],
                "variables": case.variables,
                "why": case.why,
                "smoke_steps": case.smoke_steps,
                "full_steps": case.full_steps,
                "overrides_digest": overrides_digest(item),
                "refused": item.refused,
            }
            if not item.refused:
                dest = out / "scripts" / name
                dest.mkdir(parents=True)
                for helper in item.script.parent.glob("train_gsm8k_ppo*"):
                    shutil.copy2(helper, dest / helper.name)
                profile = case.profile["name"]
                entry["verl_tree"] = verl_trees[profile]
                entry["patch_set"] = patched[profile][1]["identity"]["patch_set"]
                entry["patch_record"] = patched[profile][1]
            cases[name] = entry
        shutil.copytree(SHIM, out / "shim" / "flash_attn")
        (out / "tools").mkdir()
        # As the role runs it: the owner-run scripts' shared helpers first.
        (out / "tools" / DATA_TOOL.name).write_text(owner_script_text(DATA_TOOL) + "\n")
        print(f"Wheels for Python {python_version} (versions of {LOCK.name})")
        listed = wheels(out / "wheels", python_version)
        manifest = {
            "verl_version": VERL_VERSION,
            "python": python_version,
            # Where the scripts were rendered: the GPU check puts its own directory there, and no other path.
            "render_root": str(work / "render"),
            "cases": cases,
            "wheels": listed,
        }
        (out / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(f"Bundle in {out}: {size / 2**20:.1f} MiB")
    return manifest


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Build the GPU check's bundle")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / ".gpu")
    parser.add_argument("--python-version", default="3.12")
    args = parser.parse_args(argv)
    build(args.out, args.python_version)
    return 0


if __name__ == "__main__":
    sys.exit(main())
