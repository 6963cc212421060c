"""The release and nightly reports: assembled, written as reports/<name>.json and .md, and logged to MLflow.

    python -m edgeflow.pipeline.release --profile configs/test-tiny.yaml --deploy none     (services up; writes reports/<release_id>.*)

Release report: one row per variant (VARIANT_FIELDS of the gate report's rows, the markdown table shows COLUMNS),
the student's evaluation (STUDENT_FIELDS), the registry's outcome and the deployment; logged to the release's
parent run under `report/`, which this module then ends. Nightly report: the night's status and traffic, logged to
a run of its own in the profile's experiment. Both read the gate through edgeflow/evaluation/report.py:GateReport.
"""
from __future__ import annotations

import json
import shutil
from datetime import datetime, timezone
from typing import Any

from edgeflow.tracking.artifacts import ArtifactRef
from edgeflow.paths import REPO_ROOT
from edgeflow.evaluation.report import GateReport
from edgeflow.profile import Profile
from edgeflow.tracking.runs import log_values

# The markdown table's columns, in order.
COLUMNS = ("name", "size_mb", "engine_precision", "decode_tok_s", "ttft_ms", "decode_tok_s_greedy", "top1_agreement",
           "top1_last", "kl", "kl_p99", "ppl", "greedy_exact", "answers_ok", "passed")
# What the report keeps of each gate row (then engine_parity, rounded, from the row's metrics).
VARIANT_FIELDS = tuple(c for c in COLUMNS if c != "answers_ok") + ("decode_settings", "quantized", "reasons", "answers",
                                                                    "quality_passed", "slo")
# What the report keeps of the student's evaluation (its ArtifactRef.meta, as the distill stage recorded it).
STUDENT_FIELDS = ("student_top1_vs_teacher", "student_kl_vs_teacher", "teacher_ppl", "student_ppl", "student_ppl_before_training",
                  "student_top1_before_training", "student_kl_before_training", "student_quality_pct", "student_layers",
                  "student_params", "size_ratio")
# Where reports are written, on the host that runs the release or the nightly.
REPORTS_DIR = REPO_ROOT / "reports"


def attempt_summary(gate: GateReport) -> dict:
    """Did any quantized variant pass this attempt's gate, and how close did the best one come?"""
    from edgeflow.evaluation.answers import ok_share

    quantized = gate.quantized
    best = max(quantized, key=lambda r: r.top1_agreement, default=None)
    fp = gate.fp_row
    return {
        "attempt": gate.attempt,
        # share of the FP student's demo answers not degenerate: what gate.student.min_answers_ok limits
        "fp_answers_ok": ok_share(fp.answers) if fp and fp.answers is not None else None,
        "calibration_samples": (gate.calibration or {})["total"],
        "passed": [r.name for r in quantized if r.passed],
        # missed a service objective: no calibration set makes their engines faster or smaller
        "slo_missed": [r.name for r in quantized if any(t.get("misses") for t in r.slo or [])],
        "quantized": len(quantized),
        "best": best and f"{best.name}: agreement {best.top1_agreement:.2%}, KL {best.kl:.4f}; {'; '.join(best.reasons) or 'passed'}",
    }


def release_report(
    ctx: Any, student_meta: dict, gate: GateReport | None, registry: dict, deployed: dict | None, attempts: list[dict],
    student_gate: dict | None = None,
) -> dict:
    """The release report as a dict (what reports/<release_id>.json holds, less `plots`). `ctx`: the ReleaseContext.
    gate: the last attempt's gate report, None when the student gate refused the student before quantization;
    student_gate: its verdict (edgeflow/evaluation/student_gate.py)."""
    refused = student_gate is not None and not student_gate["passed"]
    why = registry["why_no_staging"]
    return {
        "release_id": ctx.release_id,
        "profile": ctx.profile,
        "model": ctx.resolved().registry.model_name,
        "variants": [{k: getattr(r, k) for k in VARIANT_FIELDS} | {"engine_parity": round(r.metrics["engine_parity"], 4),
                                                                    "answers_ok": answers_ok(r.answers)}
                     for r in (gate.rows if gate else [])],
        "staging": registry["staging"],
        "staging_version": registry["staging_version"],
        "registered": registry["registered"],
        "why_no_staging": why and (why if refused or not attempts else f"no variant met the bar after {len(attempts)} attempt(s); {why}"),
        "student_gate": student_gate,
        "attempts": attempts,
        "smoke_answer": deployed["smoke_answer"] if deployed else None,
        "deploy": deployed and {k: deployed[k] for k in ("url", "version", "engine_binding")},
        "gate": gate.thresholds if gate else ctx.resolved().gate.model_dump(exclude={"eval_sources"}),
        "eval_prompts": gate and gate.eval_prompts,
        "eval_positions": gate and gate.eval_positions,
        "gate_reference": gate and gate.reference and gate.reference.model_dump(),
        # .get: a student cached by an older release may lack the newer evaluation keys; the report shows what it has
        "student": {k: student_meta.get(k) for k in STUDENT_FIELDS} | {"steps": ctx.resolved().distill.steps},
        "mlflow_parent_run_id": ctx.mlflow_parent_run_id,
        "prefect_flow_run_id": ctx.prefect_flow_run_id,
    }


