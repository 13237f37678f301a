"""p40fleet apex wheel check (the host's system python, isolated: never the env owner's): which expected
extension modules the built wheel lacks, read from the wheel as a zip, and whether the build ran serially. JSON.

argv: WHEEL BUILD_LOG MODULE...
"""

import json
import sys
import zipfile

wheel, log, *expected = sys.argv[1:]
with zipfile.ZipFile(wheel) as archive:
    # Top-level extension modules: NAME.cpython-310-x86_64-linux-gnu.so (or NAME.so / NAME.abi3.so).
    built = {name.split(".", 1)[0] for name in archive.namelist() if "/" not in name and name.endswith(".so")}
with open(log, errors="replace") as handle:
    serial = "we could not find ninja" in handle.read()
print(json.dumps({"missing": [m for m in expected if m not in built], "built": sorted(built), "serial": serial}))
