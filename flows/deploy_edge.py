"""Deploy-edge stage (runs on the `orin` pool): fetch the alias, verify, bind the engine, serve, smoke-test.

Tiny CPU run (with services up and a `staging` version registered): python -m flows.deploy_edge --profile configs/demo-cpu.yaml
"""
from __future__ import annotations

import argparse

from prefect import flow, task

from tasks.config import load_profile


@task
def fetch(profile: str, alias: str) -> tuple[str, str]:
    """Download the aliased version into a versioned directory and verify every sha256."""
    from tasks.deploy import fetch_version

    version, path = fetch_version(load_profile(profile), alias)
    return version, str(path)


@task
def bind_engine(profile: str, package: str) -> tuple[str, str]:
    """Check the shipped engine against this device, or build one here from the checkpoint."""
    from pathlib import Path

    from tasks.deploy import engine_for_device

    engine, how = engine_for_device(load_profile(profile), Path(package))
    print(how)
    return str(engine), how


@task
def serve(profile: str, engine: str, version: str) -> dict:
    """Start the server on the stable port, wait for a healthy deep probe, and send one chat."""
    from pathlib import Path

    from tasks.deploy import smoke_chat, start_server, stop_server, wait_healthy

    p = load_profile(profile)
    stop_server(p)
    pid = start_server(p, Path(engine), version, p.deploy.port)
    url = f"http://{p.deploy.host}:{p.deploy.port}"
    health = wait_healthy(url, p.deploy.health_timeout_s, pid)
    answer = smoke_chat(url, p.registry.model_name, p.deploy.smoke_prompt)
    return {"url": url, "pid": pid, "version": version, "health": health, "smoke_answer": answer}


@flow(name="deploy-edge", log_prints=True)
def deploy_edge(profile: str, alias: str = "staging") -> dict:
    """Registered version in, healthy server answering chats out."""
    version, package = fetch(profile, alias)
    engine, how = bind_engine(profile, package)
    result = serve(profile, engine, version)
    return result | {"engine_binding": how, "alias": alias}


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", default="configs/demo-cpu.yaml")
    ap.add_argument("--alias", default="staging")
    a = ap.parse_args()
    print(deploy_edge(a.profile, a.alias))
