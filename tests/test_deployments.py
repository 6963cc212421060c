"""prefect.yaml: every deployment imports its flow, passes Prefect's own parameter validation, and runs on a known pool."""
from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import json
import os
import re
from unittest import mock

import pytest
import yaml
from prefect import Flow
from prefect.cli.deploy._models import PrefectYamlModel, RawScheduleConfig
from prefect.client.schemas.schedules import CronSchedule, IntervalSchedule, RRuleSchedule
from prefect.exceptions import ParameterTypeError, SignatureMismatchError
from prefect.flows import load_flow_from_entrypoint
from prefect.server.schemas.schedules import CronSchedule as ServerCronSchedule
from prefect.utilities.callables import parameter_schema, parameters_to_args_kwargs
from prefect.utilities.schema_tools import ValidationError as SchemaValidationError
from prefect.utilities.schema_tools import validate
from prefect.utilities.templating import find_placeholders
from prefect.workers.process import ProcessWorker
from pydantic import ValidationError

from edgeflow.paths import REPO_ROOT
from edgeflow.preflight import load_profile

PREFECT_YAML = REPO_ROOT / "prefect.yaml"
K8S_TEMPLATES = REPO_ROOT / "infra" / "kubernetes"
CALLER_KEY = "x-caller-parameters"

# The pool each stage's hardware needs. Deployments not named here (added later) get every other check.
HARDWARE = {
    "distill": "a100", "quantize": "a100", "gate-reference": "a100",
    "build-engine": "orin", "deploy-edge": "orin", "rollback-edge": "orin",
    # the gate scores the built engines, so it runs where they were built
    "calibrate": "cpu", "consistency": "orin", "register": "cpu", "release": "cpu",
}


class DeploymentError(AssertionError):
    """A deployment in prefect.yaml that would fail at deploy or run time."""


def deployments() -> list[dict]:
    """The deployments as written in prefect.yaml (anchors resolved)."""
    return yaml.safe_load(PREFECT_YAML.read_text())["deployments"]


def known_pools() -> list[str]:
    """The pools scripts/services.py creates by default (EDGEFLOW_POOLS unset)."""
    spec = importlib.util.spec_from_file_location("edgeflow_services", REPO_ROOT / "scripts" / "services.py")
    services = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(services)
    with mock.patch.dict(os.environ):
        os.environ.pop("EDGEFLOW_POOLS", None)
        return services.settings()["pools"].split(",")


def load_flow(dep: dict) -> Flow:
    """Import the flow the way a worker does; an import error fails instead of falling back to a placeholder."""
    path, func = dep["entrypoint"].rsplit(":", 1)
    return load_flow_from_entrypoint(f"{REPO_ROOT / path}:{func}", use_placeholder_flow=False)


def _required(flow: Flow) -> set[str]:
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    return {n for n, p in inspect.signature(flow.fn).parameters.items() if p.default is inspect.Parameter.empty and p.kind not in variadic}


def check_parameters(dep: dict, flow: Flow, params: dict | None = None) -> None:
    """Deploy-time and run-time parameter validation, as Prefect's server and flow engine do it."""
    name, entry = dep["name"], dep["entrypoint"]
    params = dict(dep.get("parameters") or {}) if params is None else params
    caller = list(dep.get(CALLER_KEY) or [])
    required = _required(flow)
    stale = [c for c in caller if c not in required or c in params]
    if stale:
        raise DeploymentError(
            f"deployment {name}: {CALLER_KEY} {stale} must name required parameters of {entry} that the deployment "
            f"does not set (required: {sorted(required)})"
        )
    missing = required - params.keys() - set(caller)
    if missing:
        raise DeploymentError(
            f"deployment {name}: {entry} requires {sorted(missing)}; set them under parameters, or list them under "
            f"{CALLER_KEY} if the calling flow passes them at run time"
        )
    try:
        # Unknown names: the signature check inside Flow.validate_parameters.
        parameters_to_args_kwargs(flow.fn, params)
        # Types: the schema `prefect deploy` stores; the server validates against it (required ones at run time).
        schema = parameter_schema(flow).model_dump(exclude_unset=True)
        validate(params, schema, raise_on_error=True, ignore_required=bool(caller))
        if not caller:
            # What the worker's flow engine runs before the flow body: pydantic validation against the signature.
            flow.validate_parameters(params)
    except (ParameterTypeError, SignatureMismatchError, SchemaValidationError) as exc:
        raise DeploymentError(f"deployment {name}: parameters {params} do not fit {entry}: {exc}") from exc


