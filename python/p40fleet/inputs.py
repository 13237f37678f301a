"""Bad input is found before any host is touched: the inventory is parsed by ansible-inventory (the
same configuration ansible-playbook will use), and every literal value the inventory or `-e` gives a
role variable is checked against that role's meta/argument_specs.yml with Ansible's own validator,
which converts as the role's own check would ("false" is a bool, "5" an int)."""

from __future__ import annotations

import difflib
import functools
import hashlib
import importlib.util
import json
import os
import re
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

import yaml

from p40fleet.paths import SITE_PLAYBOOK

ROLES_DIR = SITE_PLAYBOOK.parent / "roles"
# The batch sizes' minimums, whose home is the batch rules the launch settings' filter applies (it refuses the same
# on the host).
LAUNCH_FILTER = SITE_PLAYBOOK.parent / "plugins" / "plugin_utils" / "verl_batches.py"
SIMPLE_PATTERN = re.compile(r"^[A-Za-z0-9_.-]+$")
SHOWN_HOSTS = 5


class Opaque:
    """A value p40fleet cannot read before the run (vaulted, unsafe): never validated here."""

    def __init__(self, tag: str) -> None:
        self.tag = tag

    def __repr__(self) -> str:
        return f"<{self.tag}>"


# libyaml's loader where PyYAML has it: the pure-Python one took 8 times as long over the roles' argument
# specs, a tenth of a second on every run.
_SafeLoader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class _TolerantLoader(_SafeLoader):
    pass


for _tag in ("!vault", "!unsafe", "!vault-encrypted"):
    _TolerantLoader.add_constructor(_tag, lambda loader, node, tag=_tag: Opaque(tag))


@dataclass
class ExtraVars:
    """`-e` arguments in their order: inline ones (key=value, JSON/YAML) parsed into mappings, `@FILE`
    ones kept as paths, passed to ansible-playbook as they are."""

    items: list[dict | Path] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def for_validation(self) -> dict:
        """What the -e arguments set, later ones winning (ansible's default hash_behaviour=replace)."""
        merged: dict = {}
        for item in self.items:
            if isinstance(item, Path):
                text = item.read_text(encoding="utf-8", errors="replace")
                if text.lstrip().startswith("$ANSIBLE_VAULT"):
                    continue
                try:
                    data = yaml.load(text, Loader=_TolerantLoader)
                except yaml.YAMLError:
                    continue  # ansible-playbook will say what is wrong with it, before any host
                if isinstance(data, dict):
                    merged.update(data)
            else:
                merged.update(item)
        return merged

    def add(self, mapping: Mapping) -> None:
        self.items.append(dict(mapping))


def parse_extra_vars(arguments: Sequence[str] = ()) -> ExtraVars:
    """Parse -e arguments as ansible-playbook does: `@FILE`, a JSON/YAML mapping, or key=value pairs."""
    extra = ExtraVars()
    for argument in arguments:
        text = argument.strip()
        if not text:
            continue
        if text.startswith("@"):
            path = Path(text[1:]).expanduser().resolve()
            if not path.is_file():
                extra.problems.append(f"-e {argument}: {path} is not a file")
                continue
            extra.items.append(path)
        elif text[0] in "{[":
            try:
                data = yaml.load(text, Loader=_TolerantLoader)
            except yaml.YAMLError as error:
                extra.problems.append(f"-e {argument}: not valid JSON/YAML ({str(error).splitlines()[0]})")
                continue
            if not isinstance(data, dict):
                extra.problems.append(f"-e {argument}: expected a mapping of variable names to values")
                continue
            if _has_opaque(data):
                extra.problems.append(f"-e {argument}: tagged values (!vault, !unsafe) can only be given in @FILE")
                continue
            extra.items.append(data)
        else:
            # Ansible's own key=value parser (quotes, escapes), imported only here: importing Ansible costs a
            # run without key=value arguments a quarter of a second.
            from ansible.parsing.splitter import parse_kv

            data = parse_kv(text, check_raw=False)
            raw = data.pop("_raw_params", None)
            if raw:
                extra.problems.append(
                    f"-e {argument}: {raw!r} is not key=value; give key=value, a JSON/YAML mapping, or @FILE"
                )
                continue
            extra.items.append(KeyValues(data))
    return extra


