# Probe of a host's CUDA toolkit state, run by the cuda_toolkit role as `python3 -I -S -c <this> <json request>`.
# Reads only: version.json, `bin/nvcc --version`, the default /usr/local/cuda link, the role's
# in-progress marker, free space, apt's view of the host compiler, and who could write the directories
# root executes the installer from. Prints one JSON object.
import json
import os
import re
import shutil
import stat as stat_module
import subprocess
import sys

request = json.loads(sys.argv[1])
home = request["home"]
result = {"arch": os.uname().machine, "home_exists": os.path.lexists(home)}

try:
    with open(os.path.join(home, "version.json")) as handle:
        result["version_json"] = json.load(handle)["cuda"]["version"]
except (OSError, ValueError, KeyError, TypeError) as error:
    result["version_json"] = None
    result["version_json_error"] = str(error)

nvcc = os.path.join(home, "bin", "nvcc")
result["nvcc_release"] = None
if os.access(nvcc, os.X_OK):
    try:
        answer = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60, check=False)
        found = re.search(r"release (\d+\.\d+), V(\S+)", answer.stdout)
        if answer.returncode == 0 and found:
            result["nvcc_release"] = found.group(1)
            result["nvcc_version"] = found.group(2)
    except (OSError, subprocess.SubprocessError) as error:
        result["nvcc_error"] = str(error)
result["libcudart"] = os.path.exists(os.path.join(home, "lib64", "libcudart.so"))


def link_state(path):
    if os.path.islink(path):
        return {"state": "link", "target": os.readlink(path)}
    if os.path.lexists(path):
        return {"state": "other", "target": None}
    return {"state": "absent", "target": None}


result["default_link"] = link_state(request["link_path"])
result["marker"] = None
if os.path.lexists(request["marker"]):
    try:
        with open(request["marker"]) as handle:
            result["marker"] = json.load(handle)
    except (OSError, ValueError):
        result["marker"] = {}
# The link as it was before p40fleet's first attempt: an interrupted run recorded it in the marker.
recorded = (result["marker"] or {}).get("default_link")
result["original_link"] = recorded if isinstance(recorded, dict) else result["default_link"]


def existing_ancestor(path):
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


rooms = {}
for path, need_mib in request["room"]:
    anchor = existing_ancestor(path)
    stat = os.statvfs(anchor)
    device = os.stat(anchor).st_dev
    room = rooms.setdefault(
        device, {"paths": [], "anchor": anchor, "need_mib": 0, "avail_mib": stat.f_bavail * stat.f_frsize // 1048576}
    )
    room["paths"].append(path)
    room["need_mib"] += int(need_mib)
result["room"] = list(rooms.values())

result["apt"] = shutil.which("apt-get") is not None
result["packages"] = {}
if result["apt"]:
    for package in request["packages"]:
        answer = subprocess.run(["apt-cache", "policy", package], capture_output=True, text=True, check=False)
        installed = re.search(r"Installed: (\S+)", answer.stdout)
        candidate = re.search(r"Candidate: (\S+)", answer.stdout)
        result["packages"][package] = {
            "installed": installed.group(1) if installed and installed.group(1) != "(none)" else None,
            "candidate": candidate.group(1) if candidate and candidate.group(1) != "(none)" else None,
        }


def private_dir_problems(path):
    """Why another account could swap files in `path` (a directory root executes from), or [].

    The directory, when it exists, must be a real directory owned by root. Every existing directory
    above it (after resolving links) must be owned by root and writable by nobody else unless sticky
    (as /var/tmp is); a link on the way must belong to root, or its owner could point it elsewhere."""
    problems = []
    path = os.path.abspath(path)
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        info = None
    except OSError as error:
        return [f"{path} cannot be inspected ({error.strerror})"]
    if info is not None:
        if not stat_module.S_ISDIR(info.st_mode):
            problems.append(f"{path} exists and is not a directory")
        elif info.st_uid != 0:
            problems.append(f"{path} is owned by uid {info.st_uid}, not root")
    walked = os.path.dirname(path)
    while walked != "/":
        if os.path.islink(walked) and os.lstat(walked).st_uid != 0:
            problems.append(f"{walked} is a link owned by uid {os.lstat(walked).st_uid}, not root")
        walked = os.path.dirname(walked)
    parent = os.path.dirname(os.path.realpath(path))
    while True:
        if os.path.exists(parent):
            info = os.stat(parent)
            if info.st_uid != 0:
                problems.append(f"{parent} is owned by uid {info.st_uid}, not root")
            elif info.st_mode & (stat_module.S_IWGRP | stat_module.S_IWOTH) and not info.st_mode & stat_module.S_ISVTX:
                problems.append(f"{parent} is writable by group or others (mode {oct(info.st_mode & 0o7777)})")
        if parent == "/":
            return problems
        parent = os.path.dirname(parent)


result["private_dir_problems"] = [p for path in request["private_dirs"] for p in private_dir_problems(path)]
print(json.dumps(result))
