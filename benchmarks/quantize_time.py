"""Seconds per quantization recipe on the demo student's shape, by calibration sample count.

    python benchmarks/quantize_time.py rtn-w4a16-asym:64 gptq-w4a16-sym:64 gptq-w8a16-sym:64 gptq-w8a16-sym:16 \
        mixed-w8attn-w4mlp:64 awq-w4a16-asym:16

The student is the demo's teacher (SmolLM2-135M-Instruct) with the block of six layers 12-17 dropped: the demo
student's 24 layers and shapes, without distilling one first. Calibration: 256-token sequences of random token ids
(the time does not depend on the text). Each `recipe:n` argument times `edgeflow.quantize.run.quantize` with
deployments/recipes/<recipe>.yaml, the demo profile's recipe overrides and the first n sequences: load, oneshot,
save compressed, weight errors, as the quantize stage runs it. Prints one RESULT line per argument.

Where the stage's thread matters (the demo's inline stages share one process, distill first):

    python benchmarks/quantize_time.py gptq-w4a16-sym:64 --train-steps 8            # distill's thread, after training
    python benchmarks/quantize_time.py gptq-w4a16-sym:64 --train-steps 8 --thread   # a new thread, as a mapped task

--train-steps runs that many AdamW steps of the student (bf16 autocast, 4 x 128 tokens, as distill does) in the
main thread first; --thread runs each quantization in a new thread, as Prefect's task runner runs a mapped task.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import os
import platform
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from edgeflow.paths import REPO_ROOT  # noqa: E402
from edgeflow.preflight import load_profile  # noqa: E402
from edgeflow.distill.student import keep_layers  # noqa: E402
from edgeflow.model.source import teacher_dir  # noqa: E402
from edgeflow.quantize.run import quantize  # noqa: E402
from edgeflow.quantize.recipe import load_recipe  # noqa: E402

DROPPED = range(12, 18)
SAMPLES = 64  # calibration sequences generated; a run uses the first n
RECIPES = REPO_ROOT / "deployments" / "recipes"


def student_cut(teacher: Path, out: Path) -> Path:
    """The teacher without layers 12-17 (the distill stage's keep_layers), saved once under `out`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if (out / "config.json").exists():
        return out
    model = AutoModelForCausalLM.from_pretrained(teacher, dtype=torch.float32)
    keep_layers(model, [i for i in range(model.config.num_hidden_layers) if i not in DROPPED]).save_pretrained(out)
    AutoTokenizer.from_pretrained(teacher).save_pretrained(out)
    return out


def train(student: Path, steps: int) -> None:
    """`steps` AdamW steps of the student on random ids under bf16 autocast, in this thread (what distill leaves)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(student, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randint(100, 40000, (4, 128), generator=g)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="recipe:samples, e.g. gptq-w8a16-sym:16")
    ap.add_argument("--profile", default="configs/demo-cpu.yaml")
    ap.add_argument("--work", default=".edgeflow/bench-quantize-time")
    ap.add_argument("--train-steps", type=int, default=0, help="training steps in the main thread before the runs")
    ap.add_argument("--thread", action="store_true", help="run each quantization in a new thread")
    a = ap.parse_args()
    runs = [r.partition(":")[::2] for r in a.runs]
    for (name, n), run in zip(runs, a.runs):
        if not n.isdigit() or not 1 <= int(n) <= SAMPLES:
            ap.error(f"run {run!r}: write recipe:samples with samples 1 to {SAMPLES}, e.g. gptq-w8a16-sym:16")
        if not (RECIPES / f"{name}.yaml").exists():
            ap.error(f"run {run!r}: no recipe deployments/recipes/{name}.yaml")
    profile = load_profile(REPO_ROOT / a.profile)
    work = REPO_ROOT / a.work
    student = student_cut(teacher_dir(profile), work / "student")
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(100, 40000, (256,), generator=g).tolist() for _ in range(SAMPLES)]
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}")
    if a.train_steps:
        train(student, a.train_steps)
    where = "a new thread" if a.thread else "the main thread"
    for name, n in runs:
        recipe = load_recipe(RECIPES / f"{name}.yaml", profile.quantize.recipe_overrides)
        start = time.perf_counter()
        if a.thread:
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                pool.submit(quantize, student, recipe, ids[: int(n)], work / f"{name}-{n}").result()
        else:
            quantize(student, recipe, ids[: int(n)], work / f"{name}-{n}")
        print(f"RESULT {name} samples={n} {time.perf_counter() - start:.1f} s in {where} "
              f"after {a.train_steps} training steps", flush=True)


if __name__ == "__main__":
    main()
