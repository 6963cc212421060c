"""The checks `edgeflow doctor` runs (edgeflow/ops/doctor/__init__.py picks them per role). Each takes the run's
`Host` and returns its numbers, or raises `Failed` (the host cannot do what its role needs: the reason names what
is missing and the fix) or `Skipped` (not applicable here). Every check calls the code a release runs: the engine
backends through their one API (edgeflow.engines.Backend), the distillation through run_distill_distributed, the
quantizer through llm-compressor; nothing is reimplemented for the check. Each takes its device as an argument, so
the GPU roles' checks also run, and are tested, on a CPU up to the hardware boundary."""
from __future__ import annotations

import importlib.util
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edgeflow.profile import Profile


class Failed(Exception):
    """The check ran and the host failed it; the message is the reason, with the fix."""


class Skipped(Exception):
    """The check does not apply here; the message says why."""


@dataclass
class Host:
    """What one doctor run knows: its role, profile, scratch directory, the device the role computes on, and what
    earlier checks produced for later ones (the tiny model, the measured memory bandwidth)."""

    role: str
    profile: Profile
    work: Path
    device: str = "cpu"
    results: dict[str, str] = field(default_factory=dict)  # check name -> status
    model: dict[str, Path] = field(default_factory=dict)  # "dense" / "int4" -> checkpoint directory
    bandwidth_gb_s: float | None = None

    def need(self, *checks: str) -> None:
        """Skip the calling check unless every one of `checks` passed."""
        for c in checks:
            if self.results.get(c) != "pass":
                raise Skipped(f"needs the {c} check, which {self.results.get(c, 'did not run')}")


# The runtime each engine backend imports to build or run, and how to install it where it is missing. The backend
# module itself imports without its runtime (edgeflow.engines: a GPU runtime is imported only inside its backend).
RUNTIMES: dict[str, tuple[str, str, str]] = {
    "cpu_native": ("numpy", "numpy", "pip install -e . (edgeflow's core; the kernels compile with the system's cc)"),
    "cpu": ("onnxruntime_genai", "onnxruntime-genai", "pip install -e . (edgeflow's core)"),
    "llama_cpp": ("llama_cpp", "llama-cpp-python==0.3.36", "pip install -e '.[llamacpp]' (CMAKE_ARGS=-DGGML_CUDA=on "
                  "for a CUDA build)"),
    "vllm": ("vllm", "vllm==0.34.0", "pip install vllm==0.34.0 in the A100 host's own environment "
             "(infra/images/a100: its pins contradict edgeflow's core)"),
    "tensorrt_llm": ("tensorrt_llm", "tensorrt-llm==1.2.1 (A100) or the v0.12.0-jetson branch (Orin, JetPack 6.1)",
                     "install TensorRT-LLM in the host's own environment (infra/images: a100 or jetson jp6)"),
    "edge_llm": ("tensorrt_edgellm", "tensorrt-edgellm==0.11.0", "pip install 'tensorrt-edgellm==0.11.0' (JetPack 7.2 "
                 "on the Orin; the exporter runs on an x86 host in its own venv)"),
}

# The tiny model every engine check builds: a Llama of 8 layers, hidden 768, whose fp32 weights (~211 MB) outgrow
# any CPU's last-level cache, so its decode speed is bounded by memory, not by cache (the bandwidth fraction then
# means what it says); small enough that RTN int4, every engine build and the transformers reference take seconds.
# Initialised at 0.02 (transformers' default), not the engine tests' 0.08: at 0.08 eight random layers amplify
# llama.cpp's q8 rounding of activations until its int4 engine matched transformers' top-1 at only 78 % of positions
# (logit correlation 0.965 at worst), at 0.02 at 99.5 % (0.9998): the check is of the host, not of a chaotic model.
TINY = dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
            head_dim=192, max_position_embeddings=512, initializer_range=0.02)
PROMPT_LENGTHS = (16, 48)
NEW_TOKENS = 64
# An engine computes the model it was built from when, against transformers on the same weights, at least MIN_TOP1 of
# the scored positions have the same top-1 token and every position's logits correlate at MIN_CORRELATION or more.
# Measured on the 2-core Xeon (AVX-512, AMX): cpu_native dense and int4 and llama_cpp dense at 100 % and 1.0000,
# llama_cpp int4 (q8 activations) at 99.5 % and 0.9998. A wrong layout, kernel or ISA path scatters both.
MIN_TOP1 = 0.95
MIN_CORRELATION = 0.99