class KeyValues(dict):
    """-e key=value pairs: every value a string, as ansible-playbook would pass them."""


def typed(extra: ExtraVars, specs: Mapping[str, tuple[str, dict]] | None = None) -> list[dict | Path]:
    """The -e items as the run gets them: a key=value string for a role variable becomes the type its
    argument spec says (`apex_enabled=false` the bool false, `..._timeout=60` the int 60), as the
    user meant; everything else passes as given."""
    if not any(isinstance(item, KeyValues) for item in extra.items):
        # Nothing to convert: neither the specs nor Ansible's validator (a quarter second to import) are needed.
        return list(extra.items)
    from ansible.module_utils.common.arg_spec import ArgumentSpecValidator

    specs = specs if specs is not None else role_variable_specs()
    items: list[dict | Path] = []
    for item in extra.items:
        if isinstance(item, KeyValues):
            converted = {}
            for name, value in item.items():
                if name in specs and _is_literal(value):
                    top = {k: v for k, v in specs[name][1].items() if k not in ("required", "default")}
                    result = ArgumentSpecValidator({name: top}).validate({name: value})
                    if not result.error_messages:
                        value = result.validated_parameters[name]
                converted[name] = value
            item = converted
        items.append(item)
    return items


@dataclass
class Inventory:
    path: Path
    hosts: list[str]
    groups: dict[str, dict]
    hostvars: dict[str, dict]

    def group_hosts(self, group: str, seen: set[str] | None = None) -> set[str] | None:
        """Every host in the group or its children; None if there is no such group."""
        if group == "all":
            return set(self.hostvars)
        spec = self.groups.get(group)
        if spec is None:
            return None
        seen = seen if seen is not None else set()
        seen.add(group)
        hosts = set(spec.get("hosts", []))
        for child in spec.get("children", []):
            if child not in seen:
                hosts |= self.group_hosts(child, seen) or set()
        return hosts


class InventoryError(ValueError):
    pass