def write_release_report(
    ctx: Any, student: ArtifactRef, gate: GateReport | None, registry: dict, deployed: dict | None, attempts: list[dict],
    student_gate: dict | None = None,
) -> dict:
    """Assemble the report, save it as reports/<release_id>.json and .md (the final attempt's plots beside them), log
    them to the release's parent run under `report/` with each variant's top-1 agreement, and end that run."""
    from mlflow import MlflowClient

    from edgeflow.tracking.runs import tracking_uri
    from edgeflow.tracking.store import materialize

    c = MlflowClient(tracking_uri())
    report = release_report(ctx, student.meta, gate, registry, deployed, attempts, student_gate)
    # the parent run's experiment, for a link to the run: a reader of the report needs no MLflow client for it
    report["mlflow_experiment_id"] = c.get_run(ctx.mlflow_parent_run_id).info.experiment_id
    out = REPORTS_DIR
    out.mkdir(exist_ok=True)
    # the final attempt's plots next to the report, linked from the markdown by relative path
    plot_dir = out / ctx.release_id
    plot_dir.mkdir(exist_ok=True)
    report["plots"] = {}
    for name, ref in (gate.plots if gate else {}).items():
        shutil.copyfile(materialize(ref), plot_dir / ref.name)
        report["plots"][name] = f"{ctx.release_id}/{ref.name}"
    (out / f"{ctx.release_id}.json").write_text(json.dumps(report, indent=1))
    (out / f"{ctx.release_id}.md").write_text(markdown(report))
    c.log_artifact(ctx.mlflow_parent_run_id, str(out / f"{ctx.release_id}.json"), "report")
    c.log_artifact(ctx.mlflow_parent_run_id, str(out / f"{ctx.release_id}.md"), "report")
    if report["plots"]:
        c.log_artifacts(ctx.mlflow_parent_run_id, str(plot_dir), f"report/{ctx.release_id}")
    log_values(c, ctx.mlflow_parent_run_id, metrics={f"{r['name']}.top1_agreement": r["top1_agreement"]
                                                     for r in report["variants"] if r["top1_agreement"] is not None})
    c.set_terminated(ctx.mlflow_parent_run_id, "FINISHED")
    print(table(report["variants"]))
    return report


def write_nightly_report(profile: str, p: Profile, report: dict) -> dict:
    """Save the night's report as reports/nightly-<profile name>-<stamp>.json and .md and log both, under `report/`,
    to a run of their own in the profile's experiment (tagged edgeflow.nightly = the status); returns the report."""
    from mlflow import MlflowClient

    from edgeflow.tracking.runs import experiment_id, tracking_uri

    out = REPORTS_DIR
    out.mkdir(exist_ok=True)
    stem = f"nightly-{p.name}-{datetime.now(timezone.utc).strftime('%Y%m%d-%H%M%S')}"
    report = {"report": f"reports/{stem}.md", **report}
    (out / f"{stem}.json").write_text(json.dumps(report, indent=1, default=str))
    (out / f"{stem}.md").write_text(nightly_markdown(report))
    c = MlflowClient(tracking_uri())
    run = c.create_run(experiment_id(c, p.registry.experiment, p.registry.artifact_location), run_name=f"nightly {report['status']}", tags={
        "edgeflow.nightly": report["status"], "edgeflow.profile": profile,
        **({"edgeflow.release_id": report["release_id"]} if report.get("release_id") else {}),
    })
    c.log_artifact(run.info.run_id, str(out / f"{stem}.json"), "report")
    c.log_artifact(run.info.run_id, str(out / f"{stem}.md"), "report")
    c.set_terminated(run.info.run_id, "FINISHED")
    print(f"nightly recalibration {report['status']}: {report.get('reason') or report.get('promotion') or ''} ({report['report']})")
    return report


