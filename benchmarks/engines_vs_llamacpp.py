"""The CPU engines side by side on the same checkpoints: cpu_native, cpu (onnxruntime-genai) and llama_cpp.

    python benchmarks/engines_vs_llamacpp.py --checkpoint fp32=DIR --checkpoint gptq=DIR --rounds 3 \
        [--library native=/path/to/libllama.so] [--backends cpu_native,llama_cpp] [--busy 1] [--out results.json]
    python benchmarks/engines_vs_llamacpp.py --family qwen2 --tokenizer TEACHER_DIR --rounds 3
    python benchmarks/engines_vs_llamacpp.py --checkpoint fp32=DIR --checkpoint gptq=DIR --llama-bench build   # + llama-bench

`--family MODEL_TYPE` (llama, qwen2, qwen3, gemma3_text, ...) benchmarks a random model of that family shaped like
the demo student (DEMO_SHAPE: SmolLM2-135M cut to 24 layers; Gemma 3 with its 5:1 sliding/global layers, window 512)
instead of --checkpoint: it writes the fp32 model and its RTN int4 g64 asymmetric ("awq-like") and symmetric
("gptq-like") checkpoints under --work, with --tokenizer's files (the converted teacher's: same vocabulary), and
compares them like any other checkpoints. Random weights make the greedy agreement columns a check of exactness only.

Every quantized checkpoint (llm-compressor's output) is built by each backend with its default profile, and by
llama_cpp also with a q8_0 head (what llama.cpp's own Q4 files use). `--library LABEL=PATH` adds runs of the
llama_cpp engines on another llama.cpp build (LLAMA_CPP_LIB_PATH), e.g. one compiled for this machine's best ISA;
the installed build is labelled `installed`. Rounds alternate: round r measures every engine once, each in a fresh
process, before round r+1 starts. Per engine it reports the median over rounds of:

  decode tok/s   greedy, --new-tokens tokens after a --prompt-tokens prompt (time after the first token)
  prefill tok/s  a --prefill-tokens prompt (512: eval texts end to end) / its time to the first token: the median
                 of 3 runs after a warm-up one, as llama-bench's pp (which averages 5 after a warm-up)
  TTFT ms        time to the first token of the --prompt-tokens prompt
  2-stream tok/s two generations at once, all tokens / wall time
and, once, greedy agreement on the gate's prompts (data/eval, 16 tokens each): exact match and matching
prefix share against the FP model and against the checkpoint's fake-quantized model (both Hugging Face, fp32).
`--busy N` keeps N other CPU-bound processes running during the timed rounds: an edge device shares its cores
with the rest of the server, and engines that spin while they wait behave very differently there.
`--llama-bench PATH` (or `build`) adds, for every GGUF the llama_cpp backend built, llama.cpp's own `llama-bench`
binary on the same file with the same threads: `-p PREFILL -r 3` (pp: prompt processing of --prefill-tokens tokens,
the median of 3 after its warm-up run) and `-n NEW` (tg: --new-tokens tokens generated from an empty context), no
Python in the loop. `build` compiles it once from the
llama.cpp tree llama-cpp-python's pinned sdist vendors, with the Makefile's LLAMA_CMAKE_ARGS (the ISA `make` builds the
binding for), into ~/.cache/edgeflow/llama-bench/<pin>-<hash of the options>/ (3 min 7 s on the 2-core Intel Xeon VM).
Prints a markdown table and the machine (CPU model, ISA flags, compiler, llama.cpp system info), and writes JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

GREEDY_TOKENS = 16
# The demo student's shape (configs/demo-cpu.yaml: SmolLM2-135M with drop_block 6), for --family.
DEMO_SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=24, num_attention_heads=9,
                  num_key_value_heads=3, head_dim=64, max_position_embeddings=8192, tie_word_embeddings=True,
                  initializer_range=0.02)
# What each family adds to that shape (its real small models' settings).
FAMILY_SHAPE = {
    "llama": {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
    "qwen2": {"rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}},
    "qwen3": {"rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}},
    "gemma3_text": {"sliding_window": 512, "query_pre_attn_scalar": 64, "hidden_activation": "gelu_pytorch_tanh",
                    "layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(24)],
                    "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                        "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}}},
}
ISA = ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8")


def machine() -> dict:
    model, flags = "unknown", set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name") and model == "unknown":
            model = line.split(":", 1)[1].strip()
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
    cc = subprocess.run([os.environ.get("CC", "cc"), "--version"], capture_output=True, text=True).stdout.splitlines()
    return {"cpu": model, "cpus": len(os.sched_getaffinity(0)), "isa": [f for f in ISA if f in flags],
            "compiler": cc[0] if cc else "none"}


# ------------------------------------------------------------------------------------------ worker (one process)


def _speed(backend, session, prompt: list[int], new_tokens: int) -> dict:
    t0 = time.perf_counter()
    first, count = None, 0
    for _ in backend.generate(session, prompt, new_tokens, []):
        count += 1
        first = first or time.perf_counter()
    end = time.perf_counter()
    ttft = (first or end) - t0
    return {"decode_tok_s": (count - 1) / (end - first) if count > 1 else 0.0, "ttft_ms": 1000 * ttft,
            "prefill_tok_s": len(prompt) / ttft}


def _two_streams(backend, session, prompt: list[int], new_tokens: int) -> float:
    counts = [0, 0]

    def run(k: int) -> None:
        for _ in backend.generate(session, prompt, new_tokens, []):
            counts[k] += 1

    threads = [threading.Thread(target=run, args=(k,)) for k in range(2)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts) / (time.perf_counter() - t0)


def worker(spec: dict) -> dict:
    from edgeflow.engines import get_backend

    backend = get_backend(spec["backend"])
    session = backend.load(Path(spec["engine"]))
    list(backend.generate(session, spec["prompt"], 4, []))  # warm-up: kernels, caches, threads
    out = _speed(backend, session, spec["prompt"], spec["new_tokens"])
    # on the long prompt, as llama-bench times pp: after one warm-up run (the first one also grows the KV cache), the
    # median of 3
    long = [_speed(backend, session, spec["prefill_prompt"], 1)["prefill_tok_s"] for _ in range(4)][1:]
    out["prefill_tok_s"] = statistics.median(long)
    out["two_stream_tok_s"] = _two_streams(backend, session, spec["prompt"], spec["new_tokens"] // 2)
    if spec.get("greedy_prompts"):
        out["continuations"] = [list(map(int, backend.generate(session, p, GREEDY_TOKENS, spec["stop"])))
                                for p in spec["greedy_prompts"]]
    if spec["backend"] == "cpu_native":
        out["team"] = session.team_stats()  # the wait policy its probes chose
    if spec["backend"] == "llama_cpp":
        import llama_cpp as lc

        out["llama_system_info"] = lc.llama_print_system_info().decode()
    return out


# ------------------------------------------------------------------------------------------ parent


def family_checkpoints(model_type: str, tokenizer_dir: Path, work: Path) -> dict[str, str]:
    """fp32 / awq-like / gptq-like checkpoints of a random `model_type` model of the demo student's shape."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from tests.helpers.families import rtn_int4

    root = work / f"family-{model_type}"
    fp32 = root / "fp32"
    if not (fp32 / "config.json").exists():
        torch.manual_seed(0)
        cfg = AutoConfig.for_model(model_type, **DEMO_SHAPE, **FAMILY_SHAPE.get(model_type, {}))
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
        model.save_pretrained(fp32)
        AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(fp32)
    out = {"fp32": str(fp32)}
    for name, symmetric in (("awq-like", False), ("gptq-like", True)):
        d = root / name
        if not (d / "config.json").exists():
            rtn_int4(fp32, d, symmetric=symmetric)
            AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(d)
        out[name] = str(d)
    return out


