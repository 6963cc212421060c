"""An engine bound to this device: the package's engine for this host, or a refusal naming both sides.
"""
from __future__ import annotations

import json
from pathlib import Path

from edgeflow.engines import EngineIncompatibleError, get_backend
from edgeflow.profile import Profile


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
