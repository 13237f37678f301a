"""docs/cli.md keeps the command's word (no containers): its exit code table is python/p40fleet/exit_codes.py's,
every subcommand gives those codes for a usage error and for Ctrl-C, and its synopsis and sections name every
option argparse gives each subcommand (read from the parser, not from --help's text)."""

from __future__ import annotations

import argparse
import io
import re
import signal
import threading
from pathlib import Path

import pytest
from rich.console import Console

from p40fleet import api, cli, exit_codes, report
from p40fleet.exit_codes import Exit
from p40fleet.run import RunResult
from p40fleet_dev.paths import REPO_ROOT
from tests.local_hosts import local_inventory

DOCS = REPO_ROOT / "docs"
CLI_MD = (REPO_ROOT / "docs/cli.md").read_text(encoding="utf-8")
NOWHERE = Path("/nonexistent/artifacts/r1")
OPTION = re.compile(r"(?<![\w-])(--?[a-z][\w-]*)")


def subcommands(parser: argparse.ArgumentParser, path=()) -> dict[tuple[str, ...], argparse.ArgumentParser]:
    """Every runnable subcommand's parser, by its words (train start, cluster status)."""
    found = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found.update(subcommands(sub, (*path, name)))
    return found or {path: parser}


COMMANDS = subcommands(cli.parser())


def options(parser: argparse.ArgumentParser) -> list[list[str]]:
    """Each option's strings (-i, --inventory), help left out."""
    return [a.option_strings for a in parser._actions if a.option_strings and a.dest != "help"]


