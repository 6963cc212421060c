"""On-device quality probe: a fixed slice of the gate's greedy prompts through the deployed server.

    python -m edgeflow.pipeline.rollout --probe --profile configs/demo-cpu.yaml --version 3   # on the device (probe-edge flow)

The consistency gate scored each engine where it was built; a device serves its own binding of that
engine (shipped, or built on the device) behind its own server. The probe asks the device's stable port,
through the OpenAI API every client uses, to continue the first `rollout.probe_prompts` greedy prompts
of the gate's FP reference (temperature 0, `gate.greedy_tokens` tokens), and measures the answers' agreement
with the FP reference: the share of each reference continuation's characters matched before the first
difference, averaged over prompts. The gate's figure for the same prompts is the same measure over the
continuations the gate's engine produced (stored in its report row). Agreement below that figure by more
than `rollout.probe_tolerance` is a breach: the device does not answer as the gate said it would.
"""
from __future__ import annotations


import httpx
from pydantic import BaseModel, ConfigDict, Field

from edgeflow.profile import Profile


class ProbeResult(BaseModel):
    model_config = ConfigDict(extra="forbid")
    device: str | None = Field(description="Device id (device.yaml), None on a host without one.")
    version: str = Field(description="Registered version probed.")
    served_version: str | None = Field(description="Version the stable port reported serving (/v1/models system_fingerprint).")
    prompts: int = Field(description="Greedy prompts sent.")
    agreement: float = Field(description="Served answers' agreement with the FP reference (0..1).")
    gate_agreement: float = Field(description="The gate engine's agreement with the FP reference on the same prompts (0..1).")
    same_as_gate: float = Field(description="Share of answers identical to the gate engine's continuation.")
    tolerance: float = Field(description="rollout.probe_tolerance applied.")
    passed: bool = Field(description="agreement >= gate_agreement - tolerance, and same_as_gate >= rollout.min_same_as_gate when set.")
    reason: str = Field(description="The verdict in one line, with the numbers.")


def common_prefix_share(text: str, reference: str) -> float:
    """Share of `reference`'s characters that `text` matches before the first difference (1.0 for an empty reference)."""
    if not reference:
        return 1.0
    n = 0
    for a, b in zip(text, reference):
        if a != b:
            break
        n += 1
    return n / len(reference)


def gate_row_for(profile: Profile, version: str) -> tuple[dict, dict]:
    """(the gate report that let `version` in, its row for the version's variant), read from MLflow."""
    from mlflow import MlflowClient

    from edgeflow.tracking.registry import GATE_REPORT_TAG, load_run_json, split_runs_uri
    from edgeflow.tracking.runs import tracking_uri

    c = MlflowClient(tracking_uri())
    mv = c.get_model_version(profile.registry.model_name, version)
    link, variant = mv.tags.get(GATE_REPORT_TAG), mv.tags.get("edgeflow.variant")
    if not link or not variant:
        raise ValueError(f"{profile.registry.model_name} version {version} has no {GATE_REPORT_TAG} / edgeflow.variant tag; "
                         "it was not registered by the register stage, so there is no gate figure to probe against")
    run_id, path = split_runs_uri(link)
    report = load_run_json(c, run_id, path)
    rows = {r["name"]: r for r in report["rows"]}
    if variant not in rows:
        raise ValueError(f"gate report {link} has no row for variant {variant!r} (rows: {sorted(rows)})")
    return report, rows[variant]


def run_probe(profile: Profile, version: str, device: str | None = None) -> ProbeResult:
    """Probe the server behind this device's stable port, which must serve `version`."""
    from transformers import AutoTokenizer

    from edgeflow.tracking.artifacts import ArtifactRef
    from edgeflow.device.keys import client_headers
    from edgeflow.device.proxy import public_url
    from edgeflow.device.state import read_state
    from edgeflow.evaluation.reference import load_reference
    from edgeflow.tracking.store import materialize

    report, row = gate_row_for(profile, version)
    if not row.get("greedy_continuations") or not report.get("reference"):
        raise ValueError(f"the gate report of version {version} stores no greedy continuations (gate.greedy_prompts: 0, or a "
                         "report from before the probe existed); re-run the release, or raise gate.greedy_prompts")
    info = report["reference"]
    reference = load_reference(materialize(ArtifactRef(kind="reference", uri=info["uri"], sha256=info["sha256"])))
    current = read_state(profile).get("current") or {}
    if str(current.get("version")) != str(version):
        raise RuntimeError(f"this device serves version {current.get('version')}, not {version}; probe after its deploy-edge")
    tok = AutoTokenizer.from_pretrained(current["engine"])
    n = min(profile.rollout.probe_prompts, len(reference.prompts), len(row["greedy_continuations"]))
    url, headers = public_url(profile), client_headers(profile)
    served_version, agree, gate_agree, same = None, [], [], 0
    with httpx.Client(base_url=url, headers=headers, timeout=120) as http:
        models = http.get("/v1/models")
        models.raise_for_status()
        for i in range(n):
            r = http.post("/v1/completions", json={
                "model": profile.registry.model_name, "prompt": tok.decode(reference.prompts[i]),
                "max_tokens": profile.gate.greedy_tokens, "temperature": 0})
            if r.status_code != 200:
                raise RuntimeError(f"probe prompt {i}: {url}/v1/completions answered {r.status_code}: {r.text[:300]}")
            body = r.json()
            served_version = body.get("system_fingerprint") or served_version
            text = body["choices"][0]["text"]
            fp_text = tok.decode(reference.continuations[i])
            gate_text = tok.decode(row["greedy_continuations"][i])
            agree.append(common_prefix_share(text, fp_text))
            gate_agree.append(common_prefix_share(gate_text, fp_text))
            same += text == gate_text
    tol, min_same = profile.rollout.probe_tolerance, profile.rollout.min_same_as_gate
    a, g, share = sum(agree) / max(n, 1), sum(gate_agree) / max(n, 1), same / max(n, 1)
    within = n > 0 and a >= g - tol
    same_ok = min_same is None or share >= min_same
    passed = within and same_ok
    reason = (f"probe on {device or 'this device'}: agreement with the FP reference {a:.3f} over {n} gate prompts, "
              f"{'within' if within else 'BELOW'} the gate's {g:.3f} - tolerance {tol}; {same}/{n} answers identical to "
              f"the gate engine's" + ("" if min_same is None else f" ({'>=' if same_ok else 'BELOW'} rollout.min_same_as_gate={min_same})"))
    return ProbeResult(device=device, version=str(version), served_version=served_version, prompts=n, agreement=round(a, 4),
                       gate_agreement=round(g, 4), same_as_gate=round(share, 4), tolerance=tol, passed=passed,
                       reason=reason)

