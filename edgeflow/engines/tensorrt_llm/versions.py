"""TensorRT-LLM's API generations and versions: which generation a release offers (the TensorRT engine flow until
1.3.0rc21, the PyTorch LLM API after), versions in PEP 440 order, and the refusal of a version a generation lacks.
"""
from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict, Field


class ApiGeneration(BaseModel):
    """One generation of TensorRT-LLM's build/run API and the TensorRT-LLM versions that have it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(description="Name recorded in build profiles and engine.json, e.g. 'tensorrt-engine'.")
    what: str = Field(description="The flow: what is built from the checkpoint and what runs it.")
    since: str = Field(description="First TensorRT-LLM version this backend accepts for it (inclusive).")
    removed_in: str | None = Field(description="First TensorRT-LLM version without it (exclusive bound); None: still shipped.")
    last_release: str | None = Field(description="Last stable TensorRT-LLM release that has it (None: still shipped).")
    source: str = Field(description="Where the bounds were read.")

    def range(self) -> str:
        """The version range as a specifier, e.g. '>=0.12.0,<1.3.0rc21'."""
        return f">={self.since}" + (f",<{self.removed_in}" if self.removed_in else "")


TENSORRT_ENGINE = "tensorrt-engine"
PYTORCH_LLM_API = "pytorch-llm-api"

API_GENERATIONS: dict[str, ApiGeneration] = {
    TENSORRT_ENGINE: ApiGeneration(
        name=TENSORRT_ENGINE,
        what="convert_checkpoint.py -> TensorRT-LLM checkpoint -> trtllm-build -> TensorRT engine, run by "
             "ModelRunnerCpp (C++ executor); engines bound to the SM and the TensorRT(-LLM) versions that built them",
        # 0.12: the oldest branch a profile uses (v0.12.0-jetson); 0.12 removed trtllm-build's --max_output_len
        # (0.12.0 release notes, NVIDIA/TensorRT-LLM PR #2164), and build_command() bounds lengths with
        # --max_seq_len alone.
        since="0.12.0",
        # v1.3.0rc20 (2026-06-30) release notes: "This RC version will be the last one supporting the TensorRT
        # backend, in the next version the TensorRT backend will be removed!" Removal on main: examples
        # (PR #15763), docs + migration guide "tensorrt-backend-removal" (PR #15767), tensorrt_llm/commands/
        # build.py and the runtime's ModelRunnerCpp (PR #15918), C++ executor (PR #16369). PyPI metadata agrees:
        # 1.3.0rc15 requires tensorrt~=10.15.1, 1.3.0rc22 requires no tensorrt at all.
        removed_in="1.3.0rc21",
        # 1.2.1 (PyPI, 2026-04-20; requires tensorrt~=10.14.1) is the last stable release; Triton's
        # tensorrtllm_backend pinned release/1.2.1 and documents examples/models/core/llama/convert_checkpoint.py
        # + trtllm-build --kv_cache_type paged against it (commit 98bfe1d, docs/llama.md).
        last_release="1.2.1",
        source="NVIDIA/TensorRT-LLM release v1.3.0rc20; PRs #15763 #15767 #15918 #16369; PyPI tensorrt-llm metadata",
    ),
    PYTORCH_LLM_API: ApiGeneration(
        name=PYTORCH_LLM_API,
        what="LLM API / trtllm-serve on the PyTorch backend: Hugging Face or ModelOpt checkpoints loaded "
             "directly, no convert or engine-build step; cannot load TensorRT engines",
        since="1.3.0rc21",  # the sole backend from the removal on (migration guide "tensorrt-backend-removal")
        removed_in=None,
        last_release=None,
        source="docs/source/legacy/tensorrt-backend-removal.md (NVIDIA/TensorRT-LLM PR #15767)",
    ),
}

# The generation this backend builds and runs; an engine.json without `api` (built before the field existed)
# was built by it.
BACKEND_API = TENSORRT_ENGINE

_VERSION = re.compile(r"^(\d+)\.(\d+)\.(\d+)(?:\.?(a|b|rc)\.?(\d+))?")
_PHASE = {"a": 0, "b": 1, "rc": 2}


def version_order(version: str | None) -> tuple[tuple[int, int, int], tuple[int, int]] | None:
    """'1.3.0rc21' -> ((1, 3, 0), (2, 21)): release and pre-release in PEP 440 order; a final release sorts after
    its pre-releases ('1.3.0' -> ((1, 3, 0), (3, 0))). .post/.dev/+local suffixes are ignored, so a dev or post
    build counts as the release it is numbered after. None when the string has no major.minor.patch."""
    m = _VERSION.match(str(version or "").strip())
    if m is None:
        return None
    major, minor, patch, phase, n = m.groups()
    pre = (_PHASE[phase], int(n)) if phase else (3, 0)
    return (int(major), int(minor), int(patch)), pre


def api_generation_of(version: str | None) -> str | None:
    """The API generation an installed TensorRT-LLM version offers: 'tensorrt-engine' before 1.3.0rc21,
    'pytorch-llm-api' from it on, None for no version or an unparseable one."""
    order = version_order(version)
    if order is None:
        return None
    removed = version_order(API_GENERATIONS[TENSORRT_ENGINE].removed_in)
    return TENSORRT_ENGINE if order < removed else PYTORCH_LLM_API


def check_api_version(api: str, version: str, where: str = "tensorrt_llm_version") -> None:
    """ValueError unless TensorRT-LLM `version` has API generation `api` (naming the field, the version, the range
    and the fix)."""
    gen = API_GENERATIONS[api]
    order = version_order(version)
    if order is None:
        raise ValueError(f"{where}={version!r} is not a TensorRT-LLM version (major.minor.patch[rcN]); "
                         f"api {api!r} needs TensorRT-LLM {gen.range()}")
    if order[0] < version_order(gen.since)[0]:
        raise ValueError(
            f"{where}={version!r} is older than this backend's api {api!r} supports ({gen.range()}): its "
            f"trtllm-build flags differ (the command lines here follow 0.12, which removed --max_output_len). Fix: pin "
            f"TensorRT-LLM {gen.since} or later"
        )
    if gen.removed_in is not None and order >= version_order(gen.removed_in):
        raise ValueError(
            f"{where}={version!r} with api {api!r}: TensorRT-LLM removed the TensorRT engine flow "
            f"(convert_checkpoint.py, trtllm-build, ModelRunnerCpp) in {gen.removed_in}; api {api!r} exists in "
            f"TensorRT-LLM {gen.range()}. Fix: pin an earlier release ({gen.last_release} is the last stable one "
            f"with it) or serve the checkpoint with the vllm backend"
        )
