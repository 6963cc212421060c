"""API keys on the device: the keys clients must send, the refusal to serve beyond loopback without one, and the
headers this device's own checks send.
"""
from __future__ import annotations

from pathlib import Path

from edgeflow.profile import Profile


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
