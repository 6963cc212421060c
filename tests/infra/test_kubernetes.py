"""Kubernetes base job templates: shape, placeholders, and the Job the worker would submit, checked against Kubernetes' types."""
from __future__ import annotations

import asyncio
import copy
import importlib.util
import json
import re
import uuid

import pytest
import yaml
from kubernetes_asyncio.client import models as k8s
from prefect.client.schemas.objects import FlowRun
from prefect.server.schemas.actions import WorkPoolCreate
from prefect.utilities.schema_tools import is_valid_schema, validate
from prefect.utilities.templating import PlaceholderType, find_placeholders
from prefect_kubernetes.worker import KubernetesWorker, KubernetesWorkerJobConfiguration

from edgeflow.paths import REPO_ROOT

K8S_DIR = REPO_ROOT / "infra" / "kubernetes"
TEMPLATES = {p.stem: p for p in sorted(K8S_DIR.glob("*.json"))}
DEFAULT = KubernetesWorker.get_default_base_job_template()

# The generated client types every Quantity as str; the API server also accepts JSON numbers there.
QUANTITY_FIELDS = {("V1ResourceRequirements", "limits"), ("V1ResourceRequirements", "requests"), ("V1EmptyDirVolumeSource", "size_limit")}
# prefect-kubernetes' manifest check demands these Job fields inside the pod spec (its default template puts them
# there); PodSpec has no such fields, and the API server drops unknown fields with a warning. Tolerated, nothing else.
PREFECT_POD_SPEC_EXTRAS = {"parallelism", "completions"}
PRIMITIVES = {"str": (str,), "int": (int,), "bool": (bool,), "float": (int, float), "datetime": (str,), "date": (str,)}


def k8s_errors(data, type_name: str, path: str = "$", quantity: bool = False) -> list[str]:
    """Strictly check JSON data against a type of the generated Kubernetes client: unknown fields, types, required fields."""
    if data is None:
        return []  # JSON null is "unset"; a required field left unset is reported by its parent's constructor
    if type_name.startswith("list["):
        if not isinstance(data, list):
            return [f"{path}: expected a list, got {data!r}"]
        return [e for i, item in enumerate(data) for e in k8s_errors(item, type_name[5:-1], f"{path}[{i}]")]
    if type_name.startswith("dict("):
        if not isinstance(data, dict):
            return [f"{path}: expected a map, got {data!r}"]
        inner = type_name[type_name.index(",") + 1:-1].strip()
        return [e for k, v in data.items() for e in k8s_errors(v, inner, f"{path}.{k}", quantity)]
    if type_name == "object":
        return []
    if type_name in PRIMITIVES:
        allowed = (str, int, float) if quantity else PRIMITIVES[type_name]
        if not isinstance(data, allowed) or (isinstance(data, bool) and type_name != "bool"):
            return [f"{path}: expected {type_name}, got {data!r}"]
        return []
    cls = getattr(k8s, type_name)
    if not isinstance(data, dict):
        return [f"{path}: expected a {type_name} object, got {data!r}"]
    attr_of = {key: attr for attr, key in cls.attribute_map.items()}
    errors = []
    for key, value in data.items():
        if key not in attr_of:
            if not (cls is k8s.V1PodSpec and key in PREFECT_POD_SPEC_EXTRAS):
                errors.append(f"{path}.{key}: unknown field of {type_name}")
            continue
        attr = attr_of[key]
        errors += k8s_errors(value, cls.openapi_types[attr], f"{path}.{key}", (type_name, attr) in QUANTITY_FIELDS)
    try:
        # The generated constructors refuse a missing required field (client-side validation).
        cls(**{attr_of[k]: v for k, v in data.items() if k in attr_of})
    except (ValueError, TypeError) as exc:
        errors.append(f"{path}: {exc}")
    return errors


