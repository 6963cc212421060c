"""Hand-offs through the artifact store, against a real MLflow server that proxies its artifacts (edgeflow/tracking/store.py)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from edgeflow.tracking.artifacts import ArtifactRef, ChecksumError, sha256_file, sha256_tree


@pytest.fixture
def run(mlflow_tracking, tmp_path, monkeypatch):
    """A run to publish to, and this test's own host cache (EDGEFLOW_HOME)."""
    from mlflow import MlflowClient

    monkeypatch.setenv("EDGEFLOW_HOME", str(tmp_path / "home"))
    c = MlflowClient(mlflow_tracking)
    exp = c.get_experiment_by_name("store-test")
    exp_id = exp.experiment_id if exp else c.create_experiment("store-test")
    r = c.create_run(exp_id)
    return c, r.info.run_id


def _tree(root: Path) -> Path:
    (root / "sub").mkdir(parents=True)
    (root / "a.bin").write_bytes(b"\x00\x01" * 1000)
    (root / "sub" / "b.json").write_text(json.dumps({"k": 1}))
    return root


def _other_host(monkeypatch, tmp_path, name: str) -> Path:
    """Switch to another host's empty cache: nothing the producer wrote is visible there."""
    from edgeflow.tracking.store import cache_root

    monkeypatch.setenv("EDGEFLOW_HOME", str(tmp_path / name))
    assert not cache_root().exists()
    return cache_root()


def test_published_directory_and_file_are_store_uris_fetched_and_verified_on_another_host(run, tmp_path, monkeypatch):
    from edgeflow.tracking.store import materialize, publish

    c, run_id = run
    src = _tree(tmp_path / "out" / "student-abc")
    f = tmp_path / "out" / "calibration.parquet"
    f.write_bytes(b"PAR1" + b"x" * 100)
    d_ref = publish(c, run_id, src, "student", "student", meta={"n": 1})
    f_ref = publish(c, run_id, f, "calibration", "calibration")
    assert d_ref.uri == f"mlflow-artifacts:/{c.get_run(run_id).info.experiment_id}/{run_id}/artifacts/student"
    assert f_ref.uri.endswith(f"/{run_id}/artifacts/calibration/calibration.parquet")
    assert (d_ref.sha256, f_ref.sha256, d_ref.mlflow_run_id, d_ref.meta) == (sha256_tree(src), sha256_file(f), run_id, {"n": 1})

    cache = _other_host(monkeypatch, tmp_path, "consumer")
    got_d, got_f = materialize(d_ref), materialize(f_ref)
    assert got_d == cache / d_ref.sha256 / "student" and got_f == cache / f_ref.sha256 / "calibration.parquet"
    assert sha256_tree(got_d) == d_ref.sha256 and got_f.read_bytes() == f.read_bytes()
    assert not str(got_d).startswith(str(tmp_path / "out"))  # a copy of its own, not the producer's path


def test_the_producer_needs_no_download(run, tmp_path, monkeypatch):
    """publish seeds the producing host's cache: materialize there reads its own files (the store is not asked)."""
    import edgeflow.tracking.store as store

    c, run_id = run
    ref = store.publish(c, run_id, _tree(tmp_path / "eng"), "engine", "engine")
    monkeypatch.setattr(store, "_download", lambda *a: pytest.fail("downloaded what this host produced"))
    assert sha256_tree(store.materialize(ref)) == ref.sha256


def test_a_tampered_store_copy_is_refused_naming_artifact_hashes_and_run(run, tmp_path, monkeypatch):
    from edgeflow.tracking.store import materialize, publish

    c, run_id = run
    f = tmp_path / "gate.json"
    f.write_text('{"rows": []}')
    ref = publish(c, run_id, f, "gate", "gate-report")
    f.write_text('{"rows": ["forged"]}')
    c.log_artifact(run_id, str(f), "gate")  # the store's copy changes under the same URI
    _other_host(monkeypatch, tmp_path, "consumer")
    with pytest.raises(ChecksumError) as e:
        materialize(ref)
    msg = str(e.value)
    assert ref.uri in msg and ref.sha256 in msg and sha256_file(f) in msg and run_id in msg and "gate-report" in msg
    from edgeflow.tracking.store import cache_root

    assert not (cache_root() / ref.sha256).exists()  # nothing unverified is left in the cache


