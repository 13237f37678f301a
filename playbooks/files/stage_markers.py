"""Print each p40fleet stage's real markers on this host as JSON (read-only; run by playbooks/verify.yml).

One argument, a JSON object of where the stages put their markers (from the roles' variables):
  {"preflight_state_file", "cuda_home", "cuda_link", "cudnn_prefix", "patches_record"}
It only reads files and runs the root-owned toolkit's nvcc; nothing the env owner can write is executed.
"""

import json
import os
import pathlib
import re
import subprocess
import sys

WHERE = json.loads(sys.argv[1])


def run(*argv):
    try:
        return subprocess.run(argv, capture_output=True, text=True, check=False).stdout
    except OSError:
        return ""


def read_json(path):
    path = pathlib.Path(path)
    return json.loads(path.read_text()) if path.exists() else None


def cudnn_version():
    header = pathlib.Path(WHERE["cudnn_prefix"], "include", "cudnn_version.h")
    if not header.exists():
        return None
    text = header.read_text()
    parts = [re.search(rf"#define CUDNN_{key} (\d+)", text) for key in ("MAJOR", "MINOR", "PATCHLEVEL")]
    return ".".join(part[1] for part in parts if part)


nvcc = re.search(r"release (\S+),", run(os.path.join(WHERE["cuda_home"], "bin", "nvcc"), "--version"))
cuda_link = pathlib.Path(WHERE["cuda_link"])
print(
    json.dumps(
        {
            "preflight": read_json(WHERE["preflight_state_file"]),
            "nvcc": nvcc[1] if nvcc else None,
            # The default link is the host's own: whatever it points at, it must not dangle.
            "cuda_link": os.readlink(cuda_link) if cuda_link.is_symlink() else None,
            "cuda_link_resolves": cuda_link.exists(),
            "cudnn": cudnn_version(),
            "patches": read_json(WHERE["patches_record"]),
        }
    )
)