def _agreement(ref: list[list[int]], got: list[list[int]]) -> dict:
    exact = sum(a == b for a, b in zip(ref, got)) / len(ref)
    prefix = []
    for a, b in zip(ref, got):
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefix.append(n / max(len(a), 1))
    return {"exact": exact, "prefix": sum(prefix) / len(prefix)}


def _hf_greedy(model_dir: Path, prompts: list[list[int]], stop: list[int], dequantized: bool) -> list[list[int]]:
    import torch

    from edgeflow.engines.checkpoint import load_dequantized
    from transformers import AutoModelForCausalLM

    model = load_dequantized(model_dir) if dequantized else AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    out = []
    with torch.no_grad():
        for p in prompts:
            ids, new = list(p), []
            for _ in range(GREEDY_TOKENS):
                t = int(model(torch.tensor([ids])).logits[0, -1].argmax())
                if t in stop:
                    break
                new.append(t)
                ids.append(t)
            out.append(new)
    return out


LLAMA_BENCH_CACHE = Path.home() / ".cache" / "edgeflow" / "llama-bench"


def build_llama_bench() -> Path:
    """llama.cpp's `llama-bench`, compiled once from the tree llama-cpp-python's pinned sdist vendors, with the
    Makefile's LLAMA_CMAKE_ARGS: the same llama.cpp and ISA as the binding `make` installs."""
    import hashlib
    import re
    import shutil
    import tarfile

    pin = re.search(r'"(llama-cpp-python==[^"]+)"', (REPO / "pyproject.toml").read_text()).group(1)
    cmake_args = subprocess.run(["make", "-s", "--no-print-directory", "-C", str(REPO), "--eval", "print-llama-args: ; @echo $(LLAMA_CMAKE_ARGS)",
                                 "print-llama-args"], capture_output=True, text=True, check=True).stdout.split()
    key = hashlib.sha256(f"{pin} {' '.join(cmake_args)} {os.uname().machine}".encode()).hexdigest()[:12]
    out = LLAMA_BENCH_CACHE / f"{pin.split('==')[1]}-{key}"
    binary = out / "llama-bench"
    if binary.exists():
        return binary
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:", pin, "-d", tmp],
                       check=True)
        [sdist] = Path(tmp).glob("*.tar.gz")
        with tarfile.open(sdist) as tar:
            tar.extractall(tmp, filter="data")
        [src] = Path(tmp).glob("*/vendor/llama.cpp")
        subprocess.run(["cmake", "-S", str(src), "-B", str(src / "build"), "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF",
                        "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF",
                        "-DLLAMA_BUILD_TOOLS=ON", *cmake_args], check=True, capture_output=True)
        subprocess.run(["cmake", "--build", str(src / "build"), "--target", "llama-bench", "-j", str(os.cpu_count() or 1)],
                       check=True, capture_output=True)
        out.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src / "build" / "bin" / "llama-bench", binary)
    return binary


