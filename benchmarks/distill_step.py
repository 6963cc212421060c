"""One CPU distillation step under each allocator setting and precision: seconds, kernel time and page faults.

    python benchmarks/distill_step.py --teacher .edgeflow/demo-cpu/models/teacher-<hash> --rounds 2

The step is the demo's shape: SmolLM2-135M-Instruct as the teacher (no gradient) and a 24-layer cut of it as the
student, 4 sequences of 128 tokens, a KL loss on the full vocabulary, backward and an AdamW step. Each
(allocator, precision) pair runs in a fresh interpreter, since the malloc settings are per process: `on` is what
every stage process does (edgeflow/ops/allocator.py, applied before torch loads), `off` is glibc's defaults; `bf16` is
distill.mixed_precision's autocast, `fp32` none. One warm-up step, then --steps timed; rounds alternate the pairs.
Prints a markdown row per measurement with the CPU model and its ISA flags (edgeflow/engines/cpu_host.py).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

STEP = r"""
import json, os, resource, sys, time
if os.environ["BENCH_MALLOC"] == "on":
    from edgeflow.ops.allocator import tune
    tune()
import torch
from transformers import AutoModelForCausalLM
teacher_dir, steps, precision = sys.argv[1], int(sys.argv[2]), sys.argv[3]
teacher = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32).requires_grad_(False)
student = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32)
student.model.layers = student.model.layers[:24]
opt = torch.optim.AdamW(student.parameters(), lr=1e-4)
torch.manual_seed(0)
x = torch.randint(0, teacher.config.vocab_size, (4, 128))

def step():
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
        with torch.no_grad():
            t = teacher(x, output_hidden_states=True)
        s = student(x, output_hidden_states=True)
    loss = torch.nn.functional.kl_div(s.logits.float().log_softmax(-1), t.logits.float().log_softmax(-1),
                                      log_target=True, reduction="batchmean")
    loss.backward(); opt.step(); opt.zero_grad()

step()
r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
for _ in range(steps):
    step()
r1, dt = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter() - t0
print(json.dumps({"s_per_step": dt / steps, "user_s": (r1.ru_utime - r0.ru_utime) / steps,
                  "sys_s": (r1.ru_stime - r0.ru_stime) / steps, "minor_faults": (r1.ru_minflt - r0.ru_minflt) / steps}))
"""


def measure(teacher: Path, steps: int, malloc: str, precision: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"} | {"BENCH_MALLOC": malloc, "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", STEP, str(teacher), str(steps), precision], cwd=REPO, env=env,
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--teacher", type=Path, required=True, help="a converted teacher directory (model.safetensors)")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per measurement")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds over the four pairs")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    from edgeflow.engines.cpu_host import device_fingerprint

    fp = device_fingerprint()
    print(f"CPU: {fp['cpu_model']}, {fp['cores']} cores, ISA {' '.join(fp['isa'])}")
    print("| allocator | precision | s/step | user s/step | kernel s/step | page faults/step |\n|---|---|---|---|---|---|")
    for _ in range(args.rounds):
        for malloc in ("off", "on"):
            for precision in ("fp32", "bf16"):
                r = measure(args.teacher, args.steps, malloc, precision)
                print(f"| {malloc} | {precision} | {r['s_per_step']:.2f} | {r['user_s']:.2f} | {r['sys_s']:.2f} | "
                      f"{r['minor_faults']:,.0f} |", flush=True)


if __name__ == "__main__":
    main()
