"""Distill stage: checks before compute, student construction, the Parquet training set, resumable training,
telemetry (a real Pushgateway), the stall watchdog and run_distill on the shipped SmolLM2 teacher."""
from __future__ import annotations

import json
import logging
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
from pydantic import ValidationError

from edgeflow.paths import REPO_ROOT
from edgeflow.profile import DistillConfig
from edgeflow.distill import (
    BatchOrder,
    TokenDataset,
    TrainingStalled,
    build_student,
    build_token_dataset,
    check_memory_budget,
    check_same_tokenizer,
    checkpoint_root,
    distill_run_key,
    kept_layers,
    latest_checkpoint,
    param_ratio,
    prepare_dataset,
    resolve_layer_map,
    run_distill,
    train,
)
from tests.helpers.ports import free_port
from tests.helpers.require import require_binary
from tests.helpers.distill import write_sequences
from tests.helpers.distill import RESUME_CFG, resume_run

PUSHGATEWAY = "/usr/bin/prometheus-pushgateway"


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread, as in the killed child: identical kernels, so losses match across processes (and no
    OpenMP spinning on a busy 2-core machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _seqs(n: int = 20) -> list[list[int]]:
    """Token ids below tiny_llama's vocabulary of 512, of varying length and content."""
    return [[(7 * i + 3 * j) % 500 + 1 for j in range(8 + i % 9)] for i in range(n)]


def _tiny_pair(tiny_llama: Path, cfg: DistillConfig):
    """(teacher, student, layer map): tiny_llama, its layer-dropped cut, and the default map the beta term uses."""
    from transformers import AutoModelForCausalLM

    teacher = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    teacher.requires_grad_(False)
    student, kept = build_student(teacher, cfg)
    return teacher, student, resolve_layer_map(cfg, 2, student.config.num_hidden_layers, kept)


@pytest.fixture(scope="module")
def tiny_smol(tmp_path_factory, teacher_dir) -> Path:
    """A randomly initialised 4-layer Llama built in-test with SmolLM2's whole tokenizer and vocabulary (49,152),
    so the full run_distill path runs on it in seconds."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True)
    out = tmp_path_factory.mktemp("tiny-smol")
    LlamaForCausalLM(cfg).save_pretrained(out)
    AutoTokenizer.from_pretrained(teacher_dir).save_pretrained(out)
    return out


def _jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


# ------------------------------------------------------------------------------------------ config + student


def test_keep_layers_is_validated_in_the_config():
    with pytest.raises(ValidationError, match=r"distill.keep_layers=\[3, 1\] must be sorted and unique; use \[1, 3\]"):
        DistillConfig(keep_layers=[3, 1])
    with pytest.raises(ValidationError, match="sorted and unique"):
        DistillConfig(keep_layers=[1, 1])
    with pytest.raises(ValidationError, match="keep_layers is empty"):
        DistillConfig(keep_layers=[])
    with pytest.raises(ValidationError, match="negative"):
        DistillConfig(keep_layers=[-1, 2])
    with pytest.raises(ValidationError, match="keep_layers and distill.keep_every_k are both set"):
        DistillConfig(keep_layers=[0, 2], keep_every_k=2)
    with pytest.raises(ValidationError, match="student_from replaces layer dropping"):
        DistillConfig(student_from="some/dir", keep_layers=[0])
    with pytest.raises(ValidationError, match="several teacher layers to one student layer"):
        DistillConfig(hidden_layer_map={0: 0, 3: 0})
    for name, f in DistillConfig.model_fields.items():
        assert f.description, f"DistillConfig.{name} has no description"


def test_kept_layers_every_kth_explicit_and_out_of_range():
    assert kept_layers(DistillConfig(keep_every_k=15), 30) == [0, 15, 29]
    assert kept_layers(DistillConfig(keep_layers=[0, 7, 29]), 30) == [0, 7, 29]
    with pytest.raises(ValueError, match=r"keep_layers=\[0, 30\] names layers \[30\] but the teacher has 30 \(0..29\)"):
        kept_layers(DistillConfig(keep_layers=[0, 30]), 30)


def test_drop_block_removes_the_block_that_changes_the_residual_stream_least():
    """Layers 3 and 4 of an 8-layer model write nothing into the residual stream (o_proj and down_proj zeroed): the
    angular distance across them is 0, so drop_block=2 removes exactly them; layer 0 and the last layer always stay."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from edgeflow.distill.student import block_distances

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
    with torch.no_grad():
        for i in (3, 4):
            model.model.layers[i].self_attn.o_proj.weight.zero_()
            model.model.layers[i].mlp.down_proj.weight.zero_()
    model.eval()
    seqs = [list(range(5, 37)), list(range(40, 70))]
    d = block_distances(model, seqs, 2)
    assert sorted(d) == [1, 2, 3, 4, 5] and d[3] < 1e-3 < min(v for l, v in d.items() if l != 3)
    assert kept_layers(DistillConfig(drop_block=2), 8, model, seqs) == [0, 1, 2, 5, 6, 7]
    student, kept = build_student(model, DistillConfig(drop_block=2), None, seqs)
    assert kept == [0, 1, 2, 5, 6, 7] and student.config.num_hidden_layers == 6
    with pytest.raises(ValueError, match=r"drop_block=7 leaves no block .* use at most 6"):
        kept_layers(DistillConfig(drop_block=7), 8, model, seqs)
    with pytest.raises(ValidationError, match="drop_block replaces"):
        DistillConfig(drop_block=2, keep_every_k=2)


def test_student_keeps_the_chosen_teacher_layers(tiny_llama):
    teacher, student, layer_map = _tiny_pair(tiny_llama, DistillConfig(keep_layers=[1]))
    assert student.config.num_hidden_layers == 1
    assert layer_map == {1: 0}  # the beta term matches the student's layer with the teacher layer it was copied from
    assert torch.equal(student.model.layers[0].mlp.up_proj.weight, teacher.model.layers[1].mlp.up_proj.weight)
    assert student.model.layers[0].mlp.up_proj.weight.data_ptr() != teacher.model.layers[1].mlp.up_proj.weight.data_ptr()
    assert all(p.requires_grad for p in student.parameters()) and not any(p.requires_grad for p in teacher.parameters())


def test_student_from_a_config_or_a_checkpoint(tiny_llama, tmp_path):
    from transformers import AutoTokenizer, LlamaConfig

    narrow = tmp_path / "narrow"
    LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True).save_pretrained(narrow)
    AutoTokenizer.from_pretrained(tiny_llama).save_pretrained(narrow)
    cfg = DistillConfig(student_from=str(narrow))
    a, kept = build_student(None, cfg, narrow)
    b, _ = build_student(None, cfg, narrow)
    assert kept is None and a.config.hidden_size == 64
    assert torch.equal(a.model.layers[0].mlp.up_proj.weight, b.model.layers[0].mlp.up_proj.weight)  # seeded init
    a.save_pretrained(tmp_path / "ckpt")
    c, _ = build_student(None, cfg, tmp_path / "ckpt")
    assert torch.equal(a.model.layers[0].mlp.up_proj.weight, c.model.layers[0].mlp.up_proj.weight)
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        build_student(None, cfg, tmp_path)