def check_profile(dep: dict, params: dict | None = None) -> None:
    """A `profile` parameter names a profile that loads (pydantic, extra='forbid')."""
    params = (dep.get("parameters") or {}) if params is None else params
    if "profile" not in params:
        return
    try:
        load_profile(params["profile"])
    except (ValidationError, FileNotFoundError, ValueError) as exc:
        raise DeploymentError(f"deployment {dep['name']}: profile {params['profile']} does not load: {exc}") from exc


def check_pool(dep: dict, pools: list[str]) -> None:
    """The pool is one services.py creates, and a known stage runs on its hardware's pool."""
    pool = (dep.get("work_pool") or {}).get("name")
    if pool not in pools:
        raise DeploymentError(f"deployment {dep['name']}: work pool {pool!r} is not one of the pools {pools}")
    expected = HARDWARE.get(dep["name"])
    if expected and pool != expected:
        raise DeploymentError(f"deployment {dep['name']}: runs on {pool!r}, its hardware's pool is {expected!r}")


def pool_templates(pool: str) -> dict[str, dict]:
    """Base job templates a pool of this name may have: the local process pool, and infra/kubernetes/<pool>.json."""
    templates = {"process": ProcessWorker.get_default_base_job_template()}
    k8s = K8S_TEMPLATES / f"{pool}.json"
    if k8s.exists():
        templates["kubernetes"] = json.loads(k8s.read_text())
    return templates


def check_job_variables(dep: dict) -> None:
    """Job variables validate against every template of the pool, as the server does, and name declared variables."""
    pool = dep["work_pool"]["name"]
    job_vars = dep["work_pool"].get("job_variables") or {}
    templates = pool_templates(pool)
    declared = set().union(*(t["variables"]["properties"] for t in templates.values()))
    unknown = sorted(job_vars.keys() - declared)
    if unknown:
        raise DeploymentError(f"deployment {dep['name']}: job variables {unknown} are declared by no template of pool {pool!r} ({sorted(declared)})")
    for kind, template in templates.items():
        try:
            validate(job_vars, template["variables"], raise_on_error=True, ignore_required=True, allow_none_with_default=True)
        except SchemaValidationError as exc:
            raise DeploymentError(f"deployment {dep['name']}: job variables {job_vars} invalid for the {kind} {pool!r} pool: {exc}") from exc
        env = template["job_configuration"].get("env")
        # An env entry would silently override a value the template derives from one of its variables.
        derived = {k: v for k, v in env.items() if find_placeholders(json.dumps(v))} if isinstance(env, dict) else {}
        clash = sorted(derived.keys() & (job_vars.get("env") or {}).keys())
        if clash:
            raise DeploymentError(
                f"deployment {dep['name']}: env {clash} would override what the {kind} {pool!r} template derives "
                f"({ {k: derived[k] for k in clash} }); set the template variable instead"
            )


def check_schedules(dep: dict, flow: Flow) -> None:
    """Each schedule parses as `prefect deploy` reads it; a cron names its timezone and fires; its parameters validate."""
    for i, raw in enumerate(dep.get("schedules") or []):
        where = f"deployment {dep['name']}: schedules[{i}]"
        try:
            s = RawScheduleConfig.model_validate(raw)
            if s.cron is not None:
                if not s.timezone:
                    raise DeploymentError(f"{where}: cron {s.cron!r} needs an explicit timezone (IANA name); without one it runs in UTC")
                kwargs = {"cron": s.cron, "timezone": s.timezone} | ({"day_or": s.day_or} if s.day_or is not None else {})
                CronSchedule(**kwargs)
                # The scheduler's own date generation: a valid-looking cron such as Feb 30 never fires.
                upcoming = asyncio.run(ServerCronSchedule(**kwargs).get_dates(n=2))
                if len(upcoming) < 2:
                    raise DeploymentError(f"{where}: cron {s.cron!r} does not fire")
            elif s.interval is not None:
                IntervalSchedule(interval=s.interval, **({"timezone": s.timezone} if s.timezone else {}))
            else:
                RRuleSchedule(rrule=s.rrule, **({"timezone": s.timezone} if s.timezone else {}))
        except DeploymentError:
            raise
        except Exception as exc:  # pydantic errors and croniter's "failed to find next date"
            raise DeploymentError(f"{where}: {raw} is not a valid schedule: {exc}") from exc
        params = dict(dep.get("parameters") or {}) | dict(raw.get("parameters") or {})
        check_parameters(dep, flow, params)
        check_profile(dep, params)


def check_deployment(dep: dict, pools: list[str]) -> None:
    """Every check, in the order a failure is easiest to read."""
    for key in ("name", "entrypoint", "work_pool"):
        if not dep.get(key):
            raise DeploymentError(f"deployment {dep.get('name', '?')}: missing {key}")
    check_pool(dep, pools)
    flow = load_flow(dep)
    check_parameters(dep, flow)
    check_profile(dep)
    check_job_variables(dep)
    check_schedules(dep, flow)


