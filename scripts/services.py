"""Local services for the demo and the tests: Prefect server, MLflow server, work pools and workers.

    python scripts/services.py up      # start what does not already answer; idempotent
    python scripts/services.py down    # stop everything this script (and deploy-edge) started, by pid
    python scripts/services.py env     # print the environment a shell needs to talk to them

Ports and places come from the environment: EDGEFLOW_HOME (.edgeflow), EDGEFLOW_PREFECT_PORT (4200),
EDGEFLOW_MLFLOW_PORT (5055), EDGEFLOW_SERVICES_HOST (127.0.0.1: the address the Prefect and MLflow servers listen
on and every client of this script's environment is pointed at; give the host's address, or 0.0.0.0, when workers on
other hosts use them), EDGEFLOW_POOLS (a100,orin,cpu); EDGEFLOW_MONITORING=off leaves out Prometheus, Alertmanager, the blackbox exporter and
the alert recorder (edgeflow/ops/monitoring.py: their ports, EDGEFLOW_*_PORT, and the servers they watch,
EDGEFLOW_MONITOR_TARGETS, default the demo's 127.0.0.1:8000); EDGEFLOW_SCHEDULES=off pauses every
deployment schedule after deploying (the tests' services); EDGEFLOW_SERVERS_NICE (10) is the niceness the Prefect
and MLflow servers run at, so stage processes on the same box get the cores first; EDGEFLOW_WORKERS=off starts the servers, pools and
deployments but no worker (each host starts its own: docs/how-to/across-hosts.md).

Flow runs send a heartbeat every PREFECT_FLOWS_HEARTBEAT_FREQUENCY (30 s), and `up` creates the automation
"edgeflow: crash zombie flow runs", which marks a run Crashed when its heartbeats stop for ZOMBIE_AFTER_S
(a worker killed or a device lost power mid-stage). The release waiting on that stage then fails, and a
Retry resumes it from the stages whose results are cached.

EDGEFLOW_RESULT_STORAGE says where Prefect keeps task and flow results (what a Retry and a cross-host
`state.result()` read): a directory, which several hosts must mount at the same path, or a storage block
slug such as `s3-bucket/edgeflow-results` (create the block first; every host needs its credentials).
Default: <EDGEFLOW_HOME>/prefect/storage, which only serves hosts that share that directory.

Each process is started detached with a log under <EDGEFLOW_HOME>/logs and a pid file under <EDGEFLOW_HOME>/run,
and stopped by process group, through edgeflow/ops/processes.py (which the edge deploy uses for its servers too).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
if str(REPO) not in sys.path:  # run as `python scripts/services.py`: sys.path[0] is scripts/
    sys.path.append(str(REPO))

from edgeflow.engines.cpu_host import int_from_env  # noqa: E402 - needs REPO on sys.path
from edgeflow.ops.processes import MAX_NICE, alive, answers, read_pid, spawn_detached, stop_groups  # noqa: E402

# The Prefect and MLflow servers start at this niceness (EDGEFLOW_SERVERS_NICE overrides it; workers keep the default,
# since the stage processes they start inherit theirs). On a box that also computes, the servers' polling and
# bookkeeping (Prefect's server alone: 7 % of a core idle, 17 % with the demo's progress view polling it) took
# turns on the cores torch's two threads wait on each other across: one GPTQ W8A16 quantization (16 samples, the
# demo's student, a worker thread, 2-core AMD EPYC) took 45 s with the servers at 0 and 37 s at 10
# (BENCHMARKS.md#services-up). A request still gets the core when the stages leave one idle.
SERVERS_NICE = 10

# How `down` stops a group: SIGINT first (Prefect workers exit cleanly on it and are slow on SIGTERM), then harder.
DOWN_STEPS = ((signal.SIGINT, 10.0), (signal.SIGTERM, 10.0), (signal.SIGKILL, 2.0))


def settings() -> dict[str, str]:
    home = Path(os.environ.get("EDGEFLOW_HOME", REPO / ".edgeflow")).resolve()
    return {
        "home": str(home),
        "prefect_port": os.environ.get("EDGEFLOW_PREFECT_PORT", "4200"),
        "mlflow_port": os.environ.get("EDGEFLOW_MLFLOW_PORT", "5055"),
        "host": os.environ.get("EDGEFLOW_SERVICES_HOST", "127.0.0.1"),
        "pools": os.environ.get("EDGEFLOW_POOLS", "a100,orin,cpu"),
    }


def client_host(s: dict[str, str]) -> str:
    """The address a client on this host dials: the one the servers listen on, or loopback when they listen on all."""
    host = s.get("host", "127.0.0.1")
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


def service_env(s: dict[str, str] | None = None) -> dict[str, str]:
    """Variables every process of the pipeline needs (the workers pass them on to flow runs)."""
    s = s or settings()
    home, host = Path(s["home"]), client_host(s)
    return result_storage_env(os.environ.get("EDGEFLOW_RESULT_STORAGE"), home) | {
        "PREFECT_HOME": str(home / "prefect"),
        "PREFECT_API_URL": f"http://{host}:{s['prefect_port']}/api",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "MLFLOW_DISABLE_TELEMETRY": "true",  # edgeflow/pipeline/__init__.py says why
        "PREFECT_UI_URL": f"http://{host}:{s['prefect_port']}",
        # Results persist so that a retried release skips stages whose inputs did not change.
        "PREFECT_RESULTS_PERSIST_BY_DEFAULT": "true",
        # Heartbeats drive the zombie automation (see the module docstring); 30 s is Prefect's minimum.
        "PREFECT_FLOWS_HEARTBEAT_FREQUENCY": "30",
        # Workers poll for runs every 2 s, not Prefect's default 10: every pool-placed stage otherwise waits up to
        # 10 s (5 s on average) for its worker to notice it, and a release has up to eight (loopback API).
        "PREFECT_WORKER_QUERY_SECONDS": "2",
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
        "MLFLOW_TRACKING_URI": f"http://{host}:{s['mlflow_port']}",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "EDGEFLOW_REPO": str(REPO),
        "EDGEFLOW_HOME": str(home),
    }


def result_storage_env(spec: str | None, home: Path) -> dict[str, str]:
    """Prefect settings for EDGEFLOW_RESULT_STORAGE: a block slug (`<block type>/<name>`) or a directory."""
    if spec and "/" in spec and not spec.startswith(("/", ".", "~")):
        block_type, _, name = spec.partition("/")
        if not block_type or not name or "/" in name:
            raise SystemExit(f"EDGEFLOW_RESULT_STORAGE={spec!r} is neither a directory (absolute) nor a block slug such as "
                             "s3-bucket/edgeflow-results; give one of the two")
        return {"PREFECT_RESULTS_DEFAULT_STORAGE_BLOCK": spec,
                # local results of the runs that do not persist stay on this host
                "PREFECT_LOCAL_STORAGE_PATH": str(home / "prefect" / "storage")}
    path = Path(spec).expanduser().resolve() if spec else home / "prefect" / "storage"
    return {"PREFECT_LOCAL_STORAGE_PATH": str(path)}


ZOMBIE_AUTOMATION = "edgeflow: crash zombie flow runs"
# No heartbeat for this long after the last one: the run's process is gone (two missed 30 s beats, plus slack).
ZOMBIE_AFTER_S = 90


def ensure_pools_and_automation(pools: list[str], env: dict[str, str]) -> None:
    """Create (once) each work pool (type process; its workers start the engine directly, edgeflow/pipeline/workers.py)
    and the automation that marks a flow run Crashed when its heartbeats stop, as Prefect documents for self-hosted
    servers ("Detect zombie flows"). One Python process does both through Prefect's client: a `prefect work-pool`
    command per pool took 4.5-6 s each here, most of it importing Prefect."""
    code = f"""
