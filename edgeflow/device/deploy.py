"""Edge deploy logic: fetch a registered version, verify it, bind an engine to this device, run the server.

Tiny CPU run (with services up and a `staging` version registered): python -m edgeflow.pipeline.deploy_edge --profile configs/demo-cpu.yaml

Processes (the proxy, the edge servers) are started and stopped through edgeflow/ops/processes.py; every attempt is
recorded by record_deployment in the MLflow experiment `edgeflow-deployments`.
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import sys
import time
from pathlib import Path

import httpx

from edgeflow.tracking.artifacts import ChecksumError, verify_manifest
from edgeflow.paths import REPO_ROOT
from edgeflow.profile import Profile
from edgeflow.engines import EngineIncompatibleError, get_backend
from edgeflow.ops.processes import alive, read_pid, spawn_detached, stop_group, stop_groups


def fetch_version(profile: Profile, alias: str, version: str | None = None) -> tuple[str, Path]:
    """Download models:/<name>@<alias> (or version `version`, when given) into its own versioned directory and
    verify every sha256.

    The directory is named by version *and* package hash: a device that was once served by another
    registry (or a re-created one whose numbering restarted) never mistakes an old `v2` for the new one.
    A present but corrupted copy is moved aside (kept for inspection) and downloaded again.
    """
    from edgeflow.tracking.registry import PACKAGE_SHA256_TAG, client, download

    name = profile.registry.model_name
    mv = client().get_model_version(name, version) if version else client().get_model_version_by_alias(name, alias)
    expected = mv.tags.get(PACKAGE_SHA256_TAG)
    dest = profile.resolve(profile.deploy.install_dir) / "versions" / f"v{mv.version}-{(expected or 'unhashed')[:12]}"
    if (dest / "edgeflow-manifest.json").exists():
        try:
            verify_manifest(dest, expected)
            return mv.version, dest
        except ChecksumError as e:
            aside = dest.with_name(f"{dest.name}.corrupt-{int(time.time())}")
            print(f"{dest} failed verification ({e}); moved to {aside.name}, downloading again")
            dest.rename(aside)
    tmp = dest.with_name(dest.name + ".download")
    shutil.rmtree(tmp, ignore_errors=True)
    needed = package_bytes(name, mv.version)
    require_space(tmp.parent, needed, f"version {mv.version} of {name}")
    try:
        _, local = download(name, alias, tmp, version=mv.version)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)  # no partial package stays behind
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise DiskFull(tmp.parent, needed, f"version {mv.version} of {name}") from e
        raise
    local.rename(dest) if local != tmp else tmp.rename(dest)
    verify_manifest(dest, expected)
    return mv.version, dest


class DiskFull(OSError):
    """The device's disk cannot hold a package: nothing was switched, and no partial file was left."""

    def __init__(self, where: Path, needed: int, what: str) -> None:
        free = shutil.disk_usage(where).free if where.exists() else 0
        super().__init__(errno.ENOSPC, (
            f"{where}: {what} needs {needed:,} bytes ({needed / 2**20:.1f} MiB) and the disk has {free:,} free; "
            f"the serving version is untouched. Free space (old packages under {where} that no alias names can go) "
            "or point deploy.install_dir at a larger disk, then run the deploy again"))


def package_bytes(name: str, version: str) -> int:
    """Bytes of a registered version's files (MLflow's artifact listing, walked)."""
    from edgeflow.tracking.registry import client

    c = client()
    mv = c.get_model_version(name, version)
    run_id, _, root = mv.source.removeprefix("runs:/").partition("/")  # runs:/<run id>/<path>: edgeflow/tracking/registry.py
    total, pending = 0, [root]
    while pending:
        for f in c.list_artifacts(run_id, pending.pop()):
            if f.is_dir:
                pending.append(f.path)
            else:
                total += f.file_size or 0
    return total


# Room kept free beside a package: its unpacking, logs and the engine a device may build from it.
SPACE_MARGIN = 1.10


def require_space(where: Path, needed: int, what: str) -> None:
    """Refuse before downloading when the disk under `where` cannot hold `needed` bytes (plus SPACE_MARGIN)."""
    where.mkdir(parents=True, exist_ok=True)
    if shutil.disk_usage(where).free < needed * SPACE_MARGIN:
        raise DiskFull(where, int(needed * SPACE_MARGIN), what)


