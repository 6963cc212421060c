"""Defaults of the backend API's device hooks, for engines that run in this process's own memory and CPU.

    python -c "from edgeflow.engines import hooks; print(hooks.device_memory_used(None))"

The CPU backends export these as they are (None: "not applicable"; the edge server then reports the
process's RSS as the engine's memory and leaves GPU utilisation out). A backend whose engine lives on
a device of its own (tensorrt_llm) implements both.
"""
from __future__ import annotations

from typing import Any


def device_memory_used(session: Any) -> float | None:
    """Bytes the engine holds on a device of its own; None for an engine in this process's memory."""
    return None


def device_utilization(session: Any) -> float | None:
    """Busy fraction [0, 1] of the engine's own device; None for an engine on this process's CPU."""
    return None
