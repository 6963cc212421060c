"""Gate plots as PNG files: per-layer quantization error, agreement histogram, KL distribution."""
from __future__ import annotations

from pathlib import Path

import numpy as np


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # workers and CI have no display
    import matplotlib.pyplot as plt

    return plt


def layer_error_plot(errors: dict[str, list[float]], out: Path) -> Path:
    """One line per variant: relative error of each decoder layer's output vs the FP reference, by depth."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    for variant, e in sorted(errors.items()):
        ax.plot(range(len(e)), e, marker=".", label=variant)
    ax.set_yscale("log")
    ax.set_xlabel("decoder layer (output hidden states; the last one after the final norm)")
    ax.set_ylabel("relative error ‖h_ref − h‖ / ‖h_ref‖")
    ax.set_title("Per-layer quantization error on the evaluation set")
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