def engine_for_device(profile: Profile, package: Path) -> tuple[Path, str]:
    """Use the shipped engine if this device can run it; otherwise build one here from the checkpoint.

    TensorRT engines only run on the GPU architecture and TensorRT version that built them, so a
    device never trusts an engine built elsewhere: it checks, and rebuilds on a mismatch.
    """
    backend = get_backend(profile.engine.backend)
    shipped = package / "engine"
    try:
        backend.check_compatible(shipped)
        return shipped, "shipped engine is compatible with this device"
    except EngineIncompatibleError as e:
        reason = str(e)
    if not profile.deploy.build_on_device:
        raise EngineIncompatibleError(
            f"the shipped engine cannot run on this device ({reason}) and deploy.build_on_device is false; "
            "build the engine for this device (build-engine deployment on its pool) or set deploy.build_on_device: true"
        )
    from edgeflow.tracking.artifacts import sha256_json

    ckpt_sha = json.loads((package / "lineage.json").read_text())["checkpoint"]["sha256"]
    key = sha256_json({"ckpt": ckpt_sha, "profile": profile.engine.model_dump()})[:16]
    cached = profile.resolve(profile.deploy.install_dir) / "engines" / key
    try:
        backend.check_compatible(cached)
        return cached, f"reused device engine cache {key} ({reason})"
    except EngineIncompatibleError:
        backend.build(package / "checkpoint", cached, profile.engine.profile)
        return cached, f"built on device ({reason})"


# --------------------------------------------------------------------------------------------
# Processes on the device: one proxy on the stable port, edge servers on two side ports
# --------------------------------------------------------------------------------------------


def run_dir(profile: Profile) -> Path:
    return profile.work / "run"


def device_dir(profile: Profile) -> Path:
    return profile.resolve(profile.deploy.install_dir)


def access_log_path(profile: Profile) -> Path:
    """The access log the device's edge servers write (and ship-logs ships): <install_dir>/access_logs/access.jsonl."""
    return device_dir(profile) / "access_logs" / "access.jsonl"


def _spawn(profile: Profile, name: str, cmd: list[str]) -> int:
    """Start a process detached in its own session (it outlives this flow run and its worker); pid file run/<name>.pid."""
    return spawn_detached(cmd, profile.work / "logs" / f"{name}.log", run_dir(profile) / f"{name}.pid", REPO_ROOT)


def stop_device(profile: Profile) -> list[str]:
    """Stop the proxy and every edge server this device started (by pid file); returns what was stopped."""
    stopped = []
    run = run_dir(profile)
    pids = {pf: read_pid(pf) for pf in (sorted(run.glob("edge-*.pid")) if run.exists() else [])}
    stop_groups(list(pids.values()))  # the proxy and every server at once
    for pf, pid in pids.items():
        pf.unlink(missing_ok=True)
        stopped.append(f"{pf.stem} (pid {pid})")
    return stopped


def read_state(profile: Profile) -> dict:
    """What this device serves: {"current": {...}, "previous": {...}} (version, port, pid, engine, package)."""
    path = device_dir(profile) / "state.json"
    return json.loads(path.read_text()) if path.exists() else {}


def write_state(profile: Profile, state: dict) -> None:
    path = device_dir(profile) / "state.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=1))
    os.replace(tmp, path)


def control_url(profile: Profile) -> str:
    return f"{public_url(profile)}/_edgeflow/proxy"


def ensure_proxy(profile: Profile, timeout: float = 30) -> dict:
    """Start the stable-port proxy unless one listens; returns its control state.

    Only a refused connection starts one: a proxy slow to answer on a busy device is waited for (up to `timeout`),
    never replaced, since a second proxy could not bind the port and its pid file would hide the first."""
    deadline = time.time() + timeout
    r = None
    while r is None:
        try:
            r = httpx.get(control_url(profile), timeout=5)
        except httpx.ConnectError:
            break
        except httpx.HTTPError as e:
            if time.time() > deadline:
                raise RuntimeError(f"port {profile.deploy.port} (deploy.port) accepts connections but its proxy did not answer "
                                   f"within {timeout:.0f} s ({e!r}); see {profile.work / 'logs' / 'edge-proxy.log'}") from e
            time.sleep(0.5)
    if r is not None:
        if r.status_code == 200 and "upstream" in r.json():
            return r.json()
        raise RuntimeError(
            f"port {profile.deploy.port} (deploy.port) answers but is not the edgeflow proxy ({r.status_code} on "
            f"{control_url(profile)}); stop what listens there (make down) or choose another deploy.port"
        )
    check_exposure(profile)
    _spawn(profile, "edge-proxy", [
        sys.executable, "-m", "edgeflow.serving.proxy", "--host", profile.deploy.host, "--port", str(profile.deploy.port),
        "--state", str(device_dir(profile) / "proxy.json"),
    ])
    deadline = time.time() + timeout
    while time.time() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(control_url(profile), timeout=2).json()
        time.sleep(0.2)
    raise RuntimeError(f"proxy on port {profile.deploy.port} did not start; see {profile.work / 'logs' / 'edge-proxy.log'}")


