"""Sequence-level KD (edgeflow/distill/seqkd.py): the teacher's answers to the chat prompts, generated once, found again
by content on this host or another one (through a real MLflow server), and read as a training file."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from edgeflow.profile import DistillConfig, SequenceKDConfig
from edgeflow.distill import prepare_dataset
from edgeflow.distill.seqkd import answers_file, chat_prompts, shared_answers
from edgeflow.calibration.textdata import read_records


def _corpus(path: Path) -> Path:
    recs = [
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a resistor?"},
                      {"role": "assistant", "content": "A part that limits current."}]},
        {"text": "Prose is not a prompt."},
        {"question": "2 + 2?", "answer": "4"},
        {"messages": [{"role": "user", "content": "Name a planet."}, {"role": "assistant", "content": "Mars."},
                      {"role": "user", "content": "Another one?"}, {"role": "assistant", "content": "Venus."}]},
        {"messages": [{"role": "user", "content": "Name a colour of the sky at noon."}]},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


def test_prompts_are_conversations_up_to_their_last_user_turn(tmp_path):
    prompts = chat_prompts([_corpus(tmp_path / "chat.jsonl")])
    assert [p[-1]["content"] for p in prompts] == ["What is a resistor?", "Another one?", "Name a colour of the sky at noon."]
    assert prompts[0][0] == {"role": "system", "content": "Be brief."} and len(prompts[1]) == 3
    assert len(chat_prompts([tmp_path / "chat.jsonl"], max_prompts=2)) == 2


@pytest.fixture(scope="module")
def smol(teacher_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(2)
    return AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(teacher_dir)


def test_answers_are_generated_once_then_found_by_content_and_train_as_chat_records(smol, teacher_dir, tmp_path):
    model, tok = smol
    corpus = _corpus(tmp_path / "chat.jsonl")
    path, stats = answers_file(model, tok, [corpus], "t" * 64, 24, None, tmp_path / "cache")
    assert stats["sequence_kd_prompts"] == 3 and stats["sequence_kd_cache_hit"] == 0 and path is not None
    records = read_records(path)
    assert len(records) == stats["sequence_kd_answers"] >= 1
    for r in records:
        assert r["messages"][-1]["role"] == "assistant" and r["messages"][-1]["content"]
        assert r["messages"][-2]["role"] == "user"
    # the same inputs: found, no teacher needed
    again, stats2 = answers_file(None, tok, [corpus], "t" * 64, 24, None, tmp_path / "cache")
    assert again == path and stats2["sequence_kd_cache_hit"] == 1
    # another teacher, other prompts or other settings: not found
    for teacher_sha, n_tokens, limit in (("u" * 64, 24, None), ("t" * 64, 32, None), ("t" * 64, 24, 1)):
        with pytest.raises(ValueError, match="no answers stored"):
            answers_file(None, tok, [corpus], teacher_sha, n_tokens, limit, tmp_path / "cache")
    data, data_stats = prepare_dataset([path], tok, DistillConfig(max_seq_len=128), tmp_path / "data")
    assert data_stats["training_sequences"] == len(records)
    assert tok.decode(data[0]).count(records[0]["messages"][-1]["content"][:20]) == 1


def test_another_host_fetches_the_answers_from_mlflow_instead_of_generating(smol, teacher_dir, tmp_path, mlflow_tracking, monkeypatch):
    from mlflow import MlflowClient

    client = MlflowClient(mlflow_tracking)
    corpus = _corpus(tmp_path / "chat.jsonl")
    cfg = SequenceKDConfig(enabled=True, max_new_tokens=12, max_prompts=2)
    monkeypatch.setenv("EDGEFLOW_HOME", str(tmp_path / "a100-home"))
    first, stats = shared_answers(client, teacher_dir, "v" * 64, cfg, [corpus], tmp_path / "a100")
    assert stats["sequence_kd_cache_hit"] == 0
    monkeypatch.setenv("EDGEFLOW_HOME", str(tmp_path / "b-home"))
    import transformers

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **k: pytest.fail("the second host loaded the teacher instead of fetching its answers"))
    second, stats2 = shared_answers(client, teacher_dir, "v" * 64, cfg, [corpus], tmp_path / "b")
    assert stats2["sequence_kd_cache_hit"] == 1 and second.read_bytes() == first.read_bytes() and second != first
