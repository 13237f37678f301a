"""p40fleet apex post-install check (env's python): Apex's extension modules load. JSON.

argv: IMPORT_PACKAGE(0|1) MODULE...  torch first (the extensions link against it), then every module;
the apex package is located, and imported too when IMPORT_PACKAGE is 1.
"""

import importlib
import importlib.util
import json
import sys

import_package, modules = sys.argv[1] == "1", sys.argv[2:]
result = {}
for name in ["torch", *modules]:
    try:
        module = importlib.import_module(name)
        result[name] = {"ok": True, "file": getattr(module, "__file__", "")}
    except Exception as error:  # reported to Ansible as data
        result[name] = {"ok": False, "error": f"{type(error).__name__}: {error}"}
spec = importlib.util.find_spec("apex")
result["apex"] = {"ok": spec is not None, "file": spec.origin if spec else "", "error": "not installed"}
if spec is not None and import_package:
    try:
        importlib.import_module("apex")
    except Exception as error:
        result["apex"] = {"ok": False, "error": f"{type(error).__name__}: {error}"}
print(json.dumps(result))
