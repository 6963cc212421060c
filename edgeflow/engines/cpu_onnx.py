"""build(Path("ckpt"), Path("eng"), {}); s = load(Path("eng")); print(list(generate(s, [1, 9690], 8, [2])))

CPU engine backend: onnxruntime-genai models (int4 MatMulNBits, or fp32) built from edgeflow checkpoints.

What it does, per interface function (see `edgeflow/engines/__init__.py`):

* `build` turns a checkpoint into an onnxruntime-genai model directory with the model builder
  shipped inside onnxruntime-genai (`onnxruntime_genai.models.builder`).
  - Dense checkpoints (the FP reference row) build in fp32: CPUs have no fast fp16/bf16 GEMM
    path in ORT's CPU EP, and fp32 keeps the reference exact against HF (logits within ~1e-4).
  - llm-compressor checkpoints (compressed-tensors, format "pack-quantized", W4A16, group-wise)
    cannot be read by the builder directly (its compressed-tensors loader is a CUDA-only
    NVFP4/FP8 path), but the packed int4 tensors repack *bit-exactly* into the GPTQ layout the
    builder's GPTQ loader reads (`repack_compressed_tensors`), so the int4 ONNX model runs the
    very integers and scales llm-compressor chose: nothing is re-quantized.
  - Weight-only schemes int4 MatMulNBits cannot hold exactly (8-bit, per-channel, act-order g_idx,
    a mixed W8/W4 recipe) build, by default (`inexact_weights: dequantize`), as an fp32 engine from
    the exactly dequantized weights: the gate still measures the checkpoint's own numbers, and
    engine.json says so under "dequantized" (the report's engine column shows it). With
    `inexact_weights: error` they raise. Quantized activations, KV cache, sparsity or transforms
    always raise ValueError: dequantizing would change the model.
* `score` returns logits for every position. onnxruntime-genai's Generator exposes only the last
  step's logits through `get_logits()`, and the served decoder is built with `prune_lm_head` (the
  prefill computes the 49152-wide lm_head for the last position only, halving TTFT). So `build`
  also writes `score.onnx`, the same graph minus the two prune nodes, sharing model.onnx.data; on
  its first call `score` loads it as a second og.Model and returns `generator.get_output("logits")`
  after one prefill `append_tokens` of the whole sequence: the same kernels and weights as
  `generate` (logits within 3e-4 of HF for exact builds; verified in the tests).
* `generate` is greedy decoding with one `og.Generator` (own KV cache) per call; the `og.Model`
  (weights, ORT session) is shared, and concurrent calls from several Python threads are safe
  and give the same tokens as sequential ones (tested). onnxruntime-genai 0.18's Python binding
  keeps the GIL during `append_tokens`/`generate_next_token`, so two streams interleave step by
  step rather than run in parallel; each step already uses all intra-op threads, so on a small
  CPU the aggregate throughput of 2 streams is about that of 1 (see the benchmark).

Threads: ORT's intra_op_num_threads is set at `load` time to EDGEFLOW_ENGINE_THREADS, or to the
number of CPUs this process may use, through an `og.Config.overlay` of the genai config (the
engine dir is not modified; og's own default ran one thread on the 2-core box, 1.7x slower).
"""
from __future__ import annotations

import contextlib
import io
import json
import logging
import tempfile
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from edgeflow.model.architecture import require
from edgeflow.tracking.artifacts import sha256_tree
from edgeflow.engines import EngineIncompatibleError, engine_dir as edir, validate_profile
from edgeflow.engines.checkpoint import (
    InexactWeights,
    WeightScheme,
    copy_tokenizer_files,
    int4_group_scheme,
    load_dequantized,
    read_config,
    weight_schemes,
    write_gptq_int4,
)
from edgeflow.engines.cpu_host import THREADS_ENV, device_fingerprint, threads_from_env
from edgeflow.engines.hooks import device_memory_used, device_utilization  # noqa: F401  (backend API: CPU defaults)
from edgeflow.engines.sampling import PARAMETERS, Sampler, SamplingParams

BACKEND = "cpu"
FORMAT = "onnxruntime-genai"
# The weights are quantized in a way int4 MatMulNBits blocks cannot hold exactly (`inexact_weights` decides).
NotInt4Exact = InexactWeights

