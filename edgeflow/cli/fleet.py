"""The fleet from the command line (`edgeflow fleet`, or `python -m edgeflow.fleet` as the device's systemd unit runs it).

    python -m edgeflow.fleet list [--pool orin]                 # every registered device, its worker and what it serves
    python -m edgeflow.fleet targets --out prometheus-devices.json   # file_sd targets for Prometheus
    python -m edgeflow.fleet show                               # this host's device.yaml, as validated, and its facts
    python -m edgeflow.fleet register --profile configs/demo-cpu.yaml
    python -m edgeflow.fleet worker --profile configs/demo-cpu.yaml  # register, then run the Prefect worker on this
                                                                  # device's own queue (infra/systemd/edgeflow-orin-worker.service)
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=os.environ.pop("EDGEFLOW_PROG", "python -m edgeflow.fleet"), description=__doc__.splitlines()[0] if __doc__ else None)
    sub = ap.add_subparsers(dest="cmd", required=True)
    ls = sub.add_parser("list", help="print the inventory")
    ls.add_argument("--pool", default=None)
    ls.add_argument("--json", action="store_true", help="the records as JSON instead of the table")
    tg = sub.add_parser("targets", help="write Prometheus file_sd targets")
    tg.add_argument("--out", type=Path, required=True)
    tg.add_argument("--pool", default=None)
    sub.add_parser("show", help="this host's device config and facts")
    for name in ("register", "worker"):
        sp = sub.add_parser(name)
        sp.add_argument("--profile", default="configs/demo-cpu.yaml")
    a = ap.parse_args(argv)

    from edgeflow.device.identity import device_profile, load_device
    from edgeflow.fleet import inventory
    from edgeflow.pipeline import inventory_store as store

    if a.cmd == "list":
        records = store.read_inventory(a.pool)
        if a.json:
            print(json.dumps([r.model_dump(mode="json") for r in records], indent=1))
            return 0
        status = {}
        for pool in sorted({r.pool for r in records}):
            status |= store.worker_status(pool)
        print(inventory.table(records, status) if records else "no device registered (start one with python -m edgeflow.fleet worker)")
        return 0
    if a.cmd == "targets":
        targets = inventory.prometheus_targets(store.read_inventory(a.pool))
        tmp = a.out.with_name(a.out.name + ".tmp")
        tmp.write_text(json.dumps(targets, indent=1))
        os.replace(tmp, a.out)  # Prometheus re-reads file_sd files on change; never let it see half a file
        print(f"{len(targets)} device target(s) -> {a.out}")
        return 0
    device = load_device(required=True)
    if a.cmd == "show":
        print(json.dumps({"device": device.model_dump(mode="json"), "facts": inventory.detected_facts()}, indent=1))
        return 0
    from edgeflow.preflight import load_profile

    record = store.register(device_profile(load_profile(a.profile), device), device)
    print(f"registered {record.id} (pool {record.pool}, queue {record.queue}); serving: "
          f"{record.serving.version or 'nothing'}{' (healthy)' if record.serving.healthy else ''}")
    print(store.ensure_ship_logs(device, a.profile))
    print(store.ensure_reconcile(device, a.profile))
    if a.cmd == "register":
        return 0
    prefect = shutil.which("prefect") or str(Path(sys.executable).with_name("prefect"))
    cmd = [prefect, "worker", "start", "--pool", device.pool, "--work-queue", device.queue, "--name", device.queue]
    if device.build_queue:
        cmd += ["--work-queue", "default"]
    sys.stdout.flush()
    os.execv(cmd[0], cmd)  # the worker replaces this process: systemd supervises the worker itself
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