def point_proxy(profile: Profile, port: int) -> None:
    """Point the stable port's proxy at the server on side port `port` (the proxy persists it across restarts)."""
    r = httpx.put(control_url(profile), json={"upstream": port}, timeout=5)
    r.raise_for_status()


def side_port(profile: Profile) -> int:
    """The side port not serving now (blue/green between deploy.side_ports)."""
    current = (read_state(profile).get("current") or {}).get("port")
    free = [p for p in profile.deploy.side_ports if p != current]
    return free[0]


LOOPBACK = ("127.0.0.1", "::1", "localhost")


def api_keys(profile: Profile) -> frozenset[str]:
    """The keys this device's servers will ask for (deploy.api_key_file, else $EDGEFLOW_API_KEY); empty: none."""
    from edgeflow.serving.auth import load_keys

    path = profile.deploy.api_key_file
    try:
        return load_keys(None, Path(path) if path else None)
    except ValueError as e:
        raise ValueError(f"deploy.api_key_file: {e}") from None


def check_exposure(profile: Profile) -> None:
    """Refuse to bind anything but loopback without an API key: a device's model and feedback log are not public."""
    host = profile.deploy.host
    if host in LOOPBACK or host.startswith("127."):
        return
    if not api_keys(profile):
        raise ValueError(
            f"deploy.host={host!r} exposes the edge server beyond this device but no API key is configured; set "
            "deploy.api_key_file to a file of keys on the device (or EDGEFLOW_API_KEY in its environment), or bind "
            "deploy.host: 127.0.0.1"
        )


def client_headers(profile: Profile) -> dict[str, str]:
    """Headers the deploy's own health checks and smoke chat send (a key when the servers ask for one)."""
    keys = sorted(api_keys(profile))
    return {"Authorization": f"Bearer {keys[0]}"} if keys else {}


def start_server(profile: Profile, engine_dir: Path, version: str, port: int) -> int:
    """Start an edge server on `port`, detached; a stale server of ours on that port is stopped first."""
    name = f"edge-server-{port}"
    stale = run_dir(profile) / f"{name}.pid"
    if stale.exists():
        stop_group(read_pid(stale))
    access_log = access_log_path(profile)
    access_log.parent.mkdir(parents=True, exist_ok=True)
    from edgeflow.device.identity import load_device

    device = load_device()
    faults = (device.faults.get(str(version), {}) if device else {})  # chaos testing only (device.yaml `faults`)
    # Under the supervisor: a server its watchdog ends (engine stalled) or that crashes comes back on
    # the same port; a bad engine or bad settings (exit 2) ends the supervisor at once, failing the deploy.
    return _spawn(profile, name, [
        sys.executable, "-m", "edgeflow.serving.supervisor", "--liveness-url", f"http://127.0.0.1:{port}/ready", "--",
        sys.executable, "-m", "edgeflow.serving.server",
        "--engine", str(engine_dir),
        "--backend", profile.engine.backend,
        "--host", "127.0.0.1",  # side ports are reached through the proxy only
        "--port", str(port),
        "--model-name", profile.registry.model_name,
        "--engine-version", version,
        "--access-log", str(access_log),
        "--access-log-rotate-s", str(profile.deploy.access_log_rotate_s),
        *(["--api-key-file", str(Path(profile.deploy.api_key_file).resolve())] if profile.deploy.api_key_file else []),
        "--auth-probes", "true" if profile.deploy.auth_probes else "false",
        *[arg for flag, value in sorted(faults.items()) for arg in ("--" + flag.replace("_", "-"), str(value))],
    ])


def start_candidate(profile: Profile, engine_dir: Path, version: str, package: Path) -> dict:
    """Start the new version on the free side port, wait for a healthy deep probe, send a smoke chat.

    On any failure the candidate is stopped and the error re-raised: the serving version is untouched.
    """
    port = side_port(profile)
    pid = start_server(profile, engine_dir, version, port)
    url = f"http://127.0.0.1:{port}"
    try:
        headers = client_headers(profile)
        health = wait_healthy(url, profile.deploy.health_timeout_s, pid, headers)
        answer = smoke_chat(url, profile.registry.model_name, profile.deploy.smoke_prompt, headers=headers)
    except BaseException:
        stop_group(pid)
        (run_dir(profile) / f"edge-server-{port}.pid").unlink(missing_ok=True)
        raise
    return {"version": version, "port": port, "pid": pid, "engine": str(engine_dir), "package": str(package),
            "health": health, "smoke_answer": answer}


