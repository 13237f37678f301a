"""Bad input is found before any host is touched: the inventory is parsed by ansible-inventory (the
same configuration ansible-playbook will use), and every literal value the inventory or `-e` gives a
role variable is checked against that role's meta/argument_specs.yml with Ansible's own validator,
which converts as the role's own check would ("false" is a bool, "5" an int)."""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from p40fleet.paths import SITE_PLAYBOOK

ROLES_DIR = SITE_PLAYBOOK.parent / "roles"
SIMPLE_PATTERN = re.compile(r"^[A-Za-z0-9_.-]+$")
SHOWN_HOSTS = 5


class Opaque:
    """A value p40fleet cannot read before the run (vaulted, unsafe): never validated here."""

    def __init__(self, tag: str) -> None:
        self.tag = tag

    def __repr__(self) -> str:
        return f"<{self.tag}>"


class _TolerantLoader(yaml.SafeLoader):
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
    from ansible.parsing.splitter import parse_kv  # ansible's own key=value parser (quotes, escapes)

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
    inventory: Path, env: dict[str, str], limit: str | None = None, playbook_dir: Path | None = None
) -> Inventory:
    """The inventory as ansible-playbook will see it (group_vars merged), limited; raises
    InventoryError with ansible's own message when it cannot be parsed."""
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
    }
    result = subprocess.run(argv, env=run_env, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise InventoryError(_inventory_message(inventory, result.stderr or result.stdout))
    data = json.loads(result.stdout)
    hostvars = data.get("_meta", {}).get("hostvars", {})
    groups = {name: spec for name, spec in data.items() if name != "_meta"}
    hosts: set[str] = set(hostvars)
    for spec in groups.values():
        hosts.update(spec.get("hosts", []))
    for host in hosts:
        hostvars.setdefault(host, {})
    return Inventory(path=inventory, hosts=sorted(hosts), groups=groups, hostvars=hostvars)


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
        patterns = play["hosts"]
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


def role_variable_specs(roles_dir: Path = ROLES_DIR) -> dict[str, tuple[str, dict]]:
    """Every role variable's argument spec: name -> (role, spec of its `main` entry point)."""
    specs: dict[str, tuple[str, dict]] = {}
    for path in sorted(roles_dir.glob("*/meta/argument_specs.yml")):
        role = path.parent.parent.name
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        options = ((data.get("argument_specs") or {}).get("main") or {}).get("options") or {}
        for name, spec in options.items():
            specs[name] = (role, spec)
    return specs


def expected(spec: dict) -> str:
    kind = spec.get("type", "str")
    text = {"bool": "a bool (true/false)", "int": "an int", "float": "a number", "dict": "a mapping"}.get(
        kind, f"a {kind}"
    )
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


def check_value(name: str, value, spec: dict) -> str | None:
    """The validator's complaint about one variable's value, or None if the spec accepts it."""
    from ansible.module_utils.common.arg_spec import ArgumentSpecValidator

    # The role's defaults fill what is not set, so top level only the value is checked; inside
    # a value (list elements, dict options) `required` holds.
    top = {k: v for k, v in spec.items() if k not in ("required", "default")}
    result = ArgumentSpecValidator({name: top}).validate({name: value})
    return "; ".join(result.error_messages) if result.error_messages else None


def _shown(value) -> str:
    text = json.dumps(value, default=repr) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 200 else text[:200] + "..."


def _hosts_text(hosts: Sequence[str]) -> str:
    if len(hosts) == 1:
        return f"host {hosts[0]}"
    shown = ", ".join(hosts[:SHOWN_HOSTS])
    return f"hosts {shown}" + (f" and {len(hosts) - SHOWN_HOSTS} more" if len(hosts) > SHOWN_HOSTS else "")


def validate_variables(
    inventory: Inventory,
    hosts: Iterable[str],
    extra: Mapping,
    specs: Mapping[str, tuple[str, dict]] | None = None,
) -> list[str]:
    """One message per bad value: the host(s), the variable, what was found and what is expected."""
    specs = specs if specs is not None else role_variable_specs()
    problems: list[str] = []
    for name, value in extra.items():
        if name in specs and _is_literal(value):
            role, spec = specs[name]
            complaint = check_value(name, value, spec)
            if complaint:
                problems.append(
                    f"-e {name}: found {_shown(value)}; expected {expected(spec)} "
                    f"(roles/{role}/meta/argument_specs.yml): {complaint}"
                )
    # Hosts that share a bad value (a group variable) get one message.
    bad: dict[tuple[str, str], list[str]] = {}
    for host in sorted(hosts):
        for name, value in inventory.hostvars.get(host, {}).items():
            if name in extra or name not in specs or not _is_literal(value):
                continue
            role, spec = specs[name]
            complaint = check_value(name, value, spec)
            if complaint:
                key = (
                    name,
                    f"found {_shown(value)}; expected {expected(spec)} "
                    f"(roles/{role}/meta/argument_specs.yml): {complaint}",
                )
                bad.setdefault(key, []).append(host)
    for (name, detail), names in bad.items():
        problems.append(f"{_hosts_text(names)}: {name} in the inventory: {detail}")
    return problems


@dataclass
class CheckedInputs:
    inventory: Inventory | None
    hosts: list[str]
    problems: list[str]


def check_inputs(
    inventory_path: Path,
    env: dict[str, str],
    playbook: Path,
    limit: str | None = None,
    extra: ExtraVars | None = None,
) -> CheckedInputs:
    """Everything wrong with the inventory, the limit and the variables, found without a connection."""
    extra = extra or ExtraVars()
    given = extra.for_validation()
    problems = list(extra.problems)
    try:
        inventory = load_inventory(inventory_path, env, limit=limit, playbook_dir=playbook.parent)
    except InventoryError as error:
        inventory = None
        problems.append(str(error))
    hosts = inventory.hosts if inventory else []
    if inventory and not hosts:
        problems.append(
            f"the limit {limit!r} matches no host of {inventory_path}" if limit else f"{inventory_path} has no hosts"
        )
    patterns = play_patterns(playbook)
    if inventory and hosts and patterns is not None:
        hosts = sorted(set(hosts) & targeted(patterns, inventory))
        if not hosts:
            problems.append(
                f"no host of {inventory_path}{f' (limited to {limit!r})' if limit else ''} is in "
                f"{', '.join(patterns)}, which {playbook.name} runs on: put the hosts in that group"
            )
    problems += validate_variables(inventory or Inventory(inventory_path, [], {}, {}), hosts, given)
    return CheckedInputs(inventory, hosts, problems)
