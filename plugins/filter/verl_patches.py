"""verl_patches' lists for root, from the patch set on the controller, never from the owner's probe.

`patch_set | verl_patches_root_files` is every file the patch set edits, each a plain relative path (refused
with the offending entry when absolute, with a `..` or an empty component: root copies these into its own
state directory). `files | verl_patches_parent_dirs` is every directory those files need under the pristine
tree, parents first. `probe_list | verl_patches_only(files)` keeps what the probe named that the patch set also
names, so a forged probe output can only shorten root's work, never point it elsewhere.
`copies | verl_patches_pristine_batch(state_dir, contents, manifest)` is root's one fleet_state_path call for the
pristine tree: the old applied record removed, the directories (parents first), each copy with the content the
owner's probe read, the manifest last. `profile | verl_patches_plan(settings)` is what the GPU profile asks of
the patch sets: the dtype and attention kernel in force, their spellings for the edits, and which groups of entries
(`needs`) apply. Unit-tested in python/tests/test_verl_patches_rules.py.
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


# torch spelling, FSDP precision string and autocast arguments per profile dtype. fp32 turns the autocast off
# (Pascal has no faster dtype to cast to). So does fp16: verl 0.4.1/0.5.0 train with a bare loss.backward() and no
# loss scaler, and this model's per-token gradients lie near fp16's smallest normal, the classic silent underflow;
# Volta and Turing train in fp32 until a verl with a scaler (0.6.1) is pinned.
DTYPES = {
    "float32": {"torch": "torch.float32", "precision": "fp32", "autocast": "dtype=torch.float32, enabled=False"},
    "float16": {"torch": "torch.float16", "precision": "fp16", "autocast": "dtype=torch.float16, enabled=False"},
    "bfloat16": {"torch": "torch.bfloat16", "precision": "bf16", "autocast": "dtype=torch.bfloat16"},
}
# What verl hard-codes, so what needs no edit.
VERL_DTYPE = "bfloat16"
VERL_ATTN = "flash_attention_2"


def _flag(value):
    return value if isinstance(value, bool) else str(value).strip().lower() in ("true", "yes", "on", "1")


def verl_patches_plan(profile, settings):
    """What the GPU profile asks of the patch sets.

    settings: attn_implementation (the input; empty = the profile's), fallback_defaults (bool),
    triton_smem_required (bytes of shared memory per block flash_attn's Triton kernel needs).
    `known` is false for a dtype outside DTYPES (the role refuses it, naming `dtypes`); its spellings are then empty.
    """
    profile = profile if isinstance(profile, dict) else {}
    dtype = str(profile.get("dtype", VERL_DTYPE))
    attn = str(settings.get("attn_implementation") or "") or str(profile.get("attn_implementation", VERL_ATTN))
    needs_patches = _flag(profile.get("needs_patches", False))
    spelled = DTYPES.get(dtype, {"torch": "", "precision": "", "autocast": ""})
    # hf_rollout goes with every profile that needs patches (all of gpu_preflight's): every profile generates with
    # hf where no vLLM is installed, and the edits are inert for the vLLM/SGLang rollouts, which neither read
    # hf_rollout.py nor lack `timing`.
    active = []
    if needs_patches:
        active += ["dtype"] if dtype != VERL_DTYPE else []
        active += ["fallback"] if _flag(settings.get("fallback_defaults", True)) and dtype != VERL_DTYPE else []
        active += ["attn"] if attn != VERL_ATTN else []
        smem = int(profile.get("shared_memory_per_block") or 0)
        active += ["triton"] if smem < int(settings.get("triton_smem_required") or 0) else []
        active += ["hf_rollout"]
    return {
        "dtype": dtype,
        "known": dtype in DTYPES,
        "dtypes": list(DTYPES),
        "attn_implementation": attn,
        "torch_dtype": spelled["torch"],
        "precision": spelled["precision"],
        "autocast": spelled["autocast"],
        "active_needs": active,
        # The profile keys that decide the edits: the applied record's identity (a card swap within one profile,
        # P40 to P100, keeps the patches as they are).
        "identity": {
            "name": str(profile.get("name", "")),
            "dtype": dtype,
            "attn_implementation": attn,
            "needs_patches": needs_patches,
        },
    }


class FilterModule:
    def filters(self):
        return {
            "verl_patches_root_files": verl_patches_root_files,
            "verl_patches_parent_dirs": verl_patches_parent_dirs,
            "verl_patches_only": verl_patches_only,
            "verl_patches_pristine_batch": verl_patches_pristine_batch,
            "verl_patches_plan": verl_patches_plan,
        }
