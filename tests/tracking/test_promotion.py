"""Promotion and rollback against a real MLflow server: checks, aliases, legacy stages and records."""
from __future__ import annotations

import pytest

from edgeflow.device.record import record_deployment
from edgeflow.tracking.promotion import PROMOTIONS_EXPERIMENT, PromotionRefused, promote, rollback
from edgeflow.tracking.registry import GATE_REPORT_TAG, alias_version, client, gate_report_link, register_version

FIX = "re-run the release or promote a version that passed"
# Top-1 agreement each variant scored at the gate (the gate passes 97% and above).
PASSING = {"gptq-w4a16": 0.99, "rtn-w4a16": 0.98}


@pytest.fixture
def model(request) -> str:
    """One registered model per test, so tests share the server but not the registry state."""
    return "promo-" + request.node.name.removeprefix("test_").replace("_", "-")[:40]


def _aliases(c, name: str) -> dict[str, str | None]:
    return {a: alias_version(c, name, a) for a in ("staging", "production", "previous")}


def _stage(c, name: str, version: str) -> str:
    return c.get_model_version(name, version).current_stage


def _deployed(release, version: str, status: str = "FINISHED", error: str = "", package=None) -> None:
    """A deployment attempt recorded by the deploy stage's own recorder (`package`: the installed package directory)."""
    outcome = {"status": status, "version": version, "prefect_flow_run_id": "test"} | ({"error": error} if error else {})
    record_deployment(release.profile, "staging", outcome, package)


def _package(release, variant: str):
    """The package the register stage laid out (and registered) for a variant."""
    return release.profile.work / "releases" / release.ctx.release_id / "package" / variant


def _moves(c, name: str) -> list:
    exp = c.get_experiment_by_name(PROMOTIONS_EXPERIMENT)
    return c.search_runs([exp.experiment_id], f"tags.`edgeflow.model` = '{name}'", order_by=["attributes.start_time ASC"])


def test_staging_promotion_with_a_passing_gate_moves_the_alias_and_mirrors_stages(make_release, model):
    r = make_release(model, PASSING)
    c = client()
    gptq, rtn = r.version("gptq-w4a16"), r.version("rtn-w4a16")
    # The register stage stages the smallest passing variant, ties going to the higher agreement. Symmetric GPTQ
    # stores no zero points, so its checkpoint is smaller than asymmetric RTN's; where the gate's 0.1 MB rounding
    # makes the two equal, GPTQ's higher agreement decides.
    assert r.quantized["gptq-w4a16"].meta["size_mb"] < r.quantized["rtn-w4a16"].meta["size_mb"]
    assert _aliases(c, model)["staging"] == gptq

    move = promote(c, model, rtn, "staging", reason="rtn holds up better on chat")

    assert _aliases(c, model) == {"staging": rtn, "production": None, "previous": None}
    assert move.from_version == gptq and move.version == rtn
    [gate] = move.checks
    assert f"consistency run {r.gate_report.mlflow_run_id}, variant rtn-w4a16" in gate and gate.endswith("same engine sha256 as the package")
    assert (_stage(c, model, rtn), _stage(c, model, gptq)) == ("Staging", "Archived")
    assert move.stages == {gptq: "Archived", rtn: "Staging"}
    assert any("deprecated" in w for w in move.warnings)  # the FutureWarning is recorded, not raised
    [run] = _moves(c, model)
    assert run.info.status == "FINISHED" and run.info.run_id == move.record_run_id
    assert {k: run.data.tags[f"edgeflow.{k}"] for k in ("action", "alias", "version", "from_version", "reason")} == {
        "action": "promote", "alias": "staging", "version": rtn, "from_version": gptq, "reason": "rtn holds up better on chat"}


