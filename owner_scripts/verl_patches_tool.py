#!/usr/bin/env python3
"""Read-only helper of the verl_patches role: probe and verify, never edit.

Usage: verl_patches_tool.py probe|verify SPEC_B64

SPEC_B64 is base64 of a JSON object rendered by the role:
  source_dir, state_dir, state ("present"/"absent"), version_hint ("" = read the source),
  profile (dict), values (dict), active (the `needs` groups the GPU profile calls for), sets
  ({verl_version: {id, verl_version, entries, residue}}, unfiltered).

probe: one cheap look at the host: which verl version the source holds, which patch set that selects,
the recorded state (pristine manifest, applied record) and the real sha256 of every covered file now;
anchor counts per entry on the content the edit would start from; the files changed since the last run
(`changed_files`: neither pristine nor as that run left them, so restoring them would destroy someone's
edit; apply and revert refuse while there are any); and the action the role must take (none, apply,
revert); and, for the files apply keeps a first pristine copy of (`new_copies`), their content as read
(`new_copies_base64`, the manifest's sha256 taken from the same bytes), which root writes into its own state
directory. Edits are made by the role's verl_patches_edit module, never here.

verify: the post-state: each entry's post-condition count, no anchor or residue left, each file
compiles (builtin compile(), so no __pycache__ is written into the checkout), pristine copies intact,
and the applied record matching the files. Prints JSON; exit status 0 unless the input is unusable.
"""

import base64
import hashlib
import json
import os
import re
import sys

# owner_script helpers: sha256() and read_json() are plugins/module_utils/owner_script.py's, put before this text
# by the owner_script lookup (plugins/lookup/owner_script.py).

PRISTINE_DIR = "pristine"
MANIFEST = "pristine.json"
RECORD = "applied.json"


def read_text(path):
    with open(path, encoding="utf-8") as handle:
        return handle.read()


def count(pattern, text):
    # Same flags as ansible.builtin.replace; lineinfile anchors are written ^...$ so they agree.
    return len(re.findall(pattern, text, re.MULTILINE))


def source_version(source_dir):
    path = os.path.join(source_dir, "verl", "version", "version")
    try:
        return read_text(path).strip()
    except OSError:
        return ""


def select(spec, version):
    """The patch set for this version with only the entries and residue the profile needs."""
    patch_set = spec["sets"].get(version)
    if patch_set is None:
        return None
    active = spec["active"]
    return {
        "id": patch_set["id"],
        "entries": [entry for entry in patch_set["entries"] if entry["needs"] in active],
        "residue": [item for item in patch_set.get("residue", []) if item["needs"] in active],
    }


def covered_files(patch_set):
    files = []
    for entry in patch_set.get("entries", []):
        if entry["file"] not in files:
            files.append(entry["file"])
    return files


def identity(spec, patch_set, version):
    return {
        "patch_set": patch_set["id"],
        "verl_version": version,
        "source_dir": spec["source_dir"],
        "profile": spec["profile"],
        "values": spec["values"],
        "entries": [entry["id"] for entry in patch_set["entries"]],
    }


def pristine_state(spec, version):
    """The pristine manifest and whether its copies can be trusted for this source and version."""
    manifest = read_json(os.path.join(spec["state_dir"], MANIFEST), {"unreadable": True})
    if not manifest or manifest.get("unreadable"):
        return manifest, False, []
    problems = []
    if manifest.get("verl_version") != version:
        problems.append(f"pristine copies are of verl {manifest.get('verl_version')}, source is {version}")
    if manifest.get("source_dir") != spec["source_dir"]:
        problems.append(f"pristine copies are of {manifest.get('source_dir')}")
    for rel, digest in sorted(manifest.get("files", {}).items()):
        copy = os.path.join(spec["state_dir"], PRISTINE_DIR, rel)
        if not os.path.isfile(copy):
            problems.append(f"pristine copy {copy} is missing")
        elif sha256(copy) != digest:
            problems.append(f"pristine copy {copy} does not match its recorded sha256")
    return manifest, not problems, problems