def nightly_markdown(r: dict) -> str:
    """The nightly report as markdown: status, why, the traffic window's counts, base/staging/production lines."""
    t = r.get("traffic") or {}
    lines = [f"# Nightly recalibration: {r['status']}", ""]
    if r.get("reason"):
        lines += [f"**Why:** {r['reason']}", ""]
    if t:
        ing = t.get("ingest", {})
        lines += ["| window | files | log lines | kept | PII records scrubbed | duplicates | eval overlaps dropped |",
                  "|---|---|---|---|---|---|---|",
                  f"| {t['since']} → {t['until']} | {t['files']} | {ing.get('lines', 0)} | {t['kept']} | "
                  f"{ing.get('records_with_pii', 0)} | {ing.get('exact_duplicates', 0) + ing.get('near_duplicates', 0)} | "
                  f"{t['dropped_eval_overlap']} |", ""]
        if t.get("per_device"):
            where = "the segments the devices shipped" if t.get("source") == "store" else t.get("logs_dir")
            lines += [f"Lines read per device, from {where}:", "",
                      "| device | log lines |", "|---|---:|"]
            lines += [f"| {device} | {n} |" for device, n in sorted(t["per_device"].items())] + [""]
    for key, title in (("base", "Base"), ("staging", "Staging"), ("promotion", "Production")):
        if r.get(key):
            lines.append(f"- **{title}:** {r[key]}")
    return "\n".join(lines) + "\n"


def staged_row(report: dict) -> dict | None:
    """The report's row of the variant that got `staging`, or None when nothing was staged."""
    return next((r for r in report["variants"] if r["name"] == report.get("staging")), None)


def answers_ok(answers: list[dict] | None) -> str | None:
    """'k/n': how many of the demo prompts' answers are not degenerate (edgeflow/evaluation/answers.py); None without them."""
    return None if answers is None else f"{sum(not a['degenerate'] for a in answers)}/{len(answers)}"


def answers_section(row: dict) -> str:
    """One variant's answers to the demo prompts with their repetition figures."""
    from edgeflow.evaluation.answers import ANSWER_TOKENS, MAX_TRIGRAM_REPEATS, MIN_DISTINCT_2

    out = [f"## Answers of {row['name']}", "",
           f"Each fixed demo prompt answered by the built engine as the edge server answers (its chat template, the model's "
           f"sampling defaults, seed 1, at most {ANSWER_TOKENS} tokens). Degenerate: a word 3-gram more than "
           f"{MAX_TRIGRAM_REPEATS} times or distinct-2 below {MIN_DISTINCT_2}.", ""]
    for a in row["answers"]:
        quoted = "\n".join("> " + line for line in (a["answer"] or f"(no text{': ' + a['error'] if a.get('error') else ''})").splitlines())
        out += [f"**{a['prompt']}**", "", quoted, "",
                f"{a['tokens']} tokens · most frequent 3-gram ×{a['max_trigram_repeats']} · distinct-2 {a['distinct_2']:.2f}"
                + (" · **degenerate**" if a["degenerate"] else ""), ""]
    return "\n".join(out).rstrip("\n")


def table(rows: list[dict]) -> str:
    """Markdown table of the report columns (columns a row lacks show as '-')."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        lines.append("| " + " | ".join("-" if r.get(c) is None else str(r[c]) for c in COLUMNS) + " |")
    return "\n".join(lines)


def _settings(rows: list[dict]) -> str:
    found = sorted({r.get("decode_settings") or "not recorded" for r in rows})
    return "; ".join(found) or "greedy"


def _fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def student_table(s: dict) -> str:
    """Student vs teacher before and after training: top-1 agreement, mean KL(teacher ‖ student), perplexity."""
    return "\n".join([
        "| student | top-1 vs teacher | mean KL | perplexity |",
        "|---|---:|---:|---:|",
        f"| before training | {_fmt(s.get('student_top1_before_training'), '.1%')} | {_fmt(s.get('student_kl_before_training'), '.3f')} "
        f"| {_fmt(s.get('student_ppl_before_training'), '.1f')} |",
        f"| after training | {_fmt(s.get('student_top1_vs_teacher'), '.1%')} | {_fmt(s.get('student_kl_vs_teacher'), '.3f')} "
        f"| {_fmt(s.get('student_ppl'), '.1f')} |",
        f"| teacher | 100% | 0 | {_fmt(s.get('teacher_ppl'), '.1f')} |",
    ])


def gate_paragraph(report: dict) -> str:
    """What the consistency gate's table measured, and against which thresholds."""
    g = report["gate"]
    return (
        f"Gate: top-1 agreement ≥ {g['min_top1_agreement']}, mean KL ≤ {g['max_mean_kl']}, perplexity increase ≤ "
        f"{g['max_ppl_increase']:.0%}, engine parity ≥ {g['min_engine_parity']}"
        + (f", at least {g['min_answers_ok']:.0%} of the demo answers not degenerate" if g.get("min_answers_ok") is not None else "")
        + f"; measured on the built engines over "
        f"{report['eval_prompts']} held-out prompts ({report['eval_positions']} positions) against the full-precision student."
        + (f" KL over the reference's top-{r['top_k']} tokens per position plus one bucket for the rest, which held "
           f"{r['tail_mass_mean']:.2%} of its mass on average (0: exact; else a lower bound)."
           if (r := report.get("gate_reference")) else "")
        + (f" Greedy exact match ≥ {g['min_greedy_exact_match']:.0%}." if g.get("min_greedy_exact_match") is not None else "")
        + f" top1_last: agreement at each prompt's last position; greedy_exact: share of {g.get('greedy_prompts', 0)} prompts whose "
        f"greedy {g.get('greedy_tokens', 32)}-token continuation equals the reference's; engine_precision 'fp32 (dequantized)': "
        "the backend has no exact kernel for that scheme, so the engine runs the checkpoint's dequantized weights."
        + f" decode_tok_s and ttft_ms: one 64-token generation with the decoding the server applies by default "
        f"({_settings(report['variants'])}); decode_tok_s_greedy: the same generation decoded greedily."
    )


