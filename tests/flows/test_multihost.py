"""Three hosts on one machine that share only HTTP and a result-storage directory.

Each simulated host (a100, orin, cpu) is its own Linux user with its own checkout copy, EDGEFLOW_HOME and work
directory, all mode 0700, running its own Prefect worker (the virtual environment is shared read-only). They
share the Prefect API, the MLflow server (its proxied artifact store) and Prefect's result storage, as README's
"Running across hosts" describes. A release with every stage pool-placed (configs/test-multihost.yaml) must run
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

REPO = Path(__file__).resolve().parents[2]
# Outside the checkout: a clone may sit under a directory other users cannot enter (/root). /var/tmp is 1777.
BASE = Path(os.environ.get("EDGEFLOW_TEST_HOSTS_DIR", "/var/tmp/edgeflow-hosts"))
HOSTS = ("a100", "orin", "cpu")
GROUP = "edgeflow-hosts"
PROFILE = "configs/test-multihost.yaml"
PREFECT_PORT, MLFLOW_PORT = os.environ.get("EDGEFLOW_TEST_MH_PREFECT_PORT", "4330"), os.environ.get("EDGEFLOW_TEST_MH_MLFLOW_PORT", "5085")
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
    """One simulated host: a Linux user, its home (0700), checkout, EDGEFLOW_HOME and worker."""

    def __init__(self, pool: str, svc: dict[str, str], results: Path):
        self.pool, self.name = pool, user(pool)
        self.home = BASE / pool
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
        }
        self.proc: subprocess.Popen | None = None

    def _enter(self, *cmd: str) -> list[str]:
        """`cmd` as this host's user, in a mount namespace of its own (see namespace_script)."""
        keep = [Path(sys.base_prefix).resolve(), Path(sys.prefix).resolve()]  # the interpreter and the shared venv
        return ["unshare", "-m", "--propagation", "private", "bash", "-c", namespace_script(keep), "_",
                str(self.uid), str(self.gid), *cmd]

    def as_user(self, *cmd: str) -> subprocess.CompletedProcess:
        return _run(*self._enter(*cmd), env=self.env)

    def start_worker(self) -> None:
        log = open(BASE / "logs" / f"worker-{self.pool}.log", "ab")
        self.proc = subprocess.Popen(
            self._enter(str(Path(sys.executable).parent / "prefect"), "worker", "start", "--pool", self.pool,
                        "--name", f"host-{self.pool}"),
            env=self.env, cwd=self.checkout, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
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

    for pool in HOSTS:  # a previous session's workers and servers, if any
        _run("pkill", "-KILL", "-u", user(pool))
    servers_env = {"EDGEFLOW_HOME": str(BASE / "servers"), "EDGEFLOW_PREFECT_PORT": PREFECT_PORT,
                   "EDGEFLOW_MLFLOW_PORT": MLFLOW_PORT, "EDGEFLOW_SCHEDULES": "off", "EDGEFLOW_WORKERS": "off",
                   "EDGEFLOW_RESULT_STORAGE": str(BASE / "results")}
    subprocess.run([sys.executable, "scripts/services.py", "down"], cwd=REPO, env=os.environ | servers_env, check=False)
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
    svc = service_env({"home": str(BASE / "servers"), "prefect_port": PREFECT_PORT, "mlflow_port": MLFLOW_PORT, "pools": ""})
    svc["PREFECT_LOCAL_STORAGE_PATH"] = str(results)
    saved = {k: os.environ.get(k) for k in svc}
    os.environ.update(svc)
    # Prefect reads its settings once, at import: point this process's clients at these servers explicitly (else they
    # start an ephemeral server of their own, which outlives this module)
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: svc["PREFECT_API_URL"]}):
        yield from _hosts(svc, results, servers_env, saved)


