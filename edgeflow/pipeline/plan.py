"""edgeflow plan PROFILE: what a release of this profile would do, before it does anything.

    edgeflow plan configs/demo-cpu.yaml          (python -m edgeflow.pipeline.plan --profile configs/demo-cpu.yaml [--json])

For each stage, in the order a release runs them: where it would run (inline, or its pool, with the pool's online
workers; a pool-placed stage whose every call is cached is not started there, unless its keys hold what its own
host resolves: edgeflow/pipeline/stages.py KEYED_ON_THEIR_HOST), the cache key of each of its task calls and whether the result
store holds a result under it. Cached: the artifact a later stage fetches, with its size. Computed: why, as the
inputs that differ from what the stage's last run hashed (its MLflow run's cache_inputs.json), a profile file named
by its path. A stage downstream of a computed
one is computed after it: its key depends on an artifact that does not exist yet.

The keys are the release's own: each stage builds its task calls with one function (edgeflow/pipeline/*.py: train_call,
calibration_call, variant_calls, engine_calls, reference_call, gate_call, register_call) that the stage runs and the
plan only keys (edgeflow/pipeline/stages.py task_key: Prefect's binding of the call, then content_key). Nothing is computed,
published or started; the profile's files and a teacher already on this host are hashed, as a release hashes them.
Only the first calibration attempt is planned (a gate nobody passes adds attempts at run time).

Exit codes: 0 planned; 1 the Prefect or MLflow server does not answer, or the placement names a pool or deployment
the server lacks (a release would fail the same way before computing); 2 a profile that does not load.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from edgeflow.tracking.artifacts import ArtifactRef, sha256_tree
from edgeflow.preflight import load_profile
from edgeflow.profile import STAGES, Profile
from edgeflow.tracking.runs import ReleaseContext, cache_inputs


@dataclass
class CallPlan:
    """One cached task call of a stage."""

    run: str  # the stage's MLflow run name (tag edgeflow.stage)
    status: str  # cached | compute | after <stage> | unknown
    key: str | None = None
    why: list[str] = field(default_factory=list)
    output: dict | None = None  # the cached result's artifact: kind, uri, sha256, bytes
    reads: list[dict] = field(default_factory=list)  # computed calls: the stage outputs it would fetch (kind, sha256, bytes)


@dataclass
class StagePlan:
    stage: str
    where: str  # inline, or the pool
    workers: str  # what runs it: the release's host, or the pool's online workers
    calls: list[CallPlan] = field(default_factory=list)
    submitted: bool = True  # a run on its pool (False: inline, or every call cached and looked up by the release)

    @property
    def status(self) -> str:
        states = {c.status for c in self.calls}
        return states.pop() if len(states) == 1 else "partly cached" if "cached" in states else sorted(states)[0]


@dataclass
class Plan:
    profile: str
    model: str
    services: dict[str, str]  # server -> "ok" or why not
    problems: list[str] = field(default_factory=list)
    stages: list[StagePlan] = field(default_factory=list)
    advice: list[str] = field(default_factory=list)  # e.g. a layer cut that saves too little (never a failure)
    estimates: list[dict] = field(default_factory=list)  # per slo target: each variant estimated (edgeflow/estimate/)


# ------------------------------------------------------------------------------------------------------------------
# What the release would be handed
# ------------------------------------------------------------------------------------------------------------------


def planned_context(profile: Profile, profile_path: str) -> tuple[ReleaseContext, dict[str, Path]]:
    """The ReleaseContext a release of this profile would open, with each file the profile names hashed here instead of
    published (a key reads a reference's kind and sha256 only), and {sha256: local path} to read them."""
    from edgeflow.tracking.codeversion import code_identity

    inputs, local = {}, {}
    for path in dict.fromkeys(profile.input_files().values()):
        resolved = profile.resolve(path)
        sha = sha256_tree(resolved)
        inputs[path] = ArtifactRef(kind="input", uri=f"plan:{path}", sha256=sha, meta={"profile_path": path})
        local[sha] = resolved
    ctx = ReleaseContext(release_id="plan", profile=profile_path, mlflow_parent_run_id="(plan)", settings=profile.settings(),
                         inputs=inputs, code=code_identity())
    return ctx, local


# ------------------------------------------------------------------------------------------------------------------
# The servers: results, runs, pools
# ------------------------------------------------------------------------------------------------------------------


class Lookup:
    """The result store (Prefect's, as the release's tasks persist to it), the MLflow runs, and the artifacts' sizes."""

    def __init__(self, experiment: str, mlflow_ok: bool) -> None:
        from prefect.results import ResultStore, get_default_result_storage

        try:
            self.store, self.store_error = ResultStore(result_storage=get_default_result_storage()), None
        except Exception as e:  # noqa: BLE001 - e.g. a storage block the Prefect server cannot hand out
            self.store, self.store_error = None, f"{type(e).__name__}: {e}"
        self.client = None
        self.experiment_id = None
        self._sizes: list[tuple[dict, ArtifactRef]] = []
        if mlflow_ok:
            from mlflow import MlflowClient

            from edgeflow.tracking.runs import find_experiment_id
            from edgeflow.tracking.store import tracking_uri

            self.client = MlflowClient(tracking_uri())
            self.experiment_id = find_experiment_id(self.client, experiment)

    def result(self, key: str) -> Any | None:
        from edgeflow.pipeline.stages import MISSING, cached_result

        if self.store is None:
            return None
        out = cached_result(key, self.store)
        return None if out is MISSING else out

    def last_inputs(self, run_name: str) -> tuple[str, dict | None] | None:
        """(run id, cache_inputs.json) of the stage's latest finished run in the profile's experiment, None if none."""
        if self.client is None or self.experiment_id is None:
            return None
        runs = self.client.search_runs([self.experiment_id], f"tags.`edgeflow.stage` = '{run_name}' and attributes.status = 'FINISHED'",
                                       order_by=["attributes.start_time DESC"], max_results=1)
        if not runs:
            return None
        run_id = runs[0].info.run_id
        try:
            import mlflow.artifacts

            text = mlflow.artifacts.load_text(f"runs:/{run_id}/cache_inputs.json")
        except Exception:  # noqa: BLE001 - a run by an edgeflow that did not record its inputs
            return run_id, None
        return run_id, json.loads(text)

    def recorded_teacher(self, profile: Profile) -> ArtifactRef | None:
        """The teacher as the latest distill run of the same source recorded it (params teacher_uri, teacher_sha256):
        what a host that has converted it would hash, unless its converter changed since."""
        from edgeflow.model.source import teacher_uri

        if self.client is None or self.experiment_id is None:
            return None
        uri = teacher_uri(profile.teacher)
        runs = self.client.search_runs([self.experiment_id], f"params.teacher_uri = '{uri}' and attributes.status = 'FINISHED'",
                                       order_by=["attributes.start_time DESC"], max_results=1)
        if not runs:
            return None
        return ArtifactRef(kind="teacher", uri=uri, sha256=runs[0].data.params["teacher_sha256"],
                           meta={"recorded_by_run": runs[0].info.run_id})

    def size_into(self, out: dict, ref: ArtifactRef) -> dict:
        """`out` with "bytes": `ref`'s size, filled in by sizes()."""
        out["bytes"] = None
        self._sizes.append((out, ref))
        return out

    def sizes(self) -> None:
        """Every size size_into asked for, on eight threads: one plan asks for a dozen or more, each one to three
        `list_artifacts` calls, and one after another they were 0.8 s of a 6 s plan (BENCHMARKS.md#edgeflow-plan)."""
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=8, thread_name_prefix="plan-size") as pool:
            for (out, _), size in zip(self._sizes, pool.map(self.size, [ref for _, ref in self._sizes])):
                out["bytes"] = size
        self._sizes.clear()

    def size(self, ref: ArtifactRef) -> int | None:
        """Bytes of a stage output in the artifact store (a directory: every file under it)."""
        if self.client is None or not ref.mlflow_run_id or "/artifacts/" not in ref.uri:
            return None
        path = ref.uri.split("/artifacts/", 1)[1]
        try:
            parent = path.rsplit("/", 1)[0] if "/" in path else None
            for info in self.client.list_artifacts(ref.mlflow_run_id, parent):
                if info.path == path:
                    return info.file_size if not info.is_dir else self._tree(ref.mlflow_run_id, path)
        except Exception:  # noqa: BLE001 - a size is a courtesy; the plan stands without it
            return None
        return None

    def _tree(self, run_id: str, path: str) -> int:
        return sum(i.file_size or 0 if not i.is_dir else self._tree(run_id, i.path) for i in self.client.list_artifacts(run_id, path))