# ------------------------------------------------------------------------------------ checks before compute


def _tokenizer_variant(src: Path, dst: Path, change) -> Path:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(src)
    change(tok)
    tok.save_pretrained(dst)
    shutil.copy(src / "config.json", dst / "config.json")
    return dst


def test_tokenizer_mismatch_fails_before_any_compute_naming_the_difference_and_the_fix(tiny_llama, tmp_path):
    from transformers import AutoTokenizer

    def template(tok):
        tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"

    student_dir = _tokenizer_variant(tiny_llama, tmp_path / "student", template)
    cfg = DistillConfig(student_from=str(student_dir), steps=1)
    work = tmp_path / "work"
    with pytest.raises(ValueError) as e:
        run_distill(tiny_llama, cfg, [REPO_ROOT / "data/corpora/wiki.jsonl"], ["a b c"], tmp_path / "out", work, student_from=student_dir)
    msg = str(e.value)
    assert f"tokenizer mismatch between the teacher ({tiny_llama}) and distill.student_from ({student_dir}): chat template" in msg, msg
    assert "must share one tokenizer" in msg and "use a student made with the teacher's tokenizer" in msg
    assert not work.exists()  # refused before the training set was built

    teacher_tok = AutoTokenizer.from_pretrained(tiny_llama)
    extra = AutoTokenizer.from_pretrained(tiny_llama)
    extra.add_special_tokens({"additional_special_tokens": ["<|tool|>"]})
    with pytest.raises(ValueError, match=r"vocabulary \(49152 vs 49153 tokens; only in teacher \[\], only in student \['<\|tool\|>'\]"):
        check_same_tokenizer(teacher_tok, extra, tiny_llama, student_dir)
    check_same_tokenizer(teacher_tok, AutoTokenizer.from_pretrained(tiny_llama), tiny_llama, tiny_llama)


