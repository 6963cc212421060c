"""After a reboot the device serves its current version again: a real deploy on this host, every process of the
device SIGKILLed, then the boot command exactly as edgeflow-edge-server.service runs it."""
from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml

from edgeflow.paths import REPO_ROOT
from edgeflow.profile import Profile
from edgeflow.device.identity import DEVICE_CONFIG_ENV, DeviceConfig
from tests.helpers.ports import free_port

UNIT = REPO_ROOT / "infra" / "systemd" / "edgeflow-edge-server.service"
VERSION = "1"


@dataclass
class Device:
    profile_path: Path
    profile: Profile
    package: Path
    config: DeviceConfig

    @property
    def run(self) -> Path:
        return self.profile.work / "run"

    def state(self) -> dict:
        return json.loads((self.profile.resolve(self.profile.deploy.install_dir) / "state.json").read_text())

    @property
    def stable(self) -> str:
        return f"http://127.0.0.1:{self.profile.deploy.port}"


def _write_profile(root: Path, model_name: str) -> Path:
    """A profile as a fleet shares it, and this device's own device.yaml (its ports) where $EDGEFLOW_DEVICE_CONFIG names."""
    path = root / "profile.yaml"
    path.write_text(yaml.safe_dump({
        "name": "boot-test", "workdir": str(root / "work"),
        "quantize": {"variants": [{"name": "rtn-w4a16", "recipe": "deployments/recipes/rtn-w4a16-asym.yaml"}]},
        "engine": {"backend": "cpu"},  # the backend the session's engine_dir was built with
        "registry": {"model_name": model_name},
        "deploy": {"install_dir": str(root / "device")},
    }))
    ports = set()
    while len(ports) < 3:
        ports.add(free_port())
    port, *side = sorted(ports)
    (root / "device.yaml").write_text(yaml.safe_dump({"id": "boot-test", "deploy": {"port": port, "side_ports": side}}))
    return path


def _install_package(profile: Profile, engine_dir: Path) -> Path:
    """The package fetch_version would leave installed: engine/ + lineage.json with a manifest (the layout
    edgeflow/pipeline/register.py:package_variant writes), in versions/v<version>-<first 12 hex of its tree hash>."""
    from edgeflow.tracking.artifacts import write_manifest
    from edgeflow.tracking.store import link_or_copy

    versions = profile.resolve(profile.deploy.install_dir) / "versions"
    tmp = versions / f"v{VERSION}.download"
    shutil.copytree(engine_dir, tmp / "engine", copy_function=link_or_copy)
    (tmp / "lineage.json").write_text(json.dumps({"checkpoint": {"sha256": "0" * 64}}))
    sha = write_manifest(tmp)
    return tmp.rename(versions / f"v{VERSION}-{sha[:12]}")


