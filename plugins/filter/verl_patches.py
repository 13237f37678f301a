"""verl_patches' lists for root, from the patch set on the controller, never from the owner's probe.

`patch_set | verl_patches_root_files` is every file the patch set edits, each a plain relative path (refused
with the offending entry when absolute, with a `..` or an empty component: root copies these into its own
state directory). `files | verl_patches_parent_dirs` is every directory those files need under the pristine
tree, parents first. `probe_list | verl_patches_only(files)` keeps what the probe named that the patch set also
names, so a forged probe output can only shorten root's work, never point it elsewhere.
`copies | verl_patches_pristine_batch(state_dir, contents, manifest)` is root's one fleet_state_path call for the
pristine tree: the old applied record removed, the directories (parents first), each copy with the content the
owner's probe read, the manifest last. Unit-tested in python/tests/test_verl_patches_rules.py.
"""

from ansible.errors import AnsibleFilterError


def verl_patches_root_files(patch_set):
    files = []
    for entry in (patch_set or {}).get("entries", []):
        path = entry.get("file") if isinstance(entry, dict) else None
        parts = path.split("/") if isinstance(path, str) else []
        if not parts or path.startswith("/") or any(part in ("", ".", "..") for part in parts):
            name = entry.get("id", "?") if isinstance(entry, dict) else repr(entry)
            raise AnsibleFilterError(
                f"patch set {(patch_set or {}).get('id', '?')}: entry {name} names the file {path!r}; "
                "a patch set names files by plain paths relative to the verl checkout "
                "(no leading /, no '.' or '..' components)"
            )
        if path not in files:
            files.append(path)
    return sorted(files)


def verl_patches_parent_dirs(files):
    dirs = set()
    for path in files:
        parts = path.split("/")[:-1]
        dirs.update("/".join(parts[: index + 1]) for index in range(len(parts)))
    return sorted(dirs, key=lambda d: (d.count("/"), d))


def verl_patches_only(found, files):
    allowed = set(files)
    if isinstance(found, dict):
        return {key: value for key, value in found.items() if key in allowed}
    return [item for item in found or [] if item in allowed]


def verl_patches_pristine_batch(copies, state_dir, contents, manifest):
    """fleet_state_path requests, in order, for the files in `copies` (already checked against the patch set)."""
    if not isinstance(manifest, str):
        raise AnsibleFilterError(f"verl_patches_pristine_batch: the manifest must be JSON text, got {type(manifest)}")
    missing = [path for path in copies if not isinstance((contents or {}).get(path), str)]
    if missing:
        raise AnsibleFilterError(
            f"the verl_patches probe gave no content for {', '.join(missing)}, which the patch set edits and which "
            "has no pristine copy yet; nothing was written. Rerun; if it persists, the probe's output is not the tool's"
        )
    pristine = f"{state_dir}/pristine"
    batch = [{"path": f"{state_dir}/applied.json", "state": "absent"}]
    directories = [state_dir.rsplit("/", 1)[0] or "/", state_dir, pristine]
    directories += [f"{pristine}/{path}" for path in verl_patches_parent_dirs(copies)]
    batch += [{"path": path, "state": "directory", "mode": "0755"} for path in directories]
    batch += [
        {"path": f"{pristine}/{path}", "state": "file", "mode": "0644", "content_base64": contents[path]}
        for path in copies
    ]
    batch.append({"path": f"{state_dir}/pristine.json", "state": "file", "mode": "0644", "content": manifest + "\n"})
    return batch


class FilterModule:
    def filters(self):
        return {
            "verl_patches_root_files": verl_patches_root_files,
            "verl_patches_parent_dirs": verl_patches_parent_dirs,
            "verl_patches_only": verl_patches_only,
            "verl_patches_pristine_batch": verl_patches_pristine_batch,
        }