def load_inventory(
    inventory: Path,
    env: dict[str, str],
    limit: str | None = None,
    playbook_dir: Path | None = None,
    cache_dir: Path | None = None,
) -> Inventory:
    """The inventory as ansible-playbook will see it (group_vars merged), limited; raises
    InventoryError with ansible's own message when it cannot be parsed.

    With `cache_dir`, ansible-inventory's listing is kept there under a hash of everything it was
    computed from (see listing_key) and reused while none of that changed: starting ansible-inventory
    was most of what `p40fleet run` cost over ansible-playbook on a converged fleet (about 1 s)."""
    argv = ["ansible-inventory", "-i", str(inventory), "--list"]
    if playbook_dir is not None:
        argv += ["--playbook-dir", str(playbook_dir)]
    if limit:
        argv += ["--limit", limit]
    run_env = {
        **env,
        # An inventory Ansible cannot parse is an error here, not a warning and an empty fleet.
        "ANSIBLE_INVENTORY_UNPARSED_FAILED": "True",
        "ANSIBLE_INVENTORY_ANY_UNPARSED_IS_FAILED": "True",
        # A limit that matches nothing is this module's own finding, with its own words (check_inputs).
        "ANSIBLE_HOST_PATTERN_MISMATCH": "warning",
    }
    key = listing_key(inventory, argv, run_env, playbook_dir) if cache_dir is not None else None
    data = _cached_listing(cache_dir, key) if key else None
    if data is None:
        result = subprocess.run(argv, env=run_env, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise InventoryError(_inventory_message(inventory, result.stderr or result.stdout))
        data = json.loads(result.stdout)
        if key:
            _keep_listing(cache_dir, key, data)
    hostvars = data.get("_meta", {}).get("hostvars", {})
    groups = {name: spec for name, spec in data.items() if name != "_meta"}
    hosts: set[str] = set(hostvars)
    for spec in groups.values():
        hosts.update(spec.get("hosts", []))
    for host in hosts:
        hostvars.setdefault(host, {})
    return Inventory(path=inventory, hosts=sorted(hosts), groups=groups, hostvars=hostvars)


# Inventory sources whose listing is more than their files' text: an executable (a script inventory), an
# inventory plugin's config (its hosts come from elsewhere), anything vaulted (decrypted with a secret kept
# outside). Their listing is never reused.
DYNAMIC_SOURCE = re.compile(r"^plugin\s*:|\$ANSIBLE_VAULT", re.MULTILINE)
# Settings that bring in plugins whose output is not a file under the inventory: never reused either.
PLUGIN_SETTINGS = ("ANSIBLE_VARS_", "ANSIBLE_INVENTORY_ENABLED", "ANSIBLE_INVENTORY_PLUGINS")
LISTINGS_KEPT = 4


def _source_files(inventory: Path, playbook_dir: Path | None) -> list[Path] | None:
    """Every file ansible-inventory reads for this inventory (the source, or every file under a source
    directory; the group_vars and host_vars beside it and beside the playbook), or None when one of them
    is not plain data (DYNAMIC_SOURCE)."""
    roots = [inventory]
    if not inventory.is_dir():
        roots += [inventory.parent / "group_vars", inventory.parent / "host_vars"]
    if playbook_dir is not None:
        roots += [playbook_dir / "group_vars", playbook_dir / "host_vars"]
    files: list[Path] = []
    for root in roots:
        if root.is_file():
            files.append(root)
        elif root.is_dir():
            files += sorted(p for p in root.rglob("*") if p.is_file())
    # Ansible's script plugin runs any executable source, whatever its name.
    return None if any(os.access(path, os.X_OK) for path in files) else files


def listing_key(inventory: Path, argv: list[str], env: Mapping[str, str], playbook_dir: Path | None) -> str | None:
    """A sha256 of what ansible-inventory's listing is computed from: the command, the environment,
    ansible.cfg's text, ansible-core's version and the text of every inventory and vars file; None where
    the listing depends on more than that (see DYNAMIC_SOURCE, PLUGIN_SETTINGS)."""
    if any(name.startswith(PLUGIN_SETTINGS) for name in env):
        return None
    files = _source_files(inventory, playbook_dir)
    if files is None:
        return None
    digest = hashlib.sha256()
    digest.update(json.dumps([argv, sorted(env.items())]).encode())
    digest.update(_ansible_release().encode() + b"\0")
    config = Path(env.get("ANSIBLE_CONFIG", ""))
    if config.is_file():
        digest.update(str(config).encode() + b"\0" + config.read_bytes() + b"\0")
    for path in files:
        try:
            content = path.read_bytes()
        except OSError:
            return None
        if DYNAMIC_SOURCE.search(content.decode("utf-8", errors="replace")):
            return None
        digest.update(str(path).encode() + b"\0" + hashlib.sha256(content).digest())
    return digest.hexdigest()


def _cached_listing(cache_dir: Path, key: str) -> dict | None:
    try:
        return json.loads((cache_dir / f"listing-{key}.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _write_private_json(path: Path, data: dict) -> None:
    """Atomically and 0600: hostvars may hold values people keep to themselves, and verdicts quote values."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        json.dump(data, handle)
    tmp.replace(path)


def _keep_listing(cache_dir: Path, key: str, data: dict) -> None:
    """The listing under its key, and only the last few listings."""
    _write_private_json(cache_dir / f"listing-{key}.json", data)
    kept = sorted(cache_dir.glob("listing-*.json"), key=lambda p: p.stat().st_mtime_ns, reverse=True)
    for old in kept[LISTINGS_KEPT:]:
        old.unlink(missing_ok=True)


def _inventory_message(inventory: Path, stderr: str) -> str:
    lines = [line.rstrip() for line in stderr.splitlines() if line.strip()]
    wanted = [line for line in lines if not line.startswith("<<<") and "source not shown" not in line]
    return f"inventory {inventory} cannot be parsed:\n  " + "\n  ".join(wanted[:20])


def play_patterns(playbook: Path) -> list[str] | None:
    """The host patterns of the playbook's plays, when every play names plain hosts or groups; None
    when a pattern, a template or an import makes that a question only Ansible can answer."""
    try:
        plays = yaml.load(playbook.read_text(encoding="utf-8"), Loader=_TolerantLoader)
    except (OSError, yaml.YAMLError):
        return None
    if not isinstance(plays, list):
        return None
    found: list[str] = []
    for play in plays:
        if not isinstance(play, dict) or "hosts" not in play:
            return None
        # site.yml's empty-fleet guard templates its hosts from the group it guards: that group is its target.
        guarded = play["vars"].get("p40fleet_guard_group") if isinstance(play.get("vars"), dict) else None
        patterns = guarded if isinstance(guarded, str) else play["hosts"]
        patterns = patterns if isinstance(patterns, list) else str(patterns).split(",")
        for pattern in (str(p).strip() for p in patterns):
            if not SIMPLE_PATTERN.match(pattern):
                return None
            if pattern not in found:
                found.append(pattern)
    return found


def targeted(patterns: Iterable[str], inventory: Inventory) -> set[str]:
    hosts: set[str] = set()
    for pattern in patterns:
        group = inventory.group_hosts(pattern)
        hosts |= group if group is not None else ({pattern} if pattern in inventory.hostvars else set())
    return hosts


def _has_opaque(value) -> bool:
    if isinstance(value, Opaque):
        return True
    if isinstance(value, dict):
        return any(_has_opaque(v) for v in value.values())
    if isinstance(value, list | tuple):
        return any(_has_opaque(v) for v in value)
    return False


def _is_literal(value) -> bool:
    if isinstance(value, Opaque):
        return False
    if isinstance(value, str):
        return "{{" not in value and "{%" not in value
    if isinstance(value, dict):
        if len(value) == 1 and str(next(iter(value), "")).startswith("__ansible_"):
            return False  # how ansible-inventory prints a vaulted or unsafe value
        return all(_is_literal(k) and _is_literal(v) for k, v in value.items())
    if isinstance(value, list | tuple):
        return all(_is_literal(v) for v in value)
    return True


def role_variable_specs(roles_dir: Path = ROLES_DIR, cache_dir: Path | None = None) -> dict[str, tuple[str, dict]]:
    """Every role variable's argument spec: name -> (role, spec of its `main` entry point).

    With `cache_dir`, the specs are kept there as JSON under a sha256 of the spec files' text: building
    YAML's objects took most of the tenth of a second their reading cost on every run."""
    texts = {path: path.read_bytes() for path in sorted(roles_dir.glob("*/meta/argument_specs.yml"))}
    kept = None
    if cache_dir is not None:
        digest = hashlib.sha256()
        for path, text in texts.items():
            digest.update(str(path).encode() + b"\0" + hashlib.sha256(text).digest())
        kept = cache_dir / f"specs-{digest.hexdigest()}.json"
        try:
            return {name: (role, spec) for name, (role, spec) in json.loads(kept.read_text(encoding="utf-8")).items()}
        except (OSError, ValueError):
            pass
    specs: dict[str, tuple[str, dict]] = {}
    for path, text in texts.items():
        role = path.parent.parent.name
        data = yaml.load(text, Loader=_SafeLoader) or {}
        options = ((data.get("argument_specs") or {}).get("main") or {}).get("options") or {}
        for name, spec in options.items():
            specs[name] = (role, spec)
    if kept is not None:
        for old in kept.parent.glob("specs-*.json"):
            old.unlink(missing_ok=True)
        _write_private_json(kept, specs)
    return specs


def expected(spec: dict, name: str = "") -> str:
    kind = spec.get("type", "str")
    text = {"bool": "a bool (true/false)", "int": "an int", "float": "a number", "dict": "a mapping"}.get(
        kind, f"a {kind}"
    )
    if name in minimums():
        text += f" of at least {minimums()[name]}"
    if kind == "list":
        elements = spec.get("elements", "str")
        text = "a list of mappings" if elements == "dict" else f"a list of {elements}"
    if spec.get("choices"):
        text += f", one of: {', '.join(str(c) for c in spec['choices'])}"
    if spec.get("options"):
        required = [k for k, v in spec["options"].items() if v.get("required")]
        if required:
            text += f" (each with {', '.join(required)})"
    return text


@functools.cache
def minimums() -> dict[str, int]:
    """The least value of each variable that has one (argument specs cannot say it): the launch settings'
    BATCH_MINIMUMS, by variable name. The filter file is read as text and its table parsed, not imported."""
    import ast

    tree = ast.parse(LAUNCH_FILTER.read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "BATCH_MINIMUMS" for t in node.targets):
            return {f"launch_script_{k}": v for k, v in ast.literal_eval(node.value).items()}
    raise RuntimeError(f"{LAUNCH_FILTER} has no BATCH_MINIMUMS")


def check_value(name: str, value, spec: dict) -> str | None:
    """The validator's complaint about one variable's value, or None if the spec accepts it."""
    from ansible.module_utils.common.arg_spec import ArgumentSpecValidator

    # The role's defaults fill what is not set, so top level only the value is checked; inside
    # a value (list elements, dict options) `required` holds.
    top = {k: v for k, v in spec.items() if k not in ("required", "default")}
    result = ArgumentSpecValidator({name: top}).validate({name: value})
    if result.error_messages:
        return "; ".join(result.error_messages)
    least = minimums().get(name)
    converted = result.validated_parameters.get(name)
    if least is not None and isinstance(converted, int) and converted < least:
        return f"{name} must be at least {least} (plugins/plugin_utils/verl_batches.py, BATCH_MINIMUMS)"
    return None


# Read once per process, as _names_the_roles_use: the check asked for it once per variable.
@functools.cache
def role_prefixes(roles_dir: Path = ROLES_DIR) -> tuple[str, ...]:
    """Each role's variable prefix (its name and `_`), longest first."""
    names = [p.parent.parent.name for p in roles_dir.glob("*/meta/argument_specs.yml")]
    return tuple(sorted((f"{n}_" for n in names), key=len, reverse=True))


IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@functools.cache
def _names_the_roles_use(roles_dir: Path = ROLES_DIR) -> frozenset[str]:
    """Every identifier in the roles' files: the declared variables and the ones they set themselves (vars/,
    set_fact, register), which an -e may override on purpose."""
    found: set[str] = set()
    for path in roles_dir.rglob("*"):
        if path.is_file() and path.suffix in (".yml", ".yaml", ".j2", ".py", ".sh"):
            found.update(IDENTIFIER.findall(path.read_text(encoding="utf-8", errors="replace")))
    return frozenset(found)


# Variables that moved to another role, by their old name: an inventory that still sets one is told the new name.
RENAMED = {"gpu_preflight_launch_tiers": "launch_script_memory_tiers"}


def unknown_variable(name: str, specs: Mapping[str, tuple[str, dict]], roles_dir: Path = ROLES_DIR) -> str | None:
    """Why a variable named with a role's prefix reaches no role (a misspelling: the value the operator meant
    would be lost), with the declared names closest to it; None for one a role declares or uses."""
    if name in RENAMED:
        return f"no role reads it any more: it is now {RENAMED[name]} (same value, CHANGELOG.md)"
    if name in specs or not name.startswith(role_prefixes(roles_dir)) or name in _names_the_roles_use(roles_dir):
        return None
    near = difflib.get_close_matches(name, list(specs), n=3, cutoff=0.8)
    hint = f"did you mean {' or '.join(near)}?" if near else "check its name against the role's defaults/main.yml"
    return f"no role declares it (roles/*/meta/argument_specs.yml), so no role would read it: {hint}"


def _shown(value) -> str:
    text = json.dumps(value, default=repr) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 200 else text[:200] + "..."


def _hosts_text(hosts: Sequence[str]) -> str:
    if len(hosts) == 1:
        return f"host {hosts[0]}"
    shown = ", ".join(hosts[:SHOWN_HOSTS])
    return f"hosts {shown}" + (f" and {len(hosts) - SHOWN_HOSTS} more" if len(hosts) > SHOWN_HOSTS else "")


@functools.cache
def _ansible_release() -> str:
    """ansible-core's release.py, read rather than imported: importing ansible costs more than a run's
    whole validation does once its verdicts are known."""
    spec = importlib.util.find_spec("ansible")
    release = Path(spec.origin).with_name("release.py") if spec and spec.origin else None
    return release.read_text(encoding="utf-8") if release and release.is_file() else ""


def verdict_key(name: str, value, spec: dict) -> str:
    """What the validator's verdict on a value depends on: ansible-core's version, the variable's spec and
    minimum, its name and the value itself."""
    text = json.dumps([_ansible_release(), name, spec, minimums().get(name), value], sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()


def validate_variables(
    inventory: Inventory,
    hosts: Iterable[str],
    extra: Mapping,
    specs: Mapping[str, tuple[str, dict]] | None = None,
    verdicts: dict[str, str | None] | None = None,
    known: Mapping[str, str | None] = MappingProxyType({}),
) -> list[str]:
    """One message per bad value: the host(s), the variable, what was found and what is expected.

    `verdicts` receives the validator's verdict on each distinct value, by verdict_key: hosts mostly share
    their values (group variables), so each is checked once; one found in `known` (an earlier run's
    verdicts, kept by check_inputs) is not checked again."""
    specs = specs if specs is not None else role_variable_specs()
    problems: list[str] = []
    verdicts = verdicts if verdicts is not None else {}

    def verdict(name: str, value, spec: dict) -> str | None:
        key = verdict_key(name, value, spec)
        if key not in verdicts:
            verdicts[key] = known[key] if key in known else check_value(name, value, spec)
        return verdicts[key]

    for name in extra:
        why = unknown_variable(name, specs)
        if why:
            problems.append(f"-e {name}: {why}")
    unknown: dict[tuple[str, str], list[str]] = {}
    for host in sorted(hosts):
        for name in inventory.hostvars.get(host, {}):
            why = unknown_variable(name, specs) if name not in extra else None
            if why:
                unknown.setdefault((name, why), []).append(host)
    for (name, why), names in unknown.items():
        problems.append(f"{_hosts_text(names)}: {name} in the inventory: {why}")
    for name, value in extra.items():
        if name in specs and _is_literal(value):
            role, spec = specs[name]
            complaint = verdict(name, value, spec)
            if complaint:
                problems.append(
                    f"-e {name}: found {_shown(value)}; expected {expected(spec, name)} "
                    f"(roles/{role}/meta/argument_specs.yml): {complaint}"
                )
    # Hosts that share a bad value (a group variable) get one message.
    bad: dict[tuple[str, str], list[str]] = {}
    for host in sorted(hosts):
        for name, value in inventory.hostvars.get(host, {}).items():
            if name in extra or name not in specs or not _is_literal(value):
                continue
            role, spec = specs[name]
            complaint = verdict(name, value, spec)
            if complaint:
                key = (
                    name,
                    f"found {_shown(value)}; expected {expected(spec, name)} "
                    f"(roles/{role}/meta/argument_specs.yml): {complaint}",
                )
                bad.setdefault(key, []).append(host)
    for (name, detail), names in bad.items():
        problems.append(f"{_hosts_text(names)}: {name} in the inventory: {detail}")
    return problems


# The settings every role, playbook and command shares, by their one name (roles/p40fleet_defaults), and the role
# copies an operator used to set instead: such a copy moved one role only (qualify and train kept the default).
SHARED_SETTINGS = {
    "conda_env_owner": "p40fleet_env_owner",
    "conda_env_install_prefix": "p40fleet_conda_prefix",
    "conda_env_name": "p40fleet_conda_env_name",
    "conda_env_python_version": "p40fleet_python_version",
    "artifact_fetch_mirror_base_url": "p40fleet_mirror_base_url",
    "cuda_toolkit_home": "p40fleet_cuda_home",
    "cuda_toolkit_env_file": "p40fleet_cuda_env_file",
    "gpu_preflight_state_file": "p40fleet_preflight_state_file",
    "fleet_state_preflight_state_file": "p40fleet_preflight_state_file",
    "launch_script_work_dir": "p40fleet_work_dir",
    "ray_cluster_name": "p40fleet_cluster",
    "ray_cluster_head": "p40fleet_cluster_head",
    "verl_pinned_version": "p40fleet_verl_version",
}
SHARED_DEFAULTS_FILE = ROLES_DIR / "p40fleet_defaults" / "defaults" / "main.yml"


@functools.cache
def shared_defaults() -> dict:
    # libyaml's safe loader (_SafeLoader): the pure-Python one took about 8 ms of every run's check.
    return yaml.load(SHARED_DEFAULTS_FILE.read_text(encoding="utf-8"), Loader=_SafeLoader)


def resolve_shared(given: Mapping) -> tuple[dict, list[str]]:
    """The shared settings one host resolves (its inventory variables with -e on top, `given`), and why a role copy
    that says otherwise is refused: the shared name is the one every role and command reads, so a copy that
    differs would split the fleet (the env made for one owner, qualify and train run as another)."""
    defaults = shared_defaults()
    resolved = {new: given.get(new, defaults[new]) for new in SHARED_SETTINGS.values()}
    problems = []
    for old, new in SHARED_SETTINGS.items():
        if old in given and _is_literal(given[old]) and _is_literal(resolved[new]) and given[old] != resolved[new]:
            problems.append(
                f"{old} is {_shown(given[old])} but {new} is {_shown(resolved[new])}: set {new}: "
                f"{_shown(given[old])} instead ({new} is the one name every role, playbook and p40fleet command "
                f"reads; {old} follows it)"
            )
    return resolved, problems


def shared_setting_problems(inventory: Inventory, hosts: Iterable[str], extra: Mapping) -> list[str]:
    """resolve_shared's refusals for every host, hosts with the same refusal in one message."""
    refused: dict[str, list[str]] = {}
    for host in sorted(hosts):
        for problem in resolve_shared({**inventory.hostvars.get(host, {}), **extra})[1]:
            refused.setdefault(problem, []).append(host)
    return [f"{_hosts_text(names)}: {problem}" for problem, names in refused.items()]


@dataclass
class CheckedInputs:
    inventory: Inventory | None
    hosts: list[str]
    problems: list[str]


def limit_problem(inventory_path: Path, limit: str) -> str:
    """Why a limit that matches no host of the inventory is refused, and what to do."""
    return (
        f"the limit {limit!r} matches no host of {inventory_path}: name a host or group it has "
        f"(`ansible-inventory -i {inventory_path} --graph` lists them)"
    )


def check_inputs(
    inventory_path: Path,
    env: dict[str, str],
    playbook: Path,
    limit: str | None = None,
    extra: ExtraVars | None = None,
    cache_dir: Path | None = None,
) -> CheckedInputs:
    """Everything wrong with the inventory, the limit and the variables, found without a connection
    (`cache_dir`: where load_inventory may keep its listings)."""
    extra = extra or ExtraVars()
    given = extra.for_validation()
    problems = list(extra.problems)
    try:
        inventory = load_inventory(inventory_path, env, limit=limit, playbook_dir=playbook.parent, cache_dir=cache_dir)
    except InventoryError as error:
        inventory = None
        problems.append(str(error))
    hosts = inventory.hosts if inventory else []
    if inventory and not hosts:
        problems.append(limit_problem(inventory_path, limit) if limit else f"{inventory_path} has no hosts")
    patterns = play_patterns(playbook)
    if inventory and hosts and patterns is not None:
        hosts = sorted(set(hosts) & targeted(patterns, inventory))
        if not hosts:
            problems.append(
                f"no host of {inventory_path}{f' (limited to {limit!r})' if limit else ''} is in "
                f"{', '.join(patterns)}, which {playbook.name} runs on: put the hosts in that group"
            )
    verdicts_file = cache_dir / VERDICTS_FILE if cache_dir is not None else None
    kept = _read_verdicts(verdicts_file)
    verdicts: dict[str, str | None] = {}
    inventory_or_none = inventory or Inventory(inventory_path, [], {}, {})
    specs = role_variable_specs(cache_dir=cache_dir)
    problems += validate_variables(inventory_or_none, hosts, given, specs, verdicts=verdicts, known=kept)
    problems += shared_setting_problems(inventory_or_none, hosts, given)
    if verdicts_file is not None and verdicts != kept:
        # This run's verdicts only, so the file never outgrows one inventory's values.
        _write_private_json(verdicts_file, verdicts)
    return CheckedInputs(inventory, hosts, problems)


# The validator's verdicts of the last run, by verdict_key (so a changed value or spec is checked anew).
VERDICTS_FILE = "verdicts.json"


def _read_verdicts(path: Path | None) -> dict[str, str | None]:
    if path is None:
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
