"""Edge deploy logic: fetch a registered version, verify it, bind an engine to this device, run the server."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tasks.artifacts import ChecksumError, verify_manifest
from tasks.config import REPO_ROOT, Profile
from tasks.engines import EngineIncompatibleError, get_backend


def fetch_version(profile: Profile, alias: str) -> tuple[str, Path]:
    """Download models:/<name>@<alias> into its own versioned directory and verify every sha256.

    The directory is named by version *and* package hash: a device that was once served by another
    registry (or a re-created one whose numbering restarted) never mistakes an old `v2` for the new one.
    A present but corrupted copy is moved aside (kept for inspection) and downloaded again.
    """
    import shutil

    from tasks.registry import client, download

    name = profile.registry.model_name
    mv = client().get_model_version_by_alias(name, alias)
    expected = mv.tags.get("edgeflow.package_sha256")
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
    _, local = download(name, alias, tmp)
    local.rename(dest) if local != tmp else tmp.rename(dest)
    verify_manifest(dest, expected)
    return mv.version, dest


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
    from tasks.artifacts import sha256_json

    ckpt_sha = json.loads((package / "lineage.json").read_text())["checkpoint"]["sha256"]
    key = sha256_json({"ckpt": ckpt_sha, "profile": profile.engine.model_dump()})[:16]
    cached = profile.resolve(profile.deploy.install_dir) / "engines" / key
    try:
        backend.check_compatible(cached)
        return cached, f"reused device engine cache {key} ({reason})"
    except EngineIncompatibleError:
        backend.build(package / "checkpoint", cached, profile.engine.profile)
        return cached, f"built on device ({reason})"


def _pidfile(profile: Profile) -> Path:
    return profile.work / "run" / "edge-server.pid"


def stop_server(profile: Profile, timeout: float = 20) -> None:
    """Stop the server this device started (by pid file), waiting for it to exit."""
    pf = _pidfile(profile)
    if not pf.exists():
        return
    pid = int(pf.read_text().split()[0])
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        pf.unlink(missing_ok=True)
        return
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.2)
    else:
        os.killpg(pid, signal.SIGKILL)
    pf.unlink(missing_ok=True)


def start_server(profile: Profile, engine_dir: Path, version: str, port: int) -> int:
    """Start the edge server detached in its own session, so it outlives this flow run and its worker."""
    logs = profile.work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    access_log = profile.resolve(profile.deploy.install_dir) / "access_logs" / "access.jsonl"
    access_log.parent.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable, "-m", "serving.server",
        "--engine", str(engine_dir),
        "--host", profile.deploy.host,
        "--port", str(port),
        "--model-name", profile.registry.model_name,
        "--engine-version", version,
        "--access-log", str(access_log),
    ]
    with open(logs / "edge-server.log", "ab") as log:
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    pf = _pidfile(profile)
    pf.parent.mkdir(parents=True, exist_ok=True)
    pf.write_text(f"{proc.pid} {port} v{version}\n")
    return proc.pid


def wait_healthy(base_url: str, timeout: float, pid: int | None = None) -> dict:
    """Poll /health until it answers 200 (a real one-token generation), or fail with the last answer."""
    deadline = time.time() + timeout
    last = "no answer"
    while time.time() < deadline:
        if pid is not None:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                raise RuntimeError(f"edge server (pid {pid}) exited before becoming healthy; see .edgeflow/logs/edge-server.log")
        try:
            r = httpx.get(f"{base_url}/health", timeout=10)
            if r.status_code == 200:
                return r.json()
            last = f"{r.status_code} {r.text[:200]}"
        except httpx.HTTPError as e:
            last = repr(e)
        time.sleep(1)
    raise TimeoutError(f"{base_url}/health not healthy after {timeout:.0f}s (deploy.health_timeout_s); last: {last}")


def smoke_chat(base_url: str, model: str, prompt: str, max_tokens: int = 48) -> str:
    """Send one streamed chat request and return the concatenated answer."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "stream": True}
    parts: list[str] = []
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body, timeout=120) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"smoke chat failed: {chunk['error']}")
            for choice in chunk.get("choices", []):
                parts.append(choice.get("delta", {}).get("content") or "")
    answer = "".join(parts)
    if not answer.strip():
        raise RuntimeError("smoke chat returned an empty answer")
    return answer