def changed_since_last_run(spec, version, manifest, pristine_ok, record):
    """Files of the pristine manifest whose content is neither the pristine copy nor what the last completed
    run left there (the applied record's patched sha256): a user's edit, or new upstream content under the same
    version. Only a completed run for this checkout and version tells what the files should hold: without its
    record (a run was interrupted, or failed and restored) the files are ours to redo."""
    if not pristine_ok or not isinstance(record, dict) or record.get("unreadable"):
        return []
    recorded = record.get("identity") or {}
    if recorded.get("verl_version") != version or recorded.get("source_dir") != spec["source_dir"]:
        return []
    patched = {rel: (item or {}).get("patched_sha256") for rel, item in (record.get("files") or {}).items()}
    changed = []
    for rel, pristine in sorted(manifest.get("files", {}).items()):
        path = os.path.join(spec["source_dir"], rel)
        found = sha256(path) if os.path.isfile(path) else None
        if found is None or found not in (pristine, patched.get(rel)):
            changed.append(
                {
                    "file": rel,
                    "pristine_sha256": pristine,
                    "patched_sha256": patched.get(rel),
                    "found_sha256": found,
                }
            )
    return changed


def probe(spec):
    version = source_version(spec["source_dir"])
    result = {
        "version": version,
        "version_hint_mismatch": bool(spec["version_hint"]) and spec["version_hint"] != version,
        "supported_versions": sorted(spec["sets"]),
        "set_id": None,
        "files": {},
        "missing_files": [],
        "counts": {},
        "anchor_failures": [],
        "base": "current",
        "restore": [],
        "new_copies": [],
        "new_copies_base64": {},
        "manifest_out": {},
        "pristine_files": [],
        "discard": False,
        "converged": False,
        "action": "none",
    }
    record = read_json(os.path.join(spec["state_dir"], RECORD), {"unreadable": True})
    manifest, pristine_ok, problems = pristine_state(spec, version)
    result.update(record=record, manifest=manifest, pristine_ok=pristine_ok, pristine_problems=problems)
    result["changed_files"] = changed_since_last_run(spec, version, manifest, pristine_ok, record)
    patch_set = select(spec, version)
    needs_edits = bool(patch_set and patch_set["entries"]) or (
        spec["profile"].get("needs_patches", False) and patch_set is None
    )

    if spec["state"] == "absent" or not needs_edits:
        # Desired: the files as shipped and no state of ours left behind.
        if manifest is not None or record is not None:
            result["action"] = "revert"
            if pristine_ok:
                for rel, digest in sorted(manifest.get("files", {}).items()):
                    path = os.path.join(spec["source_dir"], rel)
                    if not os.path.isfile(path) or sha256(path) != digest:
                        result["restore"].append(rel)
        result["converged"] = result["action"] == "none"
        return result

    if patch_set is None:
        result["action"] = "apply"  # apply.yml fails closed on the missing patch set.
        return result

    result["set_id"] = patch_set["id"]
    files = covered_files(patch_set)
    for rel in files:
        path = os.path.join(spec["source_dir"], rel)
        if os.path.isfile(path):
            result["files"][rel] = sha256(path)
        else:
            result["missing_files"].append(rel)

    if (
        record
        and record.get("identity") == identity(spec, patch_set, version)
        and not result["missing_files"]
        and {rel: item.get("patched_sha256") for rel, item in record.get("files", {}).items()} == result["files"]
    ):
        result["converged"] = True
        return result

    result["action"] = "apply"
    # Files with a trusted pristine copy start from it (that also undoes edits made for another
    # profile or patch set); files new to this patch set start from their current, unedited content.
    kept = dict(manifest.get("files", {})) if pristine_ok else {}
    result["discard"] = manifest is not None and not pristine_ok
    result["base"] = "pristine" if kept else "current"
    for rel, digest in sorted(kept.items()):
        path = os.path.join(spec["source_dir"], rel)
        if not os.path.isfile(path) or sha256(path) != digest:
            result["restore"].append(rel)
    result["new_copies"] = [rel for rel in files if rel not in kept and rel not in result["missing_files"]]
    copies = {}
    for rel in result["new_copies"]:
        with open(os.path.join(spec["source_dir"], rel), "rb") as handle:
            copies[rel] = handle.read()
    result["new_copies_base64"] = {rel: base64.b64encode(data).decode("ascii") for rel, data in copies.items()}
    result["manifest_out"] = {**kept, **{rel: hashlib.sha256(data).hexdigest() for rel, data in copies.items()}}
    result["pristine_files"] = sorted(kept)
    texts = {}
    for rel in files:
        if rel in result["missing_files"]:
            continue
        if rel in kept:
            texts[rel] = read_text(os.path.join(spec["state_dir"], PRISTINE_DIR, rel))
        else:
            texts[rel] = read_text(os.path.join(spec["source_dir"], rel))
    for entry in patch_set["entries"]:
        found = count(entry["anchor"], texts[entry["file"]]) if entry["file"] in texts else 0
        result["counts"][entry["id"]] = found
        if entry["file"] in result["missing_files"]:
            result["anchor_failures"].append(f"{entry['id']} ({entry['file']}): file is missing")
        elif found != entry["count"]:
            result["anchor_failures"].append(
                f"{entry['id']} ({entry['file']}): anchor /{entry['anchor']}/ found {found}x,"
                f" expected {entry['count']}x"
            )
        if entry["module"] == "lineinfile" and entry["count"] != 1:
            result["anchor_failures"].append(
                f"{entry['id']}: lineinfile edits one line, but the entry expects {entry['count']} (use replace)"
            )
    return result