def versions(host: Host) -> dict[str, Any]:
    """Python, edgeflow and every runtime's version (what is not installed reads None)."""
    from importlib.metadata import PackageNotFoundError, version

    from edgeflow.ops.envcheck import versions as runtime_versions

    try:
        own = version("edgeflow")
    except PackageNotFoundError:
        own = None
    return {"edgeflow": own} | runtime_versions()


def device(host: Host) -> dict[str, Any]:
    """The CPU (model, ISA, cores, memory), the GPU when there is one, and the memory bandwidth of the device the role
    computes on, measured (memory_bandwidth_gb_s)."""
    import psutil

    from edgeflow.engines.cpu_host import device_fingerprint
    from edgeflow.engines.gpu_host import gpu_fingerprint

    out: dict[str, Any] = {f"cpu.{k}": v for k, v in device_fingerprint().items()}
    out["cpu.memory_gib"] = round(psutil.virtual_memory().total / 2**30, 1)
    out |= {f"gpu.{k}": v for k, v in gpu_fingerprint().items() if v is not None}
    on = host.device if host.device == "cpu" or out.get("gpu.cuda_available") else "cpu"  # no GPU: the CPU's
    host.bandwidth_gb_s = memory_bandwidth_gb_s(on)
    out["memory_bandwidth_gb_s"] = round(host.bandwidth_gb_s, 2)
    out["memory_bandwidth_device"] = on
    return out


def memory_bandwidth_gb_s(device: str, mib: int = 256, repeats: int = 5) -> float:
    """The ceiling a batch-1 decode, which reads every weight once per token, is measured against: on the CPU, the
    read stream the estimate uses (edgeflow/estimate/probe.py, on the engine's threads, over 1 GiB); on a GPU, bytes
    read and written per second by a torch copy of `mib` MiB, best of `repeats`."""
    if device == "cpu":
        from edgeflow.estimate.probe import probe

        return probe().read_gb_s
    import torch

    a = torch.ones(mib * 2**20 // 4, device=device)
    b = torch.empty_like(a)
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        b.copy_(a)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return 2 * a.numel() * 4 / best / 1e9


# Compute capability each GPU role needs (edgeflow/ops/envcheck.py holds the image targets' reasons).
ROLE_SM = {"a100": "sm80 or newer (bf16 training, Marlin W4A16)", "orin": "sm87 (Jetson AGX Orin)"}


def cuda(host: Host) -> dict[str, Any]:
    """A CUDA GPU this role can use: any sm80+ for a100, sm87 for orin, named on both sides when it is not."""
    from edgeflow.engines.gpu_host import gpu_fingerprint

    fp = gpu_fingerprint()
    if not fp["cuda_available"]:
        raise Failed(f"role {host.role} needs a CUDA GPU ({ROLE_SM[host.role]}); this host has none: {fp['reason']}. "
                     f"Fix: run `edgeflow doctor --role {host.role}` on the {host.role} host, or --role cpu here")
    sm = int(str(fp["sm"]).removeprefix("sm"))
    if (host.role == "a100" and sm < 80) or (host.role == "orin" and sm != 87):
        raise Failed(f"role {host.role} needs {ROLE_SM[host.role]}; this host's GPU is {fp['device_name']} ({fp['sm']}). "
                     "Fix: run the check on a host of that role, or pass the role this GPU plays")
    return {k: v for k, v in fp.items() if k != "reason"}


def dtypes(host: Host) -> dict[str, Any]:
    """Which of fp32, bf16 and fp16 multiply correctly on the role's device, and how fast: a 1024x1024 matmul against
    its fp64 value. fp32 must work; bf16 must on a100 (its distillation trains in bf16)."""
    import torch

    from edgeflow.distill.train import NATIVE_BF16_CPU_FLAGS
    from edgeflow.engines.cpu_host import cpu_flags

    g = torch.Generator().manual_seed(0)
    a64, b64 = (torch.randn(1024, 1024, generator=g, dtype=torch.float64) for _ in range(2))
    want = a64 @ b64
    out: dict[str, Any] = {}
    works: dict[str, bool] = {}
    for name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)):
        try:
            a, b = a64.to(host.device, dt), b64.to(host.device, dt)
            (a @ b).float().cpu()  # warm-up
            t0 = time.perf_counter()
            got = (a @ b).float().cpu()
            secs = time.perf_counter() - t0
            err = float((got.double() - want).abs().max() / want.abs().max())
            works[name] = bool(torch.isfinite(got).all()) and err < 0.05
            out[f"{name}.max_rel_error"] = err
            out[f"{name}.gflop_s"] = round(2 * 1024**3 / secs / 1e9, 1)
        except Exception as e:  # a dtype the device does not do is an answer, not a crash
            works[name] = False
            out[f"{name}.error"] = f"{type(e).__name__}: {e}"
        out[f"{name}.works"] = works[name]
    if host.device == "cpu":
        out["bf16.native"] = bool(cpu_flags() & NATIVE_BF16_CPU_FLAGS)  # else oneDNN emulates it (slower than fp32)
    if not works["fp32"]:
        raise Failed(f"fp32 matmul on {host.device} is wrong or fails ({out.get('fp32.error', out.get('fp32.max_rel_error'))})")
    if host.role == "a100" and not works["bf16"]:
        raise Failed(f"role a100 distils in bf16 and bf16 matmul on {host.device} fails "
                     f"({out.get('bf16.error', out.get('bf16.max_rel_error'))}); fix the CUDA/torch install")
    return out