def quality_phrase(s: dict) -> str:
    """The student's quality as a share of the teacher's (perplexity ratio), with the reason when it exceeds 100 %:
    a held-out perplexity below the teacher's means the student learned the held-out text's style (edgeflow's domains,
    the chat template), which the teacher never trained on, not that it is a better model."""
    pct = s.get("student_quality_pct")
    if pct is None:
        return "quality not recorded"
    phrase = f"quality {pct:.0f}% of the teacher (teacher perplexity / student perplexity)"
    if pct > 100:
        phrase += (": above 100 % because the student trained on text like the held-out set (these domains, this chat "
                   "template) and the teacher did not, not because it is the better model; top-1 agreement and KL say how "
                   "close it is to the teacher")
    return phrase


def student_gate_section(v: dict) -> str:
    """The student gate's verdict: each measure, its limit, and what failed."""
    from edgeflow.evaluation.student_gate import MEASURES

    rows = ["| measure | value | limit |", "|---|---:|---:|"]
    for measure, (field, kind, label, fmt) in MEASURES.items():
        value, limit = v["measures"].get(measure), v["limits"].get(field)
        if measure == "answers_ok" and not v.get("answers_checked"):
            value = None
        rows.append(f"| {label} | {_fmt(value, fmt)} | {'-' if limit is None else ('≥ ' if kind == 'min' else '≤ ') + format(limit, fmt)} |")
    verdict = "**passed**" if v["passed"] else "**failed**: " + "; ".join(v["failures"])
    return "\n".join(["## Student gate", "", f"The distilled student itself, before any variant of it may ship (gate.student): {verdict}.",
                      "", *rows])


def _fractions(r: dict | None) -> str:
    if not r or "not_estimated" in r:
        return "-"
    return f"{_fmt(r['decode_fraction'], '.0%')}, {_fmt(r['prefill_fraction'], '.0%')}"


def slo_section(report: dict) -> str:
    """Each quantized variant against each service objective: measured on the built engine, or why not (slo.targets)."""
    rows = [r for r in report["variants"] if r.get("slo")]
    if not rows:
        return ""
    out = ["## Service objectives", "",
           "Each quantized variant's engine measured on the host that built it against slo.targets "
           "(edgeflow/evaluation/service.py): TTFT p99 of prompts of the stated length arriving `concurrency` at a time, "
           "decode per stream (p50) at that concurrency and alone, and the engine's peak memory. A variant that misses an "
           "objective is not registered. Of the roofline: the measured decode and TTFT as fractions of what the host's "
           "bandwidth and peak allow for the bytes and FLOPs of that workload (edgeflow/estimate/).", "",
           "| variant | device | objectives | TTFT p99 ms | decode tok/s (alone) | peak MB | of the roofline: decode, prefill | verdict |",
           "|---|---|---|---:|---:|---:|---:|---|"]
    for r in rows:
        for t in r["slo"]:
            o, m = t.get("objectives") or {}, t.get("measured") or {}
            wanted = ", ".join(w for w in (
                f"TTFT p99 ≤ {o['ttft_p99_ms']:g} ms" if o.get("ttft_p99_ms") else "",
                f"decode ≥ {o['decode_tok_s']:g} tok/s" if o.get("decode_tok_s") else "",
                f"memory ≤ {o['max_memory_mb']:g} MB" if o.get("max_memory_mb") else "") if w)
            if o:
                wanted += f" at {o['prompt_tokens']} prompt tokens, concurrency {o['concurrency']}"
            verdict = ("not measured: " + t["not_measured"] if "not_measured" in t
                       else "**missed**: " + "; ".join(t["misses"]) if t["misses"] else "met")
            out.append(f"| {r['name']} | {t['device']} | {wanted or '-'} | {_fmt(m.get('ttft_p99_ms'), ',.0f')} | "
                       f"{_fmt(m.get('decode_tok_s'), ',.1f')} ({_fmt(m.get('decode_tok_s_solo'), ',.1f')}) | "
                       f"{_fmt(m.get('peak_memory_mb'), ',.0f')} | {_fractions(t.get('roofline'))} | {verdict} |")
    return "\n".join(out)