# Measured on the 10-layer student (RTN int4 asym g64), AMD EPYC 2 cores AVX2 without VNNI, 2 ORT
# threads: greedy token agreement vs the fake-quantized HF model (5 chat prompts x 32 tokens),
# teacher-forced top-1 agreement, decode tok/s (128 tokens; benchmarks/engine_cpu_results.md):
#   accuracy_level=1, lm_head=fp32   100% agreement (max |dlogit| 3e-4)  ~71-78 tok/s  <- default
#   accuracy_level=1, lm_head=int8    88% agreement (top-1 99.7%)        ~105 tok/s
#   accuracy_level=4, lm_head=fp32    24% agreement (top-1 83%)          ~97 tok/s
#   accuracy_level=4, lm_head=int8    24% agreement (top-1 82%)          ~177 tok/s
#   accuracy_level=4, lm_head=int4    18% agreement (top-1 66%)          ~182 tok/s
#   (dense fp32 engine ~61-63 tok/s, HF eager fp32 ~20 tok/s)
# accuracy_level 4 quantizes activations to int8 per 64-wide block (~1-2% relative error per
# MatMul, measured equal to ideal block quantization); on undistilled layer-dropped students and
# even on the 30-layer teacher (41% agreement, top-1 93%) that flips greedy tokens, so the default
# is the fastest setting that keeps parity >= 98%: exact fp32 activations and an fp32 lm_head.
class Profile(BaseModel):
    """`engine.profile` of the cpu backend (validated when the edgeflow profile loads)."""

    model_config = ConfigDict(extra="forbid")

    accuracy_level: Literal[1, 2, 3, 4] = Field(
        default=1, description="MatMulNBits compute precision of the int4 body: 1=fp32 (exact w.r.t. the W4A16 "
        "checkpoint), 4=int8 activations (block-wise; 2-3x faster decode, not parity-grade). 2/3 (fp16/bf16) have "
        "no AVX2 kernels and run as 1.")
    lm_head: Literal["fp32", "int8", "int4"] = Field(
        default="fp32", description="The tied lm_head, left dense by llm-compressor (ignore: [lm_head]): fp32 (exact; "
        "shares the fp32 table with the embedding Gather, -108 MB on disk), int8 or int4 (block-wise RTN by the "
        "builder, symmetric). At 135M parameters the 49152x576 lm_head is ~45% of the weights read per token.")
    lm_head_accuracy_level: Literal[1, 2, 3, 4] = Field(
        default=4, description="Accuracy level of a quantized lm_head. int8 MatMulNBits has no fp32-compute CPU kernel "
        "(accuracy_level 1 measured 294 ms vs 8.7 ms at level 4 per lm_head call), so it runs at 4.")
    lm_head_block_size: Literal[16, 32, 64, 128, 256] = Field(
        default=32, description="Block size for weights the builder quantizes itself (only a quantized lm_head).")
    prune_lm_head: bool = Field(
        default=True, description="Build the decoder with prune_lm_head: prefill computes the lm_head for the last "
        "position only (TTFT for a 43-token prompt 73 -> 35 ms, 200 tokens 280 -> 90 ms on a 3-layer student). "
        "`score` needs every position, so the build also writes score.onnx (same weights file, prune nodes removed).")
    dense_precision: Literal["fp32"] = Field(
        default="fp32", description="Precision of dense checkpoints (the FP reference row): fp32 only; the CPU EP has "
        "no fast fp16/bf16 GEMMs on AVX2 and fp32 matches HF eager within 1e-4.")
    inexact_weights: Literal["dequantize", "error"] = Field(
        default="dequantize", description="Quantized weights int4 MatMulNBits cannot hold exactly (8-bit, per-channel "
        "scales, act-order, several schemes): 'dequantize' builds an fp32 engine from the exactly dequantized weights "
        "(same numbers, dense size and speed; engine.json records it under 'dequantized'; ORT's CPU EP has no "
        "fp32-compute int8 kernel and its int8-activation kernel is not parity-grade); 'error' refuses them.")
    extra_options: dict[str, str | int | float | bool] = Field(
        default_factory=dict, description="Extra builder KEY=VALUE options, passed through last (override the above; "
        "recorded in engine.json).")