def backend_import(host: Host, name: str) -> dict[str, Any]:
    """The engine backend imports, its runtime is installed, and it states its build identity."""
    from edgeflow.engines import get_backend

    module, package, how = RUNTIMES[name]
    if importlib.util.find_spec(module) is None:
        raise Failed(f"engine.backend={name} needs {package} (module {module!r}), which is not installed here. "
                     f"Fix: {how}")
    backend = get_backend(name)
    return {"module": backend.__name__, "runtime": module, "build_identity": backend.build_identity()}


def model(host: Host) -> dict[str, Any]:
    """The tiny Llama (TINY) every engine check builds, dense fp32 and RTN int4 (group 64, asymmetric: what
    llm-compressor's AWQ/GPTQ recipes store), written under the run's work directory."""
    from edgeflow.model.tiny import build_tiny
    from edgeflow.quantize.rtn import rtn_int4

    dense = build_tiny("llama", host.work / "model" / "dense", **TINY)
    int4 = rtn_int4(dense, host.work / "model" / "int4")
    host.model = {"dense": dense, "int4": int4}
    return {"family": "llama", **TINY, "dense_mb": round(_dir_bytes(dense) / 1e6, 1),
            "int4_mb": round(_dir_bytes(int4) / 1e6, 1)}


def _dir_bytes(d: Path, min_file: int = 0) -> int:
    """Bytes of the files under d, counting only files of at least min_file bytes."""
    return sum(n for f in d.rglob("*") if f.is_file() and (n := f.stat().st_size) >= min_file)


def _reference_logits(checkpoint: Path, seqs: list[list[int]]) -> list:
    """transformers' fp32 logits of each sequence on the CPU (the gate's HFScorer): what every engine is compared with."""
    from edgeflow.evaluation.reference import HFScorer

    scorer = HFScorer(checkpoint)
    return [scorer(s) for s in seqs]


def _prompts() -> list[list[int]]:
    import numpy as np

    from edgeflow.model.tiny import VOCAB

    rng = np.random.default_rng(1)
    return [rng.integers(8, VOCAB, n).tolist() for n in PROMPT_LENGTHS]  # above every family's special tokens