def test_a_trainable_teacher_is_refused_before_and_during_training(tiny_llama):
    cfg = DistillConfig(keep_layers=[1], steps=3, batch_size=2, checkpoint_every=0)
    teacher, student, layer_map = _tiny_pair(tiny_llama, cfg)
    teacher.model.norm.weight.requires_grad_(True)
    with pytest.raises(RuntimeError, match=r"teacher has 1 trainable parameters \(e.g. \['model.norm.weight'\]\).*requires_grad_\(False\)"):
        train(teacher, student, _seqs(), cfg, pad_id=0, layer_map=layer_map)

    # unfrozen mid-run (here by the step callback): the in-loop check stops the next step
    teacher.requires_grad_(False)
    steps_seen = []

    def unfreeze(step, metrics):
        steps_seen.append(step)
        teacher.lm_head.weight.requires_grad_(True)

    with pytest.raises(RuntimeError, match="must never update it"):
        train(teacher, student, _seqs(), cfg, pad_id=0, layer_map=layer_map, log=unfreeze)
    assert steps_seen == [0]


def test_memory_budget_fails_before_any_compute_naming_the_estimate(teacher_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    cfg = DistillConfig(keep_layers=[0, 29], memory_budget_mb=100)
    student, _ = build_student(AutoModelForCausalLM.from_pretrained(teacher_dir), cfg)
    n = sum(p.numel() for p in student.parameters())
    work = tmp_path / "work"
    with pytest.raises(ValueError) as e:
        run_distill(teacher_dir, cfg, [REPO_ROOT / "data/corpora/wiki.jsonl"], ["a b"], tmp_path / "out", work)
    msg = str(e.value)
    assert f"~{n * 16 / 2**20:,.0f} MiB" in msg and f"{n:,} trainable parameters x 16 bytes" in msg, msg
    assert "distill.memory_budget_mb=100" in msg and "distill.keep_layers" in msg and "raise memory_budget_mb" in msg
    assert not work.exists()  # refused before the training set was built
    assert check_memory_budget(1000, DistillConfig(memory_budget_mb=1)) == pytest.approx(16000 / 2**20)


def test_a_tokenizer_larger_than_the_embedding_is_refused(tiny_llama, tmp_path):
    # tiny_llama has 512 embedding rows but carries SmolLM2's 49,152-token tokenizer
    with pytest.raises(ValueError, match="teacher's embedding has 512 rows but its tokenizer has 49152 tokens"):
        run_distill(tiny_llama, DistillConfig(keep_layers=[1]), [REPO_ROOT / "data/corpora/wiki.jsonl"], ["a b"], tmp_path / "o", tmp_path / "w")


def test_parameter_ratio_warns_outside_5_to_10x_but_never_fails():
    with pytest.warns(UserWarning, match=r"ratio 2.0x .* outside the usual 5-10x"):
        assert param_ratio(200, 100) == 2.0
    with pytest.warns(UserWarning, match="too small"):
        param_ratio(2000, 100)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert param_ratio(700, 100) == 7.0


# ------------------------------------------------------------------------------------------------ data


def test_training_set_is_tokenized_truncated_cached_and_memory_mapped(teacher_dir, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(teacher_dir)
    long = " ".join(["alpha beta gamma"] * 10)
    corpus = _jsonl(tmp_path / "c.jsonl", ["short text here", long, "another fine sample of prose"])
    cfg = DistillConfig(max_seq_len=8, max_truncation_ratio=50)
    data, stats = prepare_dataset([corpus], tok, cfg, tmp_path / "cache")
    assert stats["training_sequences"] == 3 and stats["truncated_samples"] == 1 and stats["dataset_cache_hit"] == 0
    expected = [tok(t, add_special_tokens=False)["input_ids"][:8] for t in ["short text here", long, "another fine sample of prose"]]
    assert [data[i] for i in range(len(data))] == expected
    # cached by content: same inputs -> same file, not rebuilt; other bytes or another max_seq_len -> another file
    before = data.path.stat().st_mtime_ns
    again, stats2 = prepare_dataset([corpus], tok, cfg, tmp_path / "cache")
    assert again.path == data.path and stats2["dataset_cache_hit"] == 1 and data.path.stat().st_mtime_ns == before
    other, _ = prepare_dataset([corpus], tok, cfg.model_copy(update={"max_seq_len": 16}), tmp_path / "cache")
    assert other.path != data.path
    _jsonl(corpus, ["short text here", long, "another fine sample of prose", "one more"])
    grown, s3 = prepare_dataset([corpus], tok, cfg, tmp_path / "cache")
    assert grown.path != data.path and s3["training_sequences"] == 4


def test_token_dataset_reads_across_row_groups(tmp_path):
    seqs = _seqs(50)
    path = tmp_path / "d.parquet"
    import pyarrow as pa
    import pyarrow.parquet as pq

    from edgeflow.distill import TOKEN_SCHEMA

    table = pa.table({"input_ids": seqs, "n_tokens": [len(s) for s in seqs], "source": [0] * 50, "record": list(range(50)),
                      "truncated": [False] * 50}, schema=TOKEN_SCHEMA)
    pq.write_table(table, path, row_group_size=7, compression="none")
    data = TokenDataset(path, cache_row_groups=2)
    assert len(data) == 50 and pq.ParquetFile(path).metadata.num_row_groups == 8
    assert [data[i] for i in [49, 0, 13, 14, 6, 7, 48]] == [seqs[i] for i in [49, 0, 13, 14, 6, 7, 48]]
    with pytest.raises(IndexError):
        data[50]


def test_an_empty_sample_fails_naming_file_index_length_and_fix(teacher_dir, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(teacher_dir)
    corpus = _jsonl(tmp_path / "bad.jsonl", ["fine text", "also fine", ""])
    with pytest.raises(ValueError) as e:
        build_token_dataset([corpus], tok, 16, 50, tmp_path / "out.parquet")
    msg = str(e.value)
    assert f"{corpus} record #2 (0-based) has 0 token(s)" in msg and "clean the corpus" in msg, msg
    assert not list(tmp_path.glob("out.parquet*"))  # nothing half-written is left behind


def test_untruncatable_data_fails_naming_file_index_length_and_fix(teacher_dir, tmp_path):
    """Rule: a file whose every record has >= max_truncation_ratio x max_seq_len tokens is refused (unsplit
    documents); one such record among normal ones is truncated and counted."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(teacher_dir)
    book = " ".join(f"word{i}" for i in range(400))  # several hundred tokens
    n = len(tok(book, add_special_tokens=False)["input_ids"])
    bad = _jsonl(tmp_path / "books.jsonl", [book, book + " end"])
    cfg = DistillConfig(max_seq_len=8, max_truncation_ratio=10)
    with pytest.raises(ValueError) as e:
        prepare_dataset([bad], tok, cfg, tmp_path / "cache")
    msg = str(e.value)
    assert f"every one of the 2 records in {bad}" in msg and f"record #0 (0-based) has {n:,}" in msg, msg
    assert "10 x max_seq_len = 80 tokens" in msg and "raise distill.max_seq_len" in msg and "clean the corpus" in msg
    mixed = _jsonl(tmp_path / "mixed.jsonl", ["a normal sample", book])
    _, stats = prepare_dataset([mixed], tok, cfg, tmp_path / "cache")
    assert stats["truncated_samples"] == 1 and stats["overlong_samples"] == 1


def test_batch_order_is_a_pure_function_of_step_and_shards_by_rank():
    a, b = BatchOrder(10, 4, seed=3), BatchOrder(10, 4, seed=3)
    assert [a.indices(s) for s in range(5)] == [b.indices(s) for s in reversed(range(5))][::-1]
    epoch0 = sum((a.indices(s) for s in range(5)), [])[:10]
    assert sorted(epoch0) == list(range(10))  # every sample once per epoch
    assert a.indices(7) == BatchOrder(10, 4, seed=3).indices(7)  # no hidden state: a resumed run gets the same batch
    shards = [a.indices(2, rank=r, world_size=2) for r in range(2)]
    assert sorted(shards[0] + shards[1]) == sorted(a.indices(2)) and not set(shards[0]) & set(shards[1])


# ---------------------------------------------------------------------------------------------- training


# The run to be killed, in its own process: after step 4's checkpoint is on disk it reports and waits to be killed.
CHILD = r"""
import sys
from pathlib import Path
import torch
from tests.helpers.distill import resume_run

torch.set_num_threads(1)

def log(step, metrics):
    if step == 4:  # runs after the step-4 checkpoint was written
        print("BLOCKED", flush=True)
        sys.stdin.read()

resume_run(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), log)
"""


def test_sigkilled_training_resumes_from_its_last_checkpoint_with_data_position_and_rng(tiny_llama, tmp_path):
    data = write_sequences(_seqs(20), tmp_path / "train.parquet")
    ckpt = tmp_path / "ckpt"
    env = os.environ | {"PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    victim = subprocess.Popen([sys.executable, "-c", CHILD, str(tiny_llama), str(data), str(ckpt)], cwd=REPO_ROOT, env=env,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = victim.stdout.readline()
        while line and line.strip() != "BLOCKED":
            line = victim.stdout.readline()
        assert line.strip() == "BLOCKED", victim.communicate()[1][-3000:]
        assert latest_checkpoint(ckpt)[0] == 4 and sorted(p.name for p in ckpt.iterdir()) == ["step-00000004"]
    finally:
        victim.send_signal(signal.SIGKILL)
        victim.wait()
    assert victim.returncode == -signal.SIGKILL
    (ckpt / "step-00000006.tmp").mkdir()  # as if killed while writing the next checkpoint: must be ignored
    (ckpt / "step-00000006.tmp" / "state.pt").write_bytes(b"half written")

    logged = []
    resumed = resume_run(tiny_llama, data, ckpt, log=lambda s, m: logged.append((s, m)))
    reference = resume_run(tiny_llama, data, tmp_path / "ref-ckpt")  # uninterrupted, same seed
    assert resumed.resumed_from_step == 4 and logged[0] == (4, {"resumed_from_step": 4.0}) and reference.resumed_from_step == 0
    assert [s for s, _ in logged[1:]] == [4, 5, 6, 7]  # continued from 4 to K=8, not from 0
    assert resumed.checkpoints_written == [6] and reference.checkpoints_written == [2, 4, 6]
    assert [h["step"] for h in resumed.history] == list(range(8))
    assert abs(resumed.final_loss - reference.final_loss) < 1e-5
    for got, want in zip(resumed.history, reference.history):
        assert got["total"] == pytest.approx(want["total"], abs=1e-5) and got["hidden_mse"] == pytest.approx(want["hidden_mse"], abs=1e-5)
    assert not (ckpt / "step-00000006.tmp").exists()


def test_gradient_checkpointing_is_switchable_and_gives_the_same_training(tiny_llama):
    losses, seen = {}, {}
    for on in (False, True):
        cfg = DistillConfig(keep_layers=[1], steps=3, batch_size=2, gradient_checkpointing=on, checkpoint_every=0, seed=1)
        teacher, student, layer_map = _tiny_pair(tiny_llama, cfg)
        result = train(teacher, student, _seqs(), cfg, pad_id=0, layer_map=layer_map, log=lambda s, m, st=student, on=on: seen.setdefault(on, st.is_gradient_checkpointing))
        losses[on] = [h["total"] for h in result.history]
        assert not student.is_gradient_checkpointing  # switched off again for evaluation and saving
    assert seen == {False: False, True: True}
    assert losses[True] == pytest.approx(losses[False], abs=1e-5)


def test_projection_is_trained_and_checkpointed_when_widths_differ(tiny_llama, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    narrow = tmp_path / "narrow"
    LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True).save_pretrained(narrow)
    AutoTokenizer.from_pretrained(tiny_llama).save_pretrained(narrow)
    cfg = DistillConfig(student_from=str(narrow), steps=3, batch_size=2, beta=1.0, checkpoint_every=2)
    teacher = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).requires_grad_(False)
    student, kept = build_student(teacher, cfg, narrow)
    layer_map = resolve_layer_map(cfg, 2, 1, kept)
    assert layer_map == {1: 0}
    result = train(teacher, student, _seqs(), cfg, pad_id=0, layer_map=layer_map, checkpoint_dir=tmp_path / "ckpt")
    assert all(h["hidden_mse"] > 0 for h in result.history) and result.checkpoints_written == [2]
    state = torch.load(latest_checkpoint(tmp_path / "ckpt")[1], weights_only=False)
    assert state["projections"]["0.weight"].shape == (128, 64)
    assert len(state["optimizer"]["state"]) == len(list(student.parameters())) + 1  # the projection is optimized too


def test_stall_watchdog_fails_the_run_naming_the_setting_and_the_fix(tiny_llama, caplog):
    cfg = DistillConfig(keep_layers=[1], steps=50, batch_size=2, stall_timeout_s=0.001, checkpoint_every=0)
    teacher, student, layer_map = _tiny_pair(tiny_llama, cfg)
    with caplog.at_level(logging.ERROR, logger="edgeflow.distill"), pytest.raises(TrainingStalled) as e:
        train(teacher, student, _seqs(), cfg, pad_id=0, layer_map=layer_map)
    msg = str(e.value)
    assert "distill.stall_timeout_s=0.001" in msg and "raise distill.stall_timeout_s" in msg and "of 50 steps were done" in msg
    # the watchdog logged where the training thread was when it tripped
    assert "distill stalled" in caplog.text and "training thread at" in caplog.text and "in train" in caplog.text


@pytest.fixture
def pushgateway(tmp_path):
    """A real Prometheus Pushgateway (Debian's prometheus-pushgateway) on a free loopback port."""
    require_binary(PUSHGATEWAY, "apt-get install -y prometheus-pushgateway; .ci/run installs it")
    port = free_port()
    log = (tmp_path / "pushgateway.log").open("w")
    proc = subprocess.Popen([PUSHGATEWAY, f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"{url}/-/ready", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "pushgateway.log").read_text()
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        log.close()


def test_training_gauges_reach_a_real_pushgateway(tiny_llama, pushgateway):
    cfg = DistillConfig(keep_layers=[1], steps=4, batch_size=2, checkpoint_every=0, pushgateway_url=pushgateway, push_every=2)
    teacher, student, layer_map = _tiny_pair(tiny_llama, cfg)
    logged = []
    result = train(teacher, student, _seqs(), cfg, pad_id=0, layer_map=layer_map, run_label="pgtest", log=lambda s, m: logged.append((s, m)))
    metrics = httpx.get(f"{pushgateway}/metrics", timeout=5).text
    labels = '{instance="",job="edgeflow-distill",run="pgtest"}'
    assert f"edgeflow_distill_step{labels} 4" in metrics, metrics[-2000:]
    for name in ("loss", "tokens_per_second", "last_step_timestamp_seconds", "process_rss_bytes"):
        assert f"edgeflow_distill_{name}{labels} " in metrics, name
    loss_line = next(x for x in metrics.splitlines() if x.startswith(f"edgeflow_distill_loss{labels}"))
    assert float(loss_line.split()[-1]) == pytest.approx(result.history[-1]["total"], rel=1e-6)
    # every step's terms also went to the log callback (MLflow in the flow)
    assert [s for s, _ in logged] == [0, 1, 2, 3]
    assert set(logged[0][1]) == {"kd", "ce", "hidden_mse", "total", "lr", "tokens_per_s"}


def test_an_unreachable_pushgateway_does_not_stop_training(tiny_llama):
    cfg = DistillConfig(keep_layers=[1], steps=2, batch_size=2, checkpoint_every=0, pushgateway_url=f"127.0.0.1:{free_port()}", push_every=1)
    teacher, student, layer_map = _tiny_pair(tiny_llama, cfg)
    assert train(teacher, student, _seqs(), cfg, pad_id=0, layer_map=layer_map).steps == 2


# --------------------------------------------------------------------------------- run_distill, real teacher


def test_run_key_follows_training_inputs_not_telemetry(tiny_llama):
    cfg = DistillConfig(keep_layers=[1])
    key = distill_run_key(tiny_llama, None, cfg, "data")
    same = cfg.model_copy(update={"pushgateway_url": "x:1", "stall_timeout_s": 5, "checkpoint_every": 7, "push_every": 3})
    assert distill_run_key(tiny_llama, None, same, "data") == key
    assert distill_run_key(tiny_llama, None, cfg.model_copy(update={"lr": 1e-3}), "data") != key
    assert distill_run_key(tiny_llama, None, cfg, "other data") != key


def test_run_distill_on_smollm2_logs_every_term_and_evaluates_against_the_teacher(teacher_dir, tmp_path):
    corpus = _jsonl(tmp_path / "c.jsonl", ["The cat sat on the mat and looked at the bird outside.",
                                           "Water boils at one hundred degrees Celsius at sea level.",
                                           " ".join(["a long sentence that will be truncated"] * 6)])
    cfg = DistillConfig(keep_layers=[0, 29], steps=2, batch_size=2, max_seq_len=16, beta=0.1, checkpoint_every=1,
                        generation_defaults={"repetition_penalty": 1.1})
    logged: list[tuple[int, dict]] = []
    with pytest.warns(UserWarning, match="parameter ratio 3.8x"):
        m = run_distill(teacher_dir, cfg, [corpus], ["Paris is the capital of France.", "Two plus two is four."],
                        tmp_path / "student", tmp_path / "work", log=lambda s, x: logged.append((s, x)))
    steps = [x for _, x in logged if "total" in x]
    assert len(steps) == 2 and all({"kd", "ce", "hidden_mse", "total", "lr", "tokens_per_s"} <= set(x) for x in steps)
    assert all(x["hidden_mse"] > 0 for x in steps)
    first = {k: v for _, x in logged[:2] for k, v in x.items()}
    assert first["truncated_samples"] == 1 and first["size_ratio"] == pytest.approx(m["size_ratio"])
    assert m["student_layers"] == 2 and 3.5 < m["size_ratio"] < 4.0 and m["param_ratio_in_guideline"] == 0.0
    for k in ("student_top1_vs_teacher", "student_kl_vs_teacher", "teacher_ppl", "student_ppl", "student_quality_pct",
              "student_ppl_before_training", "student_top1_before_training"):
        assert m[k] == m[k] and m[k] >= 0, k  # present and not NaN
    assert m["student_quality_pct"] == pytest.approx(100 * m["teacher_ppl"] / m["student_ppl"])
    assert (tmp_path / "student" / "model.safetensors").exists() and (tmp_path / "student" / "edgeflow-manifest.json").exists()
    # the decoding defaults travel with the student: what the edge server reads from an engine built from it
    from edgeflow.serving.runtime import generation_defaults

    assert generation_defaults(tmp_path / "student") == {"repetition_penalty": 1.1}
    # the teacher ran once per distinct sequence: 3 records, 4 visits in 2 steps of 2 (the cache is on by default)
    assert m["teacher_cache_misses"] == 3 and m["teacher_cache_hits"] == 1 and m["teacher_cache_bytes_written"] > 0
    # the checkpoint written at step 1 was removed once the student was saved; the training set stays cached
    assert not any((tmp_path / "work" / "checkpoints" / "distill").iterdir())
    assert len(list((tmp_path / "work" / "cache" / "distill-data").glob("*.parquet"))) == 1
    assert checkpoint_root(tmp_path / "work", "k" * 64).parent == tmp_path / "work" / "checkpoints" / "distill"


def test_train_student_logs_each_term_per_step_to_mlflow(tiny_smol, mlflow_tracking, tmp_path):
    """The flow's task body against a real MLflow server: every loss term per step, the data and size checks, and
    the evaluation the release report reads."""
    import yaml
    from mlflow import MlflowClient

    from edgeflow.pipeline.distill import train_student
    from edgeflow.pipeline.release import open_release
    from edgeflow.preflight import load_profile
    from edgeflow.model.source import ensure_teacher
    from edgeflow.tracking.store import materialize

    corpus = _jsonl(tmp_path / "c.jsonl", ["The cat sat on the mat.", "Water boils at one hundred degrees Celsius at sea level.",
                                           " ".join(["a long sentence that will be truncated"] * 6)])
    profile_path = tmp_path / "profile.yaml"
    profile_path.write_text(yaml.safe_dump({
        "name": "distill-test", "workdir": str(tmp_path / "work"), "teacher": {"source": "local", "path": str(tiny_smol)},
        "distill": {"keep_layers": [0, 3], "steps": 2, "batch_size": 2, "max_seq_len": 16, "beta": 0.1, "corpora": [str(corpus)]},
        "quantize": {"variants": [{"name": "gptq-w4a16", "recipe": "deployments/recipes/gptq-w4a16-sym.yaml"}]},
        "registry": {"model_name": "distill-test", "experiment": "distill-test-releases"},
    }))
    profile = load_profile(profile_path)
    ctx = open_release.fn(str(profile_path), profile)
    teacher = ensure_teacher(profile)
    # the training file and the eval files as the release published them to its run (what the flow hands the task)
    corpora = [ctx.input(c) for c in profile.distill.corpora]
    held_out = {d: ctx.input(p) for d, p in profile.gate.eval_sources.items()}
    assert all(r.uri.startswith("mlflow-artifacts:/") for r in corpora + list(held_out.values()))
    with pytest.warns(UserWarning, match="parameter ratio"):
        student = train_student.fn(teacher, profile.distill, corpora, held_out, ctx)
    c = MlflowClient(mlflow_tracking)
    for term in ("kd", "ce", "hidden_mse", "total", "lr", "tokens_per_s"):
        assert [m.step for m in c.get_metric_history(student.mlflow_run_id, term)] == [0, 1], term
    run = c.get_run(student.mlflow_run_id)
    assert run.data.metrics["truncated_samples"] == 1 and run.data.metrics["size_ratio"] == pytest.approx(student.meta["size_ratio"])
    assert run.data.params["beta"] == "0.1" and run.info.status == "FINISHED"
    report_keys = ("student_top1_vs_teacher", "teacher_ppl", "student_ppl", "student_ppl_before_training", "student_quality_pct",
                   "student_layers", "student_params", "size_ratio")  # what edgeflow/tracking/report.py:STUDENT_FIELDS reads
    assert set(report_keys) <= set(student.meta) and student.meta["student_layers"] == 2
    assert student.uri.startswith("mlflow-artifacts:/") and (materialize(student) / "model.safetensors").exists()


def test_mixed_precision_runs_the_forward_passes_in_bf16_and_keeps_the_weights_fp32(tiny_llama, monkeypatch):
    import importlib

    train_mod = importlib.import_module("edgeflow.distill.train")  # the module (edgeflow.distill exports its train function)
    from edgeflow.distill.run import cache_spec

    # auto follows the CPU's native bf16 flags; off and bf16 are what they say
    monkeypatch.setattr(train_mod, "cpu_flags", lambda: {"avx2", "avx512_bf16"})
    assert train_mod.autocast_dtype("auto", "cpu") is torch.bfloat16
    monkeypatch.setattr(train_mod, "cpu_flags", lambda: {"avx2", "fma"})
    assert train_mod.autocast_dtype("auto", "cpu") is None
    assert train_mod.autocast_dtype("off", "cpu") is None and train_mod.autocast_dtype("bf16", "cpu") is torch.bfloat16
    # the teacher-output cache keeps outputs computed in the two precisions apart
    specs = {m: cache_spec(DistillConfig(mixed_precision=m), "t" * 64, "cpu") for m in ("off", "bf16", "auto")}
    assert specs["off"].namespace != specs["bf16"].namespace
    assert specs["auto"].namespace == specs["off"].namespace  # auto on a CPU without native bf16 (patched above)

    seen: dict[str, set] = {}
    for mode in ("off", "bf16"):
        cfg = DistillConfig(keep_layers=[1], steps=2, batch_size=2, checkpoint_every=0, seed=1, mixed_precision=mode)
        teacher, student, layer_map = _tiny_pair(tiny_llama, cfg)
        dtypes = seen[mode] = set()
        for model in (teacher, student):
            model.model.layers[0].mlp.down_proj.register_forward_hook(lambda m, i, o, d=dtypes: d.add(o.dtype))
        result = train(teacher, student, _seqs(), cfg, pad_id=0, layer_map=layer_map)
        assert all(math.isfinite(h["total"]) for h in result.history)
        assert {p.dtype for p in student.parameters()} == {torch.float32}
    assert seen == {"off": {torch.float32}, "bf16": {torch.bfloat16}}
    with pytest.raises(ValueError, match="mixed_precision"):
        DistillConfig(mixed_precision="fp16")


def test_held_out_comparison_from_kept_teacher_logits_equals_running_the_teacher(tiny_llama, monkeypatch):
    """The comparisons before and after training share one teacher pass when its logits fit the budget: the metrics
    are bitwise those of running the teacher each time; over the budget nothing is kept."""
    import edgeflow.distill.run as run_mod

    teacher, student, _ = _tiny_pair(tiny_llama, DistillConfig(keep_layers=[0, 1]))
    seqs = _seqs(6)
    kept = run_mod.teacher_logits(teacher, seqs)
    assert [t.shape for t in kept] == [(len(s) - 1, teacher.config.vocab_size) for s in seqs]
    assert run_mod.compare_to_teacher(teacher, student, seqs, kept) == run_mod.compare_to_teacher(teacher, student, seqs)
    with torch.no_grad():  # a changed student still reads the same teacher side
        for p in student.parameters():
            p.mul_(0.9)
    assert run_mod.compare_to_teacher(teacher, student, seqs, kept) == run_mod.compare_to_teacher(teacher, student, seqs)
    need = sum(len(s) - 1 for s in seqs) * teacher.config.vocab_size * 4
    monkeypatch.setattr(run_mod, "KEEP_TEACHER_LOGITS_BYTES", need - 1)
    assert run_mod.teacher_logits(teacher, seqs) is None


def test_freeze_embeddings_trains_the_layers_and_leaves_the_tied_table_as_the_teacher_s(tiny_llama):
    """distill.freeze_embeddings: the tied embedding/head takes no gradient and no AdamW state (the memory budget
    counts it out), while the decoder layers still learn."""
    cfg = DistillConfig(keep_layers=[0, 1], steps=3, batch_size=2, lr=1e-2, freeze_embeddings=True)
    teacher, student, layer_map = _tiny_pair(tiny_llama, cfg)
    table = student.get_input_embeddings().weight
    assert not table.requires_grad and student.lm_head.weight is table  # tied: one tensor, frozen once
    layer = student.model.layers[0].mlp.up_proj.weight.detach().clone()
    train(teacher, student, _seqs(), cfg, pad_id=0, layer_map=layer_map)
    assert torch.equal(table, teacher.get_input_embeddings().weight)
    assert not torch.equal(student.model.layers[0].mlp.up_proj.weight, layer)
    trainable = sum(p.numel() for p in student.parameters() if p.requires_grad)
    assert trainable == sum(p.numel() for p in student.parameters()) - table.numel()