def assert_valid_job(manifest: dict) -> None:
    assert manifest.get("apiVersion") == "batch/v1" and manifest.get("kind") == "Job", manifest
    errors = k8s_errors(manifest, "V1Job")
    assert not errors, "invalid Kubernetes Job:\n" + "\n".join(errors)


class _NoApi:
    """Stands in for the Prefect client: rendering these templates must need no server (no block or variable references)."""

    def __getattr__(self, name):
        raise AssertionError(f"template rendering tried to use the Prefect API ({name})")


def render(template: dict, job_variables: dict) -> dict:
    """The Job manifest a Kubernetes worker would submit for one flow run: Prefect's templating, then the worker's own preparation."""
    validate(job_variables, template["variables"], raise_on_error=True, ignore_required=True, allow_none_with_default=True)
    cfg = asyncio.run(KubernetesWorkerJobConfiguration.from_template_and_values(copy.deepcopy(template), job_variables, client=_NoApi()))
    cfg.prepare_for_flow_run(FlowRun(id=uuid.uuid4(), name="sample-run", flow_id=uuid.uuid4()))
    return cfg.job_manifest


def container(manifest: dict) -> dict:
    return manifest["spec"]["template"]["spec"]["containers"][0]


def env_of(manifest: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container(manifest).get("env", [])}


def standard_placeholders(obj) -> set[str]:
    return {p.name for p in find_placeholders(json.dumps(obj)) if p.type is PlaceholderType.STANDARD}


SAMPLES = {
    "a100": {"image": "ghcr.io/acme/edgeflow:0.1.0-cuda12", "gpu_count": 4, "env": {"EXTRA": "1"}, "cpu_limit": "32"},
    "cpu": {"image": "ghcr.io/acme/edgeflow:0.1.0-cpu", "env": {"OMP_NUM_THREADS": "2"}},
}


def test_one_template_per_cluster_pool():
    # orin has none on purpose: Jetson devices run process workers under systemd (README.md here).
    assert set(TEMPLATES) == {"a100", "cpu"}
    assert set(SAMPLES) == set(TEMPLATES)


@pytest.mark.parametrize("pool", TEMPLATES)
def test_template_shape_and_prefects_own_checks(pool):
    t = json.loads(TEMPLATES[pool].read_text())
    assert set(t) == {"job_configuration", "variables"}
    is_valid_schema(t["variables"], preprocess=False)  # what the server checks on `work-pool create`
    WorkPoolCreate(name=pool, type="kubernetes", base_job_template=t)  # the server's own template check
    defaults = {k: v["default"] for k, v in t["variables"]["properties"].items() if v.get("default") is not None}
    validate(defaults, t["variables"], raise_on_error=True)  # the server refuses a pool whose defaults are invalid
    assert t["job_configuration"]["job_manifest"]["kind"] == "Job"


@pytest.mark.parametrize("pool", TEMPLATES)
def test_placeholders_are_declared_and_variables_used(pool):
    t = json.loads(TEMPLATES[pool].read_text())
    used = standard_placeholders(t["job_configuration"])
    declared = set(t["variables"]["properties"])
    assert used <= declared, f"undeclared placeholders: {sorted(used - declared)}"
    # A declared variable no placeholder uses has no effect (Prefect's docs on base job templates).
    assert declared <= used, f"variables without a placeholder: {sorted(declared - used)}"


@pytest.mark.parametrize("pool", TEMPLATES)
def test_template_keeps_prefect_kubernetes_defaults(pool):
    """Derived from prefect-kubernetes' default template: none of its variables or configuration keys dropped."""
    t = json.loads(TEMPLATES[pool].read_text())
    assert set(DEFAULT["job_configuration"]) <= set(t["job_configuration"])
    for name, schema in DEFAULT["variables"]["properties"].items():
        ours = t["variables"]["properties"][name]
        assert {k: v for k, v in ours.items() if k not in ("default", "description")} == \
               {k: v for k, v in schema.items() if k not in ("default", "description")}, name