def wait_update_lock(profile: Profile, port: int) -> float:
    """The device's update lock: wait while the server on `port` has more requests in flight than
    deploy.update_lock_max_in_flight; returns the seconds waited, or raises once deploy.update_lock_timeout_s passed."""
    limit, start = profile.deploy.update_lock_max_in_flight, time.monotonic()
    while True:
        busy = httpx.get(control_url(profile), timeout=5).json()["in_flight"].get(str(port), 0)
        if busy <= limit:
            return time.monotonic() - start
        if time.monotonic() - start > profile.deploy.update_lock_timeout_s:
            raise TimeoutError(
                f"update lock held: the serving server on port {port} still had {busy} requests in flight (> "
                f"deploy.update_lock_max_in_flight={limit}) after {profile.deploy.update_lock_timeout_s:.0f} s "
                "(deploy.update_lock_timeout_s); the old version keeps serving. Retry when traffic is lower, or raise the limit"
            )
        time.sleep(0.5)


def switch_to(profile: Profile, candidate: dict) -> dict:
    """Point the stable port at the candidate, let the old server finish its requests, then stop it.

    The update lock comes first: while the serving version is busier than deploy.update_lock_max_in_flight, the
    switch waits; if it is still busy after deploy.update_lock_timeout_s, the candidate is stopped, the old
    version keeps serving and the deploy fails saying so."""
    state = read_state(profile)
    old = state.get("current")
    ensure_proxy(profile)
    waited = 0.0
    if old and old.get("port") != candidate["port"]:
        try:
            waited = wait_update_lock(profile, old["port"])
        except BaseException:
            stop_group(candidate["pid"])
            (run_dir(profile) / f"edge-server-{candidate['port']}.pid").unlink(missing_ok=True)
            raise
    point_proxy(profile, candidate["port"])
    drained = True
    if old and old.get("port") != candidate["port"]:
        deadline = time.time() + profile.deploy.drain_timeout_s
        while time.time() < deadline:
            left = httpx.get(control_url(profile), timeout=5).json()["in_flight"].get(str(old["port"]), 0)
            if not left:
                break
            time.sleep(0.2)
        else:
            drained = False
        stop_group(old["pid"])
        (run_dir(profile) / f"edge-server-{old['port']}.pid").unlink(missing_ok=True)
    keep = {k: candidate[k] for k in ("version", "port", "pid", "engine", "package")}
    write_state(profile, {"current": keep, "previous": old and {k: old[k] for k in keep if k in old}})
    return {"switched_from": old and old.get("version"), "drained": drained, "update_lock_waited_s": round(waited, 1)}


def wait_healthy(base_url: str, timeout: float, pid: int | None = None, headers: dict[str, str] | None = None) -> dict:
    """Poll /health until it answers 200 (a real one-token generation), or fail with the last answer."""
    deadline = time.time() + timeout
    last = "no answer"
    while time.time() < deadline:
        if pid is not None and not alive(pid):
            raise RuntimeError(f"edge server (pid {pid}) exited before becoming healthy; see its log under logs/edge-server-<port>.log")
        try:
            r = httpx.get(f"{base_url}/health", timeout=10, headers=headers)
            if r.status_code == 200:
                return r.json()
            last = f"{r.status_code} {r.text[:200]}"
        except httpx.HTTPError as e:
            last = repr(e)
        time.sleep(1)
    raise TimeoutError(f"{base_url}/health not healthy after {timeout:.0f}s (deploy.health_timeout_s); last: {last}")


def smoke_chat(base_url: str, model: str, prompt: str, max_tokens: int = 48, headers: dict[str, str] | None = None) -> str:
    """Send one streamed chat request; it must end properly ([DONE], a finish_reason) with at least one
    generated token. Returns the answer text.

    What the answer says is the consistency gate's business, not the deploy's: a tiny or early student
    may well answer in whitespace. What a deploy must catch is a stream that breaks, errors, never
    finishes or carries no generated token at all.
    """
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}}
    parts: list[str] = []
    finish, usage, done = None, None, False
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body, timeout=120, headers=headers) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line == "data: [DONE]":
                done = True
                continue
            if not line.startswith("data: "):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"smoke chat failed: {chunk['error']}")
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices", []):
                parts.append(choice.get("delta", {}).get("content") or "")
                finish = choice.get("finish_reason") or finish
    if not (done and finish):
        raise RuntimeError(f"smoke chat stream ended without {'[DONE]' if not done else 'a finish_reason'}")
    if not usage or usage.get("completion_tokens", 0) < 1:
        raise RuntimeError(f"smoke chat generated no token (usage {usage}, finish_reason {finish})")
    return "".join(parts)


