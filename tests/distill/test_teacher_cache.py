"""The teacher-output cache (edgeflow/distill/teacher_cache.py): hits, misses, invalidation by teacher and by corpus, the
top-k KD term it trains with (edgeflow/distill/losses.py:kd_sums_topk), and its shards travelling between hosts through a real
MLflow server."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from edgeflow.tracking.artifacts import ChecksumError
from edgeflow.profile import DistillConfig
from edgeflow.distill import build_student, prepare_dataset, resolve_layer_map, train
from edgeflow.distill.data import collate
from edgeflow.distill.run import check_cache_budget
from edgeflow.distill.teacher_cache import CacheSpec, TeacherCache, pull, push, sequence_key
from edgeflow.distill.losses import kd_sums, kd_sums_topk, teacher_topk


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _seqs(n: int = 12) -> list[list[int]]:
    return [[(5 * i + 11 * j) % 500 + 1 for j in range(6 + i % 7)] for i in range(n)]


class CountingTeacher(torch.nn.Module):
    """The real teacher, counting the sequences it is asked to run (or refusing to run at all)."""

    def __init__(self, model, refuse: bool = False):
        super().__init__()
        self.model, self.refuse, self.sequences = model, refuse, 0
        self.config = model.config

    def forward(self, input_ids, **kw):
        if self.refuse:
            raise AssertionError("the teacher ran although every output should have come from the cache")
        self.sequences += input_ids.shape[0]
        return self.model(input_ids=input_ids, **kw)


def _teacher(tiny_llama: Path, refuse: bool = False) -> CountingTeacher:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    model.requires_grad_(False)
    model.eval()
    return CountingTeacher(model, refuse)


def _spec(teacher_sha: str = "a" * 64, top_k: int = 8, temperature: float = 2.0) -> CacheSpec:
    return CacheSpec(teacher_sha, top_k, temperature)


def _batch_outputs(cache: TeacherCache, teacher, seqs: list[list[int]], layers=(0, 1)):
    input_ids, attn, _ = collate(seqs, 0)
    return cache.outputs(teacher, seqs, input_ids, attn, list(layers))


# ------------------------------------------------------------------------------------------ the loss


def test_topk_kd_is_the_full_kl_at_full_vocabulary_and_a_lower_bound_of_it_below():
    torch.manual_seed(0)
    v = 40
    student = torch.randn(2, 6, v, requires_grad=True)
    s = student.detach()
    teacher = torch.randn(2, 6, v) * 2
    labels = torch.randint(0, v, (2, 6))
    labels[1, 4:] = -100
    for t in (1.0, 3.0):
        full, ce_full, n_full = kd_sums(s, teacher, labels, t)
        idx, logp = teacher_topk(teacher, t, v)
        exact, ce, n = kd_sums_topk(s, idx, logp, labels, t)
        assert float(exact) == pytest.approx(float(full), rel=1e-5) and float(ce) == pytest.approx(float(ce_full)) and n == n_full
        previous = float(exact)
        for k in (20, 5, 1):
            got = float(kd_sums_topk(s, *teacher_topk(teacher, t, k), labels, t)[0])
            assert 0 <= got <= previous + 1e-5  # coarser partitions never raise the KL
            previous = got
    kd, _, _ = kd_sums_topk(student, *teacher_topk(teacher, 1.0, 5), labels, 1.0)
    kd.backward()
    assert student.grad is not None and student.grad.abs().sum() > 0


def test_student_mass_outside_the_teachers_top_k_is_penalised():
    v = 10
    teacher = torch.full((1, 2, v), -10.0)
    teacher[..., 0] = 10.0  # the teacher is sure of token 0
    labels = torch.zeros((1, 2), dtype=torch.long)
    near = teacher.clone()
    far = torch.zeros((1, 2, v))
    far[..., 5] = 10.0  # the student is sure of a token outside the teacher's top 2
    idx, logp = teacher_topk(teacher, 1.0, 2)
    assert float(kd_sums_topk(far, idx, logp, labels, 1.0)[0]) > 10 * float(kd_sums_topk(near, idx, logp, labels, 1.0)[0]) + 1


# ------------------------------------------------------------------------------------------ hits and misses


def test_a_miss_runs_the_teacher_once_then_the_same_sequences_hit_after_reopening(tiny_llama, tmp_path):
    seqs = _seqs(6)
    teacher = _teacher(tiny_llama)
    cache = TeacherCache(tmp_path, _spec())
    idx, logp, hidden = _batch_outputs(cache, teacher, seqs)
    assert teacher.sequences == 6 and cache.stats.misses == 6 and cache.stats.hits == 0
    _batch_outputs(cache, teacher, seqs[:3])  # computed by this run, not yet written: still no second forward
    assert teacher.sequences == 6 and cache.stats.hits == 3
    shard = cache.flush()
    from edgeflow.tracking.artifacts import sha256_file

    assert shard is not None and shard.name == f"{sha256_file(shard)}.parquet"

    again = TeacherCache(tmp_path, _spec())
    assert len(again) == 6
    idx2, logp2, hidden2 = _batch_outputs(again, _teacher(tiny_llama, refuse=True), seqs)
    assert again.stats.hits == 6 and again.stats.misses == 0
    assert torch.equal(idx, idx2) and torch.equal(logp, logp2) and all(torch.equal(a, b) for a, b in zip(hidden, hidden2))
    # what was stored is the teacher's own top-k at T and its hidden states in bfloat16
    live = teacher.model(input_ids=collate(seqs, 0)[0], output_hidden_states=True)
    want_idx, want_logp = teacher_topk(live.logits, 2.0, 8)
    n0 = len(seqs[0])
    assert torch.equal(idx2[0, :n0], want_idx[0, :n0]) and torch.allclose(logp2[0, :n0], want_logp[0, :n0])
    assert torch.equal(hidden2[1][0, :n0], live.hidden_states[2][0, :n0].to(torch.bfloat16).float())


def test_training_on_a_warm_cache_never_runs_the_teacher_and_gives_the_same_steps(tiny_llama, tmp_path):
    cfg = DistillConfig(keep_layers=[1], steps=4, batch_size=3, checkpoint_every=0, seed=3, temperature=2.0,
                        teacher_cache={"top_k": 16})
    runs = []
    for refuse in (False, True):
        teacher = _teacher(tiny_llama, refuse=refuse)
        student, kept = build_student(teacher.model, cfg)
        layer_map = resolve_layer_map(cfg, 2, student.config.num_hidden_layers, kept)
        cache = TeacherCache(tmp_path / "cache", _spec(top_k=16))
        result = train(teacher, student, _seqs(), cfg, pad_id=0, layer_map=layer_map, teacher_cache=cache)
        runs.append(result)
    cold, warm = runs
    assert cold.teacher_cache["teacher_cache_misses"] == 12 and cold.teacher_cache["teacher_cache_hits"] == 0
    assert warm.teacher_cache["teacher_cache_hits"] == 12 and warm.teacher_cache["teacher_cache_misses"] == 0
    assert warm.teacher_cache["teacher_cache_bytes_written"] == 0
    for a, b in zip(cold.history, warm.history):
        for term in ("kd", "ce", "hidden_mse", "total"):
            assert a[term] == b[term], term


def test_a_changed_teacher_misses_everything(tiny_llama, tmp_path):
    seqs = _seqs(4)
    first = TeacherCache(tmp_path, _spec("a" * 64))
    _batch_outputs(first, _teacher(tiny_llama), seqs)
    first.flush()
    other = TeacherCache(tmp_path, _spec("b" * 64))  # another teacher's weights: another namespace
    assert len(other) == 0 and other.dir != first.dir
    teacher = _teacher(tiny_llama)
    _batch_outputs(other, teacher, seqs)
    assert other.stats.misses == 4 and teacher.sequences == 4
    # so do another k and another temperature: the stored log-probabilities depend on both
    assert len({_spec(top_k=8).namespace, _spec(top_k=16).namespace, _spec(temperature=1.0).namespace}) == 3


def test_a_corpus_edit_misses_exactly_the_sequences_it_changed(tiny_llama, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    texts = [f"record {i}: the quick brown fox jumps over {i} lazy dogs" for i in range(5)]
    corpus = tmp_path / "corpus.jsonl"
    cfg = DistillConfig(max_seq_len=32)
    teacher = _teacher(tiny_llama)

    def all_outputs(cache: TeacherCache) -> None:
        data, _ = prepare_dataset([corpus], tok, cfg, tmp_path / "data")
        seqs = [[t % 512 for t in data[i]] for i in range(len(data))]  # tiny_llama's vocabulary is 512
        _batch_outputs(cache, teacher, seqs, layers=(1,))

    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    first = TeacherCache(tmp_path / "cache", _spec())
    all_outputs(first)
    first.flush()
    texts[2] = "record 2 was rewritten overnight"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    second = TeacherCache(tmp_path / "cache", _spec())
    all_outputs(second)
    assert (second.stats.hits, second.stats.misses) == (4, 1)


def test_an_entry_lacking_a_layer_the_run_matches_is_a_miss(tiny_llama, tmp_path):
    seqs = _seqs(3)
    cache = TeacherCache(tmp_path, _spec())
    _batch_outputs(cache, _teacher(tiny_llama), seqs, layers=(1,))
    cache.flush()
    reopened = TeacherCache(tmp_path, _spec())
    _batch_outputs(reopened, _teacher(tiny_llama), seqs, layers=(1,))
    assert reopened.stats.hits == 3
    _batch_outputs(reopened, _teacher(tiny_llama), seqs, layers=(0, 1))
    assert reopened.stats.misses == 3  # stored without layer 0: computed again, with both


def test_sequence_keys_follow_token_content_only():
    assert sequence_key([1, 2, 3]) == sequence_key((1, 2, 3)) != sequence_key([1, 2, 4]) != sequence_key([1, 2])


def test_the_size_budget_refuses_before_training_naming_the_estimate_and_the_fixes():
    cfg = DistillConfig(steps=1000, batch_size=8, teacher_cache={"top_k": 64, "max_gb": 1})
    stats = {"training_sequences": 100_000, "training_tokens": 100_000 * 2048}
    with pytest.raises(ValueError, match=r"up to 291\.5 GB of teacher outputs \(8,000 sequences.*max_gb=1\. Fix: lower top_k"):
        check_cache_budget(cfg, stats, hidden_layers=15, hidden_size=576)
    roomy = cfg.model_copy(update={"teacher_cache": cfg.teacher_cache.model_copy(update={"max_gb": 10})})
    assert check_cache_budget(roomy, stats, hidden_layers=0, hidden_size=576) == pytest.approx(8000 * 2048 * 512 / 1e9)


def test_top_k_and_budget_are_validated_at_load():
    with pytest.raises(ValueError, match="top_k"):
        DistillConfig(teacher_cache={"top_k": 0})
    with pytest.raises(ValueError, match="extra"):
        DistillConfig(teacher_cache={"topk": 8})
    # the budget is not part of what is trained; k is
    assert DistillConfig(teacher_cache={"max_gb": 1}).training_identity() == DistillConfig().training_identity()
    assert DistillConfig(teacher_cache={"top_k": 8}).training_identity() != DistillConfig().training_identity()


# ------------------------------------------------------------------------------------------ between hosts


def test_shards_reach_another_host_through_mlflow_checked_by_sha256(tiny_llama, tmp_path, mlflow_tracking, monkeypatch):
    from mlflow import MlflowClient

    client = MlflowClient(mlflow_tracking)
    spec = _spec(teacher_sha="c" * 64)
    seqs = _seqs(5)
    monkeypatch.setenv("EDGEFLOW_HOME", str(tmp_path / "a100-home"))
    producer = TeacherCache(tmp_path / "a100", spec)
    _batch_outputs(producer, _teacher(tiny_llama), seqs)
    producer.flush()
    pushed = push(client, spec, tmp_path / "a100")
    assert len(pushed) == 1 and pushed[0].uri.startswith("mlflow-artifacts:") and push(client, spec, tmp_path / "a100") == []

    monkeypatch.setenv("EDGEFLOW_HOME", str(tmp_path / "other-home"))
    assert pull(client, spec, tmp_path / "other") == 1
    consumer = TeacherCache(tmp_path / "other", spec)
    _batch_outputs(consumer, _teacher(tiny_llama, refuse=True), seqs)
    assert consumer.stats.hits == 5
    assert pull(client, spec, tmp_path / "other") == 0  # nothing new
    assert pull(client, _spec(teacher_sha="d" * 64), tmp_path / "third") == 0  # another teacher: nothing to fetch

    # a shard whose bytes do not hash to the name it was stored under is refused on the way in
    bad = TeacherCache(tmp_path / "bad", spec)
    _batch_outputs(bad, _teacher(tiny_llama), _seqs(7)[5:])
    shard = bad.flush()
    shard.rename(shard.with_name("0" * 64 + ".parquet"))
    push(client, spec, tmp_path / "bad")
    monkeypatch.setenv("EDGEFLOW_HOME", str(tmp_path / "fourth-home"))
    with pytest.raises(ChecksumError, match="teacher-outputs artifact .* does not match"):
        pull(client, spec, tmp_path / "fourth")
