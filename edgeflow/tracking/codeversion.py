"""Which edgeflow code a host runs: the package version plus a hash of its source.

    python -m edgeflow.tracking.codeversion          (prints e.g. 0.1.0+3f2a9c1d0b4e)

A release records its host's identity in its ReleaseContext; a stage that lands on a worker whose
checkout differs refuses to run (edgeflow/pipeline/stages.py), naming both, instead of computing with other code.
"""
from __future__ import annotations

import hashlib
from functools import lru_cache
from importlib.metadata import PackageNotFoundError, version

from edgeflow.paths import REPO_ROOT

# What decides what a stage computes: the packages' Python, the native kernels' C, the chat page.
SOURCE_DIRS = ("edgeflow",)
SOURCE_SUFFIXES = (".py", ".c", ".h", ".html")


class CodeMismatchError(RuntimeError):
    """A stage was sent to a worker whose edgeflow code is not the release's."""


@lru_cache(maxsize=1)
def code_identity() -> str:
    """`<package version>+<first 12 hex of the sha256 over every source file's path and content>`."""
    h = hashlib.sha256()
    for d in SOURCE_DIRS:
        for f in sorted((REPO_ROOT / d).rglob("*")):
            if f.suffix in SOURCE_SUFFIXES and "__pycache__" not in f.parts and f.is_file():
                h.update(f.relative_to(REPO_ROOT).as_posix().encode() + b"\0" + hashlib.sha256(f.read_bytes()).digest())
    try:
        v = version("edgeflow")
    except PackageNotFoundError:
        v = "0+unknown"
    return f"{v}+{h.hexdigest()[:12]}"


def require_same_code(expected: str, where: str) -> None:
    """Raise CodeMismatchError naming both identities when this host's code is not `expected`."""
    here = code_identity()
    if here != expected:
        raise CodeMismatchError(
            f"{where}: this worker runs edgeflow {here}, the release was started with {expected}. Check out the release's "
            f"commit on this host (and reinstall) or restart the release from a host with this code; a stage never runs "
            "mismatched code."
        )


if __name__ == "__main__":
    print(code_identity())
