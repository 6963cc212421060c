"""Every backend in BACKENDS holds to one API: the names and signatures of `edgeflow.engines.Backend`.

A new backend that misses a function, renames a parameter or drops a default fails here, not with an
AttributeError at run time. Importing a backend needs no GPU runtime (tensorrt_llm is imported lazily).
"""
from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
from pydantic import BaseModel

from edgeflow.engines import API, BACKENDS, Backend, get_backend, validate_profile

REPO = Path(__file__).resolve().parents[2]


def _protocol_members() -> dict[str, object]:
    return {n: getattr(Backend, n) for n in dir(Backend) if not n.startswith("_")} | {"Profile": None}


def _params(fn) -> list[tuple[str, object, object]]:
    params = list(inspect.signature(fn).parameters.values())
    if params and params[0].name == "self":
        params = params[1:]
    return [(p.name, p.kind, p.default) for p in params]


def test_api_tuple_is_the_protocol():
    assert set(API) == set(_protocol_members()), "edgeflow.engines.API and the Backend Protocol list different names"


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_backend_exports_every_protocol_member_with_its_signature(name):
    module = get_backend(name)
    for member, spec in _protocol_members().items():
        assert hasattr(module, member), f"backend {name!r} does not export {member}"
        if member == "Profile":
            continue
        got, want = _params(getattr(module, member)), _params(spec)
        assert got == want, f"backend {name!r}: {member}{inspect.signature(getattr(module, member))} differs from the Protocol's"


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_backend_profile_is_a_strict_documented_model_with_valid_defaults(name):
    profile = get_backend(name).Profile
    assert issubclass(profile, BaseModel)
    assert profile.model_config.get("extra") == "forbid", f"{name}.Profile must forbid unknown keys"
    undocumented = [f for f, info in profile.model_fields.items() if not info.description]
    assert not undocumented, f"{name}.Profile fields without a description: {undocumented}"
    validate_profile(name, {})  # the defaults are a valid profile
    with pytest.raises(ValueError, match=rf"unknown {name} engine profile keys \['not_a_key'\]; known: "):
        validate_profile(name, {"not_a_key": 1})


@pytest.mark.parametrize("name", ["cpu", "cpu_native", "llama_cpp"])
def test_cpu_backends_report_no_device_of_their_own(name):
    module = get_backend(name)
    assert module.device_memory_used(object()) is None and module.device_utilization(object()) is None


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.append((node.module, [a.name for a in node.names]))
    return out


def test_no_backend_imports_another_backends_names():
    """Shared logic lives in edgeflow/engines/{checkpoint,engine_dir,cpu_host,hooks,sampling}.py, not in a backend."""
    backend_modules = set(BACKENDS.values())
    for name, dotted in BACKENDS.items():
        root = REPO / Path(*dotted.split("."))
        files = sorted(root.glob("*.py")) if root.is_dir() else [root.with_suffix(".py")]
        for f in files:
            for module, names in _imports(f):
                other = next((m for m in backend_modules if module == m or module.startswith(m + ".")), None)
                assert other in (None, dotted), f"{f.relative_to(REPO)} imports {names} from the backend {other}"


def _format_literals(tree: ast.AST) -> list[str]:
    """String constants that name a piece of the checkpoint format on their own: "weight_packed", ".weight_packed",
    "recipe.yaml" (whole constants or whole f-string pieces; words inside messages and docstrings do not count)."""
    wanted = {"weight_packed", ".weight_packed", "recipe.yaml", "/recipe.yaml"}
    return [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
            and n.value in wanted]


def test_packed_weights_and_the_recipe_are_read_only_through_checkpoint_py():
    """One owner of the checkpoint format: no backend indexes compressed-tensors' packed integers or opens the recipe
    itself; edgeflow/engines/checkpoint.py does (layer, quantized_layers, layer_scheme, holds_packed_weights,
    recipe_algorithm)."""
    offenders = []
    for dotted in BACKENDS.values():
        root = REPO / Path(*dotted.split("."))
        for f in sorted(root.glob("*.py")) if root.is_dir() else [root.with_suffix(".py")]:
            tree = ast.parse(f.read_text())
            found = _format_literals(tree) + [n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)
                                              and n.name in ("recipe_algorithm", "layer_scheme", "_layer_scheme")]
            if found:
                offenders.append(f"{f.relative_to(REPO)}: {found}")
    assert not offenders, offenders
    checkpoint = ast.parse((REPO / "edgeflow" / "engines" / "checkpoint.py").read_text())
    assert _format_literals(checkpoint)  # the owner does name them: the test looks for the right spelling