DEFAULT_PROFILE: dict[str, Any] = Profile().model_dump()

# MatMulNBits block sizes (power of two, >= 16) supported by ORT's CPU kernels.
_BLOCK_SIZES = (16, 32, 64, 128, 256)


# --------------------------------------------------------------------------------------------
# What this backend holds exactly
# --------------------------------------------------------------------------------------------


def detect_scheme(checkpoint_dir: Path) -> WeightScheme | None:
    """None for a dense checkpoint; its scheme if int4 MatMulNBits blocks hold it exactly.

    InexactWeights (NotInt4Exact) for weight-only schemes it cannot hold exactly; ValueError naming the
    field for anything no engine builds (edgeflow.engines.checkpoint.weight_schemes).
    """
    schemes = weight_schemes(read_config(checkpoint_dir), f"{checkpoint_dir}/config.json", engine="cpu")
    if schemes is None:
        return None
    return int4_group_scheme(schemes, f"{checkpoint_dir}/config.json", _BLOCK_SIZES, "MatMulNBits")


def _write_dequantized(checkpoint_dir: Path, out_dir: Path) -> None:
    """Save the checkpoint's exactly dequantized weights as a dense fp32 checkpoint the builder reads."""
    load_dequantized(checkpoint_dir).save_pretrained(out_dir)
    copy_tokenizer_files(checkpoint_dir, out_dir)


# --------------------------------------------------------------------------------------------
# Build
# --------------------------------------------------------------------------------------------


def _versions() -> dict[str, str]:
    import onnxruntime
    import onnxruntime_genai as og

    return {"onnxruntime_genai": og.__version__, "onnxruntime": onnxruntime.__version__}


def _builder_options(scheme: WeightScheme | None, prof: Profile, tied: bool) -> tuple[str, dict[str, str]]:
    """(precision, KEY=VALUE extra options) for the onnxruntime-genai model builder."""
    opts: dict[str, str] = {"hf_token": "false"}  # local directories only: never ask the Hub
    if scheme is None:
        precision = prof.dense_precision  # fp32 only (the Profile's Literal)
    else:
        precision = "int4"
        opts["accuracy_level"] = str(prof.accuracy_level)
        head = prof.lm_head
        if head == "fp32":
            # Keep the lm_head and the embedding exactly as in the checkpoint. For tied weights the
            # builder can share one fp32 table (Gather reads the lm_head weight transposed), but only
            # if neither node is quantized: shared_embeddings would otherwise add Gather to the
            # quantized op types and RTN-quantize the embedding to int4.
            if tied:
                opts["shared_embeddings"] = "true"
                opts["nodes_to_exclude"] = "/lm_head/MatMul,/model/embed_tokens/Gather"
            else:
                opts["shared_embeddings"] = "false"
                opts["nodes_to_exclude"] = "/lm_head/MatMul"
        elif head in ("int8", "int4"):
            # The embedding Gather must stay fp32 (GatherBlockQuantized is int4-only and would
            # re-quantize it), so the quantized head cannot share the table: shared_embeddings=false.
            opts["shared_embeddings"] = "false"
            opts["block_size"] = str(prof.lm_head_block_size)
            opts["is_symmetric"] = "true"
            if head == "int8":
                opts["matmul_mixed_precision"] = "last_matmul:int8"
    opts["prune_lm_head"] = "true" if prof.prune_lm_head else "false"
    for k, v in prof.extra_options.items():
        opts[str(k)] = str(v).lower() if isinstance(v, bool) else str(v)
    return precision, opts


SCORE_MODEL = "score.onnx"


