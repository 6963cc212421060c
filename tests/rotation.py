"""The `extended` tests in CI, a third at a time: each CI run takes one share, so each test runs at least every third run.

`make test` leaves out the tests marked `extended` (docs/development/tests.md says why each one). With
EDGEFLOW_EXTENDED_SHARE=k set, tests/conftest.py marks share k's tests `rotated`, and `make test` keeps them
(`-m "not extended or rotated"`). .ci/run picks k: its run counter modulo SHARES (ci_share below). `make test-all`
runs every share, always.

A test that builds on an earlier one in its file sits in that test's share (the promotion test reads the retried
release's deployment). tests/scripts/test_rotation.py holds this table to the tests that carry the marker.
"""
from __future__ import annotations

import os
from pathlib import Path

SHARES = 3
ENV = "EDGEFLOW_EXTENDED_SHARE"

# share -> the extended tests it runs (file::name), of about equal cost: on the AVX2-only EPYC each share added 280-460
# test-seconds, over 1-2 of the two end-to-end files, and `.ci/run` stayed near 37 minutes (BENCHMARKS.md#ci-bytecode).
ROTATION: dict[int, tuple[str, ...]] = {
    0: (
        "tests/pipeline/test_release_e2e.py::test_retry_in_the_prefect_ui_resumes_a_failed_release_without_recomputing",
        "tests/pipeline/test_release_e2e.py::test_promotion_is_checked_and_rollback_serves_the_previous_version",
        "tests/pipeline/test_multihost.py::test_a_rollout_killed_in_its_second_wave_resumes_there_on_retry_and_the_canary_is_not_redeployed",
    ),
    1: (
        "tests/pipeline/test_release_e2e.py::test_gate_nobody_can_pass_keeps_aliases_recalibrates_and_reports",
        "tests/pipeline/test_release_e2e.py::test_calibration_overlapping_the_eval_set_fails_before_quantization",
        "tests/pipeline/test_multihost.py::test_a_worker_with_other_code_refuses_the_stage_naming_both_versions",
    ),
    2: (
        "tests/pipeline/test_release_e2e.py::test_an_unchanged_rerun_is_cached_and_an_edited_recipe_recomputes_exactly_what_reads_it",
        "tests/pipeline/test_release_e2e.py::test_a_release_on_the_llama_cpp_engine_builds_gates_and_registers_gguf_variants",
        "tests/pipeline/test_multihost.py::test_both_devices_ship_their_logs_and_the_nightly_counts_each_devices_lines",
        "tests/pipeline/test_multihost.py::test_a_candidate_that_degrades_on_the_device_stops_at_the_canary_and_rolls_back",
    ),
}


def share_from_env() -> int | None:
    """EDGEFLOW_EXTENDED_SHARE as a share number, None when unset; a value out of range is refused, naming it."""
    raw = os.environ.get(ENV, "").strip()
    if not raw:
        return None
    if not raw.isdigit() or int(raw) not in ROTATION:
        raise ValueError(f"{ENV}={raw!r}: give a share number from 0 to {SHARES - 1} (tests/rotation.py), or unset it")
    return int(raw)


def rotated(share: int | None) -> frozenset[str]:
    """The test ids (file::name, no parameters) share `share` runs; none without a share."""
    return frozenset(ROTATION.get(share, ()))


def ci_share(counter: Path) -> int:
    """The share of this CI run: the run counter kept in `counter` (0 when absent or unreadable) modulo SHARES; the
    counter is advanced for the next run. One counter per machine, so successive runs there take 0, 1, 2, 0, …"""
    try:
        n = int(counter.read_text().strip())
    except (OSError, ValueError):
        n = 0
    counter.parent.mkdir(parents=True, exist_ok=True)
    counter.write_text(f"{n + 1}\n")
    return n % SHARES


if __name__ == "__main__":  # .ci/run: python tests/rotation.py COUNTER_FILE -> prints this run's share
    import sys

    print(ci_share(Path(sys.argv[1])))