def _llama_bench(binary: str, gguf: Path, prefill: int, new_tokens: int) -> dict:
    """One run of llama-bench on `gguf`: pp<prefill> and tg<new_tokens> tok/s, the threads cpu_native gets; pp is the
    median of 3 repetitions after llama-bench's own warm-up run, as cpu_native's prefill is timed."""
    from edgeflow.engines.cpu_host import threads_from_env

    p = subprocess.run([binary, "-m", str(gguf), "-t", str(threads_from_env()), "-p", str(prefill), "-n", "0", "-r", "3",
                        "-o", "json"], capture_output=True, text=True)
    if p.returncode:
        raise RuntimeError(f"llama-bench exit {p.returncode}: {p.stderr.strip()[-500:]}")
    pp_row = next(r for r in json.loads(p.stdout) if r["n_prompt"] == prefill and r["n_gen"] == 0)
    pp = statistics.median(pp_row["samples_ts"]) if pp_row.get("samples_ts") else pp_row["avg_ts"]
    p = subprocess.run([binary, "-m", str(gguf), "-t", str(threads_from_env()), "-p", "0", "-n", str(new_tokens),
                        "-r", "1", "-o", "json"], capture_output=True, text=True)
    if p.returncode:
        raise RuntimeError(f"llama-bench exit {p.returncode}: {p.stderr.strip()[-500:]}")
    rows = json.loads(p.stdout)
    tg = next(r["avg_ts"] for r in rows if r["n_gen"] == new_tokens and r["n_prompt"] == 0)
    return {"decode_tok_s": tg, "prefill_tok_s": pp, "build": rows[0].get("build_commit")}


