"""Fail points: named places in the device agent where a test cuts the power.

With EDGEFLOW_FAILPOINT=<name> in its environment, the process that reaches `failpoint(<name>)` kills itself with
SIGKILL there, as a power cut would: nothing after it runs (no `finally`, no atexit, no buffered write). Unset, as
everywhere outside the tests, a fail point costs one environment lookup. A test that injects the cut at the named
place, rather than replaying the steps before it by hand, fails when the code around the point is reordered.

Names, each a step boundary of edgeflow/device/switch.py's switch_to:
- `switch:locked`: the update lock was taken; the proxy still points at the serving version;
- `switch:proxy-pointed`: the stable port points at the candidate; the old server still runs and state.json still
  names the old version;
- `switch:old-stopped`: the old server was drained and stopped; state.json still names it;
- `switch:state-written`: state.json names the candidate: the switch is complete.
"""
from __future__ import annotations

import os
import signal

ENV = "EDGEFLOW_FAILPOINT"
NAMES = frozenset({"switch:locked", "switch:proxy-pointed", "switch:old-stopped", "switch:state-written"})


def failpoint(name: str) -> None:
    """SIGKILL this process here when EDGEFLOW_FAILPOINT names this point."""
    if name not in NAMES:  # a typo in the code would make a point no test can reach
        raise ValueError(f"unknown fail point {name!r}; known: {sorted(NAMES)} (edgeflow/device/failpoint.py)")
    if os.environ.get(ENV) == name:
        os.kill(os.getpid(), signal.SIGKILL)
