"""Where edgeflow's own files are: the repository (or installed tree) that holds configs/, data/ and deployments/."""
from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