def test_a_cached_copy_that_vanished_or_changed_is_fetched_again(run, tmp_path, monkeypatch):
    import shutil

    from edgeflow.tracking.store import materialize, publish

    c, run_id = run
    ref = publish(c, run_id, _tree(tmp_path / "q"), "quantized", "quantized")
    _other_host(monkeypatch, tmp_path, "consumer")
    first = materialize(ref)
    shutil.rmtree(first.parent)
    assert sha256_tree(materialize(ref)) == ref.sha256  # missing locally: downloaded again
    (first / "a.bin").write_bytes(b"edited in place")
    again = materialize(ref)
    assert again == first and sha256_tree(again) == ref.sha256  # changed locally: replaced by the store's copy


def test_a_verified_cache_entry_is_not_hashed_again_until_a_file_of_it_changes(run, tmp_path, monkeypatch):
    """Within one process, an entry it seeded or hashed is reused on its files' size, mtime and inode; an edit in
    place (same size, so only the mtime tells) or a replaced file makes materialize hash it again and fetch a good copy."""
    import os

    import edgeflow.tracking.store as store

    c, run_id = run
    ref = store.publish(c, run_id, _tree(tmp_path / "q"), "quantized", "quantized")
    hashed = []
    real = store.sha256_tree
    monkeypatch.setattr(store, "sha256_tree", lambda p: hashed.append(Path(p)) or real(p))
    first = store.materialize(ref)
    assert store.materialize(ref) == first and hashed == []  # seeded by publish in this process: trusted as is

    blob = first / "a.bin"
    st = blob.stat()
    blob.write_bytes(b"\x01\x00" * 1000)  # the same size, other bytes
    os.utime(blob, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    again = store.materialize(ref)
    assert hashed and sha256_tree(again) == ref.sha256  # hashed, found changed, fetched from the store
    hashed.clear()
    assert store.materialize(ref) == again and hashed == [again]  # a downloaded copy is hashed once more, then trusted
    assert store.materialize(ref) == again and hashed == [again]

    (again / "sub" / "b.json").unlink()  # replaced by a file of the same size: a new inode
    (again / "sub" / "b.json").write_text(json.dumps({"k": 2}))
    assert sha256_tree(store.materialize(ref)) == ref.sha256 and hashed[1] == again  # hashed again, fetched again


def test_missing_from_the_store_and_host_paths_are_clear_errors(run, tmp_path, monkeypatch):
    from edgeflow.tracking.store import ArtifactMissing, in_store, materialize, publish

    c, run_id = run
    ref = publish(c, run_id, _tree(tmp_path / "s"), "student", "student")
    assert in_store(ref)
    gone = ref.model_copy(update={"uri": ref.uri.replace("/student", "/no-such-student")})
    assert not in_store(gone)
    _other_host(monkeypatch, tmp_path, "consumer")
    with pytest.raises(ArtifactMissing, match="not in the artifact store.*Re-run the stage"):
        materialize(gone)
    with pytest.raises(ValueError, match="uri='/tmp/x' is not an artifact-store URI"):
        materialize(ArtifactRef(kind="student", uri="/tmp/x", sha256="0" * 64))


def test_an_unreachable_tracking_server_fails_naming_the_uri_and_the_fix():
    from tests.helpers.ports import free_port
    from edgeflow.tracking.store import check_reachable

    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ConnectionError, match=f"MLFLOW_TRACKING_URI={url} does not answer.*make services"):
        check_reachable(url)


def test_the_same_content_published_under_two_names_is_cached_under_both(run, tmp_path, monkeypatch):
    """A recipe copied elsewhere (same bytes, another file name) hashes the same: each name gets its own cache entry."""
    from edgeflow.tracking.store import materialize, publish

    c, run_id = run
    a, b = tmp_path / "gptq-w4a16-sym.yaml", tmp_path / "b" / "gptq.yaml"
    b.parent.mkdir()
    a.write_text("quant_stage: {}\n")
    b.write_text("quant_stage: {}\n")
    ra, rb = publish(c, run_id, a, "inputs/a", "input"), publish(c, run_id, b, "inputs/b", "input")
    assert ra.sha256 == rb.sha256
    assert materialize(ra).name == "gptq-w4a16-sym.yaml" and materialize(rb).name == "gptq.yaml"  # seeded on this host
    _other_host(monkeypatch, tmp_path, "consumer")
    assert materialize(rb).read_text() == materialize(ra).read_text() == "quant_stage: {}\n"
    assert materialize(ra).parent == materialize(rb).parent
