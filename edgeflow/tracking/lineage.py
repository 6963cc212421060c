"""Lineage of a registered version: engine → quantized checkpoint → student → calibration set and training set.

    python -m edgeflow.tracking.lineage --model edgeflow-student --version 3      (a number or an alias: --version production)

The map is the `lineage.json` the register stage packed into the version (every stage's ArtifactRef:
URI, sha256, MLflow run id); each hop is then checked against what was logged independently — the
version's tags, the producing run's stage tag and params, the distill run's training-set tag — and the
package's own manifest. Gaps and contradictions are treated differently:

- a link that was never recorded (a version registered by hand, a distill run older than the
  training-set tag) makes that hop `unknown`, with the reason; `Lineage.complete` is then False and
  `require_complete()` raises. The rest of the lineage is still returned, so a report can show it.
- records that disagree (a hash on the version that differs from the package's, a run that does not
  exist or is of another stage) raise LineageError: that lineage cannot be trusted at all.

`teacher_of` reads the teacher a distilled student records (the release hands it to the register stage).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any, Literal

from mlflow import MlflowClient
from mlflow.entities.model_registry import ModelVersion
from mlflow.exceptions import MlflowException
from pydantic import BaseModel, ConfigDict, Field

from edgeflow.tracking.artifacts import MANIFEST, ArtifactRef, sha256_file, sha256_json
from edgeflow.tracking.registry import GATE_REPORT_TAG, load_run_json, split_runs_uri
from edgeflow.tracking.runs import training_set

HopKind = Literal["engine", "checkpoint", "student", "teacher", "calibration", "training"]
# The edgeflow.stage tag each producing run carries (edgeflow/pipeline/*.py name their stage runs this way).
STAGE_PREFIX = {"engine": "build-engine", "checkpoint": "quantize", "student": "distill", "calibration": "calibrate"}


class LineageError(RuntimeError):
    """The version does not exist, or its recorded lineage contradicts itself."""


class Hop(BaseModel):
    """One artifact in the chain behind a version: where it is, what it hashes to, which run made it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: HopKind = Field(description="engine, checkpoint (quantized), student, teacher, calibration (set) or training (one file of the set).")
    uri: str | None = Field(default=None, description="Local path or URI of the artifact; None when unknown.")
    sha256: str | None = Field(default=None, description="Content hash (file, or sorted per-file hashes of a directory); None when unknown.")
    mlflow_run_id: str | None = Field(
        default=None,
        description="MLflow run that produced it; for training files the distill run that consumed and recorded them; None for the teacher (resolved, not produced).",
    )
    stage: str | None = Field(default=None, description="The run's edgeflow.stage tag, e.g. quantize-awq-w4a16.")
    checks: list[str] = Field(default_factory=list, description="Independently logged values found to agree with this hop.")
    unknown: str | None = Field(default=None, description="Why this hop cannot be traced; None when it is known.")


