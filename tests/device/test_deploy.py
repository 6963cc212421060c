"""deploy-edge's exposure rule (edgeflow/device/keys.py): nothing but loopback is bound without an API key."""
from __future__ import annotations

import pytest

from edgeflow.serving.auth import KEY_ENV
from edgeflow.paths import REPO_ROOT
from edgeflow.preflight import load_profile
from edgeflow.device.keys import check_exposure, client_headers


def _profile(**deploy):
    p = load_profile(REPO_ROOT / "configs" / "demo-cpu.yaml")
    return p.model_copy(update={"deploy": p.deploy.model_copy(update=deploy)})


@pytest.fixture(autouse=True)
def _no_env_key(monkeypatch):
    monkeypatch.delenv(KEY_ENV, raising=False)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.20"])
def test_public_bind_without_a_key_is_refused_naming_the_setting(host) -> None:
    with pytest.raises(ValueError, match=r"deploy.host=.*deploy.api_key_file.*EDGEFLOW_API_KEY"):
        check_exposure(_profile(host=host))


def test_loopback_needs_no_key_and_a_key_file_or_env_opens_public_binds(tmp_path, monkeypatch) -> None:
    check_exposure(_profile(host="127.0.0.1"))
    assert client_headers(_profile()) == {}
    keys = tmp_path / "keys"
    keys.write_text("device-key-0123456789abcdef\n")
    p = _profile(host="0.0.0.0", api_key_file=str(keys))
    check_exposure(p)
    assert client_headers(p) == {"Authorization": "Bearer device-key-0123456789abcdef"}
    monkeypatch.setenv(KEY_ENV, "env-key-0123456789abcdef")
    check_exposure(_profile(host="0.0.0.0"))


def test_a_broken_key_file_names_the_field(tmp_path) -> None:
    (tmp_path / "keys").write_text("# nothing yet\n")
    with pytest.raises(ValueError, match="deploy.api_key_file: .*holds no key"):
        check_exposure(_profile(host="0.0.0.0", api_key_file=str(tmp_path / "keys")))


def test_production_profile_sets_a_key_file() -> None:
    prod = load_profile(REPO_ROOT / "configs" / "production-a100-orin.yaml")
    assert prod.deploy.host == "0.0.0.0" and prod.deploy.api_key_file


def test_a_server_that_exits_fails_the_health_wait_at_once_not_at_the_timeout() -> None:
    """The supervisor deploy-edge spawns is its child: once it gives up it is a zombie until reaped, which
    signal 0 still reaches; the wait must see it gone and fail within a poll, not after health_timeout_s."""
    import subprocess
    import sys
    import time

    from edgeflow.device.health import wait_healthy
    from tests.helpers.ports import free_port

    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    time.sleep(1.0)  # exited, not yet reaped
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=rf"pid {proc.pid}\) exited before becoming healthy"):
        wait_healthy(f"http://127.0.0.1:{free_port()}", timeout=60, pid=proc.pid)
    assert time.monotonic() - t0 < 10


def test_package_sha256_is_the_tree_hash_the_package_was_registered_with(tmp_path):
    """record_deployment tags this hash; it must equal what write_manifest returned to the register stage."""
    from edgeflow.tracking.artifacts import write_manifest
    from edgeflow.device.fetch import package_sha256

    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "engine.json").write_text("{}")
    (tmp_path / "gate.json").write_text("{}")
    registered = write_manifest(tmp_path)
    assert package_sha256(tmp_path) == registered
    assert package_sha256(tmp_path / "engine") is None  # no manifest: no hash claimed


def test_a_proxy_too_busy_to_answer_is_waited_for_and_never_replaced(tmp_path) -> None:
    """Something accepts on deploy.port but does not answer: ensure_proxy waits its timeout, then fails naming the
    port and the log, without starting a second proxy (which could not bind and would leave a pid file of nobody)."""
    import socket

    from edgeflow.device.proxy import ensure_proxy
    from edgeflow.device.state import run_dir
    from tests.helpers.ports import free_port

    port = free_port()
    profile = _profile(port=port)
    profile = profile.model_copy(update={"work": tmp_path})
    with socket.create_server(("127.0.0.1", port)):  # listens; nobody ever reads or answers
        with pytest.raises(RuntimeError, match=rf"port {port} \(deploy.port\) accepts connections but its proxy did not "
                                               r"answer within 6 s.*edge-proxy.log"):
            ensure_proxy(profile, timeout=6)
    assert not (run_dir(profile) / "edge-proxy.pid").exists()
