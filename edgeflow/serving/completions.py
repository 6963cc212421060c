"""POST /v1/completions: raw prompt text continued by the engine, answered as `text_completion`
(streamed or not), with the legacy `logprobs: N` shape.

    return await handle_safely(request, state, Completions())
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from edgeflow.serving.decoding import Piece, TextStream, completion_logprobs
from edgeflow.serving.generation import GenerationEndpoint, RequestRecord
from edgeflow.serving.protocol import CompletionRequest
from edgeflow.serving.runtime import Runtime

if TYPE_CHECKING:
    from edgeflow.serving.settings import ServerSettings

COMPLETIONS_ENDPOINT = "/v1/completions"


class Completions(GenerationEndpoint):
    path = COMPLETIONS_ENDPOINT
    id_prefix = "cmpl"
    input_field = "prompt"
    schema = CompletionRequest
    answer_object = "text_completion"
    chunk_object = "text_completion"

    def logged_input(self, req: CompletionRequest) -> str:
        return req.prompt_text()

    def prompt_text(self, rt: Runtime, req: CompletionRequest, rec: RequestRecord) -> str:
        return req.prompt_text()

    def default_max_tokens(self, settings: ServerSettings) -> int:
        return 16  # OpenAI's default for completions

    def logprobs(self, text: TextStream, piece: Piece, offset: int) -> dict[str, Any] | None:
        return completion_logprobs(text, piece.tokens, offset)

    def chunk_choice(self, content: str | None, finish: str | None, logprobs: Any) -> dict[str, Any]:
        return {"text": content or "", "index": 0, "logprobs": logprobs, "finish_reason": finish}

    def answer_choice(self, answer: str, finish: str, logprobs: Any) -> dict[str, Any]:
        return {"text": answer, "index": 0, "logprobs": logprobs, "finish_reason": finish}
