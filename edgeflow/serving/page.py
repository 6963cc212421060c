"""GET /: the chat page (edgeflow/serving/chat.html), with the served model name and whether a key is needed.

    return chat_page(settings.model_name, auth=bool(keys))
"""
from __future__ import annotations

import json
from pathlib import Path

from fastapi.responses import Response

CHAT_PAGE = Path(__file__).with_name("chat.html")


def chat_page(model_name: str | None, auth: bool) -> Response:
    page = (CHAT_PAGE.read_text(encoding="utf-8")
            .replace("{{MODEL}}", json.dumps(model_name).replace("<", "\\u003c"))
            .replace("{{AUTH}}", "true" if auth else "false"))
    return Response(page, media_type="text/html; charset=utf-8", headers={"Cache-Control": "no-cache"})