def _services(profile: Profile) -> tuple[dict[str, str], list[str]]:
    """Each server the release talks to: "ok" or why not; and the placement's problems (a pool or deployment missing)."""
    from edgeflow.ops.processes import answers
    from edgeflow.tracking.store import tracking_uri

    status, problems = {}, []
    for server, variable, url in (("prefect", "PREFECT_API_URL", os.environ.get("PREFECT_API_URL", "")),
                                  ("mlflow", "MLFLOW_TRACKING_URI", tracking_uri())):
        ok = bool(url) and answers(f"{url.rstrip('/')}/health", timeout=5)
        status[server] = "ok" if ok else f"{variable}={url or '(unset)'} does not answer /health; start it with `edgeflow up`"
    if status["prefect"] == "ok" and profile.placement.pooled():
        from edgeflow.pipeline.stages import PlacementError, check_placement

        try:
            check_placement(profile.placement)
        except PlacementError as e:
            problems.append(str(e))
    return status, problems


def _workers(profile: Profile, prefect_ok: bool) -> dict[str, str]:
    """stage -> who would run it: the release's own host, or the pool and how many of its workers are online."""
    pools = profile.placement.pooled()
    out = {s: "the release's host" for s in STAGES if s not in pools}
    if not pools:
        return out
    if not prefect_ok:
        return out | {s: "unknown (Prefect does not answer)" for s in pools}
    from prefect.client.orchestration import get_client

    online: dict[str, int] = {}
    with get_client(sync_client=True) as client:
        for pool in set(pools.values()):
            try:
                online[pool] = sum(w.status.value == "ONLINE" for w in client.read_workers_for_work_pool(pool))
            except Exception:  # noqa: BLE001 - a pool the server lacks: the placement problem says so
                online[pool] = 0
    return out | {s: (f"{online[p]} worker{'s' if online[p] != 1 else ''} online" if online[p]
                      else f"NO worker online on pool {p}: the stage would wait") for s, p in pools.items()}


