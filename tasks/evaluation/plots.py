"""Gate plots as PNG files: per-layer quantization error, agreement histogram, KL distribution."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # workers and CI have no display
    import matplotlib.pyplot as plt

    return plt


def _short(layer: str) -> str:
    """model.layers.3.self_attn.q_proj -> 3.q"""
    m = re.search(r"layers\.(\d+)\.\w+\.(\w+?)_proj", layer)
    return f"{m.group(1)}.{m.group(2)}" if m else layer


def layer_error_plot(errors: dict[str, dict[str, float]], out: Path) -> Path:
    """One line per variant: relative weight error ‖W−Ŵ‖/‖W‖ of each quantized Linear, in model order."""
    plt = _pyplot()
    layers = sorted({name for e in errors.values() for name in e},
                    key=lambda n: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", n)])
    fig, ax = plt.subplots(figsize=(max(8, len(layers) * 0.12), 4))
    for variant, e in sorted(errors.items()):
        ax.plot(range(len(layers)), [e.get(n, np.nan) for n in layers], marker=".", label=variant)
    step = max(1, len(layers) // 40)
    ax.set_xticks(range(0, len(layers), step), [_short(n) for n in layers[::step]], rotation=90, fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("relative weight error")
    ax.set_title("Per-layer quantization error (layer.projection)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def agreement_histogram(per_sequence: dict[str, list[float]], threshold: float, out: Path) -> Path:
    """Histogram of per-prompt top-1 agreement with the FP reference, one series per variant."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    bins = np.linspace(0, 1, 41)
    for variant, values in sorted(per_sequence.items()):
        ax.hist(values, bins=bins, histtype="step", linewidth=1.5, label=f"{variant} (mean {np.mean(values):.1%})")
    ax.axvline(threshold, color="k", linestyle="--", linewidth=1, label=f"gate {threshold:.1%}")
    ax.set_xlabel("top-1 agreement with the FP reference, per prompt")
    ax.set_ylabel("prompts")
    ax.set_title("Agreement histogram")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def kl_distribution(kl: dict[str, np.ndarray], threshold: float, out: Path) -> Path:
    """Distribution of per-token KL(reference ‖ variant) on log-spaced bins, one series per variant."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    positive = np.concatenate([v[v > 0] for v in kl.values()] or [np.ones(1)])
    lo = max(float(positive.min()) if positive.size else 1e-6, 1e-8)
    hi = max(float(positive.max()) if positive.size else 1.0, lo * 10)
    bins = np.logspace(np.log10(lo), np.log10(hi), 50)
    for variant, values in sorted(kl.items()):
        ax.hist(np.clip(values, lo, None), bins=bins, histtype="step", linewidth=1.5,
                label=f"{variant} (mean {values.mean():.4f}, p99 {np.percentile(values, 99):.4f})")
    ax.axvline(threshold, color="k", linestyle="--", linewidth=1, label=f"gate mean ≤ {threshold}")
    ax.set_xscale("log")
    ax.set_xlabel("KL(FP reference ‖ variant) per token, nats")
    ax.set_ylabel("tokens")
    ax.set_title("KL distribution")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
