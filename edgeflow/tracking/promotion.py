"""Promotion and rollback through the MLflow registry: candidate → staging → production, each move checked.

Aliases are the truth (`staging`, `production`, `previous`); the legacy registry stages (Staging /
Production / Archived) are mirrored from them for readers that still filter by stage. Every attempted
move, refused ones included, is a run of the MLflow experiment `edgeflow-promotions`.
"""
from __future__ import annotations

import json
import warnings
from typing import Literal

from mlflow import MlflowClient
from mlflow.entities.model_registry import ModelVersion
from mlflow.exceptions import MlflowException
from pydantic import BaseModel, ConfigDict, Field

from edgeflow.evaluation.report import GateReport
from edgeflow.tracking.registry import GATE_REPORT_TAG, PACKAGE_SHA256_TAG, alias_version, load_run_json, split_runs_uri
from edgeflow.tracking.runs import DEPLOYMENTS_EXPERIMENT, PROMOTIONS_EXPERIMENT, experiment_id, find_experiment_id

# Legacy stage of a version, by the strongest alias it holds; a version that lost its last alias is Archived.
STAGE_FOR_ALIAS = {"production": "Production", "staging": "Staging", "previous": "Archived"}


class PromotionRefused(RuntimeError):
    """A move failed one of its checks; the message names the version, the check and the fix."""


class Move(BaseModel):
    """One alias move as it happened: which version, from where, what was checked and mirrored."""

    model_config = ConfigDict(extra="forbid")

    model_name: str = Field(description="Registered model name.")
    action: Literal["promote", "rollback"] = Field(description="promote: a checked move up; rollback: production back to previous.")
    alias: Literal["staging", "production"] = Field(description="The alias that moved.")
    version: str = Field(description="Version the alias points to after the move.")
    from_version: str | None = Field(description="Version the alias pointed to before the move (None: it was unset).")
    previous: str | None = Field(default=None, description="Version `previous` points to after a production move (None for staging moves).")
    checks: list[str] = Field(default_factory=list, description="The checks that passed, each with the MLflow run that proves it.")
    stages: dict[str, str] = Field(default_factory=dict, description="Legacy stage set on each touched version (version -> stage).")
    warnings: list[str] = Field(
        default_factory=list, description="What MLflow said while mirroring legacy stages (the deprecation warning; a failure to mirror)."
    )
    reason: str = Field(default="", description="Why the operator made the move, as given.")
    record_run_id: str | None = Field(default=None, description="Run of the `edgeflow-promotions` experiment that records the move.")


def resolve_version(c: MlflowClient, name: str, version: str) -> ModelVersion:
    """A version by number, or by alias when `version` is not a number; refuses when there is none."""
    try:
        return c.get_model_version(name, version) if version.isdigit() else c.get_model_version_by_alias(name, version)
    except MlflowException as e:
        raise PromotionRefused(f"{name} has no version {version!r} ({e.message}); list versions in the MLflow registry UI") from e


def check_gate(c: MlflowClient, name: str, mv: ModelVersion) -> str:
    """The version's gate report (linked by the register stage) exists, finished, and has a passing row for its variant."""
    v, variant = mv.version, mv.tags.get("edgeflow.variant")
    fix = "re-run the release or promote a version that passed"
    link = mv.tags.get(GATE_REPORT_TAG)
    if not link:
        raise PromotionRefused(
            f"version {v} of {name} has no gate report (version tag {GATE_REPORT_TAG} is missing: it was not registered by a "
            f"release's register stage, or was registered before gate links were recorded); {fix}"
        )
    try:
        run_id, path = split_runs_uri(link)
        run = c.get_run(run_id)
        report = GateReport.model_validate(load_run_json(c, run_id, path))
    except (ValueError, MlflowException, OSError) as e:
        raise PromotionRefused(f"version {v} of {name} has no readable gate report ({GATE_REPORT_TAG}={link}: {e}); {fix}") from e
    if run.info.status != "FINISHED":
        raise PromotionRefused(f"version {v} of {name} has no passing gate report (consistency run {run_id} ended {run.info.status}); {fix}")
    row = report.row(variant)
    if row is None:
        raise PromotionRefused(
            f"version {v} of {name} has no passing gate report (consistency run {run_id} has no row for variant {variant!r}); {fix}"
        )
    if not row.passed:
        why = "; ".join(row.reasons) or "marked failed"
        raise PromotionRefused(f"version {v} of {name} has no passing gate report (consistency run {run_id}: {why}); {fix}")
    # The row must be about the engine this version ships, not merely a variant of the same name.
    shipped = _shipped_engine_sha256(c, mv)
    gated = row.engine.sha256
    if shipped and gated and shipped != gated:
        raise PromotionRefused(
            f"version {v} of {name} has no passing gate report for its engine (consistency run {run_id} gated engine "
            f"{gated[:12]}…, the version ships {shipped[:12]}…); {fix}"
        )
    return (f"gate passed: consistency run {run_id}, variant {variant}, top-1 agreement {row.top1_agreement}, "
            f"mean KL {row.kl}" + (", same engine sha256 as the package" if shipped and gated else ""))


