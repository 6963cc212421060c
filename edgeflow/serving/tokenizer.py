"""The server's tokenizer: `tokenizers` + the checkpoint's Jinja chat template, without transformers.

Importing transformers pulls in torch (~500 MB resident); the edge server only needs to encode, decode
and render the chat template, which the `tokenizers` library and jinja2 do in a few MB.

    tok = LightTokenizer(Path("engine_dir")); tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer


def _token_str(value: Any) -> str | None:
    if isinstance(value, dict):  # older configs store AddedToken dicts
        return value.get("content")
    return value


class LightTokenizer:
    """The subset of a Hugging Face tokenizer the server uses, rendering chat templates as transformers does."""

    def __init__(self, directory: Path):
        directory = Path(directory)
        self._tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
        cfg = json.loads((directory / "tokenizer_config.json").read_text())
        template_file = directory / "chat_template.jinja"
        template = template_file.read_text() if template_file.exists() else cfg.get("chat_template")
        if not template:
            raise ValueError(f"{directory}: no chat template (chat_template.jinja or tokenizer_config.json chat_template)")
        # transformers renders with this environment: sandboxed, trim_blocks and lstrip_blocks on.
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = lambda msg: (_ for _ in ()).throw(ValueError(msg))
        self._template = env.from_string(template)
        self.special = {k: _token_str(cfg.get(k)) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
        self.eos_token_id = self._tok.token_to_id(self.special["eos_token"]) if self.special["eos_token"] else None
        self._special_ids = {i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
        return {"input_ids": self._tok.encode(text, add_special_tokens=add_special_tokens).ids}

    def get_vocab(self) -> dict[str, int]:
        return self._tok.get_vocab(with_added_tokens=True)

    def decode(self, ids: list[int], skip_special_tokens: bool = True, clean_up_tokenization_spaces: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, tokenize: bool = False) -> str:
        if tokenize:
            raise ValueError("LightTokenizer renders text only; encode the result with __call__")
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt, **self.special)