def _write_score_graph(out_dir: Path) -> str:
    """Write score.onnx: model.onnx without the lm_head prune (logits for every position).

    The builder's prune is `Gather(hidden, -1) -> Unsqueeze -> lm_head`; the lm_head is rewired to
    the un-gathered hidden states. Only the graph is rewritten: initializers keep pointing at
    model.onnx.data (ORT resolves external data relative to the model file), so no weights are
    duplicated on disk. Returns the file name to use for scoring.
    """
    import onnx

    model = onnx.load(str(out_dir / "model.onnx"), load_external_data=False)
    nodes = list(model.graph.node)
    gather = next((n for n in nodes if n.name == "/lm_head/prune/Gather"), None)
    unsqueeze = next((n for n in nodes if n.name == "/lm_head/prune/Unsqueeze"), None)
    if gather is None or unsqueeze is None:
        return "model.onnx"  # not pruned: the decoder already returns every position
    pruned_out, hidden = unsqueeze.output[0], gather.input[0]
    consumers = [n for n in nodes if pruned_out in n.input]
    if len(consumers) != 1 or not consumers[0].name.startswith("/lm_head/"):
        raise RuntimeError(f"unexpected lm_head prune pattern in {out_dir / 'model.onnx'}: {[n.name for n in consumers]}")
    head = consumers[0]
    head.input[list(head.input).index(pruned_out)] = hidden
    model.graph.node.remove(gather)
    model.graph.node.remove(unsqueeze)
    logits = next(o for o in model.graph.output if o.name == "logits")
    dims = logits.type.tensor_type.shape.dim
    if len(dims) == 3:
        dims[1].Clear()
        dims[1].dim_param = "sequence_length"
    onnx.save(model, str(out_dir / SCORE_MODEL))
    return SCORE_MODEL


def _set_lm_head_accuracy_level(out_dir: Path, level: int) -> list[str]:
    """Set accuracy_level on the quantized lm_head MatMulNBits node(s) of the built model.

    The builder applies one accuracy level to every MatMulNBits; this edits only the small graph
    file (weights stay in model.onnx.data). Returns the node names changed.
    """
    import onnx

    path = out_dir / "model.onnx"
    model = onnx.load(str(path), load_external_data=False)
    changed = []
    for node in model.graph.node:
        if node.op_type == "MatMulNBits" and node.name.startswith("/lm_head/"):
            for attr in node.attribute:
                if attr.name == "accuracy_level" and attr.i != level:
                    attr.i = level
                    changed.append(node.name)
    if changed:
        onnx.save(model, str(path))
    return changed


def _run_builder(src: Path, out_dir: Path, precision: str, opts: dict[str, str], cache_dir: Path) -> str:
    """Call the onnxruntime-genai model builder in-process; returns its (Python-level) log."""
    from onnxruntime_genai.models import builder

    log = io.StringIO()
    kv = [f"{k}={v}" for k, v in opts.items()]
    quant_logger = logging.getLogger("onnxruntime.quantization")  # one INFO line per graph node
    old_level = quant_logger.level
    quant_logger.setLevel(logging.WARNING)
    try:
        with contextlib.redirect_stdout(log):
            extra = builder.parse_extra_options(None, str(src), str(out_dir), precision, "cpu", str(cache_dir), kv)
            builder.create_model(None, str(src), str(out_dir), precision, "cpu", str(cache_dir), **extra)
    finally:
        quant_logger.setLevel(old_level)
    return log.getvalue()


