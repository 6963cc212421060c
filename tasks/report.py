"""The release report: one row per variant, as JSON and as a markdown table."""
from __future__ import annotations

COLUMNS = ("name", "size_mb", "engine_precision", "decode_tok_s", "ttft_ms", "top1_agreement", "top1_last", "kl",
           "kl_p99", "ppl", "greedy_exact", "passed")


def table(rows: list[dict]) -> str:
    """Markdown table of the report columns (columns a row lacks show as '-')."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        lines.append("| " + " | ".join("-" if r.get(c) is None else str(r[c]) for c in COLUMNS) + " |")
    return "\n".join(lines)


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


def markdown(report: dict) -> str:
    """The whole report as markdown."""
    s = report["student"]
    g = report["gate"]
    out = [
        f"# Release {report['release_id']}",
        "",
        f"Profile `{report['profile']}` · staging: **{report['staging'] or 'none'}**"
        + (f" (version {report['staging_version']})" if report.get("staging_version") else ""),
        "",
        table(report["variants"]),
        "",
        f"Gate: top-1 agreement ≥ {g['min_top1_agreement']}, mean KL ≤ {g['max_mean_kl']}, perplexity increase ≤ "
        f"{g['max_ppl_increase']:.0%}, engine parity ≥ {g['min_engine_parity']}; measured on the built engines over "
        f"{report['eval_prompts']} held-out prompts ({report['eval_positions']} positions) against the full-precision student."
        + (f" KL over the reference's top-{r['top_k']} tokens per position plus one bucket for the rest, which held "
           f"{r['tail_mass_mean']:.2%} of its mass on average (0: exact; else a lower bound)."
           if (r := report.get("gate_reference")) else "")
        + (f" Greedy exact match ≥ {g['min_greedy_exact_match']:.0%}." if g.get("min_greedy_exact_match") is not None else "")
        + f" top1_last: agreement at each prompt's last position; greedy_exact: share of {g.get('greedy_prompts', 0)} prompts whose "
        f"greedy {g.get('greedy_tokens', 32)}-token continuation equals the reference's; engine_precision 'fp32 (dequantized)': "
        "the backend has no exact kernel for that scheme, so the engine runs the checkpoint's dequantized weights.",
        "",
        "## Student vs teacher",
        "",
        f"{s['student_layers']}-layer student ({s['student_params'] / 1e6:.1f} M parameters, teacher/student size ratio "
        f"{s['size_ratio']:.1f}×), {s['steps']} distillation steps, quality {s['student_quality_pct']:.0f}% of the teacher "
        "(teacher perplexity / student perplexity). Held out from training:",
        "",
        student_table(s),
        "",
        "A short demo distillation makes a weak student: read the answers with that in mind.",
    ]
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
    """The staged version's lineage read back from MLflow (tasks/lineage.py), or why it could not be read."""
    from tasks.config import load_profile
    from tasks.lineage import lineage
    from tasks.registry import client

    try:
        return lineage(client(), load_profile(report["profile"]).registry.model_name, report["staging_version"]).render_markdown()
    except Exception as e:  # noqa: BLE001 - a report is written even when lineage cannot be traced; it says why instead
        return f"## Lineage\n\nversion {report['staging_version']} could not be traced: {type(e).__name__}: {e}\n"
