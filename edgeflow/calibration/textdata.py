"""Reading shipped corpora and logs into plain training/eval texts."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq


def read_records(path: Path) -> list[dict[str, Any]]:
    """Records of a JSONL, Parquet or plain-text file (text: one record per blank-line-separated block)."""
    path = Path(path)
    if path.suffix == ".parquet":
        return pq.read_table(path).to_pylist()
    if path.suffix in (".jsonl", ".json"):
        out = []
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if line.strip():
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{n}: not valid JSON ({e.msg}); fix or remove the line") from None
        return out
    return [{"text": block.strip()} for block in path.read_text().split("\n\n") if block.strip()]


def record_messages(rec: dict[str, Any]) -> list[dict[str, str]] | None:
    """Chat messages of a record, if it is conversational (messages or question/answer)."""
    if "messages" in rec:
        return [{"role": m["role"], "content": m["content"]} for m in rec["messages"]]
    if "question" in rec:
        msgs = [{"role": "user", "content": rec["question"]}]
        if rec.get("answer"):
            msgs.append({"role": "assistant", "content": rec["answer"]})
        return msgs
    return None


def record_text(rec: dict[str, Any], tokenizer) -> str:
    """Render a record the way the model sees it: chat records through the chat template, prose as is."""
    msgs = record_messages(rec)
    if msgs is not None:
        if rec.get("response"):  # access-log records carry the answer separately
            msgs = msgs + [{"role": "assistant", "content": rec["response"]}]
        return tokenizer.apply_chat_template(msgs, tokenize=False)
    if "text" in rec:
        return f"{rec['title']}\n{rec['text']}" if rec.get("title") else rec["text"]
    raise ValueError(f"record has none of messages/question/text: keys {sorted(rec)[:6]}")


def load_texts(paths: list[Path], tokenizer) -> list[str]:
    """All texts of several files, in file order."""
    return [record_text(r, tokenizer) for p in paths for r in read_records(p)]
