# Probe of a host's cuDNN state, run by the cudnn role as `python3 -I -S -c <this> <json request>`.
# Reads only: the prefix's cudnn_version.h and symlinks, the links in the CUDA tree, the role's record
# of what it installed, and the dynamic linker configuration. Prints one JSON object.
import glob
import json
import os
import re
import sys

request = json.loads(sys.argv[1])
prefix = request["prefix"]
cuda_home = request["cuda_home"]
# prefix sub-directory -> CUDA tree sub-directory (the archive has lib/, CUDA has lib64/)
pairs = {"lib": "lib64", "include": "include"}
name_pattern = re.compile(r"^(lib)?cudnn")
result = {"prefix_exists": os.path.isdir(prefix), "cuda_home_exists": os.path.isdir(cuda_home)}


def header_version(path):
    try:
        with open(path) as handle:
            text = handle.read()
    except OSError:
        return None
    parts = [re.search(rf"#define\s+CUDNN_{key}\s+(\d+)", text) for key in ("MAJOR", "MINOR", "PATCHLEVEL")]
    return ".".join(p.group(1) for p in parts) if all(parts) else None


result["prefix_version"] = header_version(os.path.join(prefix, "include", "cudnn_version.h"))
# The archive ships libcudnn.so.N as a symlink; a copy without -P turns it into a file (ldconfig complains).
sonames = glob.glob(os.path.join(prefix, "lib", "libcudnn.so.[0-9]"))
result["prefix_symlinks_ok"] = bool(sonames) and all(os.path.islink(p) and os.path.exists(p) for p in sonames)

desired = {}
for sub, cuda_sub in pairs.items():
    directory = os.path.join(prefix, sub)
    if os.path.isdir(directory):
        for name in sorted(os.listdir(directory)):
            desired[os.path.join(cuda_home, cuda_sub, name)] = os.path.join(directory, name)

missing, stale, foreign = [], [], []
if request["link_into_cuda"] and result["cuda_home_exists"]:
    for dest, src in desired.items():
        if not (os.path.islink(dest) and os.readlink(dest) == src):
            missing.append({"src": src, "dest": dest})
    for cuda_sub in pairs.values():
        directory = os.path.join(cuda_home, cuda_sub)
        if not os.path.isdir(directory):
            continue
        for name in sorted(os.listdir(directory)):
            path = os.path.join(directory, name)
            if not name_pattern.match(name) or path in desired:
                continue
            (stale if os.path.islink(path) else foreign).append(path)
result["links_missing"] = missing
result["links_stale"] = stale
result["foreign_files"] = foreign

result["recorded"] = None
try:
    with open(request["state_file"]) as handle:
        result["recorded"] = json.load(handle)
except (OSError, ValueError):
    pass
old = (result["recorded"] or {}).get("prefix")
result["old_prefix"] = old if old and old != prefix and os.path.isdir(old) else None

registered = []
for conf in ["/etc/ld.so.conf", *sorted(glob.glob("/etc/ld.so.conf.d/*.conf"))]:
    try:
        with open(conf) as handle:
            lines = {line.strip().rstrip("/") for line in handle}
    except OSError:
        continue
    registered += [d for d in (os.path.join(prefix, "lib"), os.path.join(cuda_home, "lib64")) if d in lines]
result["registered"] = sorted(set(registered))
print(json.dumps(result))