def engine(host: Host, name: str, weights: str, profile: dict | None = None) -> dict[str, Any]:
    """Build, load, score and decode with backend `name` on the tiny model's `weights` ("dense" or "int4"), through
    the Backend API the gate and the server use. Numbers: build and load seconds, top-1 agreement and the largest
    logit difference against transformers on the same weights, batch-1 decode tok/s, and, with the measured memory
    bandwidth, the fraction of it the decode reaches (engine bytes read per token x tok/s over the bandwidth)."""
    import numpy as np

    from edgeflow.engines import get_backend

    host.need("model", f"backend:{name}")
    backend = get_backend(name)
    checkpoint = host.model[weights]
    out_dir = host.work / "engines" / f"{name}-{weights}"
    t0 = time.perf_counter()
    backend.build(checkpoint, out_dir, dict(profile or {}))
    build_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    session = backend.load(out_dir)
    load_s = time.perf_counter() - t0

    prompts = _prompts()
    tokens = []
    decode_tok_s = []
    for ids in prompts:
        stamps = []
        got = []
        for tok in backend.generate(session, ids, NEW_TOKENS, []):
            got.append(int(tok))
            stamps.append(time.perf_counter())
        tokens.append(got)
        if len(stamps) > 1:
            decode_tok_s.append((len(stamps) - 1) / (stamps[-1] - stamps[0]))  # after the first token: decode only
    seqs = [ids + got for ids, got in zip(prompts, tokens)]
    refs = _reference_logits(checkpoint, seqs)
    agree = total = 0
    worst = 0.0
    cosines = []
    for seq, ref in zip(seqs, refs):
        logits = np.asarray(backend.score(session, seq), dtype=np.float32)
        agree += int((logits.argmax(-1) == ref.argmax(-1)).sum())
        total += len(seq)
        worst = max(worst, float(np.abs(logits - ref).max()))
        a, b = logits - logits.mean(-1, keepdims=True), ref - ref.mean(-1, keepdims=True)
        cosines += ((a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))).tolist()
    weight_bytes = _dir_bytes(out_dir, min_file=2**20 + 1)  # the weights: engine.json, tokenizer files and logs are smaller
    tok_s = max(decode_tok_s) if decode_tok_s else None
    out: dict[str, Any] = {
        "weights": weights, "build_s": round(build_s, 2), "load_s": round(load_s, 2),
        "top1_agreement": round(agree / total, 4), "max_abs_logit_diff": round(worst, 4),
        "logit_correlation_min": round(min(cosines), 5), "logit_correlation_mean": round(float(np.mean(cosines)), 5),
        "generated_tokens": [len(t) for t in tokens], "decode_tok_s": round(tok_s, 1) if tok_s else None,
        "engine_mb": round(weight_bytes / 1e6, 1),
    }
    if tok_s and host.bandwidth_gb_s:
        out["bandwidth_fraction"] = round(tok_s * weight_bytes / (host.bandwidth_gb_s * 1e9), 3)
    if agree / total < MIN_TOP1 or min(cosines) < MIN_CORRELATION:
        raise Failed(f"{name} ({weights}) does not compute the model it was built from: against transformers on the same "
                     f"weights, top-1 agreement {agree / total:.1%} of {total} positions (needs {MIN_TOP1:.0%}) and logit "
                     f"correlation {min(cosines):.4f} at worst (needs {MIN_CORRELATION}); largest logit difference "
                     f"{worst:.3g}. Fix: rebuild the backend's runtime for this CPU or GPU, and attach this report to "
                     "a bug report")
    return out


# Distillation steps the GPU roles train (the check: 20 steps on the role's device, ZeRO-3 over several GPUs).
DISTILL_STEPS = 20
# The profile's distill fields the check trains with: the method, not the data, the cut or the run's length.
DISTILL_METHOD = ("lr", "alpha", "temperature", "beta", "gradient_checkpointing", "mixed_precision", "processes", "strategy",
                  "deepspeed_config", "offload_optimizer", "offload_param", "seed")


def distill(host: Host) -> dict[str, Any]:
    """DISTILL_STEPS optimizer steps of the release's distillation (run_distill_distributed: one process per visible
    GPU, the profile's strategy over several) from the tiny model to a 4-layer cut, on the role's device. Passes
    when every step's loss is finite and the last is below the first."""
    import json
    import math

    from edgeflow.distill.launch import run_distill_distributed
    from edgeflow.distill.train import default_device, precision_label
    from edgeflow.model.tiny import corpus_texts
    from edgeflow.profile import DistillConfig

    host.need("model")
    corpus = host.work / "distill" / "corpus.jsonl"
    corpus.parent.mkdir(parents=True, exist_ok=True)
    texts = corpus_texts()
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[:256]))
    # how the profile trains (loss weights, precision, processes and strategy), on the tiny model's own cut and size
    how = host.profile.distill.model_dump(include=set(DISTILL_METHOD), exclude_unset=True)
    cfg = DistillConfig(**how, steps=DISTILL_STEPS, batch_size=4, max_seq_len=64, keep_layers=[0, 2, 5, 7],
                        checkpoint_every=0)
    t0 = time.perf_counter()
    metrics = run_distill_distributed(host.model["dense"], cfg, [corpus], texts[-4:], host.work / "distill" / "student",
                                      host.work / "distill" / "work")
    secs = time.perf_counter() - t0
    totals = [h["total"] for h in metrics["history"]]
    out = {"steps": len(totals), "first_loss": round(totals[0], 4), "last_loss": round(totals[-1], 4),
           "processes": metrics["training_processes"], "precision": precision_label(cfg.mixed_precision, default_device()),
           "tokens_per_s": round(metrics["mean_tokens_per_s"], 1), "seconds": round(secs, 1), "device": str(default_device())}
    if not all(math.isfinite(t) for t in totals) or totals[-1] >= totals[0]:
        raise Failed(f"{DISTILL_STEPS} distillation steps on {host.device} did not train: losses {totals[0]:.4g} -> "
                     f"{totals[-1]:.4g} (finite and falling expected)")
    return out