class Lineage(BaseModel):
    """Everything a registered version was made from, each hop with its URI, sha256 and MLflow run."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model_name: str = Field(description="Registered model name.")
    version: str = Field(description="Version number.")
    aliases: list[str] = Field(description="Aliases the version holds now.")
    variant: str | None = Field(description="Quantization variant (version tag edgeflow.variant).")
    release_id: str | None = Field(description="Release that registered it (version tag edgeflow.release_id).")
    package_sha256: str | None = Field(description="Tree hash of the registered package (version tag edgeflow.package_sha256).")
    register_run_id: str | None = Field(description="Register-stage run whose artifacts are the version's files.")
    gate_report: str | None = Field(description="runs:/ URI of the gate report that passed the version (version tag edgeflow.gate_report).")
    engine: Hop = Field(description="The built engine shipped in the package.")
    checkpoint: Hop = Field(description="The quantized checkpoint the engine was built from.")
    student: Hop = Field(description="The distilled full-precision student that was quantized.")
    teacher: Hop = Field(description="The teacher the student was distilled from.")
    calibration: Hop = Field(description="The calibration set the checkpoint was quantized with.")
    training_set: list[Hop] = Field(description="The files the student was trained on (one unknown hop if not recorded).")
    checks: list[str] = Field(default_factory=list, description="Checks of the package as a whole (manifest against the registered hash).")

    @property
    def hops(self) -> list[Hop]:
        return [self.engine, self.checkpoint, self.student, self.teacher, self.calibration, *self.training_set]

    @property
    def complete(self) -> bool:
        return all(h.unknown is None for h in self.hops)

    def require_complete(self) -> Lineage:
        """Self, or LineageError naming every hop that cannot be traced."""
        gaps = [f"{h.kind}: {h.unknown}" for h in self.hops if h.unknown]
        if gaps:
            raise LineageError(f"version {self.version} of {self.model_name} has untraceable hops: " + "; ".join(gaps))
        return self

    def render_markdown(self) -> str:
        """A "Lineage" section: one table row per hop, then what each hop was checked against."""
        head = (f"`{self.model_name}` version {self.version}" + (f" ({', '.join(self.aliases)})" if self.aliases else "")
                + f", variant `{self.variant or '?'}`, release `{self.release_id or '?'}`, package sha256 `{self.package_sha256 or '?'}`"
                + (f", gate report `{self.gate_report}`" if self.gate_report else "") + ".")
        rows = ["| hop | uri | sha256 | MLflow run (stage) |", "|---|---|---|---|"]
        for h in self.hops:
            if h.unknown:
                rows.append(f"| {h.kind} | unknown: {h.unknown} | - | - |")
            else:
                run = f"`{h.mlflow_run_id}` ({h.stage})" if h.mlflow_run_id else "-"
                rows.append(f"| {h.kind} | `{h.uri}` | `{h.sha256}` | {run} |")
        checks = [f"- {h.kind}: {c}" for h in self.hops for c in h.checks] + [f"- package: {c}" for c in self.checks]
        out = ["## Lineage", "", head, "", *rows]
        if checks:
            out += ["", "Cross-checked:", "", *checks]
        if not self.complete:
            out += ["", "Lineage is incomplete: the hops marked unknown were not recorded when the version was made."]
        return "\n".join(out) + "\n"


# Key of a student ArtifactRef's meta under which the distill stage (edgeflow/pipeline/distill.py) records its teacher.
TEACHER_META_KEY = "teacher"


def teacher_of(student: ArtifactRef) -> ArtifactRef:
    """The teacher a distilled student was trained from, as the distill stage recorded it with the student."""
    try:
        return ArtifactRef.model_validate(student.meta[TEACHER_META_KEY])
    except KeyError:
        raise LineageError(
            f"student {student.uri} (sha256 {student.sha256[:12]}) records no teacher (meta key {TEACHER_META_KEY!r}); it was "
            "not published by the distill stage (edgeflow/pipeline/distill.py:train_student): distill it again"
        ) from None


def _resolve(c: MlflowClient, name: str, version: str) -> ModelVersion:
    try:
        return c.get_model_version(name, version) if version.isdigit() else c.get_model_version_by_alias(name, version)
    except MlflowException as e:
        raise LineageError(f"{name} has no version {version!r}: {e.message}") from e


def _agree(version: str, what: str, logged: Any, traced: Any, checks: list[str]) -> None:
    """Record a check when an independently logged value matches; raise when it contradicts; skip when either is absent."""
    if logged in (None, "") or traced in (None, ""):
        return
    if str(logged) != str(traced):
        raise LineageError(f"version {version}: {what} is {logged!r} but the package lineage says {traced!r}; the records disagree")
    checks.append(what)


def _package(c: MlflowClient, mv: ModelVersion, checks: list[str]) -> tuple[dict | None, str | None]:
    """The version's lineage.json (checked against its manifest and registered hash), or (None, why not)."""
    v = mv.version
    try:
        run_id, path = split_runs_uri(mv.source)
    except ValueError:
        return None, f"version {v}'s source {mv.source!r} is not a run's artifacts, so it carries no lineage.json"
    with tempfile.TemporaryDirectory() as tmp:
        try:
            local = Path(c.download_artifacts(run_id, f"{path}/lineage.json", tmp))
            lineage = json.loads(local.read_text())
        except (MlflowException, OSError, ValueError) as e:
            return None, (f"version {v}'s package {mv.source} has no readable lineage.json ({type(e).__name__}): "
                          "it was not registered by the register stage")
        try:
            manifest = load_run_json(c, run_id, f"{path}/{MANIFEST}")
        except (MlflowException, OSError, ValueError) as e:
            raise LineageError(f"version {v}'s package {mv.source} has a lineage.json but no readable {MANIFEST} ({e})") from e
        _agree(v, "lineage.json is the file the package manifest lists", manifest.get("lineage.json"), sha256_file(local), checks)
    _agree(v, "package manifest hashes to version tag edgeflow.package_sha256", mv.tags.get("edgeflow.package_sha256"),
           sha256_json(manifest), checks)
    return lineage, None