def verify(spec):
    version = source_version(spec["source_dir"])
    patch_set = select(spec, version)
    record = read_json(os.path.join(spec["state_dir"], RECORD), {"unreadable": True})
    manifest, pristine_ok, problems = pristine_state(spec, version)
    failures = []
    files = {}
    wants_edits = bool(patch_set and patch_set["entries"]) or (
        spec["profile"].get("needs_patches", False) and patch_set is None
    )
    if spec["state"] == "absent" or not wants_edits:
        # Nothing of ours may remain; the restore itself was checked against the manifest.
        for name in (RECORD, MANIFEST, PRISTINE_DIR):
            if os.path.exists(os.path.join(spec["state_dir"], name)):
                failures.append(f"{os.path.join(spec['state_dir'], name)} still exists")
        return {"version": version, "failures": failures, "files": files, "record": record, "patched": False}
    if patch_set is None:
        failures.append(f"verl {version!r} has no patch set (supported: {', '.join(sorted(spec['sets']))})")
        return {"version": version, "failures": failures, "files": files, "record": record, "patched": False}
    for rel in covered_files(patch_set):
        path = os.path.join(spec["source_dir"], rel)
        try:
            text = read_text(path)
        except OSError as err:
            failures.append(f"{rel}: unreadable ({err})")
            continue
        files[rel] = sha256(path)
        try:
            compile(text, path, "exec", dont_inherit=True)
        except SyntaxError as err:
            failures.append(f"{rel}: does not compile: {err}")
        for entry in patch_set["entries"]:
            if entry["file"] != rel:
                continue
            post = count(entry["post"], text)
            if post != entry["count"]:
                failures.append(f"{entry['id']} ({rel}): post-condition found {post}x, expected {entry['count']}x")
            left = count(entry["anchor"], text)
            if left:
                failures.append(f"{entry['id']} ({rel}): anchor still matches {left}x")
        for residue in patch_set.get("residue", []):
            left = count(residue["pattern"], text)
            if left:
                failures.append(f"{rel}: {left}x /{residue['pattern']}/ left that no entry covers")
    if not pristine_ok:
        failures.append("pristine copies unusable: " + ("; ".join(problems) or "no pristine manifest"))
    else:
        if not set(files) <= set(manifest.get("files", {})):
            failures.append("pristine manifest does not cover every patched file")
        for rel, digest in sorted(manifest.get("files", {}).items()):
            path = os.path.join(spec["source_dir"], rel)
            if rel not in files and (not os.path.isfile(path) or sha256(path) != digest):
                failures.append(f"{rel}: no entry of this patch set covers it, yet it differs from its pristine copy")
    if spec.get("check_record", True):
        if not record or record.get("identity") != identity(spec, patch_set, version):
            failures.append("applied record missing or for another patch set, version, source or profile")
        elif {rel: item.get("patched_sha256") for rel, item in record.get("files", {}).items()} != files:
            failures.append("applied record checksums differ from the files")
    record_files = {
        rel: {"pristine_sha256": (manifest or {}).get("files", {}).get(rel), "patched_sha256": digest}
        for rel, digest in files.items()
    }
    return {
        "version": version,
        "failures": failures,
        "files": files,
        "record": record,
        "identity": identity(spec, patch_set, version),
        "record_files": record_files,
        "patched": True,
    }


def main(argv):
    if len(argv) != 3 or argv[1] not in ("probe", "verify"):
        print(__doc__, file=sys.stderr)
        return 2
    spec = json.loads(base64.b64decode(argv[2]).decode("utf-8"))
    result = probe(spec) if argv[1] == "probe" else verify(spec)
    print(json.dumps(result, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
