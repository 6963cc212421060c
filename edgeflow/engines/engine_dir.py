"""Engine directories: the typed `engine.json` every backend writes and every reader checks.

    python -c "from edgeflow.engines.engine_dir import read_meta; print(read_meta('eng').label)"

An engine directory is what a backend's `build` writes: its engine files, the tokenizer/chat files
copied from the checkpoint, and `engine.json`, written last (its presence marks a complete engine).
`EngineMeta` types the part every backend shares; each backend adds its own keys (runtime versions,
build options, device fingerprint), kept as they are. Readers (the backends' `check_compatible` and
`load`, the edge server, the consistency gate's report) go through `read_meta`/`check_meta`, so "not an
engine directory" and "built by another backend" are worded once.
"""
from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path
from typing import Any

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, ValidationError

from edgeflow.engines import EngineIncompatibleError

ENGINE_JSON = "engine.json"


class Dequantized(BaseModel):
    """Why a quantized checkpoint was built from its exactly dequantized weights (same numbers, dense speed)."""

    model_config = ConfigDict(extra="forbid")

    reason: str = Field(description="The engine rule the checkpoint's scheme broke (names the config group and field).")
    checkpoint_quantization: dict[str, Any] = Field(description="The checkpoint's quantization_config, as it was.")


class EngineMeta(BaseModel):
    """engine.json: what every backend records about an engine it built (backend-specific keys ride along)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    backend: str = Field(description="edgeflow.engines.BACKENDS key of the backend that built the engine.")
    format: str | None = Field(default=None, description="Engine file format and its version, e.g. 'onnxruntime-genai', "
                               "'cpu_native weights v2', 'tensorrt engine' (None in engines built before it was recorded).")
    precision: str = Field(description="What the layers compute with: 'int4', 'fp32', 'float16', 'int4_gptq', … "
                           "(the report's engine column).")
    checkpoint_sha256: str = Field(description="Tree sha256 of the checkpoint the engine was built from.")
    dequantized: Dequantized | None = Field(default=None, description="Set when the checkpoint's quantized weights were "
                                            "built dense from their exact dequantized values.")
    files: list[str] = Field(validation_alias=AliasChoices("files", "model_files", "engine_files"),
                             description="Engine files relative to the directory (all must be present to load).")
    tokenizer_files: list[str] = Field(default_factory=list, description="Tokenizer/chat files copied from the checkpoint.")
    build_identity: str | None = Field(default=None, description="The backend's build_identity() on the build host "
                                       "(None in engines built before it was recorded).")

    @property
    def label(self) -> str:
        """The report's engine column, e.g. 'int4' or 'fp32 (dequantized)'."""
        return self.precision + (" (dequantized)" if self.dequantized else "")

    def extra(self, key: str, default: Any = None) -> Any:
        """A backend-specific key of engine.json."""
        return (self.model_extra or {}).get(key, default)


def read_meta(engine_dir: Path) -> EngineMeta:
    """engine.json of an engine directory; EngineIncompatibleError if there is none or it does not parse."""
    path = Path(engine_dir) / ENGINE_JSON
    if not path.exists():
        raise EngineIncompatibleError(f"{engine_dir}: no {ENGINE_JSON}; not an edgeflow engine directory (build it with engine.build)")
    try:
        return EngineMeta.model_validate(json.loads(path.read_text()))
    except (ValueError, ValidationError) as e:  # JSONDecodeError is a ValueError
        raise EngineIncompatibleError(f"{path} is not a valid edgeflow engine.json ({e}); rebuild the engine") from e


def check_meta(engine_dir: Path, backend: str) -> EngineMeta:
    """read_meta, then: built by `backend`, and every engine file it lists present (EngineIncompatibleError otherwise)."""
    meta = read_meta(engine_dir)
    if meta.backend != backend:
        raise EngineIncompatibleError(f"{engine_dir}: engine backend is {meta.backend!r} but this device runs backend {backend!r}")
    if not meta.files:
        raise EngineIncompatibleError(f"{engine_dir}/{ENGINE_JSON} lists no engine files; rebuild the engine")
    missing = missing_files(engine_dir, meta)
    if missing:
        raise EngineIncompatibleError(f"{engine_dir}: engine files missing: {missing} (copy the whole engine directory or rebuild)")
    return meta