def _run(c: MlflowClient, v: str, kind: HopKind, ref: dict | None, checks: list[str]) -> Any:
    """The run that produced a hop, checked to exist and to be of the stage that makes that kind; None if none is named."""
    if not ref or not ref.get("mlflow_run_id"):
        return None
    try:
        run = c.get_run(ref["mlflow_run_id"])
    except MlflowException as e:
        raise LineageError(f"version {v}: the {kind}'s run {ref['mlflow_run_id']} does not exist on this tracking server ({e.message})") from e
    stage = run.data.tags.get("edgeflow.stage")
    if kind in STAGE_PREFIX and not (stage or "").startswith(STAGE_PREFIX[kind]):
        raise LineageError(f"version {v}: the {kind}'s run {run.info.run_id} is stage {stage!r}, not {STAGE_PREFIX[kind]}*")
    checks.append(f"run {run.info.run_id} exists and is stage {stage}")
    return run


def _hop(kind: HopKind, ref: dict | None, run: Any, why: str | None, checks: list[str]) -> Hop:
    """A hop from its ArtifactRef; unknown when the package names none, or names no run for a produced artifact."""
    if ref is None:
        return Hop(kind=kind, unknown=why or f"the package lineage names no {kind}")
    if run is None and kind in STAGE_PREFIX:
        return Hop(kind=kind, uri=ref.get("uri"), sha256=ref.get("sha256"), unknown=f"the package lineage names no MLflow run for the {kind}")
    return Hop(kind=kind, uri=ref["uri"], sha256=ref["sha256"], mlflow_run_id=ref.get("mlflow_run_id"),
               stage=run and run.data.tags.get("edgeflow.stage"), checks=checks)


