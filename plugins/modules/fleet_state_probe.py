#!/usr/bin/python3
"""One read of every stage's real markers on a host, and the records that say what was converged.

Modes:
- probe (read-only): for each stage, the identity of the files it owns (sha256 of small files, size and
  mtime of large ones, symlink targets, owner and mode), the leftovers of an unfinished attempt, and the
  record the stage wrote when it last converged and passed its checks. A stage has drifted when it has no
  record, when its inputs (the role's variables and code) differ from the recorded ones, or when a file
  it owns is not as recorded. Also: whether the stack must be re-verified (the preflight state differs
  from the one it was last verified on: driver, kernel module, GPUs) and, per stage, the gate: converge,
  verify, plan (check mode, prerequisites absent) or none; and the stages whose plan the dry run reports in
  their place (site.yml runs a stage only where its gate is converge or verify).
- record: write one stage's record after its converge and checks passed.
- verified: write the preflight state the whole stack was verified on.

Files are read as root without following symlinks: nothing the env owner can write is executed or
followed, and a record never holds the hash of a file a planted link points at.

A plain script in Ansible's JSON-arguments module style (ARGUMENTS below), like gpu_preflight's probe: it runs
on every host on every run, and Ansible's module library, unpacked and imported on each call, costs the host
several times the CPU of this script (docs/benchmarks-code.md). So it is one of the two named exceptions to the
collection's AnsibleModule rule (docs/extending-modules.md): its action (plugins/action/fleet_state_probe.py) checks the
task's options against the module's argument_spec on the controller, and this script checks them again.
"""

from __future__ import annotations

import errno
import fnmatch
import glob
import hashlib
import json
import os
import stat
import sys
import tempfile
from datetime import datetime, timezone

# Ansible replaces the placeholder with the task's arguments as JSON (ASCII, quotes escaped: safe in this literal).
ARGUMENTS = r"""<<INCLUDE_ANSIBLE_MODULE_JSON_ARGS>>"""

DOCUMENTATION = r"""
module: fleet_state_probe
short_description: Read every p40fleet stage's markers at once; write stage and verification records.
description:
  - Reads every p40fleet stage's markers in one call, and writes stage and verification records.
  - Mode probe only reads; modes record and verified write root-owned JSON records under O(state_dir).
author: p40fleet
options:
  mode:
    description: probe (read only), record (one stage's record) or verified (the verified preflight state).
    type: str
    choices: [probe, record, verified]
    default: probe
  state_dir:
    description: Where the records live (root-owned).
    type: path
    required: true
  stages:
    description: >-
      Stage name -> {inputs (dict), files (paths or globs), absent (paths), requires (paths), packages (bool:
      the recorded dpkg packages must be installed), json and text (name -> path of a small JSON or text file to
      return as it is, for reports)}.
    type: dict
    default: {}
  stage:
    description: The stage to record (mode record).
    type: str
  preflight_state_file:
    description: gpu_preflight's saved state, returned as it is (for reports).
    type: path
  preflight_state:
    description: The preflight state this run found (what the stack is verified against); null when not known.
    type: dict
  host:
    description: The host's inventory name, for the re-verification warning.
    type: str
    default: this host
  run_tags:
    description: The run's tags (ansible_run_tags).
    type: list
    elements: str
    default: [all]
  skip_tags:
    description: The run's skipped tags (ansible_skip_tags); with run_tags, which stages' plans are reported.
    type: list
    elements: str
    default: []
  packages:
    description: dpkg packages the stage installed (mode record, stages with packages true).
    type: list
    elements: str
    default: []
"""

RETURN = r"""
stages:
  description: Stage -> {found, drift (list of reasons, empty when converged), ready (bool), gate, plan}.
  type: dict
  returned: mode probe
planned:
  description: >-
    The stages, in order, whose gate is plan and which the run's tags select: a dry run reports their plan in
    place of running them (site.yml skips them).
  type: list
  elements: str
  returned: mode probe
reverify:
  description: Whether the stack must be re-verified on this host (also said in a warning naming the host).
  type: bool
  returned: mode probe
converged:
  description: Every stage's gate is none and nothing is to be re-verified; the play can end for this host.
  type: bool
  returned: mode probe
"""