def build(checkpoint_dir: Path, out_dir: Path, profile: dict) -> dict:
    """Compile a dense or compressed-tensors int4 checkpoint into an onnxruntime-genai CPU engine dir."""
    checkpoint_dir, out_dir = Path(checkpoint_dir), Path(out_dir)
    prof = validate_profile(BACKEND, profile)
    require(read_config(checkpoint_dir), BACKEND, f"{checkpoint_dir}/config.json")  # a family its builder takes
    dequantized: str | None = None
    try:
        scheme = detect_scheme(checkpoint_dir)  # raises ValueError before any work for unsupported schemes
    except InexactWeights as e:
        if prof.inexact_weights == "error":
            raise
        scheme, dequantized = None, str(e)
    config = read_config(checkpoint_dir)
    precision, opts = _builder_options(scheme, prof, bool(config.get("tie_word_embeddings", False)))
    checkpoint_sha = sha256_tree(checkpoint_dir)

    with tempfile.TemporaryDirectory(prefix="edgeflow-cpu-build-") as tmp:
        tmp_path = Path(tmp)
        src = checkpoint_dir
        repack_stats = None
        if scheme is not None:  # repack first: tensor-level ValueErrors come before out_dir is touched
            src = tmp_path / "gptq"
            repack_stats = write_gptq_int4(checkpoint_dir, src, scheme)
        elif dequantized:
            src = tmp_path / "dequantized"
            _write_dequantized(checkpoint_dir, src)
        out_dir.mkdir(parents=True, exist_ok=True)
        edir.clear_meta(out_dir)
        log = _run_builder(src, out_dir, precision, opts, tmp_path / "cache")
    (out_dir / "builder.log").write_text(log)
    lm_head_nodes: list[str] = []
    if scheme is not None and prof.lm_head != "fp32":
        lm_head_nodes = _set_lm_head_accuracy_level(out_dir, prof.lm_head_accuracy_level)
    score_model = _write_score_graph(out_dir)
    copied = copy_tokenizer_files(checkpoint_dir, out_dir)

    return edir.write_meta(out_dir, edir.EngineMeta(
        backend=BACKEND,
        format=FORMAT,
        precision=precision,
        checkpoint_sha256=checkpoint_sha,
        # set when a quantized checkpoint was built as fp32 from its exactly dequantized weights
        dequantized=dequantized and {"reason": dequantized, "checkpoint_quantization": config["quantization_config"]},
        files=sorted(p.name for p in out_dir.iterdir() if p.suffix in (".onnx", ".data")) + ["genai_config.json"],
        tokenizer_files=copied,
        build_identity=build_identity(),
        **_versions(),
        execution_provider="cpu",
        builder_options=opts,
        profile=prof.model_dump(),
        quantization=scheme.summary() if scheme else None,
        repack=repack_stats,
        lm_head_accuracy_level_set_on=lm_head_nodes,
        score_model=score_model,
        sampling={"method": "exact: the full fp32 logits of each step (get_logits)", "parameters": list(PARAMETERS)},
        checkpoint=str(checkpoint_dir.resolve()),
        device=device_fingerprint(),
    ))


# --------------------------------------------------------------------------------------------
# Runtime
# --------------------------------------------------------------------------------------------


def _major_minor(v: str) -> tuple[str, ...]:
    return tuple(str(v).split(".")[:2])


def build_identity() -> str:
    """What decides whether an engine built earlier still loads here: the onnxruntime(-genai) versions."""
    v = _versions()
    return f"{BACKEND} onnxruntime-genai {v['onnxruntime_genai']}, onnxruntime {v['onnxruntime']}"


def check_compatible(engine_dir: Path) -> None:
    """Raise EngineIncompatibleError (naming both sides) if this machine cannot run the engine."""
    meta = edir.check_meta(engine_dir, BACKEND)
    have = _versions()
    built = meta.extra("onnxruntime_genai", "<missing>")
    if _major_minor(built) != _major_minor(have["onnxruntime_genai"]):
        raise EngineIncompatibleError(
            f"{engine_dir}: engine built with onnxruntime-genai {built}, this device has onnxruntime-genai "
            f"{have['onnxruntime_genai']} (major.minor must match; rebuild the engine)"
        )
    # No ISA/arch requirement: the ONNX files hold no machine code (MLAS picks AVX2/AVX-512/VNNI/
    # NEON kernels and prepacks MatMulNBits weights when the session is created), so an engine
    # built here runs on any CPU onnxruntime supports; device fingerprint is provenance only.


@dataclass
class CpuSession:
    """Opaque handle returned by `load`: the shared og.Model and facts about it."""

    model: Any
    engine_dir: Path
    meta: dict[str, Any]
    vocab_size: int
    context_length: int
    threads: int
    score_model_file: str = "model.onnx"
    _score_model: Any = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def score_model(self) -> Any:
        """The og.Model whose prefill returns logits for every position (loaded on first use)."""
        if self.score_model_file == "model.onnx":
            return self.model
        with self._lock:
            if self._score_model is None:
                self._score_model = _og_model(self.engine_dir, self.threads, self.score_model_file)
            return self._score_model


def _og_model(engine_dir: Path, threads: int, filename: str | None = None) -> Any:
    import onnxruntime_genai as og

    config = og.Config(str(engine_dir))
    decoder: dict[str, Any] = {"session_options": {"intra_op_num_threads": threads}}
    if filename is not None:
        decoder["filename"] = filename
    config.overlay(json.dumps({"model": {"decoder": decoder}}))
    return og.Model(config)