# GPTQ on the role's GPU against the same recipe, data and model on the CPU: the share of int4 codes that must agree.
# Both run GPTQ's column-by-column rounding in fp32 on the same Hessian; a code differs only where the two devices'
# summation order moves a value across a rounding boundary (and the error feedback carries it along its row), which
# is rare, while a broken kernel or driver changes most of them. Unverified on GPU: the first A100 run states it.
MIN_GPTQ_CODE_AGREEMENT = 0.99
GPTQ_RECIPE = "deployments/recipes/gptq-w4a16-sym.yaml"


def gptq(host: Host) -> dict[str, Any]:
    """The shipped GPTQ W4A16 recipe (llm-compressor, through the quantize stage's quantize()) on the tiny model, on
    the role's device and on the CPU, with 16 calibration sequences of 64 tokens; their int4 codes and scales side by
    side, and each one's weight error against the dense model."""
    import numpy as np

    from edgeflow.model.tiny import VOCAB
    from edgeflow.paths import REPO_ROOT
    from edgeflow.quantize.recipe import load_recipe
    from edgeflow.quantize.run import quantize

    host.need("model")
    recipe = load_recipe(REPO_ROOT / GPTQ_RECIPE)
    rng = np.random.default_rng(0)
    ids = [rng.integers(8, VOCAB, 64).tolist() for _ in range(16)]
    out: dict[str, Any] = {"recipe": GPTQ_RECIPE, "calibration": [len(ids), 64]}
    made = {}
    for dev in dict.fromkeys((host.device, "cpu")):  # the role's device first; the CPU once either way
        t0 = time.perf_counter()
        info = quantize(host.model["dense"], recipe, ids, host.work / f"gptq-{dev}", device=dev)
        errors = list(info["weight_error"].values())
        out[f"{dev}.seconds"] = round(time.perf_counter() - t0, 2)
        out[f"{dev}.weight_error_mean"] = round(float(np.mean(errors)), 5)
        made[dev] = host.work / f"gptq-{dev}"
    if len(made) == 1:
        return out | {"compared": "the role's device is the CPU: one run"}
    agreement, worst_scale = gptq_agreement(made[host.device], made["cpu"])
    out |= {"code_agreement": round(agreement, 5), "scale_max_rel_diff": worst_scale}
    if agreement < MIN_GPTQ_CODE_AGREEMENT:
        raise Failed(f"GPTQ on {host.device} and on the CPU agree on only {agreement:.2%} of the int4 codes (needs "
                     f"{MIN_GPTQ_CODE_AGREEMENT:.0%}): the GPU's quantization differs from the CPU's; attach this report")
    return out


def gptq_agreement(a_dir: Path, b_dir: Path) -> tuple[float, float]:
    """(share of equal int4 codes over every quantized linear, largest scale difference relative to the layer's largest
    scale) between two checkpoints of one model and recipe, each layer read with the scheme its config records."""
    import numpy as np

    from edgeflow.engines.checkpoint import layer, layer_scheme, load_tensors, read_config, split_tensors, weight_schemes

    a, b = load_tensors(a_dir), load_tensors(b_dir)
    schemes = weight_schemes(read_config(a_dir), f"{a_dir}/config.json") or {}
    _, prefixes = split_tensors(a, a_dir)
    same = total = 0
    worst = 0.0
    for prefix in prefixes:
        scheme = layer_scheme(a, prefix, schemes)
        la, lb = layer(a, prefix, scheme), layer(b, prefix, scheme)
        same += int((la.q == lb.q).sum())
        total += la.q.size
        worst = max(worst, float(np.abs(la.scale - lb.scale).max() / np.abs(lb.scale).max()))
    return same / total, worst