def test_staging_refuses_a_version_without_a_gate_report_or_with_a_failing_one(make_release, model):
    r = make_release(model, PASSING | {"mixed-w8attn-w4mlp": 0.91})
    c = client()
    gptq = r.version("gptq-w4a16")
    run_id = c.get_model_version(model, gptq).run_id
    link = gate_report_link(r.gate_report)
    # Registered by hand (as from the UI): with no gate link; linked to the gate that failed its variant;
    # claiming a variant that passed while shipping another variant's engine.
    unlinked = register_version(c, model, run_id, "model/gptq-w4a16", tags={"edgeflow.variant": "gptq-w4a16"})
    failed = register_version(c, model, run_id, "model/gptq-w4a16", tags={"edgeflow.variant": "mixed-w8attn-w4mlp", GATE_REPORT_TAG: link})
    swapped = register_version(c, model, run_id, "model/gptq-w4a16", tags={"edgeflow.variant": "rtn-w4a16", GATE_REPORT_TAG: link})
    before = _aliases(c, model)

    with pytest.raises(PromotionRefused, match=rf"^version {unlinked} of {model} has no gate report \(version tag edgeflow.gate_report is missing.*; {FIX}$"):
        promote(c, model, unlinked, "staging")
    with pytest.raises(PromotionRefused) as refused:
        promote(c, model, failed, "staging")
    assert str(refused.value) == (f"version {failed} of {model} has no passing gate report (consistency run "
                                  f"{r.gate_report.mlflow_run_id}: top-1 agreement 91.00% < 97.00%); {FIX}")

    rtn_engine, gptq_engine = r.engines["rtn-w4a16"].sha256, r.engines["gptq-w4a16"].sha256
    with pytest.raises(PromotionRefused, match=rf"^version {swapped} of {model} has no passing gate report for its engine \(consistency run "
                       rf"\w+ gated engine {rtn_engine[:12]}…, the version ships {gptq_engine[:12]}…\); {FIX}$"):
        promote(c, model, swapped, "staging")

    assert _aliases(c, model) == before == {"staging": gptq, "production": None, "previous": None}
    assert {_stage(c, model, v) for v in (unlinked, failed, swapped)} == {"None"}
    runs = _moves(c, model)
    assert [(m.info.status, m.data.tags["edgeflow.version"]) for m in runs] == [("FAILED", v) for v in (unlinked, failed, swapped)]
    assert "top-1 agreement 91.00% < 97.00%" in runs[1].data.tags["edgeflow.error"]


def test_production_needs_a_successful_deployment_and_the_old_production_becomes_previous(make_release, model):
    r = make_release(model, PASSING)
    c = client()
    gptq, rtn = r.version("gptq-w4a16"), r.version("rtn-w4a16")

    # version defaults to what `staging` holds (gptq); nothing deployed yet
    with pytest.raises(PromotionRefused, match=rf"^version {gptq} of {model} has no successful edge deployment \(no deployment of it is recorded"):
        promote(c, model, None, "production")
    _deployed(r, gptq, "FAILED", "TimeoutError: /health not healthy after 180s")
    _deployed(r, rtn)  # another version's success does not count
    with pytest.raises(PromotionRefused, match=rf"has no successful edge deployment \(its last deployment, run \w+, ended FAILED: TimeoutError"):
        promote(c, model, gptq, "production")
    assert _aliases(c, model) == {"staging": gptq, "production": None, "previous": None}

    _deployed(r, gptq)
    first = promote(c, model, None, "production")
    assert (first.version, first.from_version, first.previous) == (gptq, None, None)
    assert first.checks[1].startswith("deployed: run ")
    assert _aliases(c, model) == {"staging": gptq, "production": gptq, "previous": None}
    assert _stage(c, model, gptq) == "Production"

    second = promote(c, model, rtn, "production", reason="rtn validated on the device")
    assert (second.version, second.from_version, second.previous) == (rtn, gptq, gptq)
    assert _aliases(c, model) == {"staging": gptq, "production": rtn, "previous": gptq}
    # gptq still holds `staging`, so its legacy stage is Staging (production > staging > previous)
    assert (_stage(c, model, rtn), _stage(c, model, gptq)) == ("Production", "Staging")

    with pytest.raises(PromotionRefused, match=f"version {rtn} of {model} already holds `production`"):
        promote(c, model, rtn, "production")
    statuses = [(m.info.status, m.data.tags["edgeflow.alias"]) for m in _moves(c, model)]
    assert statuses == [("FAILED", "production")] * 2 + [("FINISHED", "production")] * 2 + [("FAILED", "production")]


