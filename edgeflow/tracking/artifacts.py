"""Typed artifact references: what stages hand each other instead of tensors."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

MANIFEST = "edgeflow-manifest.json"


class ArtifactRef(BaseModel):
    """A stage output: where it lives, what it hashes to, which MLflow run produced it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: str = Field(description="Artifact kind: teacher, student, calibration, quantized, engine, report.")
    uri: str = Field(
        description="Where any host fetches it: an artifact-store URI (mlflow-artifacts:/…, s3://…) for stage outputs and "
        "release inputs (edgeflow/tracking/store.py materializes and verifies it); a source URI (pypi-gguf:…, local:…) for the teacher.",
    )
    sha256: str = Field(description="Content hash of the file, or of the sorted per-file hashes of a directory.")
    mlflow_run_id: str | None = Field(default=None, description="MLflow run that produced and logged it.")
    meta: dict = Field(default_factory=dict, description="Small, JSON-serialisable facts about it (variant, recipe, stats).")

    @property
    def name(self) -> str:
        """The file or directory name the URI ends in (what a download of it is called)."""
        return self.uri.rstrip("/").rsplit("/", 1)[-1]


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    """Hash one file in chunks (checkpoints are too large to read at once)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def file_hashes(root: Path) -> dict[str, str]:
    """Per-file sha256 of a directory, keyed by relative POSIX path; the manifest itself is excluded."""
    return {
        p.relative_to(root).as_posix(): sha256_file(p)
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != MANIFEST
    }


def sha256_tree(root: Path) -> str:
    """One hash for a file or a directory (hash of its sorted per-file hashes)."""
    root = Path(root)
    if root.is_file():
        return sha256_file(root)
    return sha256_json(file_hashes(root))


def sha256_json(obj) -> str:
    """Stable hash of a JSON-serialisable object (used for cache keys of configs)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def write_manifest(root: Path) -> str:
    """Write per-file hashes next to the files, so a downloader can verify each one; returns the tree hash."""
    hashes = file_hashes(root)
    (root / MANIFEST).write_text(json.dumps(hashes, indent=1, sort_keys=True))
    return sha256_json(hashes)


class ChecksumError(RuntimeError):
    """A downloaded artifact does not match the hashes it was registered with."""


def verify_manifest(root: Path, expected_tree_sha: str | None = None) -> None:
    """Check every file against the manifest (and the tree hash); raise naming the first bad file."""
    manifest_path = root / MANIFEST
    if not manifest_path.exists():
        raise ChecksumError(f"{root}: no {MANIFEST}; the artifact was not written by edgeflow or is incomplete")
    expected = json.loads(manifest_path.read_text())
    actual = file_hashes(root)
    missing = sorted(set(expected) - set(actual))
    if missing:
        raise ChecksumError(f"{root}: files missing from the download: {missing[:5]}")
    for rel, sha in expected.items():
        if actual[rel] != sha:
            raise ChecksumError(f"{root / rel}: sha256 {actual[rel][:12]}… does not match the manifest's {sha[:12]}…")
    if expected_tree_sha and sha256_json(expected) != expected_tree_sha:
        raise ChecksumError(
            f"{root}: manifest hash {sha256_json(expected)[:12]}… differs from the registered {expected_tree_sha[:12]}…"
        )
