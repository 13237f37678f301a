"""Case 9: variables a user got wrong are rejected when the role starts, before it changes the host, or read
the way the user meant them.

On sandbox hosts, through site.yml (host_vars as an inventory mistake would put them, -e as a command line
would): a string where a number belongs, a GPU model the host does not have, a profile with a misspelt dtype
and a profile name where its dict belongs, an unknown post-install check, checksums that are not 64 hex
digits, and the strings "false" and "2" from the command line. Without hosts: every boolean variable the
roles declare is read through `| bool` (a string "false" is truthy, and ansible-core 2.19 refuses a string
as a condition), which is what makes -e's strings safe.
p40fleet's own check of an inventory before any host is touched (exit code 4) is the p40fleet command's.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from tests.faults.tools import written_since

from p40fleet_dev.paths import REPO_ROOT

pytestmark = pytest.mark.fault_case(9)

CONDITION_KEYS = {"when", "that", "failed_when", "changed_when", "until"}
JINJA = re.compile(r"\{\{(.*?)\}\}|\{%(.*?)%\}", re.DOTALL)
MARKER = "/tmp/p40fleet-faults-case9"


def boolean_variables() -> set[str]:
    found = set()
    for spec in REPO_ROOT.glob("roles/*/meta/argument_specs.yml"):
        options = yaml.safe_load(spec.read_text())["argument_specs"]["main"]["options"]
        found |= {name for name, option in options.items() if option.get("type") == "bool"}
    return found


def expressions(node, key: str | None = None):
    """The Jinja expressions of a parsed YAML document: whole conditions, and {{ }} / {% %} inside strings."""
    if isinstance(node, dict):
        for child_key, value in node.items():
            yield from expressions(value, child_key)
    elif isinstance(node, list):
        for value in node:
            yield from expressions(value, key)
    elif isinstance(node, str):
        if key in CONDITION_KEYS and "{{" not in node:
            yield node
        for match in JINJA.finditer(node):
            yield match.group(1) or match.group(2)


def wiring_files() -> list[Path]:
    roles = REPO_ROOT / "roles"
    files = [*roles.glob("*/tasks/*.yml"), *roles.glob("*/vars/**/*.yml"), *roles.glob("*/defaults/*.yml")]
    files += [*roles.glob("*/handlers/*.yml"), *REPO_ROOT.glob("playbooks/*.yml"), REPO_ROOT / "site.yml"]
    return sorted(files)


def raw_boolean_uses(sources, booleans: set[str]) -> tuple[int, list[str]]:
    """(how many uses of the booleans the expressions hold, those not read through `| bool`)."""
    uses, raw = 0, []
    for where, found in sources:
        for expression in found:
            for name in booleans:
                for match in re.finditer(rf"(?<![\w.'\"]){name}\b(?![\w'\"])", expression):
                    uses += 1
                    rest = expression[match.end() :]
                    if not re.match(r"\s*(\|\s*default\([^()]*\)\s*)?\|\s*bool\b", rest):
                        raw.append(f"{where}: {name}{rest[:40]!r}")
    return uses, raw


def test_every_boolean_variable_is_read_through_the_bool_filter():
    booleans = boolean_variables()
    assert {"gpu_preflight_strict", "apex_enabled", "cudnn_ldconfig"} <= booleans  # the scan sees the specs
    sources = [(p.relative_to(REPO_ROOT), expressions(yaml.safe_load(p.read_text()))) for p in wiring_files()]
    for template in sorted((REPO_ROOT / "roles").glob("*/templates/*.j2")):
        found = [m.group(1) or m.group(2) for m in JINJA.finditer(template.read_text())]
        sources.append((template.relative_to(REPO_ROOT), found))
    uses, raw = raw_boolean_uses(sources, booleans)
    assert uses > 20  # the scan reads the roles' conditions, not nothing
    assert raw == []


def test_the_scan_catches_a_boolean_read_raw():
    tasks = [
        {"name": "raw", "when": "apex_enabled"},
        {"name": "filtered", "when": "apex_enabled | default(true) | bool"},
        {"name": "inside", "ansible.builtin.debug": {"msg": "{{ 'x' if cudnn_ldconfig else 'y' }}"}},
    ]
    uses, raw = raw_boolean_uses([("tasks", expressions(tasks))], {"apex_enabled", "cudnn_ldconfig"})
    assert uses == 3
    assert raw == ["tasks: apex_enabled''", "tasks: cudnn_ldconfig\" else 'y' \""]


# -- on sandbox hosts, through site.yml --------------------------------------------------------------------

PREFLIGHT_DEFAULTS = yaml.safe_load((REPO_ROOT / "roles/gpu_preflight/defaults/main.yml").read_text())
MISSPELT = [dict(p, dtype="bf16") if p["name"] == "pascal" else p for p in PREFLIGHT_DEFAULTS["gpu_preflight_profiles"]]
# host -> (its inventory mistake, what the run says about it)
AT_PREFLIGHT = {
    "node8": (
        {"gpu_preflight_min_ram_gib": "lots"},
        "Validation of arguments failed:\nargument 'gpu_preflight_min_ram_gib' is of type str and we were unable"
        " to convert to int: \"'lots'\" cannot be converted to an int",
    ),
    "node9": (
        {"gpu_preflight_gpu_select": "Tesla K80"},
        'gpu_preflight refused node9 (nothing was changed on it):\n- gpu_preflight_gpu_select is "Tesla K80" but'
        " the host has 0: Tesla P40; required: the exact name of one of its GPUs; do: set gpu_preflight_gpu_select"
        ' to one of "Tesla P40"',
    ),
    "node10": (
        {"gpu_preflight_profiles": MISSPELT},
        "Validation of arguments failed:\nvalue of dtype must be one of: float32, float16, bfloat16, got: bf16 found"
        " in gpu_preflight_profiles",
    ),
}
LATER = "node11"


@pytest.fixture(scope="module")
def later(fleet) -> str:
    """node11 past preflight once (which saves its state there): the stages after it are what the cases watch."""
    accepted = fleet.play(LATER, stages=("gpu_preflight",))
    assert accepted.rc == 0, [f.message for f in accepted.failures]
    return LATER


@pytest.fixture
def mistakes(fleet):
    """Puts host_vars mistakes in the inventory for one test and takes them out again."""
    added: dict[str, list[str]] = {}

    def put(host: str, values: dict) -> None:
        fleet.host_vars(host, **values)
        added.setdefault(host, []).extend(values)

    yield put
    for host, names in added.items():
        fleet.host_vars(host, **dict.fromkeys(names))


def only_failure(result, host: str) -> str:
    failures = result.host_failures(host)
    assert len(failures) == 1, [f.message for f in result.failures]
    return failures[0].message


@pytest.mark.sandbox
def test_a_wrong_type_an_absent_gpu_model_and_a_misspelt_profile_stop_the_host_at_preflight(fleet, mistakes):
    for host, (values, _) in AT_PREFLIGHT.items():
        mistakes(host, values)
        fleet.sh(host, f"rm -rf /etc/ansible && touch {MARKER}")
    result = fleet.play(",".join(AT_PREFLIGHT), upto="host_prereqs")
    for host, (_, message) in AT_PREFLIGHT.items():
        assert only_failure(result, host) == message
        assert {f.role for f in result.host_failures(host)} == {"gpu_preflight"}
        assert written_since(fleet.sandbox, host, MARKER) == []


# stage -> (-e values, the message, word for word); each on node11, which has nothing of that stage yet.
SHORT_SUM = "62a04e0352da19e09367ef1793c8b6d97896241260a8e102e61bb16a39a830c"  # one digit short
AT_STAGE_START = {
    "conda_env": (
        {"conda_env_installer_sha256": SHORT_SUM},
        f"{LATER}: conda_env is misconfigured: installer sha256 '{SHORT_SUM}', Python '3.11', prefix"
        " '/opt/miniconda3', channels ['conda-forge'], owner 'p40fleet' (login user 'ops'). Required: the real"
        " 64-hex sha256 of Miniconda3-standin-Linux-x86_64.sh (from Anaconda's hash table, set in the inventory"
        ' pins), a Python like "3.10", an absolute prefix, no Anaconda `defaults` channel unless'
        " conda_env_tos_accepted is true (its Terms of Service would prompt), and an env owner that is a plain"
        " account name, neither root nor the account Ansible logs in as (root trusts the login account; the env"
        " owner runs other people's code).",
    ),
    "verl": (
        {"verl_post_install_checks": ["editable", "imports"]},
        "Validation of arguments failed:\nvalue of verl_post_install_checks must be one or more of: editable,"
        " compile, hydra_compose, flash_attn_shim, pip_check, import, cfg_job. Got no match for: imports",
    ),
    "verl_patches": (
        {"verl_patches_profile": "pascal"},
        "Validation of arguments failed:\nargument 'verl_patches_profile' is of type str and we were unable to"
        " convert to dict: dictionary requested, could not parse JSON or key=value",
    ),
}


@pytest.mark.sandbox
@pytest.mark.parametrize("stage", sorted(AT_STAGE_START))
def test_a_bad_value_is_rejected_when_its_stage_starts_before_the_host_changes(fleet, later, stage):
    values, message = AT_STAGE_START[stage]
    fleet.sh(LATER, f"touch {MARKER}")
    result = fleet.play(LATER, stages=(stage,), extra_vars=values)
    assert only_failure(result, LATER) == message
    assert result.host_failures(LATER)[0].role == stage
    assert written_since(fleet.sandbox, LATER, MARKER) == []


@pytest.mark.sandbox
def test_a_checksum_prefixed_with_its_algorithm_is_rejected_before_the_download(fleet, later):
    pin = yaml.safe_load((fleet.inventory / "group_vars/p40_sandbox.yml").read_text())["cuda_toolkit_runfile_sha256"]
    fleet.sh(LATER, f"touch {MARKER}")
    result = fleet.play(LATER, stages=("cuda_toolkit",), extra_vars={"cuda_toolkit_runfile_sha256": f"sha256:{pin}"})
    message = only_failure(result, LATER)
    assert message.startswith(f"{LATER}: artifact 'cuda_runfile' is badly specified (url='http://"), message
    assert message.endswith(
        f"sha256='sha256:{pin}', dest='/var/tmp/p40fleet/cuda_toolkit.p40fleet/cuda_11.8.0_520.61.05_linux.run',"
        " source='controller', mirror base=''). Required: an http(s) URL, a 64-hex-digit sha256, an absolute dest,"
        " and p40fleet_mirror_base_url when artifact_fetch_source is mirror. Fix the pins or the inventory."
    ), message
    assert written_since(fleet.sandbox, LATER, MARKER) == []


@pytest.mark.sandbox
def test_strings_from_the_command_line_are_read_as_the_user_meant(fleet, later):
    # "false" for a boolean: node6's temp dir is too small, a soft finding strict=false lets through.
    lenient = fleet.play("node6", stages=("gpu_preflight",), extra_vars={"gpu_preflight_strict": "false"})
    assert lenient.rc == 0, [f.message for f in lenient.failures]
    assert "WARNING node6: too little disk: /srv/small/p40fleet (CUDA runfile extraction" in lenient.stdout
    fleet.sh("node6", "rm -rf /etc/ansible")  # case 6 wants it as preflight never accepted it
    # "2" and "30" for numbers: the download's retries and timeout, used in arithmetic and by get_url (the
    # Miniconda installer's download; of the stages before conda_env, the sandbox's stand-in conda needs the
    # prerequisites' packages: its envs are venvs).
    numbers = fleet.play(
        LATER,
        stages=("host_prereqs", "conda_env"),
        extra_vars={"artifact_fetch_retries": "2", "artifact_fetch_timeout": "30"},
    )
    assert numbers.rc == 0, [f.message for f in numbers.failures]
    assert fleet.exists(LATER, "/opt/miniconda3/envs/verl-env/bin/python")