def _hosts(svc: dict, results: Path, servers_env: dict, saved: dict):
    hosts = {pool: Host(pool, svc, results) for pool in HOSTS}
    a100 = hosts["a100"]
    for h in hosts.values():
        h.home.mkdir(mode=0o700)
        _copy_checkout(h.checkout)
    # The A100 node is provisioned with the teacher (production: teacher.source local, /models/teacher); here it
    # gets the wheel's GGUF and its conversion in its own work directory, so it downloads nothing.
    from tasks.config import load_profile
    from tasks.model_source import teacher_dir as converted

    src_profile = load_profile(REPO / "configs" / "test-tiny.yaml")
    work = a100.checkout / ".edgeflow" / "test-multihost"
    gguf = next((src_profile.work / "cache" / "gguf").glob("*.gguf"))
    (work / "cache" / "gguf").mkdir(parents=True)
    shutil.copy2(gguf, work / "cache" / "gguf" / gguf.name)
    shutil.copytree(converted(src_profile), work / "models" / converted(src_profile).name)
    for h in hosts.values():
        _run("chown", "-R", f"{h.name}:{h.name}", str(h.home), check=True)
        h.start_worker()
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and not all(_online_workers(p) for p in HOSTS):
        time.sleep(2)
    assert all(_online_workers(p) for p in HOSTS), {p: (BASE / "logs" / f"worker-{p}.log").read_text()[-1500:] for p in HOSTS}
    yield hosts
    for h in hosts.values():
        h.stop()
    subprocess.run([sys.executable, "scripts/services.py", "down"], cwd=REPO, env=os.environ | servers_env, check=False)
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def _stage_runs(c, release_id: str) -> list:
    exp = c.get_experiment_by_name("edgeflow-multihost")
    return c.search_runs([exp.experiment_id], f"tags.`edgeflow.release_id` = '{release_id}' and tags.`edgeflow.stage` != ''",
                         max_results=500)


def test_a_release_across_three_hosts_runs_each_stage_on_its_pool_and_serves_from_the_orin(hosts):
    import httpx
    import psutil
    from mlflow import MlflowClient
    from prefect.deployments import run_deployment

    from tasks.config import load_profile
    from tests.flows.test_release_e2e import stage_flow_runs

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
    from prefect.client.orchestration import get_client
    from prefect.states import AwaitingRetry
    from prefect.deployments import run_deployment

    from tests.flows.test_release_e2e import stage_flow_runs

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

    async def read(flow_run_id):
        async with get_client() as client:
            return await client.read_flow_run(flow_run_id)

    deadline = time.monotonic() + 600  # the zombie automation needs ~90 s without heartbeats
    run = asyncio.run(read(fr.id))
    while time.monotonic() < deadline and not run.state.is_final():
        time.sleep(5)
        run = asyncio.run(read(fr.id))
    assert run.state.is_failed(), run.state
    release_id = c.get_run(building.info.run_id).data.tags["edgeflow.release_id"]
    [crashed] = [r for r in stage_flow_runs(release_id)["build_engine"]]
    assert crashed.state.is_crashed(), crashed.state
    before = {r.info.run_id: r.data.tags["edgeflow.stage"] for r in _stage_runs(c, release_id)}
    assert not any(s.startswith(("distill", "calibrate", "quantize")) for s in before.values())  # cached from the first test

    hosts["orin"].start_worker()

    async def retry():
        async with get_client() as client:
            await client.set_flow_run_state(fr.id, AwaitingRetry(message="Retry after kill -9"), force=True)

    asyncio.run(retry())
    deadline = time.monotonic() + 1500
    run = asyncio.run(read(fr.id))
    while time.monotonic() < deadline and not (run.state.is_final() and run.run_count >= 2):
        time.sleep(5)
        run = asyncio.run(read(fr.id))
    assert run.state.is_completed(), f"retried release ended {run.state.type}: {run.state.message}"
    after = {r.info.run_id: r for r in _stage_runs(c, release_id)}
    new = {r.data.tags["edgeflow.stage"] for rid, r in after.items() if rid not in before}
    assert not any(s.startswith(("distill", "calibrate", "quantize")) for s in new), new
    assert {"build-engine-fp32", "consistency", "register"} <= new
    assert c.get_run(building.info.run_id).info.status == "KILLED"
    versions = c.search_model_versions("name = 'edgeflow-multihost-retry'")
    assert sorted(v.tags["edgeflow.variant"] for v in versions) == sorted(set(v.tags["edgeflow.variant"] for v in versions))
    assert {v.tags["edgeflow.release_id"] for v in versions} == {release_id}


def test_a_worker_with_other_code_refuses_the_stage_naming_both_versions(hosts):
    from prefect.deployments import run_deployment

    orin = hosts["orin"]
    orin.stop()
    with open(orin.checkout / "tasks" / "store.py", "a") as f:
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
