"""The monitoring stack on one box: Prometheus, Alertmanager, the blackbox exporter and an alert recorder.

    python -m edgeflow.ops.monitoring check                          # promtool + amtool on the shipped configs
    python -m edgeflow.ops.monitoring sink --port 9095 --log alerts.jsonl   # record (and print) every notification
    python -m edgeflow.ops.monitoring page-test --engine ENGINE_DIR  # freeze a server twice; print the pages and their seconds

One owner for what the shipped configs in infra/prometheus and infra/alertmanager become on a box:
`render` writes them for the targets and ports given (and, for a drill, with every duration scaled), `check`
validates them with the tools that will read them and names the file, the line and the fix, `Stack` runs them,
and `page_drill` is the measured paging test (tests/infra/test_paging.py and `make page-test` run the same one).
`scripts/services.py up` starts the same stack next to the Prefect and MLflow servers.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import yaml

from edgeflow.ops.alert_routes import MonitoringConfigError, check_routes  # noqa: F401 - the checks below raise it
from edgeflow.ops.processes import answers
from edgeflow.paths import REPO_ROOT

PROM_DIR = REPO_ROOT / "infra" / "prometheus"
AM_DIR = REPO_ROOT / "infra" / "alertmanager"
ALERTMANAGER = "prometheus-alertmanager"  # Debian's name for the alertmanager binary
BLACKBOX = "prometheus-blackbox-exporter"
# The ports the shipped configs name; `render` replaces them with the ones a stack really uses.
SHIPPED = {"alertmanager": "127.0.0.1:9093", "blackbox": "127.0.0.1:9115", "sink": "127.0.0.1:9095",
           "server": "127.0.0.1:8000"}


# --------------------------------------------------------------------------------------------
# Checking
# --------------------------------------------------------------------------------------------

def _line_of(path: Path, message: str) -> int | None:
    m = re.search(r"\bline (\d+)", message)
    if m:
        return int(m.group(1))
    quoted = re.search(r'"([^"]+)"', message)  # e.g. undefined receiver "x" used in route
    if quoted:
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(rf"\b{re.escape(quoted.group(1))}\b", line) and not line.lstrip().startswith("#"):
                return i
    return None


def check_alertmanager(path: Path) -> None:
    """`amtool check-config`, or MonitoringConfigError naming the file, the line and the fix."""
    amtool = shutil.which("amtool")
    if amtool is None:
        raise MonitoringConfigError(f"{path}: cannot check it, amtool is not installed; install Debian's "
                                    "prometheus-alertmanager (`apt-get install prometheus-alertmanager`)")
    r = subprocess.run([amtool, "check-config", str(path)], capture_output=True, text=True)
    if r.returncode == 0:
        return
    out = (r.stdout + r.stderr).strip()
    m = re.search(r"FAILED: (.*?)(?:\n\s*\n|amtool: error|$)", out, re.S)
    why = " ".join((m.group(1) if m else out).split())
    line = _line_of(path, why)
    if "undefined receiver" in why:
        fix = "give that route the name of one of `receivers:` (or add a receiver of that name)"
    elif "field" in why and "not found" in why:
        fix = "remove or correct the key: Alertmanager's configuration reference lists the valid ones"
    else:
        fix = "correct the YAML there; `amtool check-config FILE` checks it without starting anything"
    raise MonitoringConfigError(f"{path}{f':{line}' if line else ''}: {why}; fix: {fix}")


def check_prometheus(path: Path) -> None:
    """`promtool check config` (which checks its rule files too), or MonitoringConfigError."""
    promtool = shutil.which("promtool")
    if promtool is None:
        raise MonitoringConfigError(f"{path}: cannot check it, promtool is not installed; install Debian's prometheus")
    r = subprocess.run([promtool, "check", "config", str(path)], capture_output=True, text=True, cwd=path.parent)
    if r.returncode != 0:
        why = " ".join((r.stdout + r.stderr).split())[-800:]
        line = re.search(r"\bline (\d+)", why)
        raise MonitoringConfigError(f"{path}{f':{line.group(1)}' if line else ''}: {why}; fix: correct it there; "
                                    f"`promtool check config {path.name}` checks it without starting anything")


def check(am_config: Path = AM_DIR / "alertmanager.yml", prom_config: Path = PROM_DIR / "prometheus.yml") -> None:
    check_alertmanager(am_config)
    check_prometheus(prom_config)


# --------------------------------------------------------------------------------------------
# Rendering
# --------------------------------------------------------------------------------------------

_UNIT_S = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}


def seconds(duration: str) -> float:
    """A Prometheus/Alertmanager duration ("1m", "30s", "1h30m") in seconds."""
    parts = re.findall(r"(\d+)(ms|s|m|h|d)", duration)
    if not parts or "".join(n + u for n, u in parts) != duration:
        raise ValueError(f"not a duration: {duration!r}")
    return sum(int(n) * _UNIT_S[u] for n, u in parts)


def _scaled(duration: str, scale: float) -> str:
    return f"{max(1, round(seconds(duration) * scale * 1000))}ms"


def scale_rules(text: str, scale: float) -> str:
    """alerts.yml with every `for:`, range `[...]` and `offset` multiplied by `scale` (a drill runs the shipped rules
    `scale` times faster: 1m of `for:` at 1/20 is 3 s)."""
    if scale == 1:
        return text
    text = re.sub(r"(for:\s*)(\w+)", lambda m: m.group(1) + _scaled(m.group(2), scale), text)
    text = re.sub(r"\[(\w+)\]", lambda m: f"[{_scaled(m.group(1), scale)}]", text)
    return re.sub(r"(offset\s+)(\w+)", lambda m: m.group(1) + _scaled(m.group(2), scale), text)


@dataclass
class Ports:
    prometheus: int = 9090
    alertmanager: int = 9093
    blackbox: int = 9115
    sink: int = 9095


def render(out: Path, targets: list[str], ports: Ports, scale: float = 1.0, scrape_s: float | None = None) -> dict[str, Path]:
    """Write prometheus.yml, alerts.yml, blackbox.yml and alertmanager.yml into `out` for these edge servers
    (host:port each) and ports. `scale` < 1 shortens every rule and grouping duration (drills only);
    `scrape_s` sets the scrape and evaluation interval. Returns {name: path}, checked by the tools."""
    out.mkdir(parents=True, exist_ok=True)
    prom = yaml.safe_load((PROM_DIR / "prometheus.yml").read_text())
    if scrape_s is not None:
        prom["global"].update(scrape_interval=f"{int(scrape_s * 1000)}ms", evaluation_interval=f"{int(scrape_s * 1000)}ms",
                              scrape_timeout=f"{int(scrape_s * 1000)}ms")
    prom["rule_files"] = ["alerts.yml"]
    prom["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"] = [f"127.0.0.1:{ports.alertmanager}"]
    jobs = {j["job_name"]: j for j in prom["scrape_configs"]}
    jobs["edgeflow-edge"]["static_configs"][0]["targets"] = list(targets)
    jobs["edgeflow-health"]["static_configs"][0]["targets"] = [f"http://{t}/health" for t in targets]
    jobs["edgeflow-health"]["relabel_configs"][-1]["replacement"] = f"127.0.0.1:{ports.blackbox}"
    jobs["alertmanager"]["static_configs"][0]["targets"] = [f"127.0.0.1:{ports.alertmanager}"]
    paths = {"prometheus": out / "prometheus.yml", "alerts": out / "alerts.yml", "blackbox": out / "blackbox.yml",
             "alertmanager": out / "alertmanager.yml"}
    paths["prometheus"].write_text(yaml.safe_dump(prom, sort_keys=False))
    paths["alerts"].write_text(scale_rules((PROM_DIR / "alerts.yml").read_text(), scale))
    blackbox = yaml.safe_load((PROM_DIR / "blackbox.yml").read_text())
    if scrape_s is not None:  # a probe must end within its scrape
        for module in blackbox["modules"].values():
            module["timeout"] = f"{int(scrape_s * 1000)}ms"
    paths["blackbox"].write_text(yaml.safe_dump(blackbox, sort_keys=False))
    am_text = (AM_DIR / "alertmanager.yml").read_text().replace(SHIPPED["sink"], f"127.0.0.1:{ports.sink}")
    am = yaml.safe_load(am_text)
    if scale != 1:
        for route in [am["route"], *am["route"].get("routes", [])]:
            for key in ("group_wait", "group_interval", "repeat_interval"):
                if key in route:
                    route[key] = _scaled(route[key], scale)
    paths["alertmanager"].write_text(yaml.safe_dump(am, sort_keys=False))
    check(paths["alertmanager"], paths["prometheus"])
    return paths


# --------------------------------------------------------------------------------------------
# The alert recorder (the default webhook receiver)
# --------------------------------------------------------------------------------------------

@dataclass
class Notification:
    received: float  # time.time() when it arrived
    receiver: str
    status: str  # firing | resolved
    alerts: list[dict] = field(default_factory=list)

    def names(self) -> set[str]:
        return {a["labels"].get("alertname", "") for a in self.alerts}

    def line(self) -> str:
        a = self.alerts[0] if self.alerts else {"labels": {}, "annotations": {}}
        when = time.strftime("%H:%M:%S", time.localtime(self.received))
        return (f"{when} {self.receiver}: {self.status.upper()} {a['labels'].get('alertname')} "
                f"device={a['labels'].get('device', '-')} severity={a['labels'].get('severity', '-')}: "
                f"{a.get('annotations', {}).get('summary', '')}")


class AlertSink:
    """A webhook receiver that keeps every notification (and appends it to `log` as a JSON line)."""

    def __init__(self, port: int, log: Path | None = None, echo: bool = False) -> None:
        self.notifications: list[Notification] = []
        self.log, self.echo = log, echo
        self._lock = threading.Lock()
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                try:
                    payload = json.loads(body)
                    n = Notification(time.time(), payload.get("receiver", self.path), payload.get("status", "?"),
                                     payload.get("alerts", []))
                except (ValueError, AttributeError):
                    self.send_response(400)
                    self.end_headers()
                    return
                sink.add(n, payload)
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.port = self.server.server_address[1]
        self._thread = threading.Thread(target=self.server.serve_forever, name="alert-sink", daemon=True)

    def add(self, n: Notification, payload: dict) -> None:
        with self._lock:
            self.notifications.append(n)
            if self.log is not None:
                self.log.parent.mkdir(parents=True, exist_ok=True)
                with self.log.open("a") as f:
                    f.write(json.dumps({"received": n.received, **payload}) + "\n")
        if self.echo:
            print(n.line(), flush=True)

    def start(self) -> AlertSink:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def first(self, alertname: str, status: str, after: float = 0.0) -> Notification | None:
        with self._lock:
            return next((n for n in self.notifications
                         if n.status == status and alertname in n.names() and n.received >= after), None)

    def wait_for(self, alertname: str, status: str, timeout: float, after: float = 0.0) -> Notification:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            n = self.first(alertname, status, after)
            if n is not None:
                return n
            time.sleep(0.2)
        got = [n.line() for n in self.notifications]
        raise TimeoutError(f"no {status} notification for {alertname} within {timeout:.0f} s; received: {got}")


# --------------------------------------------------------------------------------------------
# Running the stack
# --------------------------------------------------------------------------------------------

def commands(paths: dict[str, Path], ports: Ports, data: Path) -> dict[str, list[str]]:
    """The command line of each service (one place: the drill and `scripts/services.py up` start the same)."""
    return {
        "alertmanager": [ALERTMANAGER, f"--config.file={paths['alertmanager']}", f"--storage.path={data / 'alertmanager'}",
                         f"--web.listen-address=127.0.0.1:{ports.alertmanager}", "--cluster.listen-address="],
        "blackbox": [BLACKBOX, f"--config.file={paths['blackbox']}", f"--web.listen-address=127.0.0.1:{ports.blackbox}"],
        "prometheus": ["prometheus", f"--config.file={paths['prometheus']}", f"--storage.tsdb.path={data / 'tsdb'}",
                       f"--web.listen-address=127.0.0.1:{ports.prometheus}"],
    }


def ready_urls(ports: Ports) -> dict[str, str]:
    return {"alertmanager": f"http://127.0.0.1:{ports.alertmanager}/-/ready",
            "blackbox": f"http://127.0.0.1:{ports.blackbox}/",
            "prometheus": f"http://127.0.0.1:{ports.prometheus}/-/ready"}


def missing_binaries() -> list[str]:
    return [b for b in ("prometheus", "promtool", ALERTMANAGER, "amtool", BLACKBOX) if shutil.which(b) is None]


@contextmanager
def stack(work: Path, targets: list[str], ports: Ports, scale: float = 1.0, scrape_s: float | None = None,
          sink: AlertSink | None = None) -> Iterator[dict[str, Path]]:
    """Prometheus, Alertmanager and the blackbox exporter as child processes (logs in `work`), ready on entry."""
    paths = render(work / "config", targets, ports, scale, scrape_s)
    procs: list[subprocess.Popen] = []
    try:
        for name, cmd in commands(paths, ports, work / "data").items():
            procs.append(subprocess.Popen(cmd, stdout=(work / f"{name}.log").open("w"), stderr=subprocess.STDOUT))
        for name, url in ready_urls(ports).items():
            deadline = time.monotonic() + 60
            while not answers(url):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{name} did not answer {url} within 60 s: {(work / f'{name}.log').read_text()[-1500:]}")
                time.sleep(0.2)
        yield paths
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()


def settings_from_env(env: dict[str, str] | None = None) -> tuple[bool, Ports, list[str]]:
    """(on, ports, targets) from EDGEFLOW_MONITORING (on|off; unset: on where the binaries are installed),
    EDGEFLOW_{PROMETHEUS,ALERTMANAGER,BLACKBOX,ALERT_SINK}_PORT and EDGEFLOW_MONITOR_TARGETS (host:port,...)."""
    env = os.environ if env is None else env
    mode = env.get("EDGEFLOW_MONITORING", "")
    if mode not in ("", "on", "off"):
        raise MonitoringConfigError(f"EDGEFLOW_MONITORING={mode!r}: must be on or off (unset: on where Prometheus and "
                                    "Alertmanager are installed)")
    missing = missing_binaries()
    if mode == "on" and missing:
        raise MonitoringConfigError(f"EDGEFLOW_MONITORING=on, but {missing} are not installed: apt-get install prometheus "
                                    "prometheus-alertmanager prometheus-blackbox-exporter, or set EDGEFLOW_MONITORING=off")
    on = mode == "on" or (mode == "" and not missing)
    ports = Ports()
    for name, var in (("prometheus", "EDGEFLOW_PROMETHEUS_PORT"), ("alertmanager", "EDGEFLOW_ALERTMANAGER_PORT"),
                      ("blackbox", "EDGEFLOW_BLACKBOX_PORT"), ("sink", "EDGEFLOW_ALERT_SINK_PORT")):
        if env.get(var):
            if not env[var].isdigit() or not 0 < int(env[var]) < 65536:
                raise MonitoringConfigError(f"{var}={env[var]!r}: must be a TCP port, 1 to 65535")
            setattr(ports, name, int(env[var]))
    targets = [t for t in env.get("EDGEFLOW_MONITOR_TARGETS", SHIPPED["server"]).split(",") if t]
    return on, ports, targets


def up(home: Path, env: dict[str, str] | None = None) -> list[tuple[str, str]]:
    """Start the alert sink, Alertmanager, the blackbox exporter and Prometheus for `scripts/services.py up`, each
    detached with a log under <home>/logs and a pid file under <home>/run (`services.py down` stops them). What
    already answers is left alone. Returns [(name, ready url)] of those started. A config that does not check
    raises MonitoringConfigError before anything starts."""
    from edgeflow.ops.processes import alive, read_pid, spawn_detached

    on, ports, targets = settings_from_env(env)
    if not on:
        return []
    paths = render(home / "monitoring" / "config", targets, ports)
    urls = ready_urls(ports)
    cmds = commands(paths, ports, home / "monitoring")
    cmds["alert-sink"] = [sys.executable, "-m", "edgeflow.ops.monitoring", "sink", "--port", str(ports.sink),
                          "--log", str(home / "logs" / "alerts.jsonl")]
    started = []
    for name in ("alert-sink", "alertmanager", "blackbox", "prometheus"):
        url, pidfile = urls.get(name), home / "run" / f"{name}.pid"
        if (pidfile.exists() and alive(read_pid(pidfile))) or (url is not None and answers(url)):
            continue
        spawn_detached(cmds[name], home / "logs" / f"{name}.log", home / "run" / f"{name}.pid", REPO_ROOT,
                       os.environ | {"PYTHONPATH": str(REPO_ROOT)})
        if url is not None:
            started.append((name, url))
    return started


# --------------------------------------------------------------------------------------------
# The paging drill
# --------------------------------------------------------------------------------------------

def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _server_pid(supervisor_pid: int) -> int | None:
    import psutil

    children = psutil.Process(supervisor_pid).children()
    return children[0].pid if children else None


@dataclass
class DrillResult:
    case: str
    alert: str
    receiver: str
    page_s: float  # fault → firing notification received
    recovered_s: float  # fault → /health healthy again on a restarted server
    resolved_s: float  # fault → resolved notification received
    notification: str


# The drill's timings: the shipped rules and routes at 1/20 of their durations (`for: 1m` is 3 s, group_wait 10 s
# is 0.5 s), a 1 s scrape, and a watchdog and liveness check slower than the scaled `for:`, so the page goes out
# before the restart heals it (with the shipped durations the restart comes first; docs/how-to/monitoring.md).
DRILL_SCALE = 1 / 20
DRILL_SCRAPE_S = 1.0
DRILL_WATCHDOG_S = 10.0
DRILL_LIVENESS = ("1", "1", "8")  # interval s, timeout s, failures: killed ~16 s after it stopped answering


def page_drill(engine_dir: Path, work: Path, model_name: str = "edge", echo: bool = False) -> list[DrillResult]:
    """Serve `engine_dir` under the supervisor, with the monitoring stack around it, and freeze it twice:

    1. the engine wedges while the process stays up (`fault_stall_after_s`): the deep probe fails, the health page
       goes out, the watchdog ends the server, the supervisor restarts it, the page resolves;
    2. the whole server is SIGSTOPped: its scrape fails, the target-down page goes out, the supervisor's
       liveness check kills and restarts it, the page resolves.
    Each case's seconds are measured from the fault to the notification the webhook received."""
    import httpx

    work.mkdir(parents=True, exist_ok=True)
    ports = Ports(prometheus=_free_port(), alertmanager=_free_port(), blackbox=_free_port(), sink=_free_port())
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    sink = AlertSink(ports.sink, work / "alerts.jsonl", echo=echo).start()
    stall_after = 12.0  # the engine wedges this long after it is ready: the stack has seen it healthy first
    cmd = [sys.executable, "-m", "edgeflow.serving.supervisor", "--backoff-s", "0.2", "--liveness-url", f"{url}/ready",
           "--liveness-interval-s", DRILL_LIVENESS[0], "--liveness-timeout-s", DRILL_LIVENESS[1],
           "--liveness-failures", DRILL_LIVENESS[2], "--",
           sys.executable, "-m", "edgeflow.serving.server", "--engine", str(engine_dir), "--port", str(port),
           "--model-name", model_name, "--watchdog-stall-s", str(DRILL_WATCHDOG_S),
           "--fault-stall-after-s", str(stall_after)]
    results: list[DrillResult] = []
    sup = subprocess.Popen(cmd, stdout=(work / "server.log").open("w"), stderr=subprocess.STDOUT, start_new_session=True,
                           cwd=REPO_ROOT)

    def healthy() -> bool:
        try:
            return httpx.get(f"{url}/health", timeout=2).json().get("status") == "healthy"
        except (httpx.HTTPError, ValueError):
            return False

    def wait_healthy(timeout: float) -> float:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if sup.poll() is not None:
                raise RuntimeError(f"the supervisor exited with {sup.returncode}: {(work / 'server.log').read_text()[-2000:]}")
            if healthy():
                return time.time()
            time.sleep(0.25)
        raise TimeoutError(f"{url} not healthy within {timeout:.0f} s: {(work / 'server.log').read_text()[-2000:]}")

    def case(name: str, alert: str, fault_at: float) -> None:
        fired = sink.wait_for(alert, "firing", 120, after=fault_at)
        recovered = wait_healthy(180)
        resolved = sink.wait_for(alert, "resolved", 120, after=fired.received)
        results.append(DrillResult(name, alert, fired.receiver, fired.received - fault_at, recovered - fault_at,
                                   resolved.received - fault_at, fired.line()))
        if echo:
            r = results[-1]
            print(f"{name}: paged {r.page_s:.1f} s after the fault ({r.receiver}), served again at {r.recovered_s:.1f} s, "
                  f"resolved at {r.resolved_s:.1f} s", flush=True)

    try:
        ready_at = wait_healthy(300)
        with stack(work / "stack", [f"127.0.0.1:{port}"], ports, DRILL_SCALE, DRILL_SCRAPE_S):
            # case 1: the engine wedges `stall_after` s after it became ready; the process stays up
            case("engine wedged, process up", "EdgeflowHealthProbeFailing", ready_at + stall_after)
            # case 2: the whole server stops
            pid = _server_pid(sup.pid)
            assert pid is not None, "no server under the supervisor"
            time.sleep(3)  # a few healthy scrapes of the restarted server first
            frozen_at = time.time()
            os.kill(pid, signal.SIGSTOP)
            case("server frozen (SIGSTOP)", "EdgeflowTargetDown", frozen_at)
    finally:
        os.killpg(sup.pid, signal.SIGTERM)
        try:
            sup.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(sup.pid, signal.SIGKILL)
        sink.stop()
    return results


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=os.environ.pop("EDGEFLOW_PROG", "python -m edgeflow.ops.monitoring"), description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("check", help="promtool and amtool on infra/prometheus and infra/alertmanager")
    s = sub.add_parser("sink", help="record every notification Alertmanager sends (the default webhook receiver)")
    s.add_argument("--port", type=int, default=9095)
    s.add_argument("--log", type=Path, required=True, help="JSON lines file the notifications are appended to")
    d = sub.add_parser("page-test", help="freeze a server's engine, then the server; print the pages and their seconds")
    src = d.add_mutually_exclusive_group(required=True)
    src.add_argument("--engine", type=Path, help="an engine directory")
    src.add_argument("--profile", type=Path, help="a profile whose device serves a version (after `make demo`: "
                     "configs/demo-cpu.yaml): the drill serves that version's engine on a port of its own")
    d.add_argument("--work", type=Path, default=REPO_ROOT / ".edgeflow" / "page-test")
    args = p.parse_args(argv)
    try:
        if args.cmd == "check":
            check()
            print("infra/alertmanager/alertmanager.yml and infra/prometheus/prometheus.yml: valid")
        elif args.cmd == "sink":
            sink = AlertSink(args.port, args.log, echo=True).start()
            print(f"alert sink on 127.0.0.1:{sink.port}, appending to {args.log}", flush=True)
            stop = threading.Event()
            for signum in (signal.SIGINT, signal.SIGTERM):
                signal.signal(signum, lambda *_: stop.set())
            stop.wait()
            sink.stop()
        else:
            missing = missing_binaries()
            if missing:
                print(f"page-test needs {missing}: apt-get install prometheus prometheus-alertmanager "
                      "prometheus-blackbox-exporter", file=sys.stderr)
                return 2
            if args.profile is not None:
                from edgeflow.preflight import load_profile
                from edgeflow.device.state import read_state

                current = read_state(load_profile(args.profile)).get("current") or {}
                if not current.get("engine"):
                    print(f"--profile {args.profile}: its device serves no version yet; run `make demo` (or a "
                          "release with deploy) first, or give --engine DIR", file=sys.stderr)
                    return 2
                args.engine = Path(current["engine"])
            if not (args.engine / "engine.json").exists():
                print(f"--engine {args.engine}: no engine.json there; give an engine directory (`make demo` stages one)",
                      file=sys.stderr)
                return 2
            print(f"page drill: shipped rules and routes at {DRILL_SCALE:g} of their durations, scrape "
                  f"{DRILL_SCRAPE_S:g} s, watchdog {DRILL_WATCHDOG_S:g} s", flush=True)
            for r in page_drill(args.engine, args.work, echo=True):
                print(f"  {r.case}: {r.notification}")
    except MonitoringConfigError as e:
        print(str(e), file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