def test_production_ignores_a_successful_deployment_of_another_package_with_the_same_version_number(make_release, model, tmp_path):
    """A deployment record names the version by number and tags the package it installed: a FINISHED deployment of
    another package under that number (a re-created registry restarts its numbering) does not count."""
    import shutil

    from edgeflow.tracking.artifacts import write_manifest
    from edgeflow.tracking.registry import PACKAGE_SHA256_TAG

    r = make_release(model, PASSING)
    c = client()
    gptq = r.version("gptq-w4a16")
    registered = c.get_model_version(model, gptq).tags[PACKAGE_SHA256_TAG]
    other = tmp_path / "other-package"
    shutil.copytree(_package(r, "gptq-w4a16"), other)
    (other / "README.txt").write_text("another registry's version of the same number")
    other_sha = write_manifest(other)
    assert other_sha != registered

    _deployed(r, gptq, package=other)
    [run] = c.search_runs([c.get_experiment_by_name("edgeflow-deployments").experiment_id],
                          f"tags.`edgeflow.model` = '{model}'")
    assert run.info.status == "FINISHED" and run.data.tags[PACKAGE_SHA256_TAG] == other_sha
    with pytest.raises(PromotionRefused, match=rf"^version {gptq} of {model} has no successful edge deployment"):
        promote(c, model, gptq, "production")
    assert _aliases(c, model)["production"] is None

    _deployed(r, gptq, package=_package(r, "gptq-w4a16"))  # this version's own package, as fetch_version installs it
    move = promote(c, model, gptq, "production")
    assert move.version == gptq and move.checks[1].startswith("deployed: run ")
    deployed = c.search_runs([c.get_experiment_by_name("edgeflow-deployments").experiment_id],
                             f"tags.`edgeflow.model` = '{model}' and tags.`{PACKAGE_SHA256_TAG}` = '{registered}'")
    assert len(deployed) == 1 and deployed[0].info.run_id in move.checks[1]


def test_rollback_swaps_production_and_previous(make_release, model):
    r = make_release(model, PASSING)
    c = client()
    gptq, rtn = r.version("gptq-w4a16"), r.version("rtn-w4a16")
    _deployed(r, gptq)
    promote(c, model, gptq, "production")

    with pytest.raises(PromotionRefused, match=rf"nothing to roll back to: {model} has no `previous` alias \(production version {gptq}"):
        rollback(c, model)

    _deployed(r, rtn)
    promote(c, model, rtn, "production")

    back = rollback(c, model, reason="p99 time to first token doubled")
    assert (back.action, back.version, back.from_version, back.previous) == ("rollback", gptq, rtn, rtn)
    assert _aliases(c, model) == {"staging": gptq, "production": gptq, "previous": rtn}
    assert (_stage(c, model, gptq), _stage(c, model, rtn)) == ("Production", "Archived")

    again = rollback(c, model)  # a second rollback undoes the first
    assert (again.version, again.previous) == (rtn, gptq)
    assert _aliases(c, model) == {"staging": gptq, "production": rtn, "previous": gptq}
    assert (_stage(c, model, rtn), _stage(c, model, gptq)) == ("Production", "Staging")  # gptq still holds `staging`
    last = _moves(c, model)[-2]
    assert (last.data.tags["edgeflow.action"], last.data.tags["edgeflow.reason"]) == ("rollback", "p99 time to first token doubled")


def test_flows_are_the_deployments_entrypoints():
    from edgeflow.pipeline.promote import promote as promote_flow
    from edgeflow.pipeline.promote import rollback_production

    assert (promote_flow.name, rollback_production.name) == ("promote", "rollback-production")
    assert set(promote_flow.parameters.properties) == {"profile", "version", "to", "reason"}
    assert set(rollback_production.parameters.properties) == {"profile", "deploy", "reason"}
