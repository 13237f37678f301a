"""The helpers the owner-run scripts share, as text. The owner_script lookup (plugins/lookup/owner_script.py) puts
this file's text before the text of a script in owner_scripts/ that asks for it (a line starting
`# owner_script helpers:`), and a role hands both to the env owner's Python as one `-I -c` argument. Nothing on a
host imports it: an import would read a file from the env, which the owner can write.
"""

import hashlib
import json


def sha256(path):
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_json(path, unreadable=None):
    """The JSON document at path; None where there is no file, `unreadable` where it holds no JSON."""
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except FileNotFoundError:
        return None
    except ValueError:
        return unreadable