def table() -> dict[int, str]:
    section = CLI_MD.split("## Exit codes", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| (\d+) \| ([^|]+?) \|", section, re.MULTILINE)
    return {int(code): meaning for code, meaning in rows}


def test_the_table_is_the_codes_the_command_defines():
    assert table() == {int(code): meaning for code, meaning in exit_codes.MEANING.items()}
    assert set(exit_codes.MEANING) == set(Exit)
    assert (cli.EXIT_OK, cli.EXIT_ERROR, cli.EXIT_HOSTS_FAILED, cli.EXIT_BAD_INPUT) == (0, 1, 2, 4)


@pytest.mark.parametrize("words", sorted(COMMANDS), ids=" ".join)
def test_a_usage_error_exits_with_the_documented_code(words, capsys):
    for argv in ([*words, "--no-such-option"], [*words, "-i"]):
        with pytest.raises(SystemExit) as raised:
            cli.main(argv)
        assert raised.value.code == Exit.ERROR and table()[raised.value.code] == "p40fleet could not run"
        assert "usage: p40fleet" in capsys.readouterr().err
    with pytest.raises(SystemExit) as raised:
        cli.main([*words, "--help"])
    assert raised.value.code == Exit.OK


@pytest.mark.parametrize("argv", [[], ["train"], ["cluster"], ["bundle"], ["no-such-command"]], ids=str)
def test_a_missing_subcommand_or_argument_is_a_usage_error(argv, capsys):
    with pytest.raises(SystemExit) as raised:
        cli.main(argv)
    assert raised.value.code == Exit.ERROR


# What each subcommand calls to do its work: Ctrl-C during it ends the command with the documented code.
WORKERS = {
    "run": ("p40fleet.cli.provision",),
    "qualify": ("p40fleet.cli.provision",),
    "report": ("p40fleet.cli.refresh_state",),
    "cluster": ("p40fleet.cluster.cluster_status",),
    "train": ("p40fleet.train.train",),
    "fetch": ("p40fleet.fetch.fill_controller_cache",),
    "bundle": ("p40fleet.bundle.make_bundle",),
}


@pytest.mark.parametrize("words", sorted(COMMANDS), ids=" ".join)
def test_ctrl_c_exits_with_the_documented_code(words, tmp_path, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    for target in WORKERS[words[0]]:
        monkeypatch.setattr(target, interrupted)
    inventory = local_inventory(tmp_path)
    argv = [*words, *(["DIR"] if words == ("bundle",) else []), "-i", str(inventory)]
    argv += ["--refresh"] if words == ("report",) else []
    argv += (
        ["--state-dir", str(tmp_path / "state")] if any("--state-dir" in o for o in options(COMMANDS[words])) else []
    )
    code = cli.main(argv)
    assert code == Exit.INTERRUPTED and table()[code] == "interrupted"


def test_ctrl_c_during_a_playbook_ends_the_run_with_the_documented_code(tmp_path, capsys):
    playbook = tmp_path / "slow.yml"
    playbook.write_text(
        "- hosts: all\n  gather_facts: false\n  tasks:\n"
        "    - ansible.builtin.command: sleep 120\n      changed_when: false\n"
    )
    started = threading.Event()
    original = signal.getsignal(signal.SIGINT)

    def on_event(event):
        if event.get("event") == "runner_on_start" and not started.is_set():
            started.set()
            threading.Timer(1, signal.raise_signal, (signal.SIGINT,)).start()

    result = api.provision(
        local_inventory(tmp_path), playbook=playbook, state_dir=tmp_path / "state", progress=on_event
    )
    assert (result.exit_code, result.status, result.run.signal) == (Exit.INTERRUPTED, "canceled", signal.SIGINT)
    # The run's own handlers are gone: Ctrl-C after it is Python's again.
    assert signal.getsignal(signal.SIGINT) is original
    out = io.StringIO()
    report.print_summary(Console(file=out, width=200), report.build_report([("run", result)]))
    assert out.getvalue().startswith("p40fleet · run · exit 130: interrupted (canceled, ansible-playbook rc ")


def test_an_unreachable_host_exits_3_and_the_header_says_so():
    stats = {
        "node3": {"ok": 1, "changed": 0, "failures": 0, "unreachable": 1, "skipped": 0, "rescued": 0, "ignored": 0}
    }
    run = RunResult(rc=4, status="failed", stats=stats, failures=[], stdout="", artifact_dir=NOWHERE, run_id="r1")
    result = api._result_of(run, inventory=NOWHERE, playbook=NOWHERE)
    out = io.StringIO()
    report.print_summary(Console(file=out, width=200), report.build_report([("run", result)]))
    assert result.exit_code == Exit.HOSTS_UNREACHABLE
    assert (
        out.getvalue().splitlines()[0] == "p40fleet · run · exit 3: hosts unreachable (failed, ansible-playbook rc 4)"
    )


def synopsis() -> dict[tuple[str, ...], str]:
    """docs/cli.md's synopsis, by subcommand: `train start|stop|status` stands for three."""
    block = CLI_MD.split("```sh\n", 1)[1].split("```", 1)[0]
    entries: dict[tuple[str, ...], str] = {}
    words: list[tuple[str, ...]] = []
    for line in block.splitlines():
        if line.startswith("p40fleet "):
            head = []
            for token in line.split()[1:]:
                if token.startswith(("[", "-")) or token.isupper():
                    break
                head.append(token.split("|"))
            words = [(head[0][0], *([w] if len(head) > 1 else [])) for w in (head[1] if len(head) > 1 else [None])]
            words = [tuple(w for w in ws if w) for ws in words]
        for w in words:
            entries[w] = entries.get(w, "") + " " + line
    return entries


def described(words: tuple[str, ...]) -> str:
    """The docs' text about a subcommand: its section (## `train`, ## `cluster status`) and the shared options."""
    text = ""
    for page in DOCS.glob("cli*.md"):
        for section in re.split(r"^## ", page.read_text(encoding="utf-8"), flags=re.MULTILINE)[1:]:
            heading = section.split("\n", 1)[0]
            if heading.startswith((f"`{' '.join(words)}`", f"`{words[0]}`")) or heading.startswith(
                "Options every command shares"
            ):
                text += section
            elif "`" + words[0] + "`" in heading and " and " in heading:
                text += section  # ## `fetch` and `bundle`
    return text


def test_the_synopsis_names_every_option_and_no_other():
    docs = synopsis()
    assert set(docs) == set(COMMANDS)
    for words, parser in COMMANDS.items():
        given = set(OPTION.findall(docs[words]))
        argparse_options = options(parser)
        for strings in argparse_options:
            assert given & set(strings), f"docs/cli.md's synopsis of {' '.join(words)} lacks {strings}"
        known = {s for strings in argparse_options for s in strings}
        assert given <= known, f"docs/cli.md's synopsis of {' '.join(words)} names {given - known}, which it lacks"


@pytest.mark.parametrize("words", sorted(COMMANDS), ids=" ".join)
def test_every_option_is_described_and_has_help(words):
    text = described(words)
    assert text, f"no section of docs/cli*.md for {' '.join(words)}"
    for action in COMMANDS[words]._actions:
        if not action.option_strings or action.dest == "help":
            continue
        assert action.help, f"{' '.join(words)} {action.option_strings} has no help text"
        assert any(
            f"`{s}`" in text or f"`{s} " in text or f"`{s}/" in text or f"/`{s}`" in text for s in action.option_strings
        ), f"docs/cli*.md does not describe {' '.join(words)}'s {'/'.join(action.option_strings)}"
