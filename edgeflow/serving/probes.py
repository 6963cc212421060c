"""GET /health (deep probe: one real token through the engine), GET /ready and GET /metrics (Prometheus).

    return await health(state)
"""
from __future__ import annotations

from fastapi.responses import JSONResponse, Response

from edgeflow.serving.runtime import EngineFailed
from edgeflow.serving.state import AppState


async def health(state: AppState) -> JSONResponse:
    runtime = state.runtime
    base = {"model": state.settings.model_name, "engine": runtime.engine_info(), "gpu_util": runtime.device_utilization()}
    try:
        took = await runtime.probe()
    except EngineFailed as e:
        return JSONResponse({"status": "unhealthy", "reason": str(e), **base}, status_code=503)
    return JSONResponse(
        {
            "status": "healthy",
            **base,
            "probe_ms": round(took * 1000, 2),
            "in_flight": state.admission.active,
            "queue_depth": state.admission.waiting,
        }
    )


def ready(state: AppState) -> JSONResponse:
    runtime = state.runtime
    if runtime.state == "ready":
        return JSONResponse({"status": "ready", "model": state.settings.model_name})
    return JSONResponse({"status": runtime.state, "reason": runtime.reason}, status_code=503)


def metrics(state: AppState) -> Response:
    content, media_type = state.metrics.exposition()
    return Response(content, media_type=media_type)