EXAMPLES = r"""
- name: Read every stage's markers
  p40fleet.fleet.fleet_state_probe:
    state_dir: /var/lib/p40fleet/state
    stages: >-
      {{ lookup('p40fleet.fleet.fleet_state_specs', 'cuda_toolkit', 'cudnn', roles_dir=playbook_dir ~ '/roles') }}
  register: fleet_state_found
"""

# Larger files are identified by size and mtime: hashing a 4 GB model or a 400 MB library on every
# run is what the probe exists to avoid. Small files (records, configs, metadata) are hashed.
HASH_LIMIT = 4 * 1024 * 1024
RECORD_SCHEMA = 1
DPKG_STATUS = "/var/lib/dpkg/status"


FOLLOW_LIMIT = 40


def open_parent(path: str) -> tuple[int, str]:
    """A descriptor of the directory holding path's last component, and that name, reached from / one component
    at a time: a link on the way is followed only where root made it in a directory only root can write (an
    administrator's /var/run, p40fleet's /usr/local/cuda); one the env owner could have made (an `envs/` swapped
    for a link) raises ELOOP, so nothing behind it is read or hashed."""
    parts = [part for part in path.split("/") if part not in ("", ".")]
    if not path.startswith("/") or ".." in parts or not parts:
        raise OSError(errno.EINVAL, "not a plain absolute path", path)
    follows = 0
    while True:
        fd = os.open("/", os.O_RDONLY | os.O_DIRECTORY)
        walked, trusted, restart = "", True, None
        try:
            for index, name in enumerate(parts[:-1]):
                info = os.lstat(name, dir_fd=fd)
                if stat.S_ISLNK(info.st_mode):
                    if not trusted or info.st_uid != 0 or follows >= FOLLOW_LIMIT:
                        raise OSError(errno.ELOOP, "a link root does not trust on the way", f"{walked}/{name}")
                    follows += 1
                    target = os.readlink(name, dir_fd=fd)
                    base = target if target.startswith("/") else f"{walked}/{target}"
                    restart = [p for p in os.path.normpath(base).split("/") if p] + parts[index + 1 :]
                    break
                child = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
                os.close(fd)
                fd = child
                opened = os.fstat(fd)
                trusted = trusted and opened.st_uid == 0 and not stat.S_IMODE(opened.st_mode) & 0o022
                walked = f"{walked}/{name}"
        except BaseException:
            os.close(fd)
            raise
        if restart is None:
            return fd, parts[-1]
        os.close(fd)
        parts = restart


def walked_lstat(path: str) -> os.stat_result:
    fd, name = open_parent(path)
    try:
        return os.lstat(name, dir_fd=fd)
    finally:
        os.close(fd)


def identity(path: str) -> dict | None:
    """What a path is, without following it: None when absent."""
    try:
        info = walked_lstat(path)
    except FileNotFoundError:
        return None
    except OSError as error:
        return {"error": error.strerror}
    found: dict = {"uid": info.st_uid, "mode": f"{stat.S_IMODE(info.st_mode):04o}"}
    if stat.S_ISLNK(info.st_mode):
        return {"link": os.readlink(path), "uid": info.st_uid}
    if stat.S_ISDIR(info.st_mode):
        return {**found, "dir": True}
    if not stat.S_ISREG(info.st_mode):
        return {**found, "special": True}
    if info.st_size > HASH_LIMIT:
        return {**found, "size": info.st_size, "mtime_ns": info.st_mtime_ns}
    digest = hashlib.sha256()
    try:
        fd = open_regular(path)
    except OSError as error:
        return {**found, "error": error.strerror}
    with os.fdopen(fd, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return {**found, "sha256": digest.hexdigest()}


def open_regular(path: str) -> int:
    """A descriptor of a regular file, never through a link root does not trust (open_parent) or a final link, and
    never blocking: a FIFO the env owner planted opens at once (O_NONBLOCK) and is refused, as is anything else
    that is not a regular file."""
    parent, name = open_parent(path)
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=parent)
    finally:
        os.close(parent)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file", path)
    return fd