def _shipped_engine_sha256(c: MlflowClient, mv: ModelVersion) -> str | None:
    """The engine hash in the version's packaged lineage.json (None when the package has none to read)."""
    try:
        run_id, path = split_runs_uri(mv.source)
        return load_run_json(c, run_id, f"{path}/lineage.json").get("engine", {}).get("sha256")
    except (ValueError, MlflowException, OSError):
        return None


def check_deployed(c: MlflowClient, name: str, mv: ModelVersion) -> str:
    """A FINISHED run in `edgeflow-deployments` served this exact version (model name and version number) on a device."""
    v = mv.version
    fix = f"deploy it (deploy-edge with an alias pointing at version {v}, e.g. staging) until it is healthy, then promote again"
    exp_id = find_experiment_id(c, DEPLOYMENTS_EXPERIMENT)
    runs = [] if exp_id is None else c.search_runs(
        [exp_id], f"tags.`edgeflow.model` = '{name}' and tags.`edgeflow.version` = '{v}'",
        order_by=["attributes.start_time DESC"], max_results=100,
    )
    # Deployment records name the version by number; where one also names the package hash (record_deployment tags
    # the package it installed), it must be this version's: a re-created registry restarts its numbering.
    package = mv.tags.get(PACKAGE_SHA256_TAG)
    runs = [r for r in runs if not package or r.data.tags.get(PACKAGE_SHA256_TAG, package) == package]
    ok = next((r for r in runs if r.info.status == "FINISHED"), None)
    if ok is None:
        last = (f"its last deployment, run {runs[0].info.run_id}, ended {runs[0].info.status}: "
                f"{runs[0].data.tags.get('edgeflow.error') or 'no error recorded'}") if runs else (
            f"no deployment of it is recorded in the MLflow experiment {DEPLOYMENTS_EXPERIMENT}")
        raise PromotionRefused(f"version {v} of {name} has no successful edge deployment ({last}); {fix}")
    return f"deployed: run {ok.info.run_id} ({DEPLOYMENTS_EXPERIMENT}) served version {v} on {ok.data.tags.get('edgeflow.device_dir', '?')}"


def mirror_stages(c: MlflowClient, name: str, versions: set[str]) -> tuple[dict[str, str], list[str]]:
    """Set each version's legacy stage from its aliases; returns (version -> stage, what MLflow warned or failed)."""
    stages: dict[str, str] = {}
    notes: list[str] = []
    for v in sorted(versions, key=int):
        aliases = set(c.get_model_version(name, v).aliases)
        stage = next((STAGE_FOR_ALIAS[a] for a in ("production", "staging", "previous") if a in aliases), "Archived")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                c.transition_model_version_stage(name, v, stage, archive_existing_versions=False)
                stages[v] = stage
            except Exception as e:  # noqa: BLE001 - stages are a courtesy mirror; the aliases already moved and stay authoritative
                notes.append(f"version {v}: legacy stage {stage} not mirrored ({type(e).__name__}: {e})")
        notes += [str(w.message) for w in caught if str(w.message) not in notes]
    return stages, notes


def record_move(
    c: MlflowClient, name: str, action: str, alias: str, version: str | None, status: Literal["FINISHED", "FAILED"],
    detail: dict, error: str = "",
) -> str:
    """One run per attempted move in `edgeflow-promotions`: FINISHED moves, FAILED refusals with the reason."""
    exp_id = experiment_id(c, PROMOTIONS_EXPERIMENT)
    tags = {
        "edgeflow.model": name,
        "edgeflow.action": action,
        "edgeflow.alias": alias,
        "edgeflow.version": version or "",
        "edgeflow.from_version": str(detail.get("from_version") or ""),
        "edgeflow.previous": str(detail.get("previous") or ""),
        "edgeflow.reason": str(detail.get("reason") or "")[:4000],
        "edgeflow.error": error[:4000],
    }
    label = f"{action} {alias} v{version or '?'}" + ("" if status == "FINISHED" else " refused")
    run = c.create_run(exp_id, run_name=label, tags=tags)
    c.log_dict(run.info.run_id, json.loads(json.dumps(detail, default=str)), "move.json")
    c.set_terminated(run.info.run_id, status)
    return run.info.run_id