from datetime import timedelta
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import WorkPoolCreate, WorkPoolUpdate
from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound
from edgeflow.pipeline.workers import engine_command, process_pool_template
from prefect.automations import Automation
from prefect.client.schemas.objects import StateType
from prefect.events.actions import ChangeFlowRunState
from prefect.events.schemas.automations import EventTrigger, Posture
from prefect.events.schemas.events import ResourceSpecification
with get_client(sync_client=True) as client:
    for pool in {pools!r}:
        try:
            existing = client.read_work_pool(pool)
        except ObjectNotFound:
            try:
                client.create_work_pool(WorkPoolCreate(name=pool, type="process", base_job_template=process_pool_template()))
            except ObjectAlreadyExists:  # another `up` created it meanwhile
                pass
            continue
        command = existing.base_job_template.get("variables", {{}}).get("properties", {{}}).get("command", {{}})
        if existing.type == "process" and command.get("default") != engine_command():
            # a pool an earlier edgeflow created: its flow runs start the engine directly from now on
            client.update_work_pool(pool, WorkPoolUpdate(base_job_template=process_pool_template()))
name = {ZOMBIE_AUTOMATION!r}
try:
    Automation.read(name=name)
except ValueError:
    Automation(
        name=name,
        trigger=EventTrigger(
            after={{"prefect.flow-run.heartbeat"}},
            expect={{"prefect.flow-run.heartbeat", "prefect.flow-run.Completed", "prefect.flow-run.Failed",
                     "prefect.flow-run.Cancelled", "prefect.flow-run.Crashed"}},
            match=ResourceSpecification({{"prefect.resource.id": ["prefect.flow-run.*"]}}),
            for_each={{"prefect.resource.id"}},
            posture=Posture.Proactive,
            threshold=1,
            within=timedelta(seconds={ZOMBIE_AFTER_S}),
        ),
        actions=[ChangeFlowRunState(state=StateType.CRASHED, message="No heartbeat for {ZOMBIE_AFTER_S} s: the flow run's "
                                    "process is gone (worker killed, host lost). Retry the release to resume it.")],
    ).create()