def root_only(path: str) -> bool:
    """Whether only root can change what path names: root owns it and no other account can write it."""
    info = os.lstat(path)
    return info.st_uid == 0 and not stat.S_IMODE(info.st_mode) & 0o022


def safe_glob(pattern: str) -> list[str]:
    """glob's matches, without following a directory link the env owner could have made: a wildcard never
    descends into a link, and a named directory that is a link is followed only when root made it in a directory
    only root can write (glob.glob follows every link, so a planted one made the probe hash files elsewhere)."""

    def walk(base: str, parts: list[str]):
        if not parts:
            yield base
            return
        head, rest = parts[0], parts[1:]
        if head == "**":
            yield from walk(base, rest)
            for name in sorted(listdir(base)):
                if not name.startswith(".") and is_real_dir(os.path.join(base, name)):
                    yield from walk(os.path.join(base, name), parts)
        elif glob.has_magic(head):
            for name in sorted(listdir(base)):
                if name.startswith(".") and not head.startswith("."):
                    continue
                if fnmatch.fnmatchcase(name, head):
                    path = os.path.join(base, name)
                    if not rest:
                        yield path
                    elif is_real_dir(path):
                        yield from walk(path, rest)
        else:
            path = os.path.join(base, head)
            if not rest:
                if os.path.lexists(path):
                    yield path
            elif is_real_dir(path) or (os.path.islink(path) and root_only(base) and os.lstat(path).st_uid == 0):
                yield from walk(path, rest)

    def listdir(path: str) -> list[str]:
        # Only ever a real directory or a link admitted above.
        try:
            return os.listdir(path)
        except OSError:
            return []

    def is_real_dir(path: str) -> bool:
        try:
            return stat.S_ISDIR(os.lstat(path).st_mode)
        except OSError:
            return False

    absolute = pattern.startswith("/")
    parts = [part for part in pattern.split("/") if part]
    return list(dict.fromkeys(walk("/" if absolute else ".", parts)))


def expand(patterns: list[str]) -> dict[str, dict | None]:
    """Every file a stage owns, globs expanded: path -> identity (None for a plain path that is absent)."""
    files: dict[str, dict | None] = {}
    for pattern in (os.path.expanduser(p) for p in patterns):
        if glob.has_magic(pattern):
            for path in sorted(safe_glob(pattern)):
                files[path] = identity(path)
        else:
            files[pattern] = identity(pattern)
    return files


def read_text(path: str, limit: int = 4096) -> str | None:
    try:
        fd = open_regular(path)
        with os.fdopen(fd, "rb") as handle:
            return handle.read(limit).decode("utf-8", errors="replace")
    except OSError:
        return None


def read_json(path: str):
    try:
        fd = open_regular(path)
        with os.fdopen(fd, encoding="utf-8") as handle:
            return json.load(handle)
    except (OSError, ValueError):
        return None


def installed_packages(status_path: str = DPKG_STATUS) -> set[str]:
    """Packages dpkg records as installed ("install ok installed")."""
    installed, name = set(), None
    try:
        with open(status_path, encoding="utf-8", errors="replace") as handle:
            for line in handle:
                if line.startswith("Package: "):
                    name = line[9:].strip()
                elif line.startswith("Status: ") and name and line.split()[-1] == "installed":
                    installed.add(name)
    except OSError:
        pass
    return installed


