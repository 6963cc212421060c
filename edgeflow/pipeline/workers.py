"""How a process worker starts a flow run: the engine in one Python process, the worker's own interpreter.

Left to itself, Prefect's process worker starts a workspace supervisor (`python -m prefect.runner._workspace_supervisor`)
that imports Prefect, runs the deployment's pull step and then execs the engine, which imports Prefect again: 1.6-2.0 s
of imports per flow run on the 2-core AMD EPYC (BENCHMARKS.md#stage-fixed-costs), and a release starts up to nine. A
pool whose base job template sets `command` has its workers start that command instead, and the engine runs the pull
step itself (edgeflow/pipeline/checkout.py). `scripts/services.py up` creates the process pools with engine_command()
as that default (process_pool_template), and sets it on a process pool that lacks it.

The command runs the engine with the interpreter that runs the worker: the first word of the worker's own command
line (/proc/<worker>/cmdline: the venv's python, from the `prefect` script's first line), not whatever `python` the
PATH names, so a worker started by its full path (the Orin's systemd unit) runs its flows with its own venv. Kubernetes
pools keep their own templates (infra/kubernetes/).
"""
from __future__ import annotations

import shlex

# The worker is the shell's parent; its argv[0] is its interpreter (python3: a worker whose command line is unreadable)
_SCRIPT = 'py=$(tr "\\000" "\\n" < /proc/$PPID/cmdline | head -n 1); exec "${py:-python3}" '


def engine_command(*args: str) -> str:
    """The command a process worker runs for a flow run: its own interpreter with `args` (default: Prefect's engine)."""
    return "sh -c " + shlex.quote(_SCRIPT + " ".join(shlex.quote(a) for a in (args or ("-m", "prefect.engine"))))


def process_pool_template() -> dict:
    """Prefect's process pool template with engine_command() as the default `command`."""
    from prefect.workers.process import ProcessWorker

    template = ProcessWorker.get_default_base_job_template()
    template["variables"]["properties"]["command"]["default"] = engine_command()
    return template