"""
    r = subprocess.run([sys.executable, "-c", code], env=os.environ | env, cwd=REPO, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"creating the work pools {pools} or the automation {ZOMBIE_AUTOMATION!r} failed:\n{r.stderr[-2000:]}")


def servers_nice() -> int:
    """EDGEFLOW_SERVERS_NICE, checked before anything starts: the niceness the Prefect and MLflow servers start at."""
    try:
        value = int_from_env("EDGEFLOW_SERVERS_NICE", lo=0, hi=MAX_NICE,
                             meaning=f"the servers' niceness, 0 being the stages' own; unset: {SERVERS_NICE}")
    except ValueError as e:
        raise SystemExit(str(e)) from None
    return SERVERS_NICE if value is None else value


def _spawn(name: str, cmd: list[str], env: dict[str, str], home: Path, nice: int = 0) -> int:
    # Own session: survives the shell that ran `make demo`, and `down` can signal the whole group.
    return spawn_detached(cmd, home / "logs" / f"{name}.log", home / "run" / f"{name}.pid", REPO, os.environ | env, nice)


def _wait(url: str, timeout: float, name: str, home: Path) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if answers(url):
            return
        time.sleep(0.5)
    tail = (home / "logs" / f"{name}.log").read_text()[-2000:] if (home / "logs" / f"{name}.log").exists() else ""
    raise SystemExit(f"{name} did not answer {url} within {timeout:.0f}s; log tail:\n{tail}")


def up() -> None:
    s = settings()
    home = Path(s["home"])
    env, host = service_env(s), client_host(s)
    prefect_health = f"http://{host}:{s['prefect_port']}/api/health"
    mlflow_health = f"http://{host}:{s['mlflow_port']}/health"
    nice = servers_nice()
    started = []
    if not answers(prefect_health):
        # Prefect's app behind edgeflow's retry of SQLite's busy answers (edgeflow/pipeline/server.py): no 2 s client
        # back-off on a release's hand-offs.
        _spawn("prefect-server", [str(BIN / "python"), "-m", "edgeflow.pipeline.server", "--host", s["host"],
                                  "--port", s["prefect_port"]], env, home, nice)
        started.append(("prefect-server", prefect_health))
    if not answers(mlflow_health):
        (home / "mlflow").mkdir(parents=True, exist_ok=True)
        # No MLflow job runner: edgeflow submits no MLflow jobs (GenAI scorers, trace rollups), and the runner's seven
        # huey consumer processes took 3 CPU-seconds each to start (21 in all, 2-core AMD EPYC), on the cores the
        # Prefect server, the deploy and the release's first stage start on.
        _spawn("mlflow-server", [
            str(BIN / "mlflow"), "server", "--host", s["host"], "--port", s["mlflow_port"],
            "--backend-store-uri", f"sqlite:///{home / 'mlflow' / 'mlflow.db'}",
            "--artifacts-destination", str(home / "mlflow" / "artifacts"), "--workers", "1",
        ], env | {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}, home, nice)
        started.append(("mlflow-server", mlflow_health))
    for name, url in started:
        _wait(url, 180, name, home)
    pools = s["pools"].split(",")
    ensure_pools_and_automation(pools, env)
    r = subprocess.run([str(BIN / "prefect"), "--no-prompt", "deploy", "--all"], env=os.environ | env, cwd=REPO, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"prefect deploy --all failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    if os.environ.get("EDGEFLOW_SCHEDULES", "on") == "off":
        # Test services: a cron that fires mid-test (the nightly at 02:30) would start a demo-sized run
        # on the test workers; tests start every run themselves.
        subprocess.run([str(BIN / "prefect"), "--no-prompt", "deployment", "schedule", "pause", "--all"],
                       env=os.environ | env, cwd=REPO, check=True, capture_output=True)
    # Deploy first, then the workers: three workers starting (nice 0) alongside the deploy starved the niced
    # Prefect server that the deploy talks to, and the deploy took 37 s instead of 10 (`up` from nothing 70 s
    # against 38 s; BENCHMARKS.md#services-up). A run created right after `up` waits only for a worker's start.
    for pool in pools:
        pidfile = home / "run" / f"worker-{pool}.pid"
        if os.environ.get("EDGEFLOW_WORKERS", "on") == "off":
            continue
        if not (pidfile.exists() and alive(read_pid(pidfile))):
            _spawn(f"worker-{pool}", [str(BIN / "prefect"), "worker", "start", "--pool", pool, "--name", f"local-{pool}"], env, home)
    # Prometheus, Alertmanager, the blackbox exporter and the alert recorder (edgeflow/ops/monitoring.py), unless
    # EDGEFLOW_MONITORING=off; a config that amtool or promtool refuses stops `up` with its file, line and fix.
    from edgeflow.ops import monitoring

    try:
        watched = monitoring.up(home)
    except monitoring.MonitoringConfigError as e:
        raise SystemExit(f"monitoring: {e}") from None
    for name, url in watched:
        _wait(url, 60, name, home)
    print(f"Prefect UI  {env['PREFECT_UI_URL']}\nMLflow UI   {env['MLFLOW_TRACKING_URI']}")
    on, ports, targets = monitoring.settings_from_env()
    if on:
        print(f"Prometheus  http://127.0.0.1:{ports.prometheus} (scraping {','.join(targets)})\n"
              f"Alerts      http://127.0.0.1:{ports.alertmanager}, recorded in {home / 'logs' / 'alerts.jsonl'}")


def down() -> None:
    """Stop this script's processes (<EDGEFLOW_HOME>/run) and the edge servers every profile's deploys started there or
    in a work directory inside it (edgeflow/device/spawn.py and proxy.py write them under <workdir>/run: `PROFILE=configs/demo-gemma3.yaml
    make demo` serves from .edgeflow/demo-gemma3/run, which `make down` must stop too)."""
    home = Path(settings()["home"])
    pidfiles = sorted({*home.glob("run/*.pid"), *home.glob("*/run/edge-*.pid")})
    pids = {pidfile: read_pid(pidfile) for pidfile in pidfiles}
    stop_groups(list(pids.values()), DOWN_STEPS)  # all at once: as long as the slowest, not the sum
    for pidfile, pid in pids.items():
        pidfile.unlink(missing_ok=True)
        print(f"stopped {pidfile.stem} (pid {pid})")


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog=os.environ.pop("EDGEFLOW_PROG", "services.py"), description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", metavar="{up,down,env}")
    sub.add_parser("up", help="start what does not already answer (idempotent)", description=__doc__,
                   formatter_class=argparse.RawDescriptionHelpFormatter)
    sub.add_parser("down", help="stop everything this script and the edge deploys started, by pid file")
    sub.add_parser("env", help="print the environment a shell needs to talk to the servers")
    a = ap.parse_args(argv)
    if a.cmd in (None, "up"):
        up()
    elif a.cmd == "down":
        down()
    else:
        print("\n".join(f"export {k}={v}" for k, v in service_env().items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
