"""p40fleet apex probe (run by the env's python): what decides the build key, and what is installed. JSON.

argv: CUDA_HOME MARKER_FILE
"""

import importlib.metadata
import json
import os
import re
import subprocess
import sys

cuda_home, marker = sys.argv[1:3]


def version(dist):
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return ""


def nvcc_release():
    try:
        out = subprocess.run(
            [os.path.join(cuda_home, "bin", "nvcc"), "--version"], capture_output=True, text=True, check=False
        ).stdout
    except OSError:
        return ""
    found = re.search(r"release (\d+\.\d+)", out)
    return found.group(1) if found else ""


def marker_data():
    try:
        with open(marker) as handle:
            return json.load(handle)
    except (OSError, ValueError):
        return {}


with open("/proc/meminfo") as meminfo:
    mem_kib = int(next(line for line in meminfo if line.startswith("MemTotal:")).split()[1])
print(
    json.dumps(
        {
            "python": "{}.{}".format(*sys.version_info[:2]),
            "torch": version("torch"),
            "nvcc": nvcc_release(),
            "apex": version("apex"),
            "marker": marker_data(),
            "cpus": os.cpu_count() or 1,
            "mem_gib": mem_kib // (1024 * 1024),
        }
    )
)