def _state_of(pid: int) -> str | None:
    """The process state letter of /proc/<pid>/stat (Z: a zombie), or None when there is no such process."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _descendants(roots: set[int]) -> set[int]:
    children: dict[int, set[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, set()).add(int(stat.parent.name))
    found, todo = set(roots), list(roots)
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _kill_tree(run: Path, pattern: str = "*.pid") -> set[int]:
    """SIGKILL every pid in run/<pattern>, its process group and every descendant, as a power cut would; wait until gone."""
    from edgeflow.ops.processes import alive, read_pid

    roots = {read_pid(pf) for pf in run.glob(pattern)}
    tree = _descendants(roots)
    for pid in roots:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
    for pid in tree:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 60
    # alive() reaps the ones this process started; an orphan's zombie (state Z) holds no socket any more
    while any(alive(pid) and _state_of(pid) not in (None, "Z") for pid in tree):
        assert time.monotonic() < deadline, f"processes {sorted(tree)} survived SIGKILL"
        time.sleep(0.1)
    return tree


def _unit_command(profile_path: Path) -> list[str]:
    """ExecStart of edgeflow-edge-server.service, with this checkout's python and the test's profile."""
    line = next(ln for ln in UNIT.read_text().splitlines() if ln.startswith("ExecStart="))
    argv = shlex.split(line.removeprefix("ExecStart="))
    assert argv[0] == "/opt/edgeflow/.venv/bin/python" and argv[1:3] == ["-m", "edgeflow.device.boot"], argv
    argv[0] = sys.executable
    argv[argv.index("--profile") + 1] = str(profile_path)
    return argv


def _boot(profile_path: Path) -> subprocess.CompletedProcess:
    # The unit's WorkingDirectory is the checkout; its environment is this process's (HF_HUB_OFFLINE, the device config).
    return subprocess.run(_unit_command(profile_path), cwd=REPO_ROOT, capture_output=True, text=True, timeout=900)


@pytest.fixture
def device(tmp_path, engine_dir, monkeypatch) -> Iterator[Device]:
    """Version 1 deployed on this host by the deploy's own steps: bound engine, candidate on a side port health-gated
    with a smoke chat, the proxy switched to it, state.json written."""
    from edgeflow.device.bind import engine_for_device
    from edgeflow.device.proxy import ensure_proxy
    from edgeflow.device.spawn import start_candidate
    from edgeflow.device.switch import switch_to
    from edgeflow.device.identity import load_for_device

    path = _write_profile(tmp_path, "edgeflow-boot-test")
    monkeypatch.setenv(DEVICE_CONFIG_ENV, str(tmp_path / "device.yaml"))
    profile, config = load_for_device(str(path))
    assert config is not None and config.id == "boot-test"
    package = _install_package(profile, engine_dir)
    try:
        engine, _ = engine_for_device(profile, package)
        candidate = start_candidate(profile, engine, VERSION, package, config)
        ensure_proxy(profile)
        switch_to(profile, candidate)
        yield Device(path, profile, package, config)
    finally:
        _kill_tree(profile.work / "run")


def test_after_every_process_is_killed_boot_serves_the_same_version_again(device: Device) -> None:
    before = device.state()["current"]
    assert before["version"] == VERSION
    killed = _kill_tree(device.run)
    assert before["pid"] in killed
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{device.stable}/health", timeout=5)  # nothing answers on the stable port: the "reboot" happened

    r = _boot(device.profile_path)

    assert r.returncode == 0, r.stderr + r.stdout
    assert f"started version {VERSION} on port {before['port']}" in r.stdout
    after = device.state()["current"]
    assert after | {"pid": before["pid"]} == before  # the same deployment, only its server's pid is new
    assert after["pid"] != before["pid"] and after["pid"] not in killed
    side = httpx.get(f"http://127.0.0.1:{before['port']}/health", timeout=60)
    assert side.status_code == 200 and side.json()["engine"]["engine_version"] == VERSION
    assert httpx.get(f"{device.stable}/_edgeflow/proxy", timeout=5).json()["upstream"] == before["port"]
    health = httpx.get(f"{device.stable}/health", timeout=60)
    assert health.status_code == 200 and health.json()["status"] == "healthy"
    assert health.json()["engine"]["engine_version"] == VERSION
    models = httpx.get(f"{device.stable}/v1/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == [device.profile.registry.model_name]
    chat = httpx.post(f"{device.stable}/v1/chat/completions", timeout=120, json={
        "model": device.profile.registry.model_name, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4})
    assert chat.status_code == 200, chat.text
    assert chat.json()["system_fingerprint"] == VERSION

    # Run again while it serves: nothing is touched.
    pidfiles = {pf.name: pf.read_text() for pf in device.run.glob("*.pid")}
    again = _boot(device.profile_path)
    assert again.returncode == 0, again.stderr + again.stdout
    assert f"version {VERSION} already serves on port {before['port']}" in again.stdout
    assert device.state()["current"] == after
    assert {pf.name: pf.read_text() for pf in device.run.glob("*.pid")} == pidfiles


def test_a_package_that_fails_verification_or_is_gone_exits_non_zero_naming_version_path_and_fix(device: Device) -> None:
    _kill_tree(device.run, "edge-server-*.pid")  # the server is gone (the proxy still answers)
    pidfiles = {pf.name: pf.read_text() for pf in device.run.glob("*.pid")}
    tampered = device.package / "lineage.json"
    tampered.write_text(tampered.read_text() + " ")

    r = _boot(device.profile_path)

    assert r.returncode == 3, r.stderr + r.stdout
    assert f"version {VERSION}" in r.stderr and str(tampered) in r.stderr and "deploy-edge" in r.stderr
    # nothing was started from unverified files
    assert {pf.name: pf.read_text() for pf in device.run.glob("*.pid")} == pidfiles
    with pytest.raises(httpx.TransportError):
        httpx.get(f"http://127.0.0.1:{device.state()['current']['port']}/health", timeout=5)

    aside = device.package.rename(device.package.with_name("moved-away"))
    r = _boot(device.profile_path)

    assert r.returncode == 3, r.stderr + r.stdout
    assert f"version {VERSION}" in r.stderr and f"{device.package} " in r.stderr and "is gone" in r.stderr
    assert "deploy-edge" in r.stderr
    assert aside.exists()


def test_a_device_never_deployed_to_has_nothing_to_serve_and_exits_0(tmp_path, monkeypatch) -> None:
    path = _write_profile(tmp_path, "edgeflow-boot-empty")
    monkeypatch.setenv(DEVICE_CONFIG_ENV, str(tmp_path / "device.yaml"))

    r = _boot(path)

    assert r.returncode == 0, r.stderr + r.stdout
    assert "nothing to serve yet" in r.stdout and str(tmp_path / "device" / "state.json") in r.stdout
    assert not (tmp_path / "work" / "run").exists()  # no proxy, no server was started


# Each step boundary of switch_to (edgeflow/device/failpoint.py), and what boot must serve after a power cut there:
# the version state.json names, the proxy pointed at it, the switch it finds undone or not.
CUTS = {
    "switch:locked": ("1", False),  # the update lock taken; the proxy still on version 1
    "switch:proxy-pointed": ("1", True),  # the proxy on version 2; the old server runs; state.json says 1
    "switch:old-stopped": ("1", True),  # ... and the old server drained and stopped; state.json still says 1
    "switch:state-written": ("2", False),  # state.json says 2: the switch is complete
}


@pytest.mark.parametrize("point", list(CUTS))
def test_a_power_cut_between_the_switch_and_its_state_write_boots_the_recorded_version(device: Device, point: str) -> None:
    """Version 2 is started and health-gated, and switch_to runs in a process of its own with the power cut injected
    at one step boundary (edgeflow/device/failpoint.py); then every other process dies. Boot serves the version
    state.json names (the registry's deployment record is written after the state), on its port, with the proxy
    pointed at it and nothing left of the other server; a switch the proxy made and state.json did not record is
    undone and said so. Steps reordered (the state written before the switch) fail the proxy-pointed case."""
    import multiprocessing

    from edgeflow.device.failpoint import ENV
    from edgeflow.device.spawn import start_candidate
    from edgeflow.device.switch import switch_to

    expect_version, expect_undone = CUTS[point]
    before = device.state()["current"]
    engine = Path(before["engine"])
    candidate = start_candidate(device.profile, engine, "2", device.package, device.config)
    assert candidate["port"] != before["port"]

    def deploy_switch() -> None:  # the deploy's own switch, in a child: the power cut kills it at the fail point
        os.environ[ENV] = point
        switch_to(device.profile, candidate)

    child = multiprocessing.get_context("fork").Process(target=deploy_switch)
    child.start()
    child.join(120)
    assert child.exitcode == -signal.SIGKILL, child.exitcode  # it reached the fail point
    _kill_tree(device.run)  # ... and the rest of the power cut
    served_port = before["port"] if expect_version == VERSION else candidate["port"]
    other_port = candidate["port"] if expect_version == VERSION else before["port"]
    assert device.state()["current"]["version"] == expect_version

    r = _boot(device.profile_path)

    assert r.returncode == 0, r.stderr + r.stdout
    assert f"started version {expect_version} on port {served_port}" in r.stdout, r.stdout
    if expect_undone:
        assert f"an interrupted switch: the proxy last pointed at port {candidate['port']}" in r.stdout
        assert "was undone" in r.stdout
    else:
        assert "interrupted switch" not in r.stdout, r.stdout
    state = device.state()
    assert state["current"]["version"] == expect_version and state["current"]["port"] == served_port
    assert state["last_boot"]["interrupted_switch_port"] == (candidate["port"] if expect_undone else None)
    assert httpx.get(f"{device.stable}/_edgeflow/proxy", timeout=5).json()["upstream"] == served_port
    chat = httpx.post(f"{device.stable}/v1/chat/completions", timeout=120, json={
        "model": device.profile.registry.model_name, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4})
    assert chat.status_code == 200 and chat.json()["system_fingerprint"] == expect_version
    with pytest.raises(httpx.TransportError):  # nothing left of the other, half-switched server
        httpx.get(f"http://127.0.0.1:{other_port}/health", timeout=5)
