"""edgeflow/pipeline/workers.py: the command a process worker starts a flow run with."""
from __future__ import annotations

import asyncio
import os
import shlex
import subprocess
import sys
from pathlib import Path

from edgeflow.pipeline.workers import engine_command, process_pool_template

# A process worker in miniature: it starts its job's command as Prefect's does (shlex-split, no shell, its own child).
WORKER = "import shlex, subprocess, sys; sys.exit(subprocess.run(shlex.split(sys.argv[1])).returncode)"
PRINT_PREFIX = ("-c", "import sys; print(sys.prefix)")


def _run_as_worker(interpreter: str, command: str) -> subprocess.CompletedProcess:
    return subprocess.run([interpreter, "-c", WORKER, command], capture_output=True, text=True, timeout=60,
                          env=os.environ | {"PATH": "/usr/bin:/bin"})  # no venv on the PATH, as under systemd


def test_the_flow_run_gets_the_interpreter_that_runs_the_worker_not_the_one_on_the_path():
    venv = _run_as_worker(sys.executable, engine_command(*PRINT_PREFIX))
    assert venv.returncode == 0, venv.stderr
    assert venv.stdout.strip() == sys.prefix != sys.base_prefix  # the venv, though PATH names none
    base = str(Path(sys.base_prefix) / "bin" / Path(sys.executable).name)
    other = _run_as_worker(base, engine_command(*PRINT_PREFIX))
    assert other.returncode == 0, other.stderr
    assert other.stdout.strip() == sys.base_prefix  # another worker's interpreter: its own


def test_the_engine_command_is_one_process_that_execs_prefects_engine():
    """The shell that reads the interpreter becomes the engine (exec): the engine's parent is the worker, which signals
    and waits for the process it started, as with Prefect's own command."""
    argv = shlex.split(engine_command())
    assert argv[:2] == ["sh", "-c"] and argv[2].endswith(" -m prefect.engine")
    worker = "import os; print(os.getpid(), flush=True); " + WORKER
    r = subprocess.run([sys.executable, "-c", worker, engine_command("-c", "import os; print(os.getppid())")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    worker_pid, engine_parent = r.stdout.split()
    assert engine_parent == worker_pid


def test_process_pools_start_the_engine_directly():
    """The template services.py creates the pools with: valid for Prefect, and a job made from it carries the command
    (so the worker starts it instead of Prefect's workspace supervisor)."""
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.workers.process import ProcessJobConfiguration

    template = process_pool_template()
    WorkPoolCreate(name="cpu", type="process", base_job_template=template)
    job = asyncio.run(ProcessJobConfiguration.from_template_and_values(template, {}, client=object()))
    assert job.command == engine_command()
    overridden = asyncio.run(ProcessJobConfiguration.from_template_and_values(template, {"command": "x"}, client=object()))
    assert overridden.command == "x"  # a deployment may still name its own