def load(engine_dir: Path) -> CpuSession:
    """Check compatibility, then load the ONNX model once (shared by every generate/score call)."""
    engine_dir = Path(engine_dir)
    check_compatible(engine_dir)
    meta = edir.read_meta(engine_dir).model_dump(mode="json")
    genai = json.loads((engine_dir / "genai_config.json").read_text())
    threads = threads_from_env()
    return CpuSession(
        model=_og_model(engine_dir, threads),
        engine_dir=engine_dir,
        meta=meta,
        vocab_size=int(genai["model"]["vocab_size"]),
        context_length=int(genai["model"]["context_length"]),
        threads=threads,
        score_model_file=meta.get("score_model", "model.onnx"),
    )


def _generator(session: CpuSession, max_length: int, model: Any = None) -> Any:
    import onnxruntime_genai as og

    if max_length > session.context_length:
        raise ValueError(f"{max_length} tokens exceed the engine's context length {session.context_length}")
    model = session.model if model is None else model
    params = og.GeneratorParams(model)
    # Greedy; max_length bounds the KV cache the generator allocates (past/present share one
    # buffer of max_length positions; the default would size it for the whole context).
    params.set_search_options(do_sample=False, max_length=max_length, batch_size=1)
    return og.Generator(model, params)


def generate(
    session: CpuSession, input_ids: list[int], max_new_tokens: int, stop_token_ids: Sequence[int],
    sampling: SamplingParams | None = None,
) -> Iterator[int]:
    """Decode with the KV cache; yields each new token id (never a stop id).

    Plain greedy (no `sampling`, or greedy params) runs onnxruntime-genai's own greedy search: besides
    `stop_token_ids`, genai itself ends the sequence after the model's eos_token_id (genai_config.json);
    that token is yielded unless it is also a stop id. Anything else reads the step's full fp32 logits
    (`get_logits`), draws with the shared Sampler and appends the token (exact: no candidate bound).
    """
    if not input_ids:
        raise ValueError("input_ids is empty")
    if max_new_tokens <= 0:
        return
    stops = set(int(t) for t in stop_token_ids)
    gen = _generator(session, len(input_ids) + max_new_tokens)
    gen.append_tokens(np.asarray([input_ids], dtype=np.int32))
    if sampling is None or sampling.plain_greedy:
        for _ in range(max_new_tokens):
            if gen.is_done():
                break
            gen.generate_next_token()
            token = int(gen.get_next_tokens()[0])
            if token in stops:
                break
            yield token
        return
    sampler = Sampler(sampling, input_ids)
    ids = np.arange(session.vocab_size)
    for i in range(max_new_tokens):
        logits = np.asarray(gen.get_logits(), dtype=np.float32).reshape(-1)[: session.vocab_size]
        token = sampler.choose(ids, logits)
        if token in stops:
            break
        yield token
        if i + 1 < max_new_tokens:
            gen.append_tokens(np.asarray([[int(token)]], dtype=np.int32))


def sampling_support() -> frozenset[str]:
    """Every sampling parameter: the draw reads the full fp32 logits of each step."""
    return frozenset(PARAMETERS)


def score(session: CpuSession, input_ids: list[int]) -> np.ndarray:
    """Teacher-forced logits for every position: float32 [len(input_ids), vocab].

    One prefill step through og's Generator on score.onnx (the decoder graph without the lm_head
    prune; same weights file, loaded on first call): `get_output("logits")` then holds the
    [1, len, vocab] logits of that step. `get_logits()` would give the last position only.
    """
    if not input_ids:
        raise ValueError("input_ids is empty")
    gen = _generator(session, len(input_ids) + 1, session.score_model())
    gen.append_tokens(np.asarray([input_ids], dtype=np.int32))
    logits = np.asarray(gen.get_output("logits"))
    if logits.ndim != 3 or logits.shape[1] != len(input_ids):
        raise RuntimeError(
            f"engine returned logits of shape {logits.shape} for {len(input_ids)} tokens; "
            "was it built with prune_lm_head?"
        )
    return np.ascontiguousarray(logits[0], dtype=np.float32)
