"""What `edgeflow doctor` writes: each check's result (pass, fail or skip, with its reason and numbers) and the report a
user attaches to a bug report, as doctor.json and doctor.md."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

Status = Literal["pass", "fail", "skip"]


class CheckResult(BaseModel):
    """One check of the host: what it found and how long it took."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="The check, e.g. `device` or `engine:cpu_native`.")
    status: Status = Field(description="pass; fail (the host cannot do what its role needs); skip (not applicable "
                           "here, or an earlier check it needs failed).")
    reason: str | None = Field(default=None, description="Why it failed or was skipped, with the fix; None on a pass.")
    numbers: dict[str, Any] = Field(default_factory=dict, description="What it measured (versions, speeds, agreements).")
    seconds: float = Field(default=0.0, ge=0, description="Wall time of the check.")


class DoctorReport(BaseModel):
    """Every check of one `edgeflow doctor` run, with the host and the role it was checked for."""

    model_config = ConfigDict(extra="forbid")

    role: str = Field(description="The role checked: cpu, a100 or orin.")
    profile: str = Field(description="The profile whose engine backend and settings the checks use.")
    started: str = Field(description="UTC time the run started (ISO 8601).")
    seconds: float = Field(ge=0, description="Wall time of the whole run.")
    checks: list[CheckResult] = Field(description="In the order they ran.")

    def failed(self) -> list[CheckResult]:
        return [c for c in self.checks if c.status == "fail"]


def write_report(report: DoctorReport, out_dir: Path) -> tuple[Path, Path]:
    """doctor.json and doctor.md in out_dir (created); returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    js, md = out_dir / "doctor.json", out_dir / "doctor.md"
    js.write_text(json.dumps(report.model_dump(mode="json"), indent=2) + "\n")
    md.write_text(markdown(report))
    return js, md


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (list, tuple)):
        return ", ".join(map(str, v))
    return str(v)


def markdown(report: DoctorReport) -> str:
    """The report for a person: a summary table, then each check's numbers."""
    counts = {s: sum(c.status == s for c in report.checks) for s in ("pass", "fail", "skip")}
    lines = [f"# edgeflow doctor: role {report.role}", "",
             f"Profile `{report.profile}`, started {report.started}, {report.seconds:.1f} s: "
             f"{counts['pass']} passed, {counts['fail']} failed, {counts['skip']} skipped.", "",
             "| check | status | seconds | reason |", "|---|---|---|---|"]
    lines += [f"| {c.name} | {c.status} | {c.seconds:.1f} | {(c.reason or '').replace('|', '/')} |" for c in report.checks]
    for c in report.checks:
        if c.numbers:
            lines += ["", f"## {c.name}", ""] + [f"- {k}: {_fmt(v)}" for k, v in c.numbers.items()]
    return "\n".join(lines) + "\n"
