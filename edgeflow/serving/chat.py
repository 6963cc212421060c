"""POST /v1/chat/completions: a conversation rendered by the engine's chat template, answered as
`chat.completion` (or `chat.completion.chunk` events, opened with the assistant role).

    return await handle_safely(request, state, ChatCompletions())

Chat requests keep the last `history_turns` turns; older ones are condensed into one summary line
(edgeflow.serving.conversation), so a long chat stays under max_prompt_tokens.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from edgeflow.serving.conversation import condense
from edgeflow.serving.decoding import Piece, TextStream, chat_logprobs
from edgeflow.serving.generation import GenerationEndpoint, RequestRecord
from edgeflow.serving.protocol import ApiError, ChatRequest
from edgeflow.serving.runtime import Runtime

if TYPE_CHECKING:
    from edgeflow.serving.settings import ServerSettings

CHAT_ENDPOINT = "/v1/chat/completions"


class ChatCompletions(GenerationEndpoint):
    path = CHAT_ENDPOINT
    id_prefix = "chatcmpl"
    input_field = "messages"
    schema = ChatRequest
    answer_object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def logged_input(self, req: ChatRequest) -> list[dict[str, str]]:
        return req.message_dicts()

    def prompt_text(self, rt: Runtime, req: ChatRequest, rec: RequestRecord) -> str:
        kept = condense(req.message_dicts(), rt.settings.history_turns, rt.settings.history_summary_chars)
        rec.condensed_turns = kept.condensed_turns
        try:
            return rt.tokenizer.apply_chat_template(kept.messages, add_generation_prompt=True, tokenize=False)
        except Exception as e:  # noqa: BLE001 - template errors (e.g. role order) are the client's
            raise ApiError(400, f"the chat template of model {rt.settings.model_name!r} rejected the messages: {e}",
                           param="messages") from None

    def default_max_tokens(self, settings: ServerSettings) -> int:
        return settings.max_tokens_limit  # OpenAI: "as many as fit", capped by this server's limit

    def logprobs(self, text: TextStream, piece: Piece, offset: int) -> dict[str, Any] | None:
        return chat_logprobs(text, piece.tokens)

    def opening_choices(self) -> list[dict[str, Any]]:
        return [self.chunk_choice("", None, None, role=True)]  # OpenAI opens a chat stream with the role

    def chunk_choice(self, content: str | None, finish: str | None, logprobs: Any, role: bool = False) -> dict[str, Any]:
        delta: dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
        if content is not None:
            delta["content"] = content
        return {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}

    def answer_choice(self, answer: str, finish: str, logprobs: Any) -> dict[str, Any]:
        return {"index": 0, "message": {"role": "assistant", "content": answer}, "logprobs": logprobs,
                "finish_reason": finish}