def markdown(report: dict) -> str:
    """The whole report as markdown."""
    s = report["student"]
    out = [
        f"# Release {report['release_id']}",
        "",
        f"Profile `{report['profile']}` · staging: **{report['staging'] or 'none'}**"
        + (f" (version {report['staging_version']})" if report.get("staging_version") else ""),
        "",
    ]
    if report["variants"]:
        out += [table(report["variants"]), "", gate_paragraph(report), ""]
    else:
        out += ["No variant was quantized: " + ("the student gate refused the student first." if report.get("student_gate")
                and not report["student_gate"]["passed"] else "no variant could meet the service objectives (below)."), ""]
    if slo := slo_section(report):
        out += [slo, ""]
    refused = next((a.get("refused_before_build") for a in report.get("attempts", []) if a.get("refused_before_build")), None)
    if refused:
        out += ["## Not built", "", "No engine could serve these variants within slo.targets, even at the device's roofline "
                "(edgeflow/estimate/; slo.build_anyway builds them):", ""]
        out += [f"- {name}: {'; '.join(why)}" for name, why in refused.items()] + [""]
    if report.get("student_gate"):
        out += [student_gate_section(report["student_gate"]), ""]
    out += [
        "## Student vs teacher",
        "",
        f"{s['student_layers']}-layer student ({s['student_params'] / 1e6:.1f} M parameters, teacher/student size ratio "
        f"{s['size_ratio']:.1f}×), {s['steps']} distillation steps, {quality_phrase(s)}. Held out from training:",
        "",
        student_table(s),
        "",
        f"Held-out perplexity is {s['student_ppl'] / s['teacher_ppl']:.1f}× the teacher's."
        if s.get("student_ppl") and s.get("teacher_ppl") else "",
    ]
    staged = staged_row(report)
    for row in [r for r in (staged, *report["variants"][:1]) if r and r.get("answers")][:1]:
        out += ["", answers_section(row)]
    if report.get("plots"):
        p = report["plots"]
        out += ["", "## Plots", ""] + [f"![{name.replace('_', ' ')}]({path})" for name, path in p.items()]
    failed = [r for r in report["variants"] if not r["passed"]]
    if failed:
        out += ["", "## Why variants failed", ""] + [f"- {r['name']}: {'; '.join(r['reasons'])}" for r in failed]
    if len(report.get("attempts", [])) > 1:
        out += ["", "## Recalibration attempts", ""] + [
            f"- attempt {a['attempt']}: {a['calibration_samples']} calibration samples; passed: {', '.join(a['passed']) or 'none'}; best: {a['best']}"
            for a in report["attempts"]
        ]
    if report.get("why_no_staging"):
        out += ["", f"No staging: {report['why_no_staging']}"]
    if report.get("deploy"):
        d = report["deploy"]
        out += ["", "## Deployment", "", f"Server {d['url']} (version {d['version']}, {d['engine_binding']}).", "",
                f"Smoke answer: {report['smoke_answer']!r}"]
    if report.get("staging_version"):
        out += ["", lineage_section(report).rstrip("\n")]
    return "\n".join(out) + "\n"


def lineage_section(report: dict) -> str:
    """The staged version's lineage read back from MLflow (edgeflow/tracking/lineage.py), or why it could not be read."""
    from edgeflow.tracking.lineage import lineage
    from edgeflow.tracking.registry import client

    try:
        return lineage(client(), report["model"], report["staging_version"]).render_markdown()
    except Exception as e:  # noqa: BLE001 - a report is written even when lineage cannot be traced; it says why instead
        return f"## Lineage\n\nversion {report['staging_version']} could not be traced: {type(e).__name__}: {e}\n"
