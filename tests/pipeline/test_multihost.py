"""Three hosts on one machine that share only HTTP and a result-storage directory.

Each simulated host (a100, orin, cpu) is its own Linux user with its own checkout copy, EDGEFLOW_HOME and work
directory, all mode 0700, running its own Prefect worker (the virtual environment is shared read-only). They
share the Prefect API, the MLflow server (its proxied artifact store) and Prefect's result storage, as
docs/how-to/across-hosts.md describes. A release with every stage pool-placed (configs/test-multihost.yaml) must run
each stage on its pool, hand everything on through the store, gate the engines on the orin host and serve from it;
a stage killed with kill -9 mid-build must resume on Retry without re-running what came before it.
"""
from __future__ import annotations

import asyncio
import grp
import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.e2e import (  # run_deployment polls every second
    child_flow_runs, flow_run_states, flow_runs_of, read_flow_run, retry_flow_run, run_deployment, served_version,
    wait_final, wait_for_rollout_state,
)
from tests.helpers.netns import Link

REPO = Path(__file__).resolve().parents[2]
# Outside the checkout: a clone may sit under a directory other users cannot enter (/root). /var/tmp is 1777.
BASE = Path(os.environ.get("EDGEFLOW_TEST_HOSTS_DIR", "/var/tmp/edgeflow-hosts"))
HOSTS = ("a100", "orin", "cpu")
# The orin host is fleet device orin-a, which also builds and gates engines (the pool's default queue); the fleet tests
# add orin-b, a second device host with its own ports.
# No ship-logs schedule: the tests start every run themselves.
# Access logs cut into segments every 5 s, so the logs test has segments to ship.
DEVICES = {"orin": {"id": "orin-a", "pool": "orin", "build_queue": True, "tags": {"site": "lab", "ring": "canary"},
                    "ship_logs_cron": None, "reconcile_cron": None, "deploy": {"access_log_rotate_s": 5}}}
DEVICE_B = {"id": "orin-b", "pool": "orin", "tags": {"site": "lab", "ring": "main"}, "ship_logs_cron": None, "reconcile_cron": None,
            "deploy": {"port": 8785, "side_ports": [8786, 8787], "access_log_rotate_s": 5}}
PROMETHEUS_PORT = os.environ.get("EDGEFLOW_TEST_MH_PROMETHEUS_PORT", "9291")
GROUP = "edgeflow-hosts"
PROFILE = "configs/test-multihost.yaml"
PREFECT_PORT, MLFLOW_PORT = os.environ.get("EDGEFLOW_TEST_MH_PREFECT_PORT", "4330"), os.environ.get("EDGEFLOW_TEST_MH_MLFLOW_PORT", "5085")
# orin-b's network: a namespace of its own and a veth pair to this one, whose host side the servers listen on
# (tests/helpers/netns.py). Every host reaches the servers at that address; the cut-off test takes orin-b's link down.
LAB = Link("edgeflow-orin-b", os.environ.get("EDGEFLOW_TEST_MH_SUBNET", "10.213.77"), "efx-orinb")
pytestmark = [pytest.mark.e2e, pytest.mark.skipif(os.geteuid() != 0, reason="creates Linux users (needs root)")]


def user(pool: str) -> str:
    return f"edgeflow-{pool}"


def _run(*cmd: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), capture_output=True, text=True, **kw)


def _ensure_user(name: str, home: Path) -> tuple[int, int]:
    try:
        pw = pwd.getpwnam(name)
    except KeyError:
        _run("useradd", "--system", "--no-create-home", "--home-dir", str(home), "--shell", "/bin/bash", "--user-group", name,
             check=True)
        pw = pwd.getpwnam(name)
    _run("usermod", "-aG", GROUP, name, check=True)
    return pw.pw_uid, pw.pw_gid


def _copy_checkout(dest: Path) -> None:
    """What a `git clone` of this tree would hold: tracked files and untracked ones git does not ignore."""
    files = _run("git", "ls-files", "-co", "--exclude-standard", "-z", cwd=REPO, check=True).stdout
    dest.mkdir(parents=True)
    subprocess.run(f"tar -c --null -T - | tar -x -C {dest}", shell=True, input=files.encode(), cwd=REPO, check=True)