def _rounds(a, engines: list[dict], results: dict, refs: dict, prompts, speed_prompt, prefill_prompt, stop) -> None:
    for r in range(a.rounds):
        for e in engines:
            if e["backend"] == "llama-bench":
                try:
                    got = _llama_bench(e["library"], Path(e["engine"]) / "model.gguf", a.prefill_tokens, a.new_tokens)
                except RuntimeError as err:
                    results[e["name"]]["failed"] = str(err)
                    print(f"round {r}: {e['name']}: {err}", file=sys.stderr)
                    continue
                results[e["name"]]["rounds"].append({k: got[k] for k in ("decode_tok_s", "prefill_tok_s")})
                results[e["name"]]["llama_bench_build"] = got["build"]
                print(f"round {r}: {e['name']}: {got['decode_tok_s']:.1f} tok/s", file=sys.stderr)
                continue
            spec = {"backend": e["backend"], "engine": e["engine"], "prompt": speed_prompt, "new_tokens": a.new_tokens,
                    "prefill_prompt": prefill_prompt,
                    "greedy_prompts": prompts if r == 0 else [], "stop": stop}
            spec_file = a.work / "spec.json"
            spec_file.write_text(json.dumps(spec))
            env = os.environ | ({"LLAMA_CPP_LIB_PATH": str(Path(e["library"]).parent)} if e["library"] else {})
            p = subprocess.run([sys.executable, __file__, "--worker", str(spec_file)], capture_output=True, text=True, env=env)
            if p.returncode:  # e.g. a llama.cpp build using instructions this machine does not enable: recorded, not fatal
                why = f"signal {-p.returncode}" if p.returncode < 0 else f"exit {p.returncode}"
                results[e["name"]]["failed"] = f"{why}: {p.stderr.strip().splitlines()[-1] if p.stderr.strip() else ''}"
                print(f"round {r}: {e['name']}: worker failed ({why})", file=sys.stderr)
                continue
            got = json.loads(p.stdout.strip().splitlines()[-1])
            if r == 0:
                results[e["name"]]["vs_fp"] = _agreement(refs["fp32"], got["continuations"])
                results[e["name"]]["vs_fakeq"] = _agreement(refs.get(e["checkpoint"], refs["fp32"]), got["continuations"])
                results[e["name"]]["llama_system_info"] = got.get("llama_system_info")
            results[e["name"]]["rounds"].append({k: got[k] for k in ("decode_tok_s", "prefill_tok_s", "ttft_ms", "two_stream_tok_s")})
            team = f" (team {got['team']})" if got.get("team") else ""
            results[e["name"]].setdefault("teams", []).append(got.get("team"))
            print(f"round {r}: {e['name']}: {got['decode_tok_s']:.1f} tok/s{team}", file=sys.stderr)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", action="append", default=[], help="NAME=DIR; the one named fp32 is the FP model")
    ap.add_argument("--backends", default="cpu_native,llama_cpp")
    ap.add_argument("--library", action="append", default=[], help="LABEL=PATH of another libllama.so for llama_cpp")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=48)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prefill-tokens", type=int, default=512, help="the long prompt prefill tok/s is measured on")
    ap.add_argument("--llama-bench", default=None, help="PATH of llama.cpp's llama-bench, or `build` (see above)")
    ap.add_argument("--gate-prompts", type=int, default=24)
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "edgeflow-engines-vs-llamacpp")
    ap.add_argument("--busy", type=int, default=0, help="CPU-bound processes kept running during the timed rounds")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--family", default=None, help="model_type: benchmark a random model of that family (see above)")
    ap.add_argument("--tokenizer", type=Path, default=os.environ.get("EDGEFLOW_TEST_TEACHER"),
                    help="with --family: the directory whose tokenizer files the checkpoints get")
    ap.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        print(json.dumps(worker(json.loads(a.worker.read_text()))))
        return 0

    from transformers import AutoTokenizer

    from edgeflow.engines import get_backend
    from edgeflow.evaluation.gate import eval_texts, greedy_prompts, tokenize

    ckpts = dict(c.split("=", 1) for c in a.checkpoint)
    if a.family:
        if ckpts or not a.tokenizer:
            ap.error("--family takes no --checkpoint and needs --tokenizer DIR (or $EDGEFLOW_TEST_TEACHER)")
        a.work.mkdir(parents=True, exist_ok=True)
        ckpts = family_checkpoints(a.family, Path(a.tokenizer), a.work)
    if not ckpts or "fp32" not in ckpts:
        ap.error("--checkpoint fp32=DIR (the FP model) is required")
    fp = Path(ckpts["fp32"])
    tok = AutoTokenizer.from_pretrained(fp)
    sources = {d: REPO / "data" / "eval" / f"{d}.jsonl" for d in ("chat", "wiki", "math")}
    seqs = tokenize(eval_texts(sources, 4 * a.gate_prompts, tok), tok, 256)
    prompts = greedy_prompts(seqs, a.gate_prompts)
    speed_prompt = next(s for s in seqs if len(s) >= a.prompt_tokens)[: a.prompt_tokens]
    prefill_prompt = [t for s in seqs for t in s][: a.prefill_tokens]  # eval texts end to end
    if len(prefill_prompt) < a.prefill_tokens:
        ap.error(f"--prefill-tokens {a.prefill_tokens}: the eval texts give {len(prefill_prompt)} tokens; raise --gate-prompts")
    bench = str(build_llama_bench()) if a.llama_bench == "build" else a.llama_bench
    stop = [int(tok.eos_token_id)]
    libraries = {"installed": None} | dict(x.split("=", 1) for x in a.library)

    engines: list[dict] = []  # name, backend, library, engine dir, checkpoint
    for cname, cdir in ckpts.items():
        for backend in a.backends.split(","):
            profiles = {"": {}} if backend != "llama_cpp" else {"": {}, "+q8_0 head": {"head": "q8_0"}}
            for suffix, profile in profiles.items():
                out = a.work / f"{cname}-{backend}{suffix.replace(' ', '-').replace('+', '')}"
                try:
                    meta = get_backend(backend).build(Path(cdir), out, profile)
                except ValueError as e:
                    print(f"skip {cname} on {backend}: {e}", file=sys.stderr)
                    continue
                precision = meta["precision"] + (" (dequantized)" if meta.get("dequantized") else "")
                for label, lib in (libraries.items() if backend == "llama_cpp" else [("", None)]):
                    engines.append({"name": f"{cname} / {backend}{suffix}" + (f" [{label}]" if label else ""),
                                    "backend": backend, "library": lib, "engine": str(out), "checkpoint": cname,
                                    "precision": precision})
                if backend == "llama_cpp" and bench:  # the same GGUF under llama.cpp's own benchmark binary
                    engines.append({"name": f"{cname} / llama-bench{suffix}", "backend": "llama-bench", "library": bench,
                                    "engine": str(out), "checkpoint": cname, "precision": precision})

    refs = {"fp32": _hf_greedy(fp, prompts, stop, dequantized=False)}
    for cname, cdir in ckpts.items():
        if cname != "fp32":
            refs[cname] = _hf_greedy(Path(cdir), prompts, stop, dequantized=True)

    results = {e["name"]: {"rounds": []} | e for e in engines}
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(a.busy)]
    try:
        _rounds(a, engines, results, refs, prompts, speed_prompt, prefill_prompt, stop)
    finally:
        for p in busy:
            p.kill()

    print(f"\n{'family ' + a.family + ' (random, demo student shape); ' if a.family else ''}"
          f"machine: {json.dumps(machine())}; threads: {os.environ.get('EDGEFLOW_ENGINE_THREADS', 'all')}; "
          f"prompt {a.prompt_tokens} tokens, {a.new_tokens} new, prefill of {a.prefill_tokens}, median of {a.rounds} alternating rounds"
          f"{f', {a.busy} busy processes beside them' if a.busy else ''}\n")
    print(f"| engine | precision | decode tok/s | prefill tok/s ({a.prefill_tokens}) | TTFT ms ({a.prompt_tokens}) | "
          "2-stream tok/s | greedy = FP | = fake-quant |")
    print("|---|---|---|---|---|---|---|---|")
    for name, res in results.items():
        if not res["rounds"]:
            print(f"| {name} | {res['precision']} | failed: {res['failed']} | | | | | |")
            continue
        med = {k: statistics.median(x[k] for x in res["rounds"]) for k in res["rounds"][0]}
        res["median"] = med
        if res["backend"] == "llama-bench":  # no Python, no sampling, no continuations: speed only
            print(f"| {name} | {res['precision']} | {med['decode_tok_s']:.1f} | {med['prefill_tok_s']:.0f} | – | – | – | – |")
            continue
        print(f"| {name} | {res['precision']} | {med['decode_tok_s']:.1f} | {med['prefill_tok_s']:.0f} | {med['ttft_ms']:.1f} | "
              f"{med['two_stream_tok_s']:.1f} | {res['vs_fp']['exact']:.0%} ({res['vs_fp']['prefix']:.0%}) | "
              f"{res['vs_fakeq']['exact']:.0%} ({res['vs_fakeq']['prefix']:.0%}) |")
    info = next((r["llama_system_info"] for r in results.values() if r.get("llama_system_info")), None)
    if info:
        print(f"\nllama.cpp (installed): {info}")
    if a.out:
        a.out.write_text(json.dumps({"machine": machine(), "args": vars(a) | {"work": str(a.work), "out": str(a.out),
                                                                              "worker": None},
                                     "results": results}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