# The gate's torch half on the role's GPU against the CPU: the share of positions whose FP argmax must agree. Both
# score in fp32 (compute_reference); only summation order differs, which flips an argmax only at a near-tie, while a
# wrong kernel or a half-precision path scatters them. Unverified on GPU: the first A100 run states it.
MIN_REFERENCE_ARGMAX_AGREEMENT = 0.98
# Evaluation texts, greedy prompts and tokens the check scores: the gate's settings, capped so it takes seconds.
REFERENCE_CAPS = {"num_prompts": 24, "max_tokens": 64, "greedy_prompts": 4, "greedy_tokens": 16}


def gate_reference(host: Host) -> dict[str, Any]:
    """The gate's torch half (edgeflow.evaluation.reference.compute_reference: the FP model's top-k log-probabilities,
    the target log-probabilities, greedy continuations, and the GPTQ checkpoints' fake-quantized twins) on the role's
    device and on the CPU, over the profile's evaluation sources tokenized by the tiny model's tokenizer."""
    from transformers import AutoTokenizer

    from edgeflow.engines.engine_dir import stop_ids
    from edgeflow.evaluation.gate import eval_texts, greedy_prompts, tokenize
    from edgeflow.evaluation.reference import compute_reference
    from edgeflow.paths import REPO_ROOT

    host.need("model", "gptq")
    gate = host.profile.gate
    caps = {k: min(getattr(gate, k), v) for k, v in REFERENCE_CAPS.items()}
    dense = host.model["dense"]
    tok = AutoTokenizer.from_pretrained(dense)
    sources = {d: REPO_ROOT / p for d, p in gate.eval_sources.items()}
    seqs = tokenize(eval_texts(sources, caps["num_prompts"], tok), tok, caps["max_tokens"])
    prompts = greedy_prompts(seqs, caps["greedy_prompts"])
    devices = list(dict.fromkeys((host.device, "cpu")))  # the role's device, and the CPU once either way
    quantized = {d: host.work / f"gptq-{d}" for d in devices}
    refs, out = {}, {"sequences": len(seqs), "prompts": len(prompts)}
    for dev in devices:
        t0 = time.perf_counter()
        refs[dev] = compute_reference(dense, quantized, seqs, prompts, caps["greedy_tokens"], gate.reference_top_k,
                                      prompts[0], stop_ids(dense), device=dev)
        out[f"{dev}.seconds"] = round(time.perf_counter() - t0, 2)
    if len(refs) == 1:
        return out | {"compared": "the role's device is the CPU: one run"}
    out |= compare_references(refs[host.device], refs["cpu"])
    if out["argmax_agreement"] < MIN_REFERENCE_ARGMAX_AGREEMENT:
        raise Failed(f"the gate's FP reference on {host.device} and on the CPU agree on the argmax at only "
                     f"{out['argmax_agreement']:.2%} of positions (needs {MIN_REFERENCE_ARGMAX_AGREEMENT:.0%}): the GPU "
                     "scores another model; attach this report")
    return out


def compare_references(a, b) -> dict[str, Any]:
    """Two compute_reference results of one model and data side by side: argmax agreement, the largest differences
    of the top-1 and target log-probabilities, whether the greedy continuations are equal, and each fake-quantized
    twin's argmax agreement."""
    import numpy as np

    argmax = np.concatenate([x[:, 0] == y[:, 0] for x, y in zip(a.topk_ids, b.topk_ids)])
    top1_logp = max(float(np.abs(x[:, 0] - y[:, 0]).max()) for x, y in zip(a.topk_logp, b.topk_logp))
    target = max(float(np.abs(x - y).max()) for x, y in zip(a.target_logp, b.target_logp))
    fq = {n: float(np.mean(np.concatenate([x == y for x, y in zip(a.fakeq_argmax[n], b.fakeq_argmax[n])])))
          for n in a.fakeq_argmax}
    return {"argmax_agreement": float(argmax.mean()), "max_abs_top1_logp": top1_logp, "max_abs_target_logp": target,
            "greedy_equal": a.continuations == b.continuations, "fakeq_argmax_agreement": fq}
