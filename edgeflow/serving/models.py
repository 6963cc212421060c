"""GET /v1/models and GET /v1/models/{model_id}: the one model this server serves.

    return JSONResponse(model_card(state))
"""
from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse, Response

from edgeflow.serving.protocol import model_not_found
from edgeflow.serving.state import AppState


def model_card(state: AppState) -> dict[str, Any]:
    return {"id": state.settings.model_name, "object": "model", "created": state.runtime.created, "owned_by": "edgeflow"}


def list_models(state: AppState) -> dict[str, Any]:
    return {"object": "list", "data": [model_card(state)]}


def get_model(state: AppState, model_id: str) -> Response:
    if model_id != state.settings.model_name:
        return model_not_found(model_id, state.settings.model_name).response()
    return JSONResponse(model_card(state))