@pytest.mark.parametrize("pool", TEMPLATES)
def test_rendered_job_is_a_valid_kubernetes_job(pool):
    t = json.loads(TEMPLATES[pool].read_text())
    for values in ({}, SAMPLES[pool]):
        manifest = render(t, values)
        assert_valid_job(manifest)
        env = env_of(manifest)
        assert env["PREFECT_RESULTS_PERSIST_BY_DEFAULT"] == "true"
        assert env["PREFECT_RESULTS_DEFAULT_STORAGE_BLOCK"] == "s3-bucket/edgeflow-results"
        assert env["EDGEFLOW_REPO"] == container(manifest)["workingDir"]
        assert {m["mountPath"] for m in container(manifest)["volumeMounts"]} >= {env["EDGEFLOW_REPO"] + "/.edgeflow"}
    assert container(render(t, SAMPLES[pool]))["image"] == SAMPLES[pool]["image"]


@pytest.mark.parametrize("gpus", [1, 4, 8])
def test_a100_job_requests_gpu_count_gpus_and_says_so_in_edgeflow_gpus(gpus):
    t = json.loads(TEMPLATES["a100"].read_text())
    manifest = render(t, SAMPLES["a100"] | {"gpu_count": gpus})
    assert_valid_job(manifest)
    assert container(manifest)["resources"]["limits"]["nvidia.com/gpu"] == gpus
    assert env_of(manifest)["EDGEFLOW_GPUS"] == str(gpus)
    assert env_of(manifest)["EXTRA"] == "1"  # the deployment's env is merged, not replacing the template's
    pod = manifest["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container(manifest)["volumeMounts"]


def test_a100_gpu_count_outside_its_bounds_is_refused():
    t = json.loads(TEMPLATES["a100"].read_text())
    for bad in (0, 9, "4"):
        with pytest.raises(Exception, match="gpu_count"):
            render(t, {"gpu_count": bad})


def test_cpu_job_requests_no_gpu():
    manifest = render(json.loads(TEMPLATES["cpu"].read_text()), SAMPLES["cpu"])
    assert_valid_job(manifest)
    resources = container(manifest)["resources"]
    assert not any("gpu" in k for part in resources.values() for k in part), resources
    pod = manifest["spec"]["template"]["spec"]
    assert "nodeSelector" not in pod and "tolerations" not in pod
    assert "EDGEFLOW_GPUS" not in env_of(manifest)
    assert resources["limits"]["cpu"] == env_of(manifest)["OMP_NUM_THREADS"] == "2"


def _prefect_yaml() -> dict:
    return yaml.safe_load((REPO_ROOT / "prefect.yaml").read_text())


@pytest.mark.parametrize("dep", [d for d in _prefect_yaml()["deployments"] if d["work_pool"]["name"] in TEMPLATES],
                         ids=lambda d: d["name"])
def test_each_deployment_renders_on_its_kubernetes_pool(dep):
    """prefect.yaml's job variables through the pool's template: a valid Job, GPUs and threads consistent, pull step satisfied."""
    t = json.loads(TEMPLATES[dep["work_pool"]["name"]].read_text())
    manifest = render(t, dep["work_pool"].get("job_variables") or {})
    assert_valid_job(manifest)
    env, limits = env_of(manifest), container(manifest)["resources"].get("limits", {})
    gpus = limits.get("nvidia.com/gpu")
    assert (gpus is None and "EDGEFLOW_GPUS" not in env) or env.get("EDGEFLOW_GPUS") == str(gpus), (limits, env.get("EDGEFLOW_GPUS"))
    if "OMP_NUM_THREADS" in env and "cpu" in limits:
        cpus = str(limits["cpu"])
        cpus = float(cpus[:-1]) / 1000 if cpus.endswith("m") else float(cpus)
        assert int(env["OMP_NUM_THREADS"]) <= max(cpus, 1), "more OpenMP threads than the CPU limit"
    # The deployments' pull step (edgeflow/pipeline/checkout.py) enters $EDGEFLOW_REPO at run time: the job must set it, to
    # the image's checkout (a checkout holds prefect.yaml, which enter_checkout looks for).
    assert _prefect_yaml()["pull"] == [{"edgeflow.pipeline.checkout.enter_checkout": {}}]
    assert env["EDGEFLOW_REPO"] == container(manifest)["workingDir"]
    placeholders = {p.name for p in find_placeholders(json.dumps(_prefect_yaml().get("pull"))) if p.type is PlaceholderType.ENV_VAR}
    assert not placeholders, f"{placeholders}: `prefect deploy` fills these on the deploying host, not on the worker"


def test_volume_claims_are_valid():
    docs = [d for d in yaml.safe_load_all((K8S_DIR / "volumes.yaml").read_text()) if d]
    assert {d["metadata"]["name"] for d in docs} == {"edgeflow-workdir", "edgeflow-models"}
    for d in docs:
        errors = k8s_errors(d, "V1PersistentVolumeClaim")
        assert not errors, errors
        assert d["spec"]["accessModes"] == ["ReadWriteMany"]
    a100 = json.loads(TEMPLATES["a100"].read_text())["variables"]["properties"]
    assert {a100["workdir_claim"]["default"], a100["models_claim"]["default"]} == {d["metadata"]["name"] for d in docs}


# --- the checks fail where they should ---

def test_an_undeclared_placeholder_is_caught():
    t = json.loads(TEMPLATES["a100"].read_text())
    t["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]["priorityClassName"] = "{{ priority_class }}"
    assert "priority_class" in standard_placeholders(t["job_configuration"]) - set(t["variables"]["properties"])
    with pytest.raises(ValueError, match="priority_class"):
        WorkPoolCreate(name="a100", type="kubernetes", base_job_template=t)


@pytest.mark.parametrize("mutate, message", [
    (lambda m: m["spec"]["template"]["spec"].update(nodeSelecter={"a": "b"}), "nodeSelecter: unknown field of V1PodSpec"),
    (lambda m: container(m)["env"].append({"name": "N", "value": 3}), r"env\[\d+\]\.value: expected str"),
    (lambda m: container(m).pop("name"), "Invalid value for `name`"),
    (lambda m: m["spec"]["template"]["spec"]["volumes"][0]["persistentVolumeClaim"].pop("claimName"), "claim_name"),
])
def test_the_job_check_catches_invalid_jobs(mutate, message):
    manifest = render(json.loads(TEMPLATES["a100"].read_text()), SAMPLES["a100"])
    mutate(manifest)
    with pytest.raises(AssertionError, match=message):
        assert_valid_job(manifest)


def _create_pools():
    spec = importlib.util.spec_from_file_location("edgeflow_create_pools", K8S_DIR / "create_pools.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_create_pools_dry_run(monkeypatch, capsys):
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    _create_pools().main(["--dry-run", "--set", "a100.gpu_count=2", "--set", "cpu.image=ghcr.io/acme/e:1"])
    out = capsys.readouterr().out
    assert "prefect work-pool create a100 --type kubernetes" in out and '"gpu_count": 2' in out
    assert "['a100'] still name the placeholder registry" in out


@pytest.mark.parametrize("args, env, message", [
    (["--set", "a100.gpu_count=0"], {}, "gpu_count"),
    (["--set", "a100.gpu_cnt=2"], {}, "no variable 'gpu_cnt'"),
    ([], {"CI": "true", "PREFECT_API_URL": "http://127.0.0.1:9/api"}, "refusing to create Kubernetes work pools in CI"),
    ([], {}, "set PREFECT_API_URL"),
    ([], {"PREFECT_API_URL": "http://127.0.0.1:9/api"}, "placeholder image"),
])
def test_create_pools_refuses(monkeypatch, args, env, message):
    """Every refusal comes before any call to a server (port 9 would not answer anyway)."""
    for key in ("CI", "PREFECT_API_URL"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(SystemExit, match=re.escape(message)):
        _create_pools().main(args)
