"""Print each p40fleet stage's real markers on this host as JSON (read-only; run by playbooks/verify.yml)."""

import json
import pathlib
import re
import subprocess
import sys

ENV_PYTHON = sys.argv[1]
CUDNN_HEADER = pathlib.Path("/usr/local/cudnn-8.9.7-cuda11/include/cudnn_version.h")
# verl and the apex package are located, not imported: their imports need the GPU-only stack, which sandbox
# hosts lack; Apex's compiled extensions (apex_C, amp_C) are imported.
STACK_PROBE = (
    "import importlib.util, os, torch, apex_C, amp_C; assert importlib.util.find_spec('apex'); "
    "print(torch.__version__, torch.version.cuda, os.path.dirname(importlib.util.find_spec('verl').origin))"
)


def run(*argv):
    return subprocess.run(argv, capture_output=True, text=True, check=False).stdout


def read_json(path):
    path = pathlib.Path(path)
    return json.loads(path.read_text()) if path.exists() else None


def cudnn_version():
    if not CUDNN_HEADER.exists():
        return None
    header = CUDNN_HEADER.read_text()
    parts = [re.search(rf"#define CUDNN_{key} (\d+)", header) for key in ("MAJOR", "MINOR", "PATCHLEVEL")]
    return ".".join(part[1] for part in parts if part)


nvcc = re.search(r"release (\S+),", run("/usr/local/cuda-11.8/bin/nvcc", "--version"))
cuda_link = pathlib.Path("/usr/local/cuda")
print(
    json.dumps(
        {
            "preflight": read_json("/etc/ansible/facts.d/p40fleet_preflight.fact"),
            "nvcc": nvcc[1] if nvcc else None,
            "cuda_link": str(cuda_link.resolve()) if cuda_link.is_symlink() else None,
            "cudnn": cudnn_version(),
            "stack": run(ENV_PYTHON, "-c", STACK_PROBE).split(),
            "patches": read_json("/var/lib/p40fleet/verl_patches/applied.json"),
        }
    )
)
