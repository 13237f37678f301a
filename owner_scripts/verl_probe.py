"""p40fleet verl probe (run by the env's python, as the env owner): the checkout, verl's install and the shim, as JSON.

argv: SOURCE_DIR GIT_REF MARKER_FILE
"""

import importlib.metadata
import json
import os
import subprocess
import sys

source, ref, marker = sys.argv[1:4]


# Run as the env owner, who owns the checkout: git's safe.directory protection stays on.
def git(*args):
    done = subprocess.run(["git", "-C", source, *args], capture_output=True, text=True, check=False)
    return done.stdout.strip() if done.returncode == 0 else ""


def read(path):
    try:
        with open(path) as handle:
            return handle.read().strip()
    except OSError:
        return ""


def dist(name):
    try:
        found = importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return {"version": "", "direct_url": {}}
    return {"version": found.version, "direct_url": json.loads(found.read_text("direct_url.json") or "{}")}


verl = dist("verl")
print(
    json.dumps(
        {
            "head": git("rev-parse", "HEAD") if os.path.isdir(os.path.join(source, ".git")) else "",
            "ref_commit": git("rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}"),
            "source_version": read(os.path.join(source, "verl", "version", "version")),
            "verl_version": verl["version"],
            "verl_editable": verl["direct_url"].get("dir_info", {}).get("editable", False),
            "verl_url": verl["direct_url"].get("url", ""),
            "shim_version": dist("p40fleet-flash-attn-shim")["version"],
            "requirements_digest": read(marker),
        }
    )
)