# --- the real prefect.yaml, one case per deployment (new deployments are picked up automatically) ---

@pytest.fixture(scope="module")
def pools() -> list[str]:
    return known_pools()


def test_prefect_yaml_parses_as_prefect_deploy_reads_it():
    raw = yaml.safe_load(PREFECT_YAML.read_text())
    model = PrefectYamlModel.model_validate(raw)
    names = [d.name for d in model.deployments]
    assert names and len(names) == len(set(names)), f"deployment names must be unique: {names}"
    assert known_pools() == ["a100", "orin", "cpu"]


@pytest.mark.parametrize("dep", deployments(), ids=lambda d: d.get("name", "?"))
def test_deployment(dep, pools):
    check_deployment(dep, pools)


def test_every_stage_has_its_deployment_on_its_hardware():
    by_name = {d["name"]: d for d in deployments()}
    for name, pool in HARDWARE.items():
        assert name in by_name, f"no deployment {name!r} in prefect.yaml"
        assert by_name[name]["work_pool"]["name"] == pool


def test_every_flow_has_a_deployment():
    """One deployment per flow: each @flow defined in edgeflow/pipeline/*.py is some deployment's entrypoint."""
    entrypoints = {d["entrypoint"] for d in deployments()}
    for path in sorted((REPO_ROOT / "edgeflow" / "pipeline").glob("*.py")):
        if path.stem == "__init__":
            continue
        module = importlib.import_module(f"edgeflow.pipeline.{path.stem}")
        for attr, obj in vars(module).items():
            if isinstance(obj, Flow) and obj.fn.__module__ == module.__name__:
                assert f"edgeflow/pipeline/{path.name}:{attr}" in entrypoints, (
                    f"flow {obj.name!r} (edgeflow/pipeline/{path.name}:{attr}) has no deployment in prefect.yaml; add one on its hardware's pool"
                )


def test_every_placeable_stage_names_its_deployment():
    """edgeflow/pipeline/stages.py sends a pool-placed stage to DEPLOYMENTS[stage]: each one exists and runs that stage's flow."""
    from edgeflow.pipeline.stages import DEPLOYMENTS
    from edgeflow.profile import STAGES

    by_name = {d["name"]: d for d in deployments()}
    assert set(DEPLOYMENTS) == set(STAGES)
    for stage, target in DEPLOYMENTS.items():
        flow_name, dep_name = target.split("/")
        assert dep_name in by_name, f"placement of {stage} names deployment {target}, which prefect.yaml lacks"
        assert load_flow(by_name[dep_name]).name == flow_name, (stage, target)


def test_run_deployment_targets_exist():
    """Names that flows pass to run_deployment ("flow/deployment") resolve to a deployment of that flow."""
    by_name = {d["name"]: d for d in deployments()}
    pattern = re.compile(r"run_deployment\(\s*[\"']([^\"']+)[\"']")
    targets = [(p.name, t) for p in sorted((REPO_ROOT / "edgeflow" / "pipeline").glob("*.py")) for t in pattern.findall(p.read_text())]
    assert targets, "release dispatches deploy-edge by name; the pattern found no run_deployment call"
    for source, target in targets:
        flow_name, dep_name = target.split("/")
        assert dep_name in by_name, f"{source}: run_deployment({target!r}) names no deployment in prefect.yaml"
        assert load_flow(by_name[dep_name]).name == flow_name, f"{source}: deployment {dep_name} does not run flow {flow_name!r}"


# --- the checks fail where they should ---

def _dep(**overrides) -> dict:
    base = {"name": "probe", "entrypoint": "edgeflow/pipeline/release.py:release", "work_pool": {"name": "cpu"},
            "parameters": {"profile": "configs/demo-cpu.yaml", "deploy": "none"}}
    return base | overrides


def test_the_probe_deployment_itself_passes(pools):
    check_deployment(_dep(), pools)


def test_unknown_parameter_is_caught(pools):
    with pytest.raises(DeploymentError, match="profle"):
        check_deployment(_dep(parameters={"profle": "configs/demo-cpu.yaml"}), pools)


def test_unknown_parameter_is_caught_where_the_caller_supplies_the_rest(pools):
    dep = _dep(entrypoint="edgeflow/pipeline/calibrate.py:calibrate", parameters={"attempt": 1, "steps": 3}, **{CALLER_KEY: ["ctx", "student"]})
    with pytest.raises(DeploymentError, match="steps"):
        check_deployment(dep, pools)


