"""p40fleet pytorch probe: the installed torch version, the env's pip files and the digest of
the torch lock pip last installed completely (the sha1 of its marker) (as JSON)."""

import hashlib
import importlib.metadata
import json
import os
import sys


def version(dist):
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return ""


def sha1(path):
    try:
        with open(path, "rb") as handle:
            return hashlib.sha1(handle.read()).hexdigest()
    except OSError:
        return ""


print(
    json.dumps(
        {
            "torch": version("torch"),
            "pip_conf_sha1": sha1(os.path.join(sys.prefix, "pip.conf")),
            "constraints_sha1": sha1(os.path.join(sys.prefix, "p40fleet-constraints.txt")),
            "lock_marker_sha1": sha1(os.path.join(sys.prefix, ".p40fleet-torch-lock.sha1")),
        }
    )
)
