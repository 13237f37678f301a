"""p40fleet apex post-install check (env's python): apex and its compiled extension modules load. JSON.

argv: MODULE...  (apex_C for the cpp extension, amp_C for the CUDA ones)
"""

import importlib
import json
import sys

result = {}
for name in ["apex", *sys.argv[1:]]:
    try:
        module = importlib.import_module(name)
        result[name] = {"ok": True, "file": getattr(module, "__file__", "")}
    except Exception as error:  # reported to Ansible as data
        result[name] = {"ok": False, "error": f"{type(error).__name__}: {error}"}
print(json.dumps(result))