def canonical_sha256(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def input_digests(inputs: dict) -> dict:
    """Each input's sha256 (of its canonical JSON): what a record keeps, so it tells a change without the value."""
    return {key: canonical_sha256(value) for key, value in inputs.items()}


def record_path(state_dir: str, stage: str) -> str:
    return os.path.join(state_dir, "stages", f"{stage}.json")


def changed_keys(old: dict, new: dict) -> list[str]:
    return sorted(key for key in set(old) | set(new) if old.get(key) != new.get(key))


def stage_drift(stage: str, spec: dict, found_files: dict, record: dict | None, installed: set[str]) -> list[str]:
    """Why a stage is not converged; empty when its record, inputs and files all agree."""
    drift = [f"an unfinished earlier attempt left {path}" for path in spec.get("absent") or [] if identity(path)]
    if not isinstance(record, dict) or record.get("schema") != RECORD_SCHEMA:
        return [*drift, f"no record of a completed {stage} run (first run, or the last one stopped before its checks)"]
    # Records hold digests of the inputs, never their values (an index URL may carry credentials); a record of an
    # earlier p40fleet holds the values in a 0644 file: the stage converges again and its record is rewritten.
    if "input_sha256" not in record:
        drift.append("its record holds the inputs' values (an earlier p40fleet wrote it): it is recorded again")
    recorded_inputs = record.get("input_sha256") or input_digests(record.get("inputs") or {})
    inputs = changed_keys(recorded_inputs, input_digests(spec.get("inputs") or {}))
    if inputs:
        drift.append(f"inputs changed since the last converge: {', '.join(inputs)}")
    recorded = record.get("files") or {}
    for path in sorted(set(recorded) | set(found_files)):
        before, now = recorded.get(path), found_files.get(path)
        if before == now:
            continue
        if now is None:
            drift.append(f"{path} is missing")
        elif before is None:
            drift.append(f"{path} appeared since the last converge")
        else:
            drift.append(f"{path} changed since the last converge")
    if spec.get("packages"):
        missing = [name for name in record.get("packages") or [] if name not in installed]
        if missing:
            drift.append(f"packages no longer installed: {', '.join(missing)}")
    return drift


def gate(drift: list[str], ready: bool, reverify: bool, run_tags: list[str], check_mode: bool) -> str:
    """What a stage's gate includes: converge (install and verify), verify (checks only), plan (check mode
    cannot simulate the stage before its prerequisites exist: report the drift) or none."""
    if "verify" in run_tags:
        return "verify"
    if drift:
        return "converge" if ready or not check_mode else "plan"
    return "verify" if reverify else "none"


def selected(stage: str, run_tags: list[str], skip_tags: list[str]) -> bool:
    """Whether the run's tags run a stage: site.yml tags each stage's role with the stage's name."""
    return ("all" in run_tags or stage in run_tags) and stage not in skip_tags


def probe(params: dict, check_mode: bool) -> dict:
    state_dir = params["state_dir"]
    preflight = params.get("preflight_state")
    verified = read_json(os.path.join(state_dir, "verified.json"))
    reverify = preflight is not None and (
        not isinstance(verified, dict) or verified.get("preflight_sha256") != canonical_sha256(preflight)
    )
    needs_packages = any(spec.get("packages") for spec in params["stages"].values())
    installed = installed_packages() if needs_packages else set()
    stages = {}
    for name, spec in params["stages"].items():
        files = expand(spec.get("files") or [])
        record = read_json(record_path(state_dir, name))
        drift = stage_drift(name, spec, files, record, installed)
        ready = all(os.path.exists(os.path.expanduser(path)) for path in spec.get("requires") or [])
        stages[name] = {
            "found": {
                "files": files,
                "json": {key: read_json(path) for key, path in (spec.get("json") or {}).items()},
                "text": {key: read_text(path) for key, path in (spec.get("text") or {}).items()},
                "recorded_at": (record or {}).get("at") if isinstance(record, dict) else None,
            },
            "drift": drift,
            "ready": ready,
            "gate": gate(drift, ready, reverify, params["run_tags"], check_mode),
            "plan": f"{name} would be converged: " + "; ".join(drift) if drift else f"{name} is converged",
        }
    saved_preflight = read_json(params["preflight_state_file"]) if params.get("preflight_state_file") else None
    gates = {name: stage["gate"] for name, stage in stages.items()}
    result = {
        "changed": False,
        "preflight": saved_preflight,
        "stages": stages,
        "reverify": reverify,
        "verified": verified,
        "gates": gates,
        "planned": [
            name
            for name, value in gates.items()
            if value == "plan" and selected(name, params["run_tags"], params["skip_tags"])
        ],
        "converged": not reverify and all(value == "none" for value in gates.values()),
    }
    if reverify:
        was = verified.get("driver_version") if isinstance(verified, dict) else None
        result["warnings"] = [
            f"{params['host']}: the preflight state changed since the stack was last verified "
            f"({was or 'never verified'} -> {(preflight or {}).get('driver_version') or '?'}): re-verifying every stage"
        ]
    return result


def write_json(path: str, content: dict, check_mode: bool, compare_without: tuple[str, ...] = ("at",)) -> bool:
    """Write atomically unless the file already says the same (ignoring timestamps); True if it differed."""
    current = read_json(path)
    strip = lambda doc: {k: v for k, v in doc.items() if k not in compare_without}  # noqa: E731
    if isinstance(current, dict) and strip(current) == strip(content):
        return False
    if check_mode:
        return True
    directory = os.path.dirname(path)
    os.makedirs(directory, mode=0o755, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            json.dump(content, handle, indent=2, sort_keys=True)
            handle.write("\n")
        # Root's bookkeeping, read by root alone.
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return True


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def record(params: dict, check_mode: bool) -> dict:
    name = params["stage"]
    spec = params["stages"][name]
    content = {
        "schema": RECORD_SCHEMA,
        "stage": name,
        "at": now(),
        "input_sha256": input_digests(spec.get("inputs") or {}),
        "files": expand(spec.get("files") or []),
        "packages": sorted(params["packages"]),
    }
    written = write_json(record_path(params["state_dir"], name), content, check_mode)
    # A record is p40fleet's bookkeeping, not the host's configuration: writing it is not a change.
    return {"changed": False, "recorded": written, "path": record_path(params["state_dir"], name)}


def verified_record(params: dict, check_mode: bool) -> dict:
    preflight = params.get("preflight_state")
    content = {"schema": RECORD_SCHEMA, "at": now(), "preflight_sha256": canonical_sha256(preflight)}
    if isinstance(preflight, dict):
        content["driver_version"] = preflight.get("driver_version")
        content["gpus"] = preflight.get("gpus")
    written = write_json(os.path.join(params["state_dir"], "verified.json"), content, check_mode)
    return {"changed": False, "recorded": written}


# Option -> (types it accepts, default); `required` and the modes' own needs are checked in options().
OPTIONS = {
    "mode": ((str,), "probe"),
    "state_dir": ((str,), None),
    "stages": ((dict,), {}),
    "stage": ((str,), None),
    "preflight_state": ((dict, type(None)), None),
    "preflight_state_file": ((str, type(None)), None),
    "run_tags": ((list,), ["all"]),
    "skip_tags": ((list,), []),
    "host": ((str,), "this host"),
    "packages": ((list,), []),
}
MODES = {"probe": probe, "record": record, "verified": verified_record}


def options(arguments: dict) -> dict:
    """The task's options with their defaults; a bad option is a ValueError naming it."""
    unknown = sorted(key for key in arguments if not key.startswith("_ansible_") and key not in OPTIONS)
    if unknown:
        raise ValueError(f"unsupported option(s) {', '.join(unknown)}; supported: {', '.join(OPTIONS)}")
    params = {}
    for name, (types, default) in OPTIONS.items():
        value = arguments.get(name)
        params[name] = default if value is None else value
        if params[name] is not None and not isinstance(params[name], types):
            raise ValueError(f"{name} must be a {' or '.join(t.__name__ for t in types)}, got {value!r}")
    for name in ("run_tags", "skip_tags", "packages"):
        if not all(isinstance(item, str) for item in params[name]):
            raise ValueError(f"{name} must be a list of strings, got {params[name]!r}")
    if params["mode"] not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {params['mode']!r}")
    if not params["state_dir"]:
        raise ValueError("state_dir (a path) is required")
    if params["mode"] == "record" and params["stage"] not in params["stages"]:
        raise ValueError(f"no markers given for stage {params['stage']}")
    if params["mode"] == "verified" and params["preflight_state"] is None:
        raise ValueError("mode verified needs preflight_state")
    for name in ("state_dir", "preflight_state_file"):
        if params[name]:
            params[name] = os.path.expanduser(os.path.expandvars(params[name]))
    return params


def main() -> None:
    arguments = json.loads(ARGUMENTS)
    try:
        params = options(arguments)
    except ValueError as error:
        print(json.dumps({"failed": True, "msg": f"fleet_state_probe: {error}"}))
        sys.exit(1)
    print(json.dumps(MODES[params["mode"]](params, bool(arguments.get("_ansible_check_mode")))))


if __name__ == "__main__":
    main()