class Host:
    """One simulated host: a Linux user, its home (0700), checkout, EDGEFLOW_HOME and worker.

    An `orin` host is a fleet device: its EDGEFLOW_HOME holds device.yaml and its worker is the device worker
    (python -m edgeflow.fleet worker: register, then poll its own queue device-<id>, and the pool's default queue
    when the device also builds and gates engines)."""

    def __init__(self, key: str, svc: dict[str, str], results: Path, pool: str | None = None, device: dict | None = None,
                 netns: Link | None = None):
        self.key, self.pool, self.name = key, pool or key, user(key)
        self.device, self.netns = device, netns
        self.home = BASE / key
        self.checkout, self.edgeflow_home = self.home / "checkout", self.home / "edgeflow"
        self.uid, self.gid = _ensure_user(self.name, self.home)
        self.env = {
            "HOME": str(self.home), "USER": self.name, "LOGNAME": self.name,
            "PATH": f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin",
            "PREFECT_API_URL": svc["PREFECT_API_URL"], "MLFLOW_TRACKING_URI": svc["MLFLOW_TRACKING_URI"],
            "PREFECT_HOME": str(self.home / "prefect"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_RESULTS_PERSIST_BY_DEFAULT": "true", "PREFECT_LOCAL_STORAGE_PATH": str(results),
            "PREFECT_FLOWS_HEARTBEAT_FREQUENCY": svc["PREFECT_FLOWS_HEARTBEAT_FREQUENCY"],
            "EDGEFLOW_HOME": str(self.edgeflow_home), "EDGEFLOW_REPO": str(self.checkout),
            # the shared venv holds an editable install of the root checkout; this host imports its own copy
            "PYTHONPATH": str(self.checkout),
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "2",
        } | {k: os.environ[k] for k in ("EDGEFLOW_TORCH_THREADS",) if os.environ.get(k)}  # `make test`'s cores per worker
        self.proc: subprocess.Popen | None = None

    def _enter(self, *cmd: str) -> list[str]:
        """`cmd` as this host's user, in a mount namespace of its own (see namespace_script), and in its network
        namespace when it has one."""
        keep = [Path(sys.base_prefix).resolve(), Path(sys.prefix).resolve()]  # the interpreter and the shared venv
        return [*(self.netns.enter() if self.netns else []), "unshare", "-m", "--propagation", "private", "bash", "-c",
                namespace_script(keep), "_",
                str(self.uid), str(self.gid), *cmd]

    def as_user(self, *cmd: str) -> subprocess.CompletedProcess:
        return _run(*self._enter(*cmd), env=self.env, cwd=self.checkout)

    def write_device_config(self) -> None:
        import yaml

        path = self.edgeflow_home / "device.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(self.device))
        _run("chown", "-R", f"{self.name}:{self.name}", str(self.edgeflow_home), check=True)

    def start_worker(self) -> None:
        log = open(BASE / "logs" / f"worker-{self.key}.log", "ab")
        cmd = ([sys.executable, "-m", "edgeflow.fleet", "worker", "--profile", PROFILE] if self.device else
               [str(Path(sys.executable).parent / "prefect"), "worker", "start", "--pool", self.pool, "--name", f"host-{self.pool}"])
        self.proc = subprocess.Popen(
            self._enter(*cmd), env=self.env, cwd=self.checkout, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )

    def kill(self) -> None:
        """kill -9 every process of this host's user: the worker, the flow runs it started (Prefect gives each its
        own session, so a process group would miss them) and any edge server it runs."""
        _run("pkill", "-KILL", "-u", self.name)
        if self.proc:
            self.proc.wait(30)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                pass
        self.kill()  # whatever is left, and the device's detached edge servers

    def cache_holds(self, sha256: str) -> bool:
        return (self.edgeflow_home / "cache" / "artifacts" / sha256).is_dir()


def namespace_script(keep: list[Path]) -> str:
    """Bash run as root in a fresh mount namespace, then as the host's user ($1 uid, $2 gid, then the command).

    The shared interpreter and venv may live under a directory other users cannot enter (pyenv under /root, mode
    0700; a clone under /root). The namespace covers each such directory with an empty tmpfs and binds back only
    the paths in `keep`, so the host sees Python and the venv and nothing else of it.
    """
    hidden: dict[Path, list[Path]] = {}
    for k in dict.fromkeys(keep):
        closed = [p for p in [k, *k.parents] if p != Path("/") and not p.stat().st_mode & 0o001]
        if closed:
            hidden.setdefault(closed[-1], []).append(k)
    lines = ["set -e"]
    for i, (cover, paths) in enumerate(sorted(hidden.items())):
        for j, k in enumerate(paths):
            lines.append(f"mkdir -p /tmp/.edgeflow-ns-$$-{i}-{j} && mount --bind '{k}' /tmp/.edgeflow-ns-$$-{i}-{j}")
        lines.append(f"mount -t tmpfs -o mode=0755 tmpfs '{cover}'")
        for j, k in enumerate(paths):
            lines.append(f"mkdir -p '{k}' && mount --bind /tmp/.edgeflow-ns-$$-{i}-{j} '{k}'")
    lines.append('uid=$1 gid=$2; shift 2')
    lines.append('exec setpriv --reuid="$uid" --regid="$gid" --init-groups bash -c \'umask 002; exec "$@"\' _ "$@"')
    return "\n".join(lines) + "\n"


def _online_workers(pool: str) -> list[str]:
    from prefect.client.orchestration import get_client

    async def read():
        async with get_client() as client:
            return await client.read_workers_for_work_pool(pool)

    return [w.name for w in asyncio.run(read()) if str(getattr(w, "status", "ONLINE")).upper().endswith("ONLINE")]


@pytest.fixture(scope="module")
def hosts(teacher_dir):
    sys.path.insert(0, str(REPO / "scripts"))
    from services import service_env

    for pool in (*HOSTS, "orin2"):  # a previous session's workers and servers, if any
        _run("pkill", "-KILL", "-u", user(pool))
    servers_env = {"EDGEFLOW_HOME": str(BASE / "servers"), "EDGEFLOW_PREFECT_PORT": PREFECT_PORT,
                   "EDGEFLOW_MLFLOW_PORT": MLFLOW_PORT, "EDGEFLOW_SCHEDULES": "off", "EDGEFLOW_WORKERS": "off",
                   "EDGEFLOW_MONITORING": "off",  # the monitoring stack is held by test_release_e2e.py and tests/infra
                   "EDGEFLOW_RESULT_STORAGE": str(BASE / "results"), "EDGEFLOW_SERVICES_HOST": LAB.outer_ip}
    subprocess.run([sys.executable, "scripts/services.py", "down"], cwd=REPO, env=os.environ | servers_env, check=False)
    from tests.helpers.e2e import clear_stale_servers

    clear_stale_servers(PREFECT_PORT, MLFLOW_PORT)
    LAB.create()  # before the servers: they listen on its host-side address
    shutil.rmtree(BASE, ignore_errors=True)
    (BASE / "logs").mkdir(parents=True)
    BASE.chmod(0o755)
    (BASE / "servers").mkdir(mode=0o700)
    _run("groupadd", "-f", GROUP, check=True)
    results = BASE / "results"  # the configured result storage: one directory every host mounts at the same path
    results.mkdir()
    os.chown(results, 0, grp.getgrnam(GROUP).gr_gid)
    results.chmod(0o2770)
    subprocess.run([sys.executable, "scripts/services.py", "up"], cwd=REPO, env=os.environ | servers_env, check=True)
    svc = service_env({"home": str(BASE / "servers"), "prefect_port": PREFECT_PORT, "mlflow_port": MLFLOW_PORT, "pools": "",
                       "host": LAB.outer_ip})
    svc["PREFECT_LOCAL_STORAGE_PATH"] = str(results)
    saved = {k: os.environ.get(k) for k in svc}
    os.environ.update(svc)
    # Prefect reads its settings once, at import: point this process's clients at these servers explicitly (else they
    # start an ephemeral server of their own, which outlives this module)
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: svc["PREFECT_API_URL"]}):
        yield from _hosts(svc, results, servers_env, saved)


