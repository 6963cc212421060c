"""What a test needs from the machine, and the one rule for when the machine lacks it.

On a developer's machine a test that needs a tool which is not installed (the monitoring binaries, the browser,
DeepSpeed, Edge-LLM's exporter, root for a tmpfs or Linux users) is skipped, naming the tool and how to get it.
Where EDGEFLOW_REQUIRE_ALL is set (.ci/run sets it) the same test fails instead: a CI run is green only when every
test that can run on its machine ran. tests/conftest.py enforces it for every skip, however it was raised
(pytest.skip, importorskip, a skipif marker): under EDGEFLOW_REQUIRE_ALL a skip is a failure unless it is a
hardware skip, one that only another kind of machine lifts (a CUDA GPU, a Jetson, a CPU without AVX2), raised with
`skip_for_hardware` or from a test marked `gpu`.
"""
from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path
from typing import NoReturn

import pytest

REQUIRE_ENV = "EDGEFLOW_REQUIRE_ALL"
# the prefix of a skip reason that CI accepts: the machine is the wrong kind, not missing a tool
HARDWARE = "hardware: "


def strict() -> bool:
    """True where a missing tool fails the test (EDGEFLOW_REQUIRE_ALL set to anything but '' or '0')."""
    return os.environ.get(REQUIRE_ENV, "") not in ("", "0")


def lacking(what: str, fix: str, *, module: bool = False) -> NoReturn:
    """This test (with `module`: this whole test file) cannot run: `what` is missing here. Skipped, or a failure
    under EDGEFLOW_REQUIRE_ALL."""
    message = f"{what} ({fix})"
    if strict():
        pytest.fail(f"{message}; {REQUIRE_ENV} is set, so a missing tool is a failure, not a skip", pytrace=False)
    pytest.skip(message, allow_module_level=module)


def check_or_warn(ok: bool, what: str, fix: str) -> bool:
    """For a part of a longer test: True when `ok`. Otherwise a failure under EDGEFLOW_REQUIRE_ALL, and elsewhere a
    warning in pytest's summary and False (the caller leaves that part out and the rest of the test still runs)."""
    if ok:
        return True
    message = f"{what} ({fix})"
    if strict():
        pytest.fail(f"{message}; {REQUIRE_ENV} is set, so a missing tool is a failure, not a part left out")
    warnings.warn(f"left out of this test: {message}", pytest.PytestWarning, stacklevel=2)
    return False


def skip_for_hardware(reason: str, *, module: bool = False) -> NoReturn:
    """Skip because this machine is the wrong kind (no GPU, not a Jetson, no AVX2): allowed everywhere, CI included."""
    pytest.skip(HARDWARE + reason, allow_module_level=module)


def is_hardware_skip(reason: str) -> bool:
    return reason.startswith(HARDWARE)


def require_binary(name: str, fix: str) -> str:
    """The path of executable `name` (a name on PATH or an absolute path); `lacking` when there is none."""
    found = shutil.which(name) if os.sep not in name else (name if os.access(name, os.X_OK) else None)
    if found is None:
        lacking(f"{name} is not installed", fix)
    return found


MONITORING_FIX = ("Debian's prometheus, prometheus-alertmanager and prometheus-blackbox-exporter packages; "
                  ".ci/run installs them")


def require_monitoring() -> None:
    """Prometheus, promtool, Alertmanager, amtool and the blackbox exporter (edgeflow.ops.monitoring runs them)."""
    from edgeflow.ops import monitoring

    if missing := monitoring.missing_binaries():
        lacking(f"the monitoring stack lacks {', '.join(missing)}", MONITORING_FIX)


def require_browser() -> Path:
    """Debian's chromium, which the UI tests drive through Playwright."""
    from tests.helpers.browser import CHROMIUM

    if not CHROMIUM.exists():
        lacking(f"{CHROMIUM} not found", "apt-get install chromium, or set EDGEFLOW_CHROMIUM; .ci/run installs it")
    return CHROMIUM


def require_root(why: str) -> None:
    """The test does what only root may (`why`: mount a tmpfs, create Linux users)."""
    if os.geteuid() != 0:
        lacking(f"{why} needs root", "run the tests as root, as .ci/run does")


def require_cpu_native(*, module: bool = False) -> None:
    """What cpu_native's kernels need, as its own checks say (edgeflow/engines/cpu_native/kernels.py): an
    AVX2/FMA/F16C CPU (hardware) and a C compiler (a tool)."""
    from edgeflow.engines import EngineIncompatibleError
    from edgeflow.engines.cpu_native.kernels import _compiler, _require_isa

    try:
        _require_isa()
    except EngineIncompatibleError as e:
        skip_for_hardware(str(e), module=module)
    try:
        _compiler()
    except EngineIncompatibleError as e:
        lacking(str(e), "apt-get install gcc", module=module)


# The plugin half (tests/conftest.py loads this module as a pytest plugin): every skip passes through here, however it
# was raised (pytest.skip, importorskip, a skipif marker, a module-level skip).
def _require_all(report, gpu_test: bool) -> None:
    if not (report.skipped and strict()) or hasattr(report, "wasxfail") or gpu_test:
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    if is_hardware_skip(reason.removeprefix("Skipped: ")):
        return
    report.outcome = "failed"
    report.longrepr = (f"{reason}\n{REQUIRE_ENV} is set: a skip for anything but the kind of machine fails the run "
                       "(tests/helpers/require.py); install what the reason names")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    _require_all(outcome.get_result(), item.get_closest_marker("gpu") is not None)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    _require_all(outcome.get_result(), False)