def lineage(client: MlflowClient, model_name: str, version: str) -> Lineage:
    """Walk back from a registered version (number or alias) to every artifact it was made from."""
    mv = _resolve(client, model_name, str(version))
    v, tags = mv.version, mv.tags
    pkg_checks: list[str] = []
    refs, why = _package(client, mv, pkg_checks)
    refs = refs or {}
    eng, ckpt, stu, tea, cal = (refs.get(k) for k in ("engine", "checkpoint", "student", "teacher", "calibration"))
    chk: dict[str, list[str]] = {k: [] for k in ("engine", "checkpoint", "student", "teacher", "calibration")}
    e_run = _run(client, v, "engine", eng, chk["engine"])
    q_run = _run(client, v, "checkpoint", ckpt, chk["checkpoint"])
    d_run = _run(client, v, "student", stu, chk["student"])
    c_run = _run(client, v, "calibration", cal, chk["calibration"])

    def meta(ref: dict | None, key: str) -> Any:
        return (ref or {}).get("meta", {}).get(key)

    def param(run: Any, key: str) -> Any:
        return run.data.params.get(key) if run is not None else None

    # Each check sets a value recorded somewhere else (the version's tags, the runs' params) against the
    # lineage file; the params are what each stage logged about its *inputs*, so they are the links.
    if eng and ckpt:
        _agree(v, "built from this checkpoint's sha256 (engine meta checkpoint_sha256)", meta(eng, "checkpoint_sha256"), ckpt["sha256"], chk["engine"])
    _agree(v, "backend = version tag edgeflow.engine_backend", tags.get("edgeflow.engine_backend"), meta(eng, "backend"), chk["engine"])
    _agree(v, "backend = build-engine run param backend", param(e_run, "backend"), meta(eng, "backend"), chk["engine"])
    _agree(v, "recipe = version tag edgeflow.recipe", tags.get("edgeflow.recipe"), meta(ckpt, "recipe"), chk["checkpoint"])
    _agree(v, "variant = quantize run param name", param(q_run, "name"), tags.get("edgeflow.variant"), chk["checkpoint"])
    if stu:
        _agree(v, "sha256 = version tag edgeflow.student_sha256", tags.get("edgeflow.student_sha256"), stu["sha256"], chk["student"])
        _agree(v, "run = version tag edgeflow.student_run_id", tags.get("edgeflow.student_run_id"), stu.get("mlflow_run_id"), chk["student"])
    if tea:
        _agree(v, "sha256 = version tag edgeflow.teacher_sha256", tags.get("edgeflow.teacher_sha256"), tea["sha256"], chk["teacher"])
        _agree(v, "sha256 = distill run param teacher_sha256", param(d_run, "teacher_sha256"), tea["sha256"], chk["teacher"])
    if cal:
        _agree(v, "sha256 = version tag edgeflow.calibration_sha256", tags.get("edgeflow.calibration_sha256"), cal["sha256"], chk["calibration"])
        _agree(v, "sha256 = quantize run param calibration_sha256", param(q_run, "calibration_sha256"), cal["sha256"], chk["calibration"])

    engine = _hop("engine", eng, e_run, why, chk["engine"])
    checkpoint = _hop("checkpoint", ckpt, q_run, why, chk["checkpoint"])
    student = _hop("student", stu, d_run, why, chk["student"])
    teacher = _hop("teacher", tea, None, why, chk["teacher"])
    calibration = _hop("calibration", cal, c_run, why, chk["calibration"])

    files = training_set(d_run) if d_run is not None else None
    if files:
        training = [Hop(kind="training", uri=f, sha256=sha, mlflow_run_id=d_run.info.run_id, stage="distill",
                        checks=["recorded on the distill run (tag edgeflow.training_set)"]) for f, sha in sorted(files.items())]
    elif d_run is not None:
        named = d_run.data.params.get("corpora")
        training = [Hop(kind="training", unknown=f"distill run {d_run.info.run_id} recorded no training-set hashes (tag "
                        f"edgeflow.training_set; runs before it was logged)" + (f"; its corpora param names {named}" if named else ""))]
    else:
        training = [Hop(kind="training", unknown=why or "the student's distill run is unknown")]

    return Lineage(
        model_name=model_name, version=v, aliases=sorted(mv.aliases), variant=tags.get("edgeflow.variant"),
        release_id=tags.get("edgeflow.release_id"), package_sha256=tags.get("edgeflow.package_sha256"),
        register_run_id=mv.run_id or None, gate_report=tags.get(GATE_REPORT_TAG), engine=engine, checkpoint=checkpoint,
        student=student, teacher=teacher, calibration=calibration, training_set=training, checks=pkg_checks,
    )


def main(argv: list[str] | None = None) -> int:
    from edgeflow.tracking.registry import client

    ap = argparse.ArgumentParser(description="Print the lineage of a registered version as markdown.")
    ap.add_argument("--model", required=True, help="registered model name (registry.model_name of the profile)")
    ap.add_argument("--version", required=True, help="version number or alias (staging, production, previous)")
    ap.add_argument("--json", action="store_true", help="print the Lineage as JSON instead")
    ap.add_argument("--strict", action="store_true", help="exit 1 when a hop is unknown")
    a = ap.parse_args(argv)
    try:
        lin = lineage(client(), a.model, a.version)
    except LineageError as e:
        print(f"lineage: {e}", file=sys.stderr)
        return 1
    print(lin.model_dump_json(indent=1) if a.json else lin.render_markdown())
    return 1 if a.strict and not lin.complete else 0


if __name__ == "__main__":
    sys.exit(main())
