"""The profile's preflight: the checks that read this host's disk, run once per entry point, after the values.

    python -c "from edgeflow.preflight import load_profile; print(load_profile('configs/test-tiny.yaml').name)"

`load_profile(path)` reads a profile's YAML, validates its values (edgeflow/profile/: no I/O there) and runs
`preflight` on it: every file the profile names exists, the alerts' routes parse and reach a receiver, each eval
source holds its share of gate.num_prompts, the engine's build profile fits its backend (and the generation
defaults the sampler's ranges), and the model's family (from its config.json or GGUF header, where this host already
has it) is one the engine runs. A failure is a pydantic ValidationError titled `Profile`, worded as before the checks
moved here: field, value, limit and fix. A stage on another host validates the settings the release resolved
(edgeflow/tracking/runs.py ReleaseContext) and never runs these: it reads the files from the artifact store.
"""
from __future__ import annotations

from pathlib import Path
from typing import NoReturn

import yaml
from pydantic import ValidationError

from edgeflow.paths import REPO_ROOT
from edgeflow.profile import Profile


def _refuse(p: Profile, message: str, section: str | None = None) -> NoReturn:
    """A ValidationError as the profile's own validators raise one: titled Profile, at `section` (or the top), its
    input what the profile says there."""
    settings = p.settings()
    raise ValidationError.from_exception_data("Profile", [{
        "type": "value_error", "loc": (section,) if section else (), "input": settings.get(section) if section else settings,
        "ctx": {"error": ValueError(message)}}])


def check_engine(p: Profile) -> None:
    """engine.backend is a backend and engine.profile fits its `Profile` model (edgeflow/engines); the generation
    defaults are in the sampler's ranges (edgeflow/engines/sampling.py)."""
    from edgeflow.engines import BACKENDS, validate_profile
    from edgeflow.engines.sampling import SamplingParams

    if p.engine.backend not in BACKENDS:
        _refuse(p, f"engine.backend={p.engine.backend!r} is unknown; choose one of {sorted(BACKENDS)}", "engine")
    try:
        validate_profile(p.engine.backend, p.engine.profile)
    except ValueError as e:
        _refuse(p, f"engine.profile: {e}", "engine")
    g = p.distill.generation_defaults
    if g is not None:
        try:
            SamplingParams(**{k: int(v) if k == "top_k" else v for k, v in g.items() if k != "do_sample"})
        except ValueError as e:
            _refuse(p, f"distill.generation_defaults: {e}", "distill")


def check_slo(p: Profile) -> None:
    """Each slo target's runtime (its own, else engine.backend) is an engine backend that serves on the target's kind
    of device (edgeflow/estimate/runtimes.py target_runtime)."""
    from edgeflow.engines import BACKENDS
    from edgeflow.estimate.runtimes import target_runtime

    for i, t in enumerate(p.slo.targets):
        if t.runtime is not None and t.runtime not in BACKENDS:
            _refuse(p, f"slo.targets[{i}].runtime={t.runtime!r} is unknown; choose one of {sorted(BACKENDS)}", "slo")
        try:
            target_runtime(p.engine.backend, t, f"slo.targets[{i}]")
        except ValueError as e:
            _refuse(p, str(e), "slo")


def check_files(p: Profile) -> None:
    """Name every missing input file up front, not hours into a run."""
    missing = [f"{field}={path}" for field, path in p.input_files().items() if not p.resolve(path).exists()]
    if missing:
        _refuse(p, f"files named by the profile do not exist (paths are relative to {REPO_ROOT}): {missing}")


def check_alert_routes(p: Profile) -> None:
    """The alerts' routes parse and reach a receiver (edgeflow/ops/monitoring.py check_routes)."""
    from edgeflow.ops.alert_routes import check_routes

    try:
        check_routes(p.resolve(p.monitoring.alertmanager_config))
    except ValueError as e:
        _refuse(p, str(e))


def check_eval_prompts(p: Profile) -> None:
    """gate.num_prompts is spread evenly over gate.eval_sources (edgeflow/evaluation/gate.py:eval_texts): every source
    must hold its share, or the gate would silently ask fewer prompts than the profile says."""
    from edgeflow.calibration.mix import allocate
    from edgeflow.calibration.textdata import read_records

    have = {d: len(read_records(p.resolve(path))) for d, path in p.gate.eval_sources.items()}
    want = allocate({d: 1.0 for d in have}, p.gate.num_prompts)
    short = {d: (want[d], have[d]) for d in have if want[d] > have[d]}
    if short:
        most = max(n for n in range(sum(have.values()) + 1)
                   if all(c <= have[d] for d, c in allocate({d: 1.0 for d in have}, n).items()))
        listing = ", ".join(f"{d} needs {w} but {p.gate.eval_sources[d]} holds {h}" for d, (w, h) in sorted(short.items()))
        _refuse(
            p, f"gate.num_prompts={p.gate.num_prompts} is spread evenly over {len(have)} eval sources and {listing} "
            f"({sum(have.values())} held-out items in all); set gate.num_prompts to at most {most}, or add held-out "
            "items to the short sources (disjoint from the training and calibration text)"
        )


def check_family(p: Profile) -> None:
    """The model's family (edgeflow/model/architecture.py) must be one engine.backend runs: refused here, naming the
    family, the backend and the backends that run it, whenever the model's config.json (or its GGUF) is already on
    this host; the build checks it again on the real config.json."""
    from edgeflow.engines import check_model
    from edgeflow.model.architecture import require, require_family
    from edgeflow.model.source import teacher_config

    found = teacher_config(p)
    if found is None:
        return
    config, where = found
    try:
        if set(config) == {"model_type"}:  # from a GGUF header: the family is all that is known yet
            require_family(config["model_type"], p.engine.backend, where)
        else:
            require(config, p.engine.backend, where)
            check_model(p.engine.backend, config, p.engine.profile, where)
    except ValueError as e:
        _refuse(p, str(e))


def preflight(p: Profile) -> Profile:
    """Every check of the module doc on a profile whose values are valid; returns it."""
    check_engine(p)
    check_slo(p)
    check_files(p)
    check_alert_routes(p)
    check_eval_prompts(p)
    check_family(p)
    return p


def load_profile(path: str | Path) -> Profile:
    """Read a profile YAML, validate it and preflight it on this host; errors name the field."""
    f = Path(path)
    if not f.is_absolute() and not f.exists():
        f = REPO_ROOT / f
    if not f.exists():
        raise FileNotFoundError(f"profile {path} not found; profiles live in {REPO_ROOT / 'configs'}")
    return preflight(Profile.model_validate(yaml.safe_load(f.read_text())))
