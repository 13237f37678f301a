"""p40fleet apex wheel check (the host's system python, isolated: never the env owner's): which expected
extension modules the built wheel lacks, read from the wheel as a zip, and whether the build ran serially. JSON.

argv: WHEEL BUILD_LOG MODULE...
"""

import json
import os
import stat
import sys
import zipfile


def open_regular(path: str, mode: str = "rb", **kwargs):
    """Root's copies of the build's wheel and log: still never through a link, never blocking on a FIFO."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        sys.exit(f"{path} is not a regular file: refused")
    return os.fdopen(fd, mode, **kwargs)


wheel, log, *expected = sys.argv[1:]
with open_regular(wheel) as handle, zipfile.ZipFile(handle) as archive:
    # Top-level extension modules: NAME.cpython-310-x86_64-linux-gnu.so (or NAME.so / NAME.abi3.so).
    built = {name.split(".", 1)[0] for name in archive.namelist() if "/" not in name and name.endswith(".so")}
with open_regular(log, "r", errors="replace") as handle:
    serial = "we could not find ninja" in handle.read()
print(json.dumps({"missing": [m for m in expected if m not in built], "built": sorted(built), "serial": serial}))
