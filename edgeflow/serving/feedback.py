"""POST /feedback: the chat page's feedback buttons, counted in metrics and written to the access log.

    return await record_feedback(request, state)
"""
from __future__ import annotations

import uuid

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from edgeflow.serving.protocol import ApiError, Feedback, read_json, validation_error
from edgeflow.serving.state import AppState, utc_now


async def record_feedback(request: Request, state: AppState) -> JSONResponse:
    settings = state.settings
    try:
        fb = Feedback.model_validate(await read_json(request, settings.max_body_bytes, settings.request_timeout_s))
    except ValidationError as e:
        return validation_error(e).response()
    except ApiError as e:
        return e.response()
    state.metrics.feedback.labels(kind=fb.feedback).inc()
    record_id = f"fb-{uuid.uuid4().hex}"
    if state.access_log is not None:
        state.log({
            "ts": utc_now(), "id": record_id, "kind": "feedback", "engine_version": state.runtime.engine_version,
            "model": settings.model_name, **fb.model_dump(mode="json"),
        })
    return JSONResponse({"status": "recorded", "id": record_id, "access_log": state.access_log is not None})
