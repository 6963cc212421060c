"""Hand-offs through the artifact store: a stage publishes its output, any host materializes it by URI + sha256.

    python -m edgeflow.tracking.store fetch mlflow-artifacts:/1/<run>/artifacts/student <sha256>    (prints the verified local path)

Hosts share no disk: the A100 node, the cpu host and the Jetsons share the MLflow tracking server and
the artifact store it proxies (`mlflow server --artifacts-destination …`: run artifact URIs are
`mlflow-artifacts:/…`), or an `s3://…` bucket when the experiment's artifact location is one
(registry.artifact_location). A stage logs its output to its own MLflow run and hands on an ArtifactRef
whose `uri` is that store URI; it never hands on a path.

A consuming host materializes the artifact into its own content-addressed cache,
`<EDGEFLOW_HOME>/cache/artifacts/<sha256>/<name>`, and checks the sha256 before every use: a cache entry is
hashed again, not trusted, unless this process hashed it (or seeded it) and no file of it has changed size,
mtime or inode since. The producer seeds its own cache with hard links to what it just wrote (one host, one
file system), so a stage placed on the same host as its upstream downloads nothing.
"""
from __future__ import annotations

import argparse
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

from edgeflow.tracking.artifacts import ArtifactRef, ChecksumError, sha256_tree
from edgeflow.paths import REPO_ROOT

# URI schemes an ArtifactRef of a stage output may carry: the tracking server's proxied store, a bucket,
# or a run-relative URI the tracking server resolves.
STORE_SCHEMES = ("mlflow-artifacts:", "s3://", "gs://", "runs:/", "http://", "https://")


class ArtifactMissing(RuntimeError):
    """The artifact a reference names is not (or no longer) in the store."""


def cache_root() -> Path:
    """This host's content-addressed artifact cache (under EDGEFLOW_HOME, never shared with another host)."""
    return Path(os.environ.get("EDGEFLOW_HOME", REPO_ROOT / ".edgeflow")).resolve() / "cache" / "artifacts"


# Cache entries this process hashed (or seeded from what it had just hashed), with their files' (path, size, mtime,
# inode) at that moment. A release's stages run in one process on one host and materialize the same student and
# checkpoints 5-10 times each: re-hashing them took 9.7 s of the CPU demo's release.
_VERIFIED: dict[Path, tuple] = {}