# ------------------------------------------------------------------------------------------------------------------
# Why a call is computed
# ------------------------------------------------------------------------------------------------------------------


def _leaves(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        if set(value) == {"kind", "sha256"}:  # a reference: one leaf, its content
            return {prefix: value}
        out: dict[str, Any] = {}
        for k, v in value.items():
            out |= _leaves(v, f"{prefix}.{k}" if prefix else str(k))
        return out
    if isinstance(value, list):
        out = {}
        for i, v in enumerate(value):
            out |= _leaves(v, f"{prefix}[{i}]")
        return out
    return {prefix: value}


def differences(before: dict, now: dict, files: dict[str, str]) -> list[str]:
    """What changed between two cache_inputs: one line per changed input, a profile file named by its path."""
    a, b = _leaves(json.loads(json.dumps(before, default=str))), _leaves(json.loads(json.dumps(now, default=str)))
    lines = []
    for path in sorted(set(a) | set(b)):
        old, new = a.get(path), b.get(path)
        if old == new:
            continue
        if isinstance(new, dict) and "sha256" in new:
            name = files.get(new["sha256"])
            what = f"{name} (the profile's file)" if name else f"its {new['kind']}"
            was = f"sha256 {old['sha256'][:12]}" if isinstance(old, dict) else "absent"
            lines.append(f"{path}: {what} changed ({was} → {new['sha256'][:12]})")
        else:
            lines.append(f"{path}: {_short(old)} → {_short(new)}")
    return lines


def _short(value: Any) -> str:
    text = json.dumps(value, default=str) if value is not None else "absent"
    return text if len(text) <= 60 else text[:57] + "…"


# ------------------------------------------------------------------------------------------------------------------
# The plan
# ------------------------------------------------------------------------------------------------------------------


def make_plan(profile_path: str) -> Plan:
    """The plan of a release of `profile_path` (see the module doc)."""
    from edgeflow.pipeline.build_engine import engine_calls
    from edgeflow.pipeline.calibrate import calibration_call
    from edgeflow.pipeline.consistency import gate_call
    from edgeflow.pipeline.distill import train_call
    from edgeflow.pipeline.gate_reference import reference_call
    from edgeflow.pipeline.quantize import variant_calls
    from edgeflow.pipeline.register import lineage_of, register_call
    from edgeflow.pipeline.stages import KEYED_ON_THEIR_HOST
    from edgeflow.model.source import resolved_teacher

    profile = load_profile(profile_path)
    services, problems = _services(profile)
    plan = Plan(profile=profile_path, model=profile.registry.model_name, services=services, problems=problems)
    ctx, local = planned_context(profile, profile_path)
    files = {ref.sha256: path for path, ref in ctx.inputs.items()}
    look = Lookup(profile.registry.experiment, services["mlflow"] == "ok")
    if look.store_error:
        plan.problems.append(f"the result store does not open ({look.store_error}): every stage shows as computed")
    workers = _workers(profile, services["prefect"] == "ok")

    def stage(name: str) -> StagePlan:
        s = StagePlan(name, profile.placement.where(name), workers[name])
        plan.stages.append(s)
        return s

    def resolve(s: StagePlan, calls) -> list[Any]:
        """Key each call and read its result: one result per call, None where it would be computed."""
        results = []
        for call in calls:
            key = call.key()
            cp = CallPlan(call.run_name, "compute", key)
            out = look.result(key)
            if out is not None:
                cp.status = "cached"
                ref = out if isinstance(out, ArtifactRef) else None
                cp.output = (look.size_into({"kind": ref.kind, "uri": ref.uri, "sha256": ref.sha256}, ref) if ref
                             else {"result": out})
            else:  # what it would fetch: the stage outputs among its arguments
                cp.why = _why(look, call, files)
                cp.reads = [look.size_into({"kind": r.kind, "sha256": r.sha256}, r) for r in _refs(call.args) if r.mlflow_run_id]
            s.calls.append(cp)
            results.append(out)
        return results

    def after(s: StagePlan, runs: list[str]) -> None:
        """Calls whose key waits on an artifact not computed yet: after the first stage that computes."""
        upstream = next(p.stage for p in plan.stages if any(c.status != "cached" for c in p.calls))
        s.calls += [CallPlan(r, f"after {upstream}", why=[f"its key depends on what {upstream} computes"]) for r in runs]

    def one(s: StagePlan, ready: bool, make) -> Any:
        """A stage of one call: keyed when its inputs are known, else computed after the stage that holds it up."""
        if not ready:
            after(s, [s.stage.replace("_", "-")])
            return None
        [out] = resolve(s, [make()])
        return out

    here = resolved_teacher(profile)
    if here is not None:
        plan.advice += student_advice(profile)
    teacher = here or look.recorded_teacher(profile)
    s = stage("distill")
    if teacher is None:
        s.calls.append(CallPlan("distill", "unknown", why=[
            "the teacher is not on this host yet (distill's host fetches and converts it on first use): run "
            "`edgeflow plan` on that host, or after one release there"]))
        student = None
    else:
        student = one(s, True, lambda: train_call(ctx, teacher))
        if "recorded_by_run" in teacher.meta:
            s.calls[0].why.insert(0, f"the teacher is not on this host: keyed with the sha256 distill run "
                                     f"{teacher.meta['recorded_by_run'][:12]} recorded for {teacher.uri}")
    calibration = one(stage("calibrate"), student is not None, lambda: calibration_call(ctx, student))
    s = stage("quantize")
    variants = [v.name for v in profile.quantize.variants]
    if student is None or calibration is None:
        after(s, [f"quantize-{v}" for v in variants])
        quantized = [None] * len(variants)
    else:
        quantized = resolve(s, variant_calls(ctx, student, calibration, open_input=lambda ref: local[ref.sha256]))
    checkpoints = [student, *quantized]
    s = stage("build_engine")  # one build per checkpoint: those whose checkpoint is known are keyed
    known = [c for c in checkpoints if c is not None]
    engines = dict(zip((c.sha256 for c in known), resolve(s, engine_calls(ctx, known)))) if known else {}
    if len(known) < len(checkpoints):
        after(s, [f"build-engine-{name}" for name, c in zip(["fp32", *variants], checkpoints) if c is None])
    complete = len(known) == len(checkpoints)
    reference = one(stage("gate_reference"), complete and calibration is not None,
                    lambda: reference_call(ctx, student, calibration, checkpoints))
    built = [engines.get(c.sha256) for c in known]
    gate_report = one(stage("consistency"), reference is not None and complete and all(e is not None for e in built),
                      lambda: gate_call(ctx, reference, checkpoints, built))
    one(stage("register"), gate_report is not None, lambda: register_call(ctx, gate_report, lineage_of(student, calibration)))
    look.sizes()
    slo_plan(plan, profile, here is not None)
    for s in plan.stages:  # as edgeflow/pipeline/stages.py run_stage decides: a cached stage the release can key is not started
        s.submitted = s.where != "inline" and (s.status != "cached" or s.stage in KEYED_ON_THEIR_HOST)
    return plan


def slo_plan(plan: Plan, profile: Profile, teacher_here: bool) -> None:
    """Each variant estimated on each slo target (edgeflow/estimate/variants.py), from the teacher's config.json when
    this host has the teacher (resolving it would download or convert: the distill host's work); a target no variant
    can meet even at the hardware's limit (the roofline: what the release refuses to build) is a problem (exit 1)
    unless slo.build_anyway."""
    if not profile.slo.targets:
        return
    from edgeflow.estimate.variants import slo_estimates

    if not teacher_here:
        plan.estimates.append({"not_estimated": "the teacher is not on this host yet (distill's host fetches it): run "
                               "`edgeflow plan` there, or `edgeflow estimate --model` on the teacher's config.json"})
        return
    try:
        teacher = teacher_architecture(profile)
    except (OSError, ValueError) as e:
        plan.estimates.append({"not_estimated": str(e)})
        return
    plan.estimates = slo_estimates(profile, teacher)
    for t in plan.estimates:
        rows = [r for r in t["variants"] if "estimate" in r and r["unservable"] is not None]
        rows = [r for r in rows if r["variant"] not in ("fp32", "fp16")]  # the yardstick: built whatever the objectives
        if rows and all(r["unservable"] for r in rows) and not profile.slo.build_anyway:
            target = t["target"]
            plan.problems.append(
                f"slo: no variant can meet the objectives on {target['device']}, whatever the engine ({rows[0]['variant']}: "
                f"{'; '.join(rows[0]['unservable'])}); change the objectives or the student (fewer layers, fewer bits), or "
                "set slo.build_anyway to build them anyway")


def _refs(value: Any) -> list[ArtifactRef]:
    if isinstance(value, ArtifactRef):
        return [value]
    if isinstance(value, dict):
        return [r for v in value.values() for r in _refs(v)]
    if isinstance(value, (list, tuple)):
        return [r for v in value for r in _refs(v)]
    return []


def _why(look: Lookup, call, files: dict[str, str]) -> list[str]:
    from prefect.utilities.callables import get_call_parameters

    now = cache_inputs(get_call_parameters(call.task.fn, call.args, {}))
    last = look.last_inputs(call.run_name)
    if last is None:
        return ["no earlier run of this stage in the profile's experiment" if look.client is not None
                else "MLflow does not answer: what changed is unknown"]
    run_id, before = last
    if before is None:
        return [f"its last run ({run_id[:12]}) recorded no inputs (an older edgeflow): what changed is unknown"]
    changed = differences(before, now, files)
    return ([f"since run {run_id[:12]}: {line}" for line in changed] if changed else
            [f"its inputs equal those of run {run_id[:12]}, but the result store holds no result under this key "
             "(another result storage, or one that was cleared)"])


# ------------------------------------------------------------------------------------------------------------------
# Output
# ------------------------------------------------------------------------------------------------------------------


def teacher_architecture(profile: Profile):
    """The teacher's description from its config.json on this host (call it where the teacher is: resolving it
    elsewhere downloads or converts); ValueError when there is none or its family is unknown."""
    from edgeflow.engines.checkpoint import read_config
    from edgeflow.model.architecture import describe
    from edgeflow.model.source import teacher_dir

    path = teacher_dir(profile)
    return describe(read_config(path), f"{path}/config.json")


def student_advice(profile: Profile) -> list[str]:
    """What the distill settings would make of the teacher on this host, when a layer cut saves too little to be worth
    it (edgeflow/model/architecture.py cut_advice); nothing for a family the model description does not know (the distill
    stage names that) or a student_from student."""
    from edgeflow.model.architecture import cut_advice

    try:
        arch = teacher_architecture(profile)
    except (OSError, ValueError):
        return []
    kept = profile.distill.student_layers(arch.num_hidden_layers)
    advice = cut_advice(arch, kept) if kept else None
    return [advice] if advice else []


def _bytes(n: int | None) -> str:
    if n is None:
        return "size unknown"
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return ""


def _render_estimates(estimates: list[dict]) -> list[str]:
    if not estimates:
        return []
    lines = ["\nservice objectives (estimated before any build: edgeflow/estimate/)"]
    for t in estimates:
        if "not_estimated" in t:
            lines.append(f"  not estimated: {t['not_estimated']}")
            continue
        g, lim, rt = t["target"], t["limits"], t["runtime"]
        wanted = ", ".join(w for w in (f"TTFT p99 <= {g['ttft_p99_ms']:g} ms" if g["ttft_p99_ms"] else "",
                                       f"decode >= {g['decode_tok_s']:g} tok/s" if g["decode_tok_s"] else "",
                                       f"memory <= {g['max_memory_mb']:g} MB" if g["max_memory_mb"] else "") if w)
        lines.append(f"  {g['device']}: {wanted} at {g['prompt_tokens']} prompt tokens, concurrency {g['concurrency']} "
                     f"({lim['bandwidth_gb_s']:g} GB/s, {lim['peak_tflops']:g} TFLOP/s; runtime {rt['name']}"
                     + ("" if rt["fitted"] else ", not fitted: the roofline") + f"; the student: {t['student']})")
        for r in t["variants"]:
            if "not_estimated" in r:
                lines.append(f"    {r['variant']:<28} not estimated: {r['not_estimated']}")
                continue
            e = r["estimate"]
            lines.append(f"    {r['variant']:<28} decode {e['decode_tok_s']:,.1f} tok/s, TTFT p99 {e['ttft_p99_ms']:,.0f} ms, "
                         f"memory {e['memory_mb']:,.0f} MB" + ("" if r["misses"] else ": can meet"))
            if r.get("unservable"):
                lines += [f"      not built (no engine could: the roofline): {m}" for m in r["unservable"]]
            else:
                lines += [f"      cannot meet (estimate): {m}" for m in r["misses"]]
    return lines


def render(plan: Plan) -> str:
    lines = [f"plan for {plan.profile} (registered model {plan.model})"]
    lines += [f"  {server}: {state}" for server, state in plan.services.items()]
    lines += [f"  placement: {p}" for p in plan.problems]
    lines += [f"  student: {a}" for a in plan.advice]
    for s in plan.stages:
        where = "inline" if s.where == "inline" else f"pool {s.where}"
        if s.where != "inline" and not s.submitted:
            where += " (cached: the release reuses it without a run there)"
        lines.append(f"\n{s.stage:<15} {s.status:<14} {where}, {s.workers}")
        for c in s.calls:
            lines.append(f"  {c.run:<28} {c.status:<14} {c.key or ''}")
            if c.output and "bytes" in c.output:
                lines.append(f"      cached: {c.output['kind']} {c.output['sha256'][:12]}, {_bytes(c.output['bytes'])}")
            elif c.output:
                lines.append(f"      cached: {_short(c.output['result'])}")
            lines += [f"      why: {w}" for w in c.why]
            if c.status != "cached":
                lines += [f"      fetches: {r['kind']} {r['sha256'][:12]}, {_bytes(r['bytes'])}" for r in c.reads]
    lines += _render_estimates(plan.estimates)
    counts = [c.status for s in plan.stages for c in s.calls]
    lines.append(f"\n{counts.count('cached')} of {len(counts)} task calls cached; "
                 f"{len(counts) - counts.count('cached')} would be computed")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=os.environ.pop("EDGEFLOW_PROG", "python -m edgeflow.pipeline.plan"),
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--profile", default="configs/demo-cpu.yaml", help="the profile a release would run")
    ap.add_argument("--json", action="store_true", help="print the plan as JSON")
    a = ap.parse_args(argv)
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # the stage runs' cache_inputs.json: no bars
    plan = make_plan(a.profile)
    print(json.dumps(asdict(plan), indent=1, default=str) if a.json else render(plan))
    bad = [v for v in plan.services.values() if v != "ok"] + plan.problems
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
