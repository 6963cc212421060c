"""monitoring: where the fleet's alerts go.
"""
from __future__ import annotations

from pydantic import Field

from edgeflow.profile.base import _Strict


class MonitoringConfig(_Strict):
    """Where the fleet's alerts go (`scripts/services.py up` runs this config; edgeflow/ops/monitoring.py)."""

    alertmanager_config: str = Field(
        default="infra/alertmanager/alertmanager.yml",
        description="Alertmanager config routing the alerts of infra/prometheus/alerts.yml to people; checked when the "
        "profile loads (it parses, every route names a defined receiver) and by amtool when the services start.",
    )