def _signature(path: Path) -> tuple:
    """(relative path, size, mtime, inode) of each file under path (or of path itself)."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return tuple((p.relative_to(path).as_posix(), st.st_size, st.st_mtime_ns, st.st_ino) for p in files for st in (p.stat(),))


def is_store_uri(uri: str) -> bool:
    return uri.startswith(STORE_SCHEMES)


def tracking_uri() -> str:
    """The MLflow tracking server every host talks to (its artifact store is this module's store)."""
    return os.environ.get("MLFLOW_TRACKING_URI", "http://127.0.0.1:5055")


def publish(client: Any, run_id: str, local: Path, artifact_path: str, kind: str, meta: dict | None = None,
            sha256: str | None = None) -> ArtifactRef:
    """Log a file or directory to `run_id` under `artifact_path` and return its store reference.

    A directory is logged as `<artifact_path>` itself; a file as `<artifact_path>/<file name>`. The
    reference's sha256 is the file's hash, or the tree hash of the directory (its edgeflow manifest excluded);
    pass it when the caller has just computed it.
    """
    local = Path(local)
    sha = sha256 or sha256_tree(local)
    base = client.get_run(run_id).info.artifact_uri.rstrip("/")
    if local.is_dir():
        client.log_artifacts(run_id, str(local), artifact_path)
        uri = f"{base}/{artifact_path}"
    else:
        client.log_artifact(run_id, str(local), artifact_path)
        uri = f"{base}/{artifact_path}/{local.name}"
    ref = ArtifactRef(kind=kind, uri=uri, sha256=sha, mlflow_run_id=run_id, meta=meta or {})
    seed(local, sha, ref.name)  # under the store's name: a consumer on this host sees what a download would give
    return ref


def link_or_copy(src: str | Path, dst: str | Path) -> None:
    """A hard link where the file system allows (files of this host, on this host), a copy otherwise."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _copy_tree(src: Path, dst: Path) -> None:
    if src.is_dir():
        shutil.copytree(src, dst, copy_function=link_or_copy)
    else:
        dst.parent.mkdir(parents=True, exist_ok=True)
        link_or_copy(src, dst)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _install(staged: Path, dest: Path) -> Path:
    """Move a staged copy into the cache as `dest` in one rename; a copy another process put there first wins
    (same sha256, same content). One sha256 may be cached under several names (a file published twice)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.rename(staged, dest)
    except OSError:
        if not dest.exists():
            raise
        _remove(staged)
    return dest


def seed(local: Path, sha: str, name: str) -> Path:
    """Put what this host just produced into its own cache under its hash (no download for a local consumer)."""
    dest = cache_root() / sha / name
    if dest.exists():
        return dest
    tmp = cache_root() / f".seed-{sha[:16]}-{uuid.uuid4().hex[:8]}"
    try:
        _copy_tree(local, tmp / name)
        sig = _signature(tmp / name)
        installed = _install(tmp / name, dest)
        if _signature(installed) == sig:  # our copy of what the caller just hashed (a rename keeps inodes), not another's
            _VERIFIED[installed] = sig
        return installed
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def materialize(ref: ArtifactRef) -> Path:
    """The artifact as a verified local file or directory on this host: from the cache, else from the store.

    Raises ChecksumError (naming the artifact, both hashes and the producing run) when the store's copy does
    not hash to the reference's sha256, and ArtifactMissing when the store does not have it.
    """
    if not is_store_uri(ref.uri):
        raise ValueError(
            f"{ref.kind} artifact uri={ref.uri!r} is not an artifact-store URI ({', '.join(STORE_SCHEMES)}): a path is only "
            "readable on the host that wrote it. Stages hand on what edgeflow.tracking.store.publish returns; re-run the producing stage."
        )
    dest = cache_root() / ref.sha256 / ref.name
    if dest.exists():
        sig = _signature(dest)
        if _VERIFIED.get(dest) == sig or sha256_tree(dest) == ref.sha256:
            _VERIFIED[dest] = sig
            return dest
        _VERIFIED.pop(dest, None)
        _remove(dest)  # a cached copy changed after it was verified (edited in place, disk fault): fetch it again
    tmp = cache_root() / f".download-{ref.sha256[:16]}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    try:
        local = Path(_download(ref, tmp))
        actual = sha256_tree(local)
        if actual != ref.sha256:
            raise ChecksumError(
                f"{ref.kind} artifact {ref.uri} (MLflow run {ref.mlflow_run_id}): downloaded sha256 {actual} does not match "
                f"the reference's {ref.sha256}; the store's copy was changed or damaged after the run logged it. Re-run the "
                "stage that produced it (Retry recomputes it once its cached result is refreshed)."
            )
        return _install(local, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _download(ref: ArtifactRef, dst: Path) -> str:
    import mlflow.artifacts
    from mlflow.exceptions import MlflowException

    try:
        return mlflow.artifacts.download_artifacts(artifact_uri=ref.uri, dst_path=str(dst), tracking_uri=tracking_uri())
    except (MlflowException, OSError) as e:
        if not in_store(ref):
            raise ArtifactMissing(
                f"{ref.kind} artifact {ref.uri} (MLflow run {ref.mlflow_run_id}) is not in the artifact store (the download "
                f"said: {' '.join(str(e).split())[:300]}). Re-run the stage that produced it."
            ) from e
        raise


def source_url(uri: str) -> str:
    """A URL that names the artifact outside MLflow's client (a dataset input's source): the tracking server's
    artifact proxy endpoint for mlflow-artifacts:/…, the URI itself for a bucket."""
    if uri.startswith("mlflow-artifacts:"):
        return f"{tracking_uri().rstrip('/')}/api/2.0/mlflow-artifacts/artifacts/{uri.removeprefix('mlflow-artifacts:').lstrip('/')}"
    return uri


def in_store(ref: ArtifactRef) -> bool:
    """Does the store still hold the artifact? (a listing of its parent, no download)"""
    import mlflow.artifacts
    from mlflow.exceptions import MlflowException

    parent = ref.uri.rstrip("/").rpartition("/")[0]
    try:
        listing = mlflow.artifacts.list_artifacts(artifact_uri=parent, tracking_uri=tracking_uri())
    except (MlflowException, OSError):
        return False
    return any(f.path.rstrip("/").rsplit("/", 1)[-1] == ref.name for f in listing or [])


def check_reachable(uri: str) -> None:
    """Fail before any compute when the tracking server (and so its artifact store) does not answer."""
    import httpx

    try:
        ok = httpx.get(f"{uri.rstrip('/')}/health", timeout=5).status_code == 200
    except httpx.HTTPError as e:
        ok, why = False, str(e)
    else:
        why = "no 200 from /health"
    if not ok:
        raise ConnectionError(
            f"MLFLOW_TRACKING_URI={uri} does not answer ({why}); every hand-off goes through its artifact store. Start the "
            "tracking server (`make services`) or point MLFLOW_TRACKING_URI at it."
        )


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fetch", help="materialize one artifact into this host's cache and print its path")
    f.add_argument("uri")
    f.add_argument("sha256")
    f.add_argument("--kind", default="artifact")
    a = ap.parse_args()
    print(materialize(ArtifactRef(kind=a.kind, uri=a.uri, sha256=a.sha256)))