def missing_files(engine_dir: Path, meta: EngineMeta) -> list[str]:
    """Engine files engine.json lists that are not on disk."""
    return [f for f in meta.files if not (Path(engine_dir) / f).exists()]


def clear_meta(out_dir: Path) -> None:
    """Remove engine.json before a (re)build writes anything: a failed rebuild must not look like a valid engine."""
    (Path(out_dir) / ENGINE_JSON).unlink(missing_ok=True)


def write_meta(out_dir: Path, meta: EngineMeta | dict[str, Any]) -> dict[str, Any]:
    """Validate and write engine.json (the last file a build writes); returns it as the JSON dict written."""
    typed = meta if isinstance(meta, EngineMeta) else EngineMeta.model_validate(meta)
    data = typed.model_dump(mode="json")  # JSON-ready: what read_meta gives back
    (Path(out_dir) / ENGINE_JSON).write_text(json.dumps(data, indent=2, sort_keys=True))
    return data


def copy_engine(src: Path, dst: Path) -> EngineMeta:
    """Copy a complete engine directory (checked first); engine.json is copied last, like a build writes it."""
    meta = read_meta(src)
    missing = missing_files(src, meta)
    if missing:
        raise EngineIncompatibleError(f"{src}: engine files missing: {missing}; not copying an incomplete engine")
    dst = Path(dst)
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(ENGINE_JSON), dirs_exist_ok=True)
    shutil.copy2(Path(src) / ENGINE_JSON, dst / ENGINE_JSON)
    return meta


def _token_id(engine_dir: Path, token: Any) -> int | None:
    """Id of a special token given as a string or an AddedToken dict, from tokenizer.json."""
    if isinstance(token, dict):
        token = token.get("content")
    path = Path(engine_dir) / "tokenizer.json"
    if not isinstance(token, str) or not path.exists():
        return None
    tok = json.loads(path.read_text())
    for added in tok.get("added_tokens", []):
        if added.get("content") == token:
            return int(added["id"])
    vocab = (tok.get("model") or {}).get("vocab") or {}
    return int(vocab[token]) if isinstance(vocab, dict) and token in vocab else None


def special_token_ids(engine_dir: Path) -> tuple[int | None, int | None]:
    """(end_id, pad_id) of the tokenizer files an engine directory carries: generation_config.json, else
    tokenizer_config.json + tokenizer.json; pad falls back to end. The TensorRT runtimes take them as numbers."""
    engine_dir = Path(engine_dir)
    gen, tok = {}, {}
    with contextlib.suppress(OSError, ValueError):
        gen = json.loads((engine_dir / "generation_config.json").read_text())
    with contextlib.suppress(OSError, ValueError):
        tok = json.loads((engine_dir / "tokenizer_config.json").read_text())
    end = gen.get("eos_token_id")
    if isinstance(end, list):
        end = end[0] if end else None
    if end is None:
        end = _token_id(engine_dir, tok.get("eos_token"))
    pad = gen.get("pad_token_id")
    if pad is None:
        pad = _token_id(engine_dir, tok.get("pad_token"))
    end = int(end) if end is not None else None
    return end, (int(pad) if pad is not None else end)


def stop_ids(model_dir: Path) -> list[int]:
    """Every token a generation from the model in `model_dir` (an engine or checkpoint directory) stops at: the
    tokenizer's eos, every eos generation_config.json lists (Gemma: <eos> and <end_of_turn>), and each family's
    end-of-turn and end-of-text tokens its vocabulary holds (edgeflow/model/architecture.py END_TOKENS). The server, the demo
    answers and the gate reference all stop where the model's own chat turn ends. Sorted; [] if none is found."""
    from edgeflow.model.architecture import END_TOKENS

    model_dir = Path(model_dir)
    ids: set[int] = set()
    with contextlib.suppress(OSError, ValueError):
        eos = json.loads((model_dir / "generation_config.json").read_text()).get("eos_token_id")
        ids.update(int(i) for i in ([eos] if isinstance(eos, int) else (eos or [])))
    with contextlib.suppress(OSError, ValueError):
        end = _token_id(model_dir, json.loads((model_dir / "tokenizer_config.json").read_text()).get("eos_token"))
        if end is not None:
            ids.add(end)
    for token in END_TOKENS:
        if (i := _token_id(model_dir, token)) is not None:
            ids.add(i)
    return sorted(ids)