def _hosts(svc: dict, results: Path, servers_env: dict, saved: dict):
    hosts = {pool: Host(pool, svc, results, device=DEVICES.get(pool)) for pool in HOSTS}
    a100 = hosts["a100"]
    for h in hosts.values():
        h.home.mkdir(mode=0o700)
        _copy_checkout(h.checkout)
    # The A100 node is provisioned with the teacher (production: teacher.source local, /models/teacher); here it
    # gets the wheel's GGUF and its conversion in its own work directory, so it downloads nothing.
    from edgeflow.preflight import load_profile
    from edgeflow.model.source import teacher_dir as converted

    src_profile = load_profile(REPO / "configs" / "test-tiny.yaml")
    work = a100.checkout / ".edgeflow" / "test-multihost"
    gguf = next((src_profile.work / "cache" / "gguf").glob("*.gguf"))
    (work / "cache" / "gguf").mkdir(parents=True)
    shutil.copy2(gguf, work / "cache" / "gguf" / gguf.name)
    shutil.copytree(converted(src_profile), work / "models" / converted(src_profile).name)
    for h in hosts.values():
        _run("chown", "-R", f"{h.name}:{h.name}", str(h.home), check=True)
        if h.device:
            h.write_device_config()
        h.start_worker()
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and not all(_online_workers(p) for p in HOSTS):
        time.sleep(2)
    assert all(_online_workers(p) for p in HOSTS), {p: (BASE / "logs" / f"worker-{p}.log").read_text()[-1500:] for p in HOSTS}
    yield hosts
    for h in hosts.values():
        h.kill()  # the module is done: no run to let finish, nothing to keep
    subprocess.run([sys.executable, "scripts/services.py", "down"], cwd=REPO, env=os.environ | servers_env, check=False)
    LAB.remove()
    _remove_all_but_logs()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def _remove_all_but_logs() -> None:
    """The hosts' checkouts, caches, the servers' store and the result storage are gigabytes: removed once the module is
    done (EDGEFLOW_KEEP_TEST_HOSTS=1 keeps them for a look); the workers' logs stay."""
    if os.environ.get("EDGEFLOW_KEEP_TEST_HOSTS") == "1":
        return
    for path in BASE.iterdir():
        if path.name != "logs":
            shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)


def _stage_runs(c, release_id: str) -> list:
    exp = c.get_experiment_by_name("edgeflow-multihost")
    return c.search_runs([exp.experiment_id], f"tags.`edgeflow.release_id` = '{release_id}' and tags.`edgeflow.stage` != ''",
                         max_results=500)


def test_a_release_across_three_hosts_runs_each_stage_on_its_pool_and_serves_from_the_orin(hosts):
    import httpx
    import psutil
    from mlflow import MlflowClient

    from edgeflow.preflight import load_profile
    from tests.helpers.e2e import stage_flow_runs

    # the hosts cannot read each other's files, nor the servers'
    for h in hosts.values():
        assert h.home.stat().st_mode & 0o777 == 0o700
        for other in hosts.values():
            if other is not h:
                assert h.as_user("cat", str(other.checkout / "pyproject.toml")).returncode != 0, (h.name, other.name)
                assert h.as_user("ls", str(other.edgeflow_home)).returncode != 0
        assert h.as_user("ls", str(BASE / "servers")).returncode != 0
        assert h.as_user("cat", str(h.checkout / "pyproject.toml")).returncode == 0  # its own, it reads

    profile = load_profile(REPO / PROFILE)
    fr = run_deployment("release/release", parameters={"profile": PROFILE, "deploy": "pool"}, timeout=2400)
    assert fr.state.is_completed(), f"release ended {fr.state.type}: {fr.state.message}"
    report = fr.state.result()
    assert report["staging"] and report["deploy"]

    # every stage's flow run ran on its pool, as a subflow of the release
    placed = stage_flow_runs(report["release_id"])
    assert {s: {r.work_pool_name for r in runs} for s, runs in placed.items()} == {
        s: {p} for s, p in profile.placement.pooled().items()}
    assert all(r.parent_task_run_id and r.state.is_completed() for runs in placed.values() for r in runs)
    # ...on that pool's host: the MLflow stage runs name the Linux user, EDGEFLOW_HOME and flow run that ran them
    c = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    by_stage = {r.data.tags["edgeflow.stage"]: r for r in _stage_runs(c, report["release_id"])}
    host = socket.gethostname()
    expect = {"distill": "a100", "calibrate": "cpu", "quantize-awq-w4a16": "a100", "quantize-gptq-w4a16": "a100",
              "build-engine-fp32": "orin", "build-engine-awq-w4a16": "orin", "gate-reference": "a100",
              "consistency": "orin", "register": "cpu"}
    for stage, pool in expect.items():
        tags = by_stage[stage].data.tags
        assert tags["edgeflow.host"] == f"{user(pool)}@{host}", (stage, tags)
        assert tags["edgeflow.home"] == str(hosts[pool].edgeflow_home), (stage, tags)
    codes = {r.data.tags["edgeflow.code"] for r in by_stage.values()}
    assert len(codes) == 1  # three checkouts, one code identity

    # every hand-off was fetched from the store into the consumer's own cache (a host cannot read another's files,
    # so a cached copy there came over HTTP; materialize checks the sha256 before it keeps one)
    gate = json.loads(Path(c.download_artifacts(by_stage["consistency"].info.run_id, "gate/gate-attempt0.json")).read_text())
    rows = {r["name"]: r for r in gate["rows"]}
    student = rows["fp32"]["checkpoint"]
    for name, row in rows.items():
        ckpt, engine = row["checkpoint"], row["engine"]
        assert ckpt["uri"].startswith("mlflow-artifacts:/") and engine["uri"].startswith("mlflow-artifacts:/")
        assert hosts["orin"].cache_holds(ckpt["sha256"]), name  # a100 → orin: the build's input
        if row["passed"] and row["quantized"]:
            assert hosts["cpu"].cache_holds(ckpt["sha256"]) and hosts["cpu"].cache_holds(engine["sha256"])  # → register
    assert hosts["a100"].cache_holds(gate["calibration"]["sha256"])  # cpu → a100: quantize's input
    assert hosts["orin"].cache_holds(gate["reference"]["sha256"])  # a100 → orin: the gate's FP reference
    assert hosts["cpu"].cache_holds(student["sha256"])  # a100 → cpu: calibration tokenizes with the student
    # the engine gate ran on the orin host, against the engines it built there
    assert by_stage["consistency"].data.tags["edgeflow.host"] == f"{user('orin')}@{host}"

    # the served answer comes from a server the orin host started
    url = f"http://127.0.0.1:{profile.deploy.port}"
    listeners = [cn for cn in psutil.net_connections("tcp") if cn.laddr.port == profile.deploy.port and cn.status == "LISTEN"]
    assert listeners and {psutil.Process(cn.pid).username() for cn in listeners} == {user("orin")}
    r = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
        "model": profile.registry.model_name, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] is not None
    assert (hosts["orin"].checkout / profile.deploy.install_dir).is_dir()  # installed in the orin host's own tree