def already_serving(profile: Profile, version: str, package: Path) -> dict | None:
    """The current deployment if it is this version from this package, behind the proxy, and healthy now; else None.

    A re-run release or nightly that changed nothing asks for the version the device already serves;
    a second blue/green switch would only cost a cold start. Anything short of "same package, proxied,
    deep probe passes" (a crashed server, a proxy pointing elsewhere) is a real deploy.
    """
    current = read_state(profile).get("current") or {}
    if current.get("version") != version or Path(current.get("package", "")) != Path(package):
        return None
    try:
        upstream = httpx.get(control_url(profile), timeout=2).json().get("upstream")
        if upstream != current.get("port"):
            return None
        health = httpx.get(f"http://127.0.0.1:{current['port']}/health", timeout=profile.deploy.health_timeout_s,
                           headers=client_headers(profile))
    except (httpx.HTTPError, ValueError):
        return None
    return current | {"health": health.json()} if health.status_code == 200 else None


def public_url(profile: Profile) -> str:
    """The stable URL clients use on this device."""
    host = "127.0.0.1" if profile.deploy.host in ("0.0.0.0", "::") else profile.deploy.host
    return f"http://{host}:{profile.deploy.port}"


def previous_deployment(profile: Profile) -> dict:
    """The version this device served before the current one, or a clear error if there is none."""
    prev = read_state(profile).get("previous")
    if not prev:
        raise RuntimeError(
            f"nothing to roll back to: {device_dir(profile) / 'state.json'} records no previous deployment on this device"
        )
    if not Path(prev["package"]).exists():
        raise RuntimeError(f"previous version {prev['version']} is gone from {prev['package']}; redeploy it from the registry instead")
    return prev


def record_deployment(profile: Profile, alias: str, outcome: dict, package: Path | None = None) -> str:
    """One run per deployment attempt in the `edgeflow-deployments` MLflow experiment; FAILED ones say why.

    `package`: the installed package directory, once fetched and verified; its tree hash (from its manifest) is
    tagged `edgeflow.package_sha256`, the hash the registered version carries, so the promotion check can tell
    this package from another registry's version of the same number (edgeflow/tracking/promotion.py:check_deployed).
    """
    from mlflow import MlflowClient

    from edgeflow.tracking.registry import PACKAGE_SHA256_TAG
    from edgeflow.device.identity import device_id
    from edgeflow.tracking.runs import DEPLOYMENTS_EXPERIMENT, experiment_id, tracking_uri

    c = MlflowClient(tracking_uri())
    exp_id = experiment_id(c, DEPLOYMENTS_EXPERIMENT)
    tags = {
        "edgeflow.model": profile.registry.model_name,
        "edgeflow.alias": alias,
        "edgeflow.version": str(outcome.get("version", "")),
        "edgeflow.device_dir": str(device_dir(profile)),
        "edgeflow.device_id": device_id() or "",
        "edgeflow.reason": str(outcome.get("reason", ""))[:4000],
        "edgeflow.prefect_flow_run_id": str(outcome.get("prefect_flow_run_id") or ""),
        "edgeflow.error": str(outcome.get("error", ""))[:4000],
    }
    sha = package_sha256(package) if package is not None else None
    if sha:
        tags[PACKAGE_SHA256_TAG] = sha
    where = f" on {tags['edgeflow.device_id']}" if tags["edgeflow.device_id"] else ""
    run = c.create_run(exp_id, run_name=f"{alias} v{outcome.get('version', '?')}{where} {outcome['status'].lower()}", tags=tags)
    c.log_dict(run.info.run_id, {k: v for k, v in outcome.items() if k != "health"}, "deployment.json")
    c.set_terminated(run.info.run_id, outcome["status"])
    return run.info.run_id


def package_sha256(package: Path) -> str | None:
    """The tree hash of an installed package, read from its manifest (what write_manifest returned when it was
    packaged, and fetch_version verified against the version's tag); None when it has no readable manifest."""
    from edgeflow.tracking.artifacts import MANIFEST, sha256_json

    try:
        return sha256_json(json.loads((Path(package) / MANIFEST).read_text()))
    except (OSError, ValueError):
        return None
