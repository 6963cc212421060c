"""Ship-logs (runs on each device, hourly, from its own work queue): the device's rotated access-log segments go home.

On a device (services up, its device.yaml in place): python -m edgeflow.pipeline.ship_logs --profile configs/demo-cpu.yaml

Every segment the edge servers cut (edgeflow/serving/access_log.py: on size, and hourly on age) is uploaded to the device's
run in the `edgeflow-access-logs` MLflow experiment with its sha256, time range and line count in the run's
manifest, then marked shipped and deleted on the device (edgeflow/device/logship.py). A retry after any failure ships
what is left without losing or double-counting a line; the nightly recalibration reads the window from the store.
"""
from __future__ import annotations

import argparse

from prefect import flow, task

from edgeflow.device.identity import DeviceConfig
from edgeflow.profile import Profile


@task
def ship(target: Profile, device: DeviceConfig) -> dict:
    """Ship this device's rotated segments and mark them; returns the ShipReport as a dict."""
    from edgeflow.device.logship import ship_segments

    report = ship_segments(target, device)
    print(f"device {report.device_id}: {len(report.uploaded)} segments ({report.lines} lines) shipped, "
          f"{len(report.already_stored)} already stored, {len(report.removed)} removed from {report.log}")
    for problem in report.problems:
        print(f"  {problem}")
    return report.model_dump()


@flow(name="ship-logs", log_prints=True)
def ship_logs(profile: str = "configs/demo-cpu.yaml") -> dict:
    """This device's access-log segments to the artifact store; the ShipReport out."""
    from edgeflow.device.identity import device_profile, load_device
    from edgeflow.preflight import load_profile

    device = load_device(required=True)  # once each: handed to the step
    return ship(device_profile(load_profile(profile), device), device)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--profile", default="configs/demo-cpu.yaml")
    a = ap.parse_args()
    ship_logs(a.profile)
