"""Create or update the Kubernetes work pools (one per infra/kubernetes/<pool>.json) on the Prefect server at PREFECT_API_URL.

    python infra/kubernetes/create_pools.py --dry-run --set a100.image=ghcr.io/acme/edgeflow:0.1.0-cuda12

    PREFECT_API_URL=https://prefect.internal/api python infra/kubernetes/create_pools.py \
        --set a100.image=ghcr.io/acme/edgeflow:0.1.0-cuda12 --set cpu.image=ghcr.io/acme/edgeflow:0.1.0-cpu

`--set POOL.VARIABLE=VALUE` changes a variable's default in the template sent (VALUE is parsed as JSON when it
can be, e.g. `a100.gpu_count=4`). `make k8s-pools` runs this script; CI and `make test` never do: it refuses to
touch a server when CI is set, and it never turns an existing pool of another type (the local demo's process
pools) into a Kubernetes pool.
"""
from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PLACEHOLDER_REGISTRY = "registry.example.com"


def templates() -> dict[str, dict]:
    """Pool name -> base job template, from the JSON files beside this script."""
    return {p.stem: json.loads(p.read_text()) for p in sorted(HERE.glob("*.json"))}


def apply_overrides(tpls: dict[str, dict], sets: list[str]) -> dict[str, dict]:
    """Return copies of the templates with `POOL.VARIABLE=VALUE` defaults applied and checked against their schemas."""
    from prefect.utilities.schema_tools import ValidationError, validate

    out = copy.deepcopy(tpls)
    for item in sets:
        target, sep, raw = item.partition("=")
        pool, dot, var = target.partition(".")
        if not (sep and dot):
            raise SystemExit(f"--set {item!r}: expected POOL.VARIABLE=VALUE")
        if pool not in out:
            raise SystemExit(f"--set {item!r}: no template for pool {pool!r} (have {sorted(out)})")
        props = out[pool]["variables"]["properties"]
        if var not in props:
            raise SystemExit(f"--set {item!r}: pool {pool!r} has no variable {var!r} (have {sorted(props)})")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        try:
            validate({var: value}, out[pool]["variables"], raise_on_error=True, ignore_required=True)
        except ValidationError as exc:
            raise SystemExit(f"--set {item!r}: {exc}") from None
        props[var]["default"] = value
    return out


async def _existing_type(name: str) -> str | None:
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    async with get_client() as client:
        try:
            return (await client.read_work_pool(name)).type
        except ObjectNotFound:
            return None


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--set", action="append", default=[], metavar="POOL.VARIABLE=VALUE", help="change a variable's default")
    ap.add_argument("--pools", default=None, help="comma-separated subset of the templates' pools (default: all)")
    ap.add_argument("--dry-run", action="store_true", help="print what would be sent; contact no server")
    args = ap.parse_args(argv)

    tpls = apply_overrides(templates(), args.set)
    if args.pools:
        wanted = args.pools.split(",")
        unknown = sorted(set(wanted) - set(tpls))
        if unknown:
            raise SystemExit(f"--pools: no template for {unknown} (have {sorted(tpls)})")
        tpls = {k: v for k, v in tpls.items() if k in wanted}
    placeholder = [p for p, t in tpls.items() if PLACEHOLDER_REGISTRY in str(t["variables"]["properties"]["image"].get("default"))]

    if args.dry_run:
        for pool, t in tpls.items():
            defaults = {k: v.get("default") for k, v in t["variables"]["properties"].items() if v.get("default") is not None}
            print(f"prefect work-pool create {pool} --type kubernetes --base-job-template <{pool}.json> --overwrite")
            print(f"  defaults: {json.dumps(defaults, sort_keys=True)}")
        if placeholder:
            print(f"note: {placeholder} still name the placeholder registry; a real run refuses until --set POOL.image=...")
        return

    # Never from CI: these pools belong to a real server, and the test suite's servers use process pools.
    if os.environ.get("CI"):
        raise SystemExit("refusing to create Kubernetes work pools in CI (CI is set); use --dry-run")
    if not os.environ.get("PREFECT_API_URL"):
        raise SystemExit("set PREFECT_API_URL to the Prefect server whose pools these are (not the local demo server)")
    if placeholder:
        raise SystemExit(f"pools {placeholder} still use the placeholder image; pass --set POOL.image=YOUR_REGISTRY/edgeflow:TAG")
    prefect = shutil.which("prefect", path=str(Path(sys.executable).parent)) or "prefect"
    for pool, t in tpls.items():
        existing = asyncio.run(_existing_type(pool))
        if existing not in (None, "kubernetes"):
            raise SystemExit(
                f"pool {pool!r} exists on {os.environ['PREFECT_API_URL']} as type {existing!r}; refusing to replace it "
                "(is this the local demo server?). Delete it first if it really should become a Kubernetes pool."
            )
        with tempfile.NamedTemporaryFile("w", suffix=f"-{pool}.json", delete=False) as f:
            json.dump(t, f)
        try:
            subprocess.run([prefect, "work-pool", "create", pool, "--type", "kubernetes",
                            "--base-job-template", f.name, "--overwrite"], check=True)
        finally:
            os.unlink(f.name)
    print("next: run a Kubernetes worker per pool in the cluster, e.g. `prefect worker start --pool a100 --type kubernetes` "
          "(prefect-kubernetes installed), or the prefect-worker Helm chart; see infra/kubernetes/README.md")


if __name__ == "__main__":
    main()
