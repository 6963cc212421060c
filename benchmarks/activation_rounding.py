"""How far the native engine's int16 activations move the logits of a quantized checkpoint.

    python benchmarks/activation_rounding.py --quantized INT4_DIR [--tokens 64]

Loads the fake-quantized model (transformers' dequantized reload of the compressed-tensors checkpoint,
fp32), greedily continues 5 chat prompts, then scores prompt + continuation twice: as is, and with
every decoder Linear's input rounded the way `native/q4.c` rounds it (int16 per 64-element group,
scale max|x| / 32767, round half to even). Prints the largest |Δlogit|, the largest |logit| and how
many greedy next-token choices differ. The lm_head is left alone: the engine's head is exact.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

PROMPTS = ("Explain how a computer works, step by step, in detail.", "What is the capital of France?",
           "Write a haiku about the sea.", "List three prime numbers.", "Solve 12*7+3.")


def int16_groups(x: torch.Tensor, group: int = 64) -> torch.Tensor:
    """x rounded to int16 per `group` elements of its last axis, returned dequantized."""
    shape = x.shape
    g = x.reshape(-1, shape[-1] // group, group)
    step = g.abs().amax(-1, keepdim=True) / 32767
    q = torch.where(step > 0, torch.round(g / torch.where(step > 0, step, 1)), 0)
    return (q * step).reshape(shape)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quantized", type=Path, required=True, help="llm-compressor int4 checkpoint")
    ap.add_argument("--tokens", type=int, default=64, help="greedy tokens per prompt")
    args = ap.parse_args(argv)

    from transformers import AutoTokenizer

    from edgeflow.engines.checkpoint import load_dequantized

    model = load_dequantized(args.quantized).float().eval()
    tok = AutoTokenizer.from_pretrained(args.quantized)
    linears = [m for m in model.model.modules() if isinstance(m, torch.nn.Linear)]
    max_diff = max_logit = 0.0
    differ = steps = 0
    for prompt in PROMPTS:
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)["input_ids"]
        with torch.no_grad():
            seq = model.generate(ids, max_new_tokens=args.tokens, do_sample=False)
            ref = model(seq).logits[0]
            hooks = [m.register_forward_pre_hook(lambda _m, a: (int16_groups(a[0]),)) for m in linears]
            try:
                got = model(seq).logits[0]
            finally:
                for h in hooks:
                    h.remove()
        n = ids.shape[1]
        max_diff = max(max_diff, float((ref - got).abs().max()))
        max_logit = max(max_logit, float(ref.abs().max()))
        differ += int((ref[n - 1:-1].argmax(-1) != got[n - 1:-1].argmax(-1)).sum())
        steps += seq.shape[1] - n
    out = {"max_abs_logit_diff": max_diff, "max_abs_logit": max_logit, "relative": max_diff / max_logit,
           "greedy_steps": steps, "greedy_steps_that_differ": differ}
    print(out)
    return out


if __name__ == "__main__":
    main()
