"""The fault suite's cases: what each asserts, which tests prove it, and what is still missing.

A test in this directory names its case with `@pytest.mark.fault_case(N)`. Tests elsewhere that already
prove part of a case are listed here by node id (`reused`): they run in their own files (in `make test`),
and the suite's table counts their results rather than running them twice. `make faults` runs the suite
and those node ids (`python cases.py --reused` prints them for the Makefile).

`pending` names a part of a case that belongs to a feature another branch builds; until that feature is
merged the table shows the case as waiting for it instead of passing.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

T = "python/tests/"


@dataclass(frozen=True)
class Case:
    number: int
    title: str
    reused: tuple[str, ...] = ()
    pending: str = ""


CASES = (
    Case(
        1,
        "controller SIGKILLed mid-CUDA install, mid conda env creation, mid Apex build, mid verl install: the next"
        " run converges, nothing half-installed counts as installed",
        reused=(T + "test_cuda_toolkit.py::test_failed_and_killed_installs_name_the_log_and_are_redone",),
    ),
    Case(
        2,
        "a tampered artifact, each one: the host fails naming the file and both sums, nothing installed from it,"
        " nothing kept under its final name",
        reused=(
            T + "test_artifact_fetch.py::test_tampered_artifact_fails_and_leaves_nothing_under_the_final_name",
            T + "test_cuda_toolkit.py::test_tampered_runfile_fails_the_checksum_and_installs_nothing",
            T + "test_cuda_toolkit.py::test_runfile_swapped_after_its_download_is_refused_before_root_runs_it",
            T + "test_cudnn.py::test_tampered_tarball_fails_the_checksum_and_installs_nothing",
        ),
    ),
    Case(
        3,
        "one of four hosts unreachable mid-run: the other three converge, summary and exit code name it,"
        " --retry-failed finishes it",
        reused=(T + "test_operations.py::test_summary_exit_codes_retry_failed_and_the_report",),
    ),
    Case(
        4,
        "driver too old, branch too new, NVML mismatch, no GPU: preflight stops that host with its message and"
        " changes nothing on it",
        # Its hosts for these four: node3 driver too old, node4 past R580, node5 NVML mismatch, node6 no GPU.
        reused=(
            *(
                T + f"test_gpu_preflight.py::test_refused_host_gets_one_exact_message_and_is_left_untouched[{host}]"
                for host in ("node3", "node4", "node5", "node6")
            ),
            T + "test_gpu_preflight.py::test_driver_change_is_reported_and_changes_only_the_saved_state",
        ),
    ),
    Case(
        5,
        "driver upgraded on a converged host: the re-run reports it, re-verifies that host's stack, changes"
        " nothing else",
        reused=(T + "test_converged_run.py::test_a_driver_change_reverifies_that_host_only",),
    ),
    Case(
        6,
        "disk too small for the runfile's temp dir on the configured path: fails in preflight, before any download",
    ),
    Case(
        7,
        "verl without a patch set, a verl file edited so an anchor moved: fails closed, the files stay as they were",
        reused=(
            T + "test_verl_patches.py::test_unknown_version_fails_closed_before_any_edit",
            T + "test_verl_patches.py::test_moved_anchor_fails_closed_naming_the_entries",
            T + "test_verl_patches.py::test_sandbox_host_converges_verifies_reverts_and_refuses_040",
        ),
    ),
    Case(
        8,
        "a patched verl file changed since the last run: refused naming the file and its three sums, nothing"
        " touched (also with verl_patches_state: absent)",
        reused=(
            T + "test_verl_patches_tool.py",
            T + "test_verl_patches.py::test_a_patched_file_edited_since_the_last_run_is_refused_not_overwritten",
            T + "test_verl_patches.py::test_new_files_under_the_same_version_are_refused_until_the_state_is_removed",
        ),
    ),
    Case(
        9,
        "invalid variables (wrong types, unknown GPU profile, malformed checksum, -e string 'false'): rejected at"
        " role start before the host is changed, or handled as meant",
        reused=(
            T + "test_inputs.py::test_bad_values_name_the_host_the_variable_what_was_found_and_what_is_expected",
            T + "test_inputs.py::test_the_command_exits_4_before_any_host_is_touched",
            T + "test_inputs.py::test_key_value_strings_become_the_type_the_role_variable_has",
        ),
    ),
    Case(
        10,
        "a Hugging Face token and a sudo password given for a run: in no log, runner artifact, report or process"
        " list, on the controller or the hosts",
        reused=(
            T + "test_login_modes.py::test_sudo_password_mode_converges_with_the_password_file_and_leaks_it_nowhere",
            T + "test_training_data.py::test_the_token_is_in_no_file_the_run_left",
            T + "test_launch_script.py::test_the_token_appears_in_no_artifact",
        ),
    ),
    Case(
        11,
        "a second p40fleet run against the same inventory while one runs: refused with a clear message",
        reused=(T + "test_lock.py::test_a_second_run_is_refused_while_one_runs_and_a_killed_run_blocks_nothing",),
    ),
    Case(
        12,
        "a host loses its disk space mid-install: the failure is named, the next run after space is freed converges",
    ),
)

BY_NUMBER = {case.number: case for case in CASES}


def reused_node_ids() -> list[str]:
    return [node for case in CASES for node in case.reused]


if __name__ == "__main__":
    if sys.argv[1:] != ["--reused"]:
        sys.exit("usage: cases.py --reused   (the node ids of the tests the suite reuses, one per line)")
    print("\n".join(reused_node_ids()))