def promote(
    c: MlflowClient, name: str, version: str | None, to: Literal["staging", "production"], reason: str = ""
) -> Move:
    """Move `to` onto `version` after its checks pass; refusals raise PromotionRefused and move nothing.

    staging: the version's gate report (version tag `edgeflow.gate_report`, set by the register stage)
    must exist and show its variant passing. production: the same, plus a successful edge deployment of
    that version in `edgeflow-deployments`; the version that was production becomes `previous`.
    `version` is a number or an alias; None means the version at the alias below (`staging` for production).
    """
    try:
        if to not in ("staging", "production"):
            raise PromotionRefused(f"cannot promote to {to!r}: the registry's promotion aliases are 'staging' and 'production'")
        if version is None:
            if to == "staging":
                raise PromotionRefused(f"promoting {name} to staging needs a version: name the registered candidate to stage")
            version = alias_version(c, name, "staging")
            if version is None:
                raise PromotionRefused(f"no version given and {name} has no `staging` alias; name the version to promote to production")
        mv = resolve_version(c, name, version)
        current = alias_version(c, name, to)
        if current == mv.version:
            raise PromotionRefused(f"version {mv.version} of {name} already holds `{to}`; nothing to move")
        checks = [check_gate(c, name, mv)]
        if to == "production":
            checks.append(check_deployed(c, name, mv))
    except PromotionRefused as e:
        record_move(c, name, "promote", to, version, "FAILED", {"reason": reason}, str(e))
        raise
    touched = {mv.version} | ({current} if current else set())
    previous = None
    if to == "production":
        if current:
            # `previous` first: a crash between the two calls leaves production where it was, never a lost version.
            touched |= {p for p in [alias_version(c, name, "previous")] if p}
            c.set_registered_model_alias(name, "previous", current)
        c.set_registered_model_alias(name, "production", mv.version)
        previous = alias_version(c, name, "previous")
    else:
        c.set_registered_model_alias(name, "staging", mv.version)
    stages, notes = mirror_stages(c, name, touched)
    move = Move(model_name=name, action="promote", alias=to, version=mv.version, from_version=current, previous=previous,
                checks=checks, stages=stages, warnings=notes, reason=reason)
    move.record_run_id = record_move(c, name, "promote", to, mv.version, "FINISHED", move.model_dump())
    return move


def rollback(c: MlflowClient, name: str, reason: str = "") -> Move:
    """Point `production` back at `previous`, and `previous` at the version that was production (a swap).

    The swap keeps `previous` meaning one thing, "the production version before the last move", as the
    device's own state.json does after a rollback-edge; so a second rollback undoes the first, like
    `cd -`. Nothing is re-checked: `previous` passed its gate and deployment checks when it was promoted,
    and a rollback must work when the checks' services are the problem. The rolled-back version keeps its
    record and is mirrored to the Archived stage.
    """
    prod, prev = alias_version(c, name, "production"), alias_version(c, name, "previous")
    try:
        if prod is None:
            raise PromotionRefused(f"{name} has no `production` alias: there is nothing to roll back")
        if prev is None:
            raise PromotionRefused(
                f"nothing to roll back to: {name} has no `previous` alias (production version {prod} is the first one "
                "promoted); promote another version to production instead"
            )
    except PromotionRefused as e:
        record_move(c, name, "rollback", "production", prev, "FAILED", {"from_version": prod, "reason": reason}, str(e))
        raise
    # production first: the serving alias is what matters if the second call never happens.
    c.set_registered_model_alias(name, "production", prev)
    c.set_registered_model_alias(name, "previous", prod)
    stages, notes = mirror_stages(c, name, {prod, prev})
    move = Move(model_name=name, action="rollback", alias="production", version=prev, from_version=prod, previous=prod,
                checks=[f"rolled back from version {prod} to version {prev} (was `previous`)"], stages=stages,
                warnings=notes, reason=reason)
    move.record_run_id = record_move(c, name, "rollback", "production", prev, "FINISHED", move.model_dump())
    return move