def test_a_stage_killed_mid_build_resumes_on_retry_without_rerunning_upstream_stages(hosts, tmp_path):
    """kill -9 the orin worker while it builds engines: the zombie automation marks the stage Crashed, the release
    fails; restart the worker, Retry the release through the API: it completes, no upstream stage writes a new MLflow
    run, the build's orphaned MLflow run is KILLED, and each variant is registered once."""
    import yaml
    from mlflow import MlflowClient

    from tests.helpers.e2e import stage_flow_runs

    # Another engine build option: the build is new, everything upstream is the first test's (cached, across hosts)
    data = yaml.safe_load((REPO / PROFILE).read_text())
    data["name"] = "test-multihost-retry"
    data["engine"]["profile"] = {"max_candidates": 4095}
    data["registry"]["model_name"] = "edgeflow-multihost-retry"
    rel = "configs/test-multihost-retry.yaml"
    cpu = hosts["cpu"]
    (cpu.checkout / rel).write_text(yaml.safe_dump(data))  # only the release's host reads the profile
    os.chown(cpu.checkout / rel, cpu.uid, cpu.gid)

    c = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    fr = run_deployment("release/release", parameters={"profile": rel, "deploy": "none"}, timeout=0)
    deadline = time.monotonic() + 900
    building = None
    while time.monotonic() < deadline and building is None:
        runs = c.search_runs([c.get_experiment_by_name("edgeflow-multihost").experiment_id],
                             "tags.`edgeflow.stage` LIKE 'build-engine-%' and attributes.status = 'RUNNING'")
        building = next((r for r in runs if r.data.tags.get("edgeflow.profile") == rel), None)
        time.sleep(0.2)
    assert building is not None, "the engine build never started"
    hosts["orin"].kill()  # kill -9: the worker and the flow run building the engine

    run = wait_final(fr.id, 600)  # the zombie automation needs ~90 s without heartbeats
    assert run.state.is_failed(), run.state
    release_id = c.get_run(building.info.run_id).data.tags["edgeflow.release_id"]
    [crashed] = [r for r in stage_flow_runs(release_id)["build_engine"]]
    assert crashed.state.is_crashed(), crashed.state
    # the message the fault table quotes: the release failed naming the stage, its pool and how its run ended
    msg = run.state.message
    assert f"stage build_engine (deployment build-engine/build-engine, pool orin): flow run {crashed.id} ended CRASHED" in msg, msg
    before = {r.info.run_id: r.data.tags["edgeflow.stage"] for r in _stage_runs(c, release_id)}
    assert not any(s.startswith(("distill", "calibrate", "quantize")) for s in before.values())  # cached from the first test

    hosts["orin"].start_worker()

    retry_flow_run(fr.id, "Retry after kill -9")
    run = wait_final(fr.id, 1500, runs=2)
    assert run.state.is_completed(), f"retried release ended {run.state.type}: {run.state.message}"
    after = {r.info.run_id: r for r in _stage_runs(c, release_id)}
    new = {r.data.tags["edgeflow.stage"] for rid, r in after.items() if rid not in before}
    assert not any(s.startswith(("distill", "calibrate", "quantize")) for s in new), new
    assert {"build-engine-fp32", "consistency", "register"} <= new
    assert c.get_run(building.info.run_id).info.status == "KILLED"
    versions = c.search_model_versions("name = 'edgeflow-multihost-retry'")
    assert sorted(v.tags["edgeflow.variant"] for v in versions) == sorted(set(v.tags["edgeflow.variant"] for v in versions))
    assert {v.tags["edgeflow.release_id"] for v in versions} == {release_id}


# --------------------------------------------------------------------------------------------
# The fleet: two devices (orin-a, the orin host; orin-b, a fourth Linux user), a real Prometheus scraping both
# --------------------------------------------------------------------------------------------


