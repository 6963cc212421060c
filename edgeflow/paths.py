"""Where edgeflow's own files are: the repository (or installed tree) that holds configs/, data/ and deployments/,
and the user's cache, which outlives any checkout (models, compiled kernels and ops)."""
from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def user_cache() -> Path:
    """edgeflow's per-user cache, ~/.cache/edgeflow (as pip keeps its wheels; the Makefile keeps the llama.cpp wheel
    there too). Each user of it takes a directory of its own and may be pointed elsewhere by its own variable."""
    return Path.home() / ".cache" / "edgeflow"
