"""Prefect pull step: run a deployment's flow from this worker's own edgeflow checkout.

    prefect.yaml:  pull: [{edgeflow.pipeline.checkout.enter_checkout: {}}]

`prefect deploy` fills `{{ $VAR }}` templates on the host that deploys, so a working directory templated
from an environment variable would name the deploying host's checkout on every worker (a process worker
otherwise runs each flow in a fresh temporary directory). This step reads the directory where the flow
runs: EDGEFLOW_REPO if the worker sets it, else the checkout this edgeflow is installed from.
"""
from __future__ import annotations

import os
from pathlib import Path

from edgeflow.paths import REPO_ROOT


def enter_checkout() -> dict[str, str]:
    """chdir into this host's checkout; returns {"directory": it}, as Prefect's set_working_directory does."""
    directory = Path(os.environ.get("EDGEFLOW_REPO") or REPO_ROOT)
    if not (directory / "prefect.yaml").is_file():
        raise FileNotFoundError(
            f"EDGEFLOW_REPO={directory} holds no prefect.yaml: point EDGEFLOW_REPO at this host's edgeflow checkout "
            "(the worker unit or job sets it) or unset it to use the checkout edgeflow is installed from"
        )
    os.chdir(directory)
    return {"directory": os.getcwd()}