@pytest.mark.parametrize("params, field", [
    ({"profile": "configs/demo-cpu.yaml", "deploy": "sideways"}, "deploy"),
    ({"profile": ["configs/demo-cpu.yaml"]}, "profile"),
])
def test_wrong_type_is_caught(pools, params, field):
    with pytest.raises(DeploymentError, match=field):
        check_deployment(_dep(parameters=params), pools)


def test_wrong_type_is_caught_where_the_caller_supplies_the_rest(pools):
    dep = _dep(entrypoint="edgeflow/pipeline/calibrate.py:calibrate", parameters={"attempt": "first"}, **{CALLER_KEY: ["ctx", "student"]})
    with pytest.raises(DeploymentError, match="attempt"):
        check_deployment(dep, pools)


def test_missing_required_parameter_is_caught(pools):
    with pytest.raises(DeploymentError, match=r"requires \['ctx'\].*x-caller-parameters"):
        check_deployment(_dep(entrypoint="edgeflow/pipeline/distill.py:distill", parameters={}), pools)


def test_caller_parameters_must_be_real_and_unset(pools):
    dep = _dep(entrypoint="edgeflow/pipeline/calibrate.py:calibrate", **{CALLER_KEY: ["ctx", "student", "attempt"]}, parameters={"attempt": 1})
    with pytest.raises(DeploymentError, match=r"\['attempt'\]"):
        check_deployment(dep, pools)


def test_profile_with_an_unknown_key_is_caught(pools, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text((REPO_ROOT / "configs" / "demo-cpu.yaml").read_text() + "\ncolour: blue\n")
    with pytest.raises(DeploymentError, match=r"(?s)colour.*Extra inputs are not permitted"):
        check_deployment(_dep(parameters={"profile": str(bad)}), pools)


def test_missing_profile_is_caught(pools):
    with pytest.raises(DeploymentError, match="not found"):
        check_deployment(_dep(parameters={"profile": "configs/nope.yaml"}), pools)


def test_unknown_pool_is_caught(pools):
    with pytest.raises(DeploymentError, match="'gpu' is not one of the pools"):
        check_deployment(_dep(work_pool={"name": "gpu"}), pools)


def test_stage_on_the_wrong_hardware_is_caught(pools):
    with pytest.raises(DeploymentError, match="hardware's pool is 'a100'"):
        check_deployment(_dep(name="distill", entrypoint="edgeflow/pipeline/distill.py:distill", work_pool={"name": "cpu"}, **{CALLER_KEY: ["ctx"]}), pools)


@pytest.mark.parametrize("job_variables, message", [
    ({"env": {"OMP_NUM_THREADS": 2}}, "not valid under any"),  # env values are strings
    ({"gpu_cnt": 2}, r"\['gpu_cnt'\] are declared by no template"),
    ({"gpu_count": "two"}, "invalid for the kubernetes 'a100' pool"),
    ({"env": {"EDGEFLOW_GPUS": "8"}}, r"EDGEFLOW_GPUS.*gpu_count"),
])
def test_bad_job_variables_are_caught(pools, job_variables, message):
    dep = _dep(name="probe-a100", entrypoint="edgeflow/pipeline/distill.py:distill", work_pool={"name": "a100", "job_variables": job_variables},
               parameters={}, **{CALLER_KEY: ["ctx"]})
    with pytest.raises(DeploymentError, match=message):
        check_deployment(dep, pools)


# --- schedules (e.g. a nightly recalibration): none in prefect.yaml yet, so the checks are proven here ---

NIGHTLY = {"cron": "0 2 * * *", "timezone": "Europe/Berlin"}


def test_a_cron_schedule_with_a_timezone_passes(pools):
    check_deployment(_dep(schedules=[NIGHTLY | {"parameters": {"deploy": "none"}}]), pools)


@pytest.mark.parametrize("schedule, message", [
    ({"cron": "0 2 * *", "timezone": "Europe/Berlin"}, "Invalid cron string"),
    ({"cron": "0 2 * * *", "timezone": "Europe/Atlantis"}, "Invalid timezone"),
    ({"cron": "0 2 * * *"}, "needs an explicit timezone"),
    ({"cron": "0 2 30 2 *", "timezone": "UTC"}, "not a valid schedule"),  # Feb 30: valid syntax, never fires
    ({"cron": "0 2 * * *", "timezon": "Europe/Berlin"}, "timezon"),
    (NIGHTLY | {"parameters": {"deploy": "sideways"}}, "deploy"),
    (NIGHTLY | {"parameters": {"profile": "configs/nope.yaml"}}, "not found"),
])
def test_bad_schedules_are_caught(pools, schedule, message):
    with pytest.raises(DeploymentError, match=message):
        check_deployment(_dep(schedules=[schedule]), pools)
