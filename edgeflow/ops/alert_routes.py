"""The Alertmanager config's routes, checked without amtool: what the profile's preflight runs (edgeflow/preflight.py),
and the error every monitoring check raises (edgeflow/ops/monitoring.py runs amtool and promtool as well).

    python -c "from pathlib import Path; from edgeflow.ops.alert_routes import check_routes; check_routes(Path('infra/alertmanager/alertmanager.yml'))"
"""
from __future__ import annotations

from pathlib import Path

import yaml


class MonitoringConfigError(ValueError):
    """A Prometheus or Alertmanager config that its own tool refuses; the message names file, line and fix."""


def check_routes(path: Path) -> None:
    """Without amtool (the profile load): the file parses, its route tree has a receiver at the root, and every route
    names a receiver that `receivers:` defines. MonitoringConfigError with the file, the line and the fix otherwise."""
    try:
        root = yaml.compose(path.read_text())
    except OSError as e:
        raise MonitoringConfigError(f"{path}: cannot read it ({e.strerror}); fix: give an existing Alertmanager config "
                                    "(the shipped one is infra/alertmanager/alertmanager.yml)") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        raise MonitoringConfigError(f"{path}{line}: does not parse as YAML ({getattr(e, 'problem', e)}); fix: correct "
                                    "the YAML there; `amtool check-config FILE` checks the whole file") from None

    def get(node, key):
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                if k.value == key:
                    return v
        return None

    receivers = get(root, "receivers")
    names = {get(r, "name").value for r in (receivers.value if isinstance(receivers, yaml.SequenceNode) else [])
             if get(r, "name") is not None}
    route = get(root, "route")
    if route is None or get(route, "receiver") is None:
        line = route.start_mark.line + 1 if route is not None else 1
        raise MonitoringConfigError(f"{path}:{line}: the root route names no receiver, so an alert matching no sub-route "
                                    "would reach nobody; fix: give `route:` a `receiver:` from `receivers:`")
    pending = [route]
    while pending:
        node = pending.pop()
        receiver = get(node, "receiver")
        if receiver is not None and receiver.value not in names:
            raise MonitoringConfigError(
                f"{path}:{receiver.start_mark.line + 1}: route receiver {receiver.value!r} is not one of receivers: "
                f"{sorted(names)}; fix: name one of those, or add a receiver {receiver.value!r}")
        routes = get(node, "routes")
        if isinstance(routes, yaml.SequenceNode):
            pending.extend(routes.value)
