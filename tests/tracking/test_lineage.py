"""Lineage of a registered version against a real MLflow server, from a release recorded as the stages record it."""
from __future__ import annotations

from pathlib import Path

import pytest

from edgeflow.tracking.artifacts import sha256_file, sha256_tree
from edgeflow.tracking.lineage import LineageError, lineage, main
from edgeflow.tracking.registry import client, register_version
from edgeflow.tracking.report import lineage_section

MODEL = "lineage-test"


@pytest.fixture(scope="module")
def release(make_release):
    return make_release(MODEL, {"gptq-w4a16": 0.99, "rtn-w4a16": 0.98})


def test_every_hop_carries_the_uri_hash_and_run_the_stages_logged(release, tmp_path):
    c = client()
    v = release.version("gptq-w4a16")
    lin = lineage(c, MODEL, v)
    expected = {"engine": release.engines["gptq-w4a16"], "checkpoint": release.quantized["gptq-w4a16"],
                "student": release.student, "calibration": release.calibration, "teacher": release.teacher}
    for kind, ref in expected.items():
        hop = getattr(lin, kind)
        assert (hop.uri, hop.sha256, hop.mlflow_run_id, hop.unknown) == (ref.uri, ref.sha256, ref.mlflow_run_id, None), kind
    # ...and those hashes are the hashes of what the runs actually logged to MLflow
    logged = {"engine": "engine", "checkpoint": "quantized", "student": "student", "calibration": "calibration/calibration.parquet"}
    for kind, path in logged.items():
        hop = getattr(lin, kind)
        local = Path(c.download_artifacts(hop.mlflow_run_id, path, str(tmp_path / kind)))
        assert (sha256_tree(local) if local.is_dir() else sha256_file(local)) == hop.sha256, kind
    assert (lin.engine.stage, lin.checkpoint.stage, lin.student.stage, lin.calibration.stage) == (
        "build-engine-gptq-w4a16", "quantize-gptq-w4a16", "distill", "calibrate")
    corpora = release.profile.distill.corpora  # named as the profile names them, not by any host's path
    assert [(h.uri, h.sha256, h.mlflow_run_id) for h in lin.training_set] == sorted(
        (p, sha256_file(release.profile.resolve(p)), release.student.mlflow_run_id) for p in corpora)
    assert lin.complete and lin.require_complete() is lin
    assert (lin.variant, lin.release_id, lin.aliases) == ("gptq-w4a16", release.ctx.release_id, ["staging"])
    assert lin.gate_report == f"runs:/{release.gate_report.mlflow_run_id}/gate/gate-attempt0.json"
    # each hop was set against what was logged elsewhere, not only the lineage file
    assert "sha256 = quantize run param calibration_sha256" in lin.calibration.checks
    assert "sha256 = distill run param teacher_sha256" in lin.teacher.checks
    assert "variant = quantize run param name" in lin.checkpoint.checks
    assert "built from this checkpoint's sha256 (engine meta checkpoint_sha256)" in lin.engine.checks
    assert len(lin.checks) == 2  # lineage.json is in the manifest, the manifest hashes to the registered package hash
    assert lineage(c, MODEL, "staging") == lin


def test_markdown_cli_and_report_section(release, capsys):
    v = release.version("rtn-w4a16")
    lin = lineage(client(), MODEL, v)
    md = lin.render_markdown()
    assert md.startswith("## Lineage\n")
    for hop in lin.hops:
        assert f"`{hop.sha256}`" in md and f"`{hop.uri}`" in md
    assert main(["--model", MODEL, "--version", v]) == 0
    assert capsys.readouterr().out.strip() == md.strip()
    assert lineage_section({"profile": str(release.profile_path), "model": MODEL, "staging_version": v}) == md
    gone = lineage_section({"profile": str(release.profile_path), "model": MODEL, "staging_version": "99"})
    assert gone.startswith("## Lineage\n\nversion 99 could not be traced: LineageError: lineage-test has no version '99'")
    assert main(["--model", MODEL, "--version", "99"]) == 1


def test_a_training_set_that_was_not_recorded_is_an_explicit_unknown(make_release, capsys):
    r = make_release("lineage-old-distill", {"gptq-w4a16": 0.99}, training_set=False)
    lin = lineage(client(), "lineage-old-distill", r.version("gptq-w4a16"))
    [hop] = lin.training_set
    assert (hop.uri, hop.sha256) == (None, None)
    assert hop.unknown.startswith(f"distill run {r.student.mlflow_run_id} recorded no training-set hashes")
    assert "data/corpora/chat.jsonl" in hop.unknown  # the run's corpora param still names the files
    assert all(h.unknown is None for h in (lin.engine, lin.checkpoint, lin.student, lin.calibration, lin.teacher))
    assert not lin.complete
    with pytest.raises(LineageError, match=r"untraceable hops: training: distill run \w+ recorded no training-set hashes"):
        lin.require_complete()
    assert "| training | unknown: distill run" in lin.render_markdown()
    assert main(["--model", "lineage-old-distill", "--version", "staging", "--strict"]) == 1
    assert "Lineage is incomplete" in capsys.readouterr().out


def test_a_version_registered_without_a_package_has_every_hop_unknown(release):
    c = client()
    v = register_version(c, MODEL, release.student.mlflow_run_id, "student", tags={"edgeflow.variant": "by-hand"})
    lin = lineage(c, MODEL, v)
    assert not lin.complete
    for hop in lin.hops:
        assert (hop.uri, hop.sha256, hop.mlflow_run_id) == (None, None, None)
        assert hop.unknown.startswith(f"version {v}'s package runs:/{release.student.mlflow_run_id}/student has no readable lineage.json")


def test_records_that_disagree_raise(release):
    c = client()
    mv = c.get_model_version(MODEL, release.version("rtn-w4a16"))
    # the same package registered again, with a student hash that is not the package's
    v = register_version(c, MODEL, mv.run_id, "model/rtn-w4a16", tags=dict(mv.tags) | {"edgeflow.student_sha256": "0" * 64})
    with pytest.raises(LineageError, match=rf"version {v}: sha256 = version tag edgeflow.student_sha256 is '0{{64}}' but the package lineage says '{release.student.sha256}'"):
        lineage(c, MODEL, v)
    with pytest.raises(LineageError, match=f"{MODEL} has no version 'nope'"):
        lineage(c, MODEL, "nope")