class Load:
    """Steady client traffic on every device's stable port (one request in flight per device), bounded in count."""

    def __init__(self, urls: dict[str, str], model: str, limit: int = 3000):
        import threading

        self.urls, self.model, self.limit = urls, model, limit
        self.stop_event = threading.Event()
        self.results: dict[str, list[str]] = {d: [] for d in urls}
        self.threads = [threading.Thread(target=self._run, args=(d,), daemon=True) for d in urls]

    def _run(self, device: str) -> None:
        import httpx

        with httpx.Client(timeout=60) as client:  # keep-alive: a connection outlives the switch
            while not self.stop_event.is_set() and len(self.results[device]) < self.limit:
                try:
                    r = client.post(f"{self.urls[device]}/v1/chat/completions", json={
                        "model": self.model, "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 4})
                    self.results[device].append(str(r.status_code))
                except Exception as e:  # noqa: BLE001 - every failure is counted, none hidden
                    self.results[device].append(f"{type(e).__name__}: {e}")
                time.sleep(0.25)  # a few requests a second: steady, and leaves the 2 cores to the rollout

    def __enter__(self) -> "Load":
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop_event.set()
        for t in self.threads:
            t.join(timeout=90)

    def failures(self) -> dict[str, list[str]]:
        return {d: [x for x in rs if x != "200"] for d, rs in self.results.items()}


@pytest.fixture(scope="module")
def fleet(hosts):
    """orin-b joins (its own user, checkout, ports and device worker, in its own network namespace: LAB); Prometheus
    scrapes both devices by the inventory's file_sd targets, every second. orin-b's stable port answers here through
    LAB's forwarder, as it answers its own clients on the device: not over the link the cut-off test cuts."""
    orin = hosts["orin"]
    # The kill -9 test took orin-a's edge servers down with its worker: the device's boot command (what
    # edgeflow-edge-server.service runs) serves its current version again, then the device re-registers.
    for cmd in (["-m", "edgeflow.device.boot", "--profile", PROFILE], ["-m", "edgeflow.fleet", "register", "--profile", PROFILE]):
        r = orin.as_user(sys.executable, *cmd)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    svc = {k: orin.env[k] for k in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI", "PREFECT_FLOWS_HEARTBEAT_FREQUENCY")}
    b = Host("orin2", svc, BASE / "results", pool="orin", device=DEVICE_B, netns=LAB)
    LAB.forward(DEVICE_B["deploy"]["port"])
    b.home.mkdir(mode=0o700)
    _copy_checkout(b.checkout)
    _run("chown", "-R", f"{b.name}:{b.name}", str(b.home), check=True)
    b.write_device_config()
    b.start_worker()
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and "device-orin-b" not in _online_workers("orin"):
        time.sleep(2)
    assert "device-orin-b" in _online_workers("orin"), (BASE / "logs" / "worker-orin2.log").read_text()[-1500:]

    prom = BASE / "prometheus"
    prom.mkdir()
    targets = prom / "devices.json"
    subprocess.run([sys.executable, "-m", "edgeflow.fleet", "targets", "--pool", "orin", "--out", str(targets)], cwd=REPO,
                   env=os.environ, check=True)
    (prom / "prometheus.yml").write_text(json.dumps({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [{"job_name": "edgeflow-edge", "metrics_path": "/metrics",
                            "file_sd_configs": [{"files": [str(targets)], "refresh_interval": "1s"}]}]}))
    proc = subprocess.Popen(["prometheus", f"--config.file={prom / 'prometheus.yml'}", f"--storage.tsdb.path={prom / 'data'}",
                             f"--web.listen-address=127.0.0.1:{PROMETHEUS_PORT}"],
                            stdout=open(prom / "prometheus.log", "w"), stderr=subprocess.STDOUT)
    import httpx

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{PROMETHEUS_PORT}/-/ready", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.5)
    yield {"orin-a": orin, "orin-b": b, "cpu": hosts["cpu"], "prometheus": f"http://127.0.0.1:{PROMETHEUS_PORT}",
           "targets": targets}
    proc.terminate()
    proc.wait(30)
    b.kill()


def _proxy_log(host: Host) -> str:
    """The end of a device's proxy log: why it answered 502 (an edge server it could not reach), if it did."""
    logs = sorted(host.home.glob("**/edge-proxy.log"))
    return "".join(f"{p}: {p.read_text()[-1500:]}" for p in logs) or f"no edge-proxy.log under {host.home}"


def _deployments(c, device: str) -> list:
    exp = c.get_experiment_by_name("edgeflow-deployments")
    return c.search_runs([exp.experiment_id], f"tags.`edgeflow.device_id` = '{device}'", order_by=["attributes.start_time DESC"])


PORTS = {"orin-a": 8775, "orin-b": DEVICE_B["deploy"]["port"]}


def test_devices_register_with_their_facts_and_a_targeted_deploy_runs_on_the_named_device(fleet):
    import psutil
    from mlflow import MlflowClient

    from edgeflow.pipeline.inventory_store import read_inventory

    c = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    staging = c.get_model_version_by_alias("edgeflow-multihost", "staging").version
    records = {r.id: r for r in read_inventory("orin")}
    assert sorted(records) == ["orin-a", "orin-b"]
    a, b = records["orin-a"], records["orin-b"]
    assert (a.queue, b.queue) == ("device-orin-a", "device-orin-b") and a.tags["ring"] == "canary"
    assert a.facts["mem_total_mb"] and "sku" in a.tags  # detected, merged into the tags rollouts target
    assert a.serving.version == staging and a.serving.healthy  # the release deployed staging on orin-a
    assert b.serving.version is None and b.metrics_target == "127.0.0.1:8785"
    listing = subprocess.run([sys.executable, "-m", "edgeflow.fleet", "list", "--pool", "orin"], cwd=REPO, env=os.environ,
                             capture_output=True, text=True, check=True).stdout
    rows = {line.split()[0]: line for line in listing.splitlines()[1:]}
    assert "device-orin-b" in rows["orin-b"] and "online" in rows["orin-b"] and f"v{staging}" in rows["orin-a"]

    # a deploy sent to orin-b's queue runs there: its worker, its ports, its install dir, its name on the record
    fr = run_deployment("deploy-edge/deploy-edge", parameters={"profile": PROFILE, "alias": "staging"},
                        work_queue_name="device-orin-b", timeout=900)
    assert fr.state.is_completed(), fr.state.message
    assert fr.work_queue_name == "device-orin-b"
    listeners = LAB.listeners(8785)  # inside orin-b's namespace; here, 8785 is LAB's forwarder
    assert listeners and {psutil.Process(pid).username() for pid in listeners} == {user("orin2")}
    assert served_version(8785, "edgeflow-multihost") == staging
    [record, *_] = _deployments(c, "orin-b")
    assert record.data.tags["edgeflow.version"] == staging and record.info.status == "FINISHED"
    assert record.data.tags["edgeflow.device_dir"].startswith(str(fleet["orin-b"].checkout))
    assert read_inventory("orin")[1].serving.version == staging  # the record now says what orin-b serves


def _rollout_waves(flow_run_id) -> list[str]:
    return sorted(r.name for r in child_flow_runs(flow_run_id) if r.name.startswith("wave "))


def test_a_good_candidate_goes_canary_first_then_the_rest_and_production_moves(fleet):
    """…and a second rollout of the fleet, started while the first is at work, is refused naming the first."""
    from mlflow import MlflowClient

    from edgeflow.fleet.rollout import find_state
    from edgeflow.tracking.registry import alias_version

    c = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    serving = c.get_model_version_by_alias("edgeflow-multihost", "staging").version  # on both devices, not yet production
    candidate = next(v.version for v in c.search_model_versions("name = 'edgeflow-multihost'") if v.version != serving)
    production_before = alias_version(c, "edgeflow-multihost", "production")  # None: no rollout has moved it yet
    with Load({d: f"http://127.0.0.1:{p}" for d, p in PORTS.items()}, "edgeflow-multihost") as load:
        fr = run_deployment("rollout/rollout", parameters={"profile": PROFILE, "version": candidate}, timeout=0)
        wait_for_rollout_state(fr.id, lambda s: True)  # planned: this rollout holds the fleet now
        # a second rollout of the same fleet, started as a user would (a deployment run on the cpu pool) while the
        # first is at work: refused at its first step, naming the first, before it plans or touches a device
        second = run_deployment("rollout/rollout", parameters={"profile": PROFILE, "version": candidate}, timeout=600)
        assert second.state.is_failed(), second.state
        assert f"rollout refused: flow run {fr.name!r} ({fr.id}) of rollout is already at work on orin" in second.state.message, second.state.message
        assert f"prefect flow-run cancel {fr.id}" in second.state.message
        assert child_flow_runs(second.id) == [] and find_state(str(second.id)) is None  # no wave, no deploy, no state
        assert alias_version(c, "edgeflow-multihost", "production") == production_before
        fr = wait_final(fr.id, 1800)
    assert fr.state.is_completed(), fr.state.message
    state = fr.state.result()
    assert [w["devices"] for w in state["waves"]] == [["orin-a"], ["orin-b"]]  # the canary, then the rest
    assert [w["status"] for w in state["waves"]] == ["passed", "passed"] and state["status"] == "completed"
    for w in state["waves"]:
        [probe] = w["probes"]
        assert probe["passed"] and probe["prompts"] == 6 and probe["agreement"] >= probe["gate_agreement"] - probe["tolerance"]
        assert probe["same_as_gate"] == 1.0  # the device answers exactly as the gate engine did
        [figures] = w["watch"]["wave"]
        assert figures["scraped"] and figures["requests"] >= 3 and figures["errors_5xx"] == 0
    assert state["waves"][0]["watch"]["baseline"]["device"] == "orin-b"  # the canary was compared with the old version
    assert c.get_model_version_by_alias("edgeflow-multihost", "production").version == candidate
    assert {d: served_version(p, "edgeflow-multihost") for d, p in PORTS.items()} == {"orin-a": candidate, "orin-b": candidate}
    assert load.failures() == {"orin-a": [], "orin-b": []}, (load.failures(), _proxy_log(fleet["orin-a"]), _proxy_log(fleet["orin-b"]))
    assert all(len(r) >= 5 for r in load.results.values())
    # the Prefect UI shows each wave as a subflow run named by its devices
    assert _rollout_waves(fr.id) == ["wave 0: ['orin-a']", "wave 1: ['orin-b']"]
    rollouts = c.search_runs([c.get_experiment_by_name("edgeflow-rollouts").experiment_id],
                             f"tags.`edgeflow.prefect_flow_run_id` = '{fr.id}'")
    assert rollouts[0].data.tags["edgeflow.rollout_status"] == "completed" and rollouts[0].info.status == "FINISHED"


@pytest.mark.extended  # `make test-all` only: docs/development/tests.md
def test_a_rollout_killed_in_its_second_wave_resumes_there_on_retry_and_the_canary_is_not_redeployed(fleet):
    """kill -9 of the rollout's process (the cpu host's worker and every flow run it started) once wave 0 passed and
    wave 1 began. The zombie automation marks the rollout Crashed; Retry, as the Prefect UI sends it, resumes at wave 1
    from the state the rollout persisted: orin-a (wave 0) is not deployed again, both devices end on the version,
    `production` moves, and the registry's rollout record says what the devices serve."""
    from mlflow import MlflowClient

    from edgeflow.fleet.rollout import find_state
    from edgeflow.pipeline.inventory_store import read_inventory

    c = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    name = "edgeflow-multihost"
    production = c.get_model_version_by_alias(name, "production").version
    target = next(v.version for v in c.search_model_versions(f"name = '{name}'") if v.version != production)
    deploys_before = {r.id for r in flow_runs_of("deploy-edge")}
    fr = run_deployment("rollout/rollout", parameters={"profile": PROFILE, "version": target}, timeout=0)
    wait_for_rollout_state(fr.id, lambda s: s.waves[0].status == "passed" and s.waves[1].status == "deploying", 900)
    fleet["cpu"].kill()  # kill -9: the rollout's process dies in wave 1
    crashed = wait_final(fr.id, 600)  # the zombie automation: ~90 s without heartbeats
    assert crashed.state.is_crashed(), crashed.state
    before = find_state(str(fr.id))
    assert before.waves[1].status == "deploying"  # what the Retry resumes from
    assert before.waves[0].status == "passed" and before.waves[0].started_at, before.waves[0]

    fleet["cpu"].start_worker()

    retry_flow_run(fr.id, "Retry from the UI")
    done = wait_final(fr.id, 1500, runs=2)
    assert done.state.is_completed(), f"the retried rollout ended {done.state.type}: {done.state.message}"
    state = done.state.result()
    assert [w["status"] for w in state["waves"]] == ["passed", "passed"] and state["status"] == "completed", state
    # wave 0's device was deployed once, by the run before the kill; the Retry deployed only wave 1's
    new = [r for r in flow_runs_of("deploy-edge") if r.id not in deploys_before and r.parameters.get("version") == target]
    by_device = {q: [r for r in new if r.work_queue_name == q] for q in ("device-orin-a", "device-orin-b")}
    assert len(by_device["device-orin-a"]) == 1, [(r.name, r.state_type) for r in new]
    assert by_device["device-orin-b"], [(r.name, r.state_type) for r in new]
    assert c.get_model_version_by_alias(name, "production").version == target
    assert {d: served_version(p, name) for d, p in PORTS.items()} == {"orin-a": target, "orin-b": target}
    record = find_state(str(fr.id))  # the registry's record of the rollout matches the devices
    assert record.status == "completed" and record.version == target
    # the Retry skipped the passed wave: its persisted record (start time, probes, watch, verdict) is the one the
    # killed run wrote, not a second pass over it (Prefect would hand a re-entered wave the old subflow's result)
    assert record.waves[0] == before.waves[0], (record.waves[0], before.waves[0])
    assert record.waves[1].started_at != before.waves[1].started_at  # wave 1 was deployed again, from its start
    assert {r.id: r.serving.version for r in read_inventory("orin")} == {"orin-a": target, "orin-b": target}


@pytest.mark.extended  # `make test-all` only: docs/development/tests.md
def test_a_candidate_that_degrades_on_the_device_stops_at_the_canary_and_rolls_back(fleet):
    """The version passed the gate and every registry check; on orin-a it answers wrongly (the server's chaos flag,
    set for that version in the device's own config). The canary's probe catches it: orin-a is rolled back, orin-b is
    never touched, `production` does not move, and no client request fails on either device."""
    from mlflow import MlflowClient

    c = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    production = c.get_model_version_by_alias("edgeflow-multihost", "production").version
    bad = next(v.version for v in c.search_model_versions("name = 'edgeflow-multihost'") if v.version != production)
    b_records = len(_deployments(c, "orin-b"))
    a = fleet["orin-a"]
    a.device = DEVICES["orin"] | {"faults": {bad: {"fault_corrupt_every": 1}}}
    a.write_device_config()
    try:
        with Load({d: f"http://127.0.0.1:{p}" for d, p in PORTS.items()}, "edgeflow-multihost") as load:
            fr = run_deployment("rollout/rollout", parameters={"profile": PROFILE, "version": bad}, timeout=1800)
    finally:
        a.device = DEVICES["orin"]
        a.write_device_config()
    assert fr.state.is_failed()
    msg = fr.state.message
    assert "wave 0 breached: orin-a: probe on orin-a: agreement with the FP reference" in msg and "BELOW" in msg, msg
    assert f"rolled back: orin-a -> {production}" in msg and f"production unchanged (v{production})" in msg, msg
    assert c.get_model_version_by_alias("edgeflow-multihost", "production").version == production
    assert {d: served_version(p, "edgeflow-multihost") for d, p in PORTS.items()} == {"orin-a": production, "orin-b": production}
    assert load.failures() == {"orin-a": [], "orin-b": []} and all(len(r) >= 5 for r in load.results.values())
    # the records: orin-a ran the bad version, then was rolled back, saying why; orin-b was not deployed to
    back, switched, *_ = _deployments(c, "orin-a")
    assert (switched.data.tags["edgeflow.version"], switched.info.status) == (bad, "FINISHED")
    assert back.data.tags["edgeflow.version"] == production and back.info.status == "FINISHED"
    assert back.data.tags["edgeflow.reason"].startswith(f"rollback of v{bad} after wave 0: orin-a: probe on orin-a")
    assert len(_deployments(c, "orin-b")) == b_records  # the rollout never reached orin-b
    [rollout] = c.search_runs([c.get_experiment_by_name("edgeflow-rollouts").experiment_id],
                              f"tags.`edgeflow.prefect_flow_run_id` = '{fr.id}'")
    assert rollout.data.tags["edgeflow.rollout_status"] == "rolled_back" and rollout.info.status == "FAILED"
    assert _rollout_waves(fr.id) == ["wave 0: ['orin-a']"]


@pytest.mark.extended  # `make test-all` only: docs/development/tests.md
def test_both_devices_ship_their_logs_and_the_nightly_counts_each_devices_lines(fleet):
    """The rollouts' client traffic is in each device's access log, cut into segments every 5 s. Each device's own
    ship-logs deployment (created by its worker, on its queue) takes them home; a second run ships nothing twice; the
    nightly reads the shipped segments from the store and counts each device's lines."""
    import yaml

    time.sleep(6)  # the segment timer cuts the lines of the last test
    shipped = {}
    for device in ("orin-a", "orin-b"):
        fr = run_deployment(f"ship-logs/ship-logs-{device}", timeout=600)
        assert fr.state.is_completed(), fr.state.message
        assert fr.work_queue_name == f"device-{device}"
        report = fr.state.result()
        assert report["device_id"] == device and report["lines"] > 0 and report["uploaded"], report
        shipped[device] = report["lines"]
        if device == "orin-b":  # a second run ships only segments cut since, never the same one (more in test_logship.py)
            again = run_deployment(f"ship-logs/ship-logs-{device}", timeout=600).state.result()
            assert sum(e["lines"] for e in again["uploaded"]) == again["lines"]
            assert not set(e["sha256"] for e in again["uploaded"]) & set(e["sha256"] for e in report["uploaded"])
            shipped[device] += again["lines"]

    # the nightly over the store: more records wanted than were shipped, so it counts, reports and skips
    data = yaml.safe_load((REPO / PROFILE).read_text())
    data["name"] = "test-multihost-nightly"
    data["nightly"] = {"min_records": 1_000_000, "base_alias": "production"}
    rel = "configs/test-multihost-nightly.yaml"
    cpu = fleet["cpu"]
    (cpu.checkout / rel).write_text(yaml.safe_dump(data))
    os.chown(cpu.checkout / rel, cpu.uid, cpu.gid)
    fr = run_deployment("nightly-recalibration/nightly-recalibration", timeout=900,
                        parameters={"profile": rel, "deploy": "none"})
    assert fr.state.is_completed(), fr.state.message
    night = fr.state.result()
    assert night["status"] == "skipped", night
    assert night["traffic"]["per_device"] == shipped, (night["traffic"], shipped)


@pytest.mark.extended  # `make test-all` only: docs/development/tests.md
def test_a_worker_with_other_code_refuses_the_stage_naming_both_versions(hosts):

    orin = hosts["orin"]
    orin.stop()
    with open(orin.checkout / "edgeflow" / "tracking" / "store.py", "a") as f:
        f.write("\n# a local edit on the device\n")
    orin.start_worker()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not _online_workers("orin"):
        time.sleep(2)
    fr = run_deployment("release/release", parameters={"profile": PROFILE, "deploy": "none"}, timeout=1800)
    assert fr.state.is_failed()
    msg = fr.state.message
    assert "CodeMismatchError" in msg and "stage build_engine" in msg and "this worker runs edgeflow 0.1.0+" in msg, msg
    assert "the release was started with 0.1.0+" in msg


def test_a_device_cut_off_during_a_wave_keeps_serving_fails_the_rollout_closed_and_catches_up_on_its_return(fleet):
    """orin-b's network link goes down (LAB.cut: its veth to the servers' namespace) the moment orin-b switched to the
    candidate in wave 1. Everything on orin-b runs on: its edge server, its worker, the deploy run that switched, which
    can no longer report. That run's heartbeats stop, the zombie automation marks it Crashed, and the wave breaches
    naming orin-b; orin-a is rolled back, the rollback of orin-b is never picked up (cancelled after
    rollout.pickup_timeout_s), and `production` does not move. orin-b keeps answering its own clients all along. When
    the link is back, its worker polls again, its own reconcile deployment brings it to `production`, and none of the
    cancelled runs ever runs: the worker took the reconcile run from the same queue, and they stay cancelled."""
    import threading

    import httpx
    import yaml
    from mlflow import MlflowClient


    c = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    name = "edgeflow-multihost"
    production = c.get_model_version_by_alias(name, "production").version
    candidate = next(v.version for v in c.search_model_versions(f"name = '{name}'") if v.version != production)
    data = yaml.safe_load((REPO / PROFILE).read_text())
    # how long a wave waits for a device's worker to take a run: orin-b's rollback is never taken, so the rollout waits
    # this long before it cancels it. The runs that are taken (orin-a's deploy in wave 0 took over 30 s on a loaded
    # 2-core box) keep the profile's deploy_timeout_s.
    data["rollout"]["pickup_timeout_s"] = 45
    rel = "configs/test-multihost-cutoff.yaml"
    for h in (fleet["cpu"], fleet["orin-a"], fleet["orin-b"]):  # each host reads the profile from its own checkout
        (h.checkout / rel).write_text(yaml.safe_dump(data))
        os.chown(h.checkout / rel, h.uid, h.gid)
    b = fleet["orin-b"]
    b_records = len(_deployments(c, "orin-b"))
    answers: list[int | str] = []
    cut = threading.Event()

    def cut_off_when_switched() -> None:
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline and not cut.is_set():
            try:
                r = httpx.post(f"http://127.0.0.1:{PORTS['orin-b']}/v1/chat/completions", timeout=60, json={
                    "model": name, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
            except httpx.HTTPError as e:  # counted (the assertion below wants none), and the watch goes on
                answers.append(f"{type(e).__name__}: {e}")
                continue
            answers.append(r.status_code)
            if r.status_code == 200 and r.json()["system_fingerprint"] == candidate:
                LAB.cut()
                cut.set()
            time.sleep(0.2)

    watcher = threading.Thread(target=cut_off_when_switched, daemon=True)
    watcher.start()
    try:
        fr = run_deployment("rollout/rollout", parameters={"profile": rel, "version": candidate}, timeout=1800)
        watcher.join(60)
        assert not LAB.is_up()  # cut until here: the rollout ended without orin-b
    finally:
        cut.set()
        LAB.restore()
    assert cut.is_set(), (f"orin-b never served the candidate; the rollout ended {fr.state.type.value}: {fr.state.message}; "
                          f"answers {answers[-5:]}; {_proxy_log(b)}")
    assert fr.state.is_failed(), fr.state.message
    msg = fr.state.message
    assert "wave 1 breached: orin-b" in msg and "rollback FAILED" in msg and f"production unchanged (v{production})" in msg, msg
    assert "lost mid-run" in msg, msg  # the wave's deploy on orin-b: switched, then never heard of again
    assert "not picked up within rollout.pickup_timeout_s=45 s" in msg, msg  # the rollback's run, cancelled unrun
    assert c.get_model_version_by_alias(name, "production").version == production
    assert served_version(PORTS["orin-a"], name) == production  # rolled back
    assert served_version(PORTS["orin-b"], name) == candidate  # cut off: kept serving what it had
    assert answers and set(answers) == {200}, (answers, _proxy_log(b))  # answered all along, through the switch and the cut

    # the link is back (restored above): the worker that ran through the cut polls again
    assert b.proc.poll() is None, f"orin-b's worker exited while cut off: {(BASE / 'logs' / 'worker-orin2.log').read_text()[-2000:]}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and "device-orin-b" not in _online_workers("orin"):
        time.sleep(2)
    fr = run_deployment("reconcile-edge/reconcile-orin-b", parameters={"profile": PROFILE}, timeout=900)
    assert fr.state.is_completed(), fr.state.message
    assert fr.state.result()["action"] == "deploy" and fr.work_queue_name == "device-orin-b"
    assert served_version(PORTS["orin-b"], name) == production
    # the runs the rollout cancelled for orin-b (never picked up): still cancelled now that its worker has polled its
    # queue again and taken the later reconcile run from it
    cancelled = [r for r in flow_runs_of("deploy-edge") + flow_runs_of("probe-edge")
                 if r.work_queue_name == "device-orin-b" and r.state and r.state.is_cancelled()
                 and "not picked up within rollout.pickup_timeout_s" in (r.state.message or "")]
    assert cancelled, "the rollout cancelled no run of orin-b's"
    for r in cancelled:
        history = [st.type.value for st in flow_run_states(r.id)]
        assert read_flow_run(r.id).state.is_cancelled() and "RUNNING" not in history, (r.name, history)
    records = _deployments(c, "orin-b")
    new = records[: len(records) - b_records]  # newest first; the wave's own deploy may record late, once it reaches MLflow
    reconciled = [r for r in new if r.data.tags["edgeflow.reason"].startswith("reconcile: serves v" + candidate)]
    assert reconciled and reconciled[0].data.tags["edgeflow.version"] == production, [r.data.tags for r in new]
    assert reconciled[0].info.status == "FINISHED", reconciled[0].data.tags
    assert not [r for r in new if r.data.tags["edgeflow.reason"].startswith("rollback of")]  # the cancelled run never ran
