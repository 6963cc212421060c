"""A registered version fetched from the registry onto this device: its package verified against its manifest,
the room it needs checked first (DiskFull names the bytes), and a package's content hash.
"""
from __future__ import annotations

import errno
import json
import os
import shutil
import time
from pathlib import Path

from edgeflow.profile import Profile
from edgeflow.tracking.artifacts import ChecksumError, verify_manifest


def fetch_version(profile: Profile, alias: str, version: str | None = None) -> tuple[str, Path]:
    """Download models:/<name>@<alias> (or version `version`, when given) into its own versioned directory and
    verify every sha256.

    The directory is named by version *and* package hash: a device that was once served by another
    registry (or a re-created one whose numbering restarted) never mistakes an old `v2` for the new one.
    A present but corrupted copy is moved aside (kept for inspection) and downloaded again.
    """
    from edgeflow.tracking.registry import PACKAGE_SHA256_TAG, client, download

    name = profile.registry.model_name
    mv = client().get_model_version(name, version) if version else client().get_model_version_by_alias(name, alias)
    expected = mv.tags.get(PACKAGE_SHA256_TAG)
    dest = profile.resolve(profile.deploy.install_dir) / "versions" / f"v{mv.version}-{(expected or 'unhashed')[:12]}"
    if (dest / "edgeflow-manifest.json").exists():
        try:
            verify_manifest(dest, expected)
            return mv.version, dest
        except ChecksumError as e:
            aside = dest.with_name(f"{dest.name}.corrupt-{int(time.time())}")
            print(f"{dest} failed verification ({e}); moved to {aside.name}, downloading again")
            dest.rename(aside)
    tmp = dest.with_name(dest.name + ".download")
    shutil.rmtree(tmp, ignore_errors=True)
    needed = package_bytes(name, mv.version)
    require_space(tmp.parent, needed, f"version {mv.version} of {name}")
    try:
        _, local = download(name, alias, tmp, version=mv.version)
    except Exception as e:
        # MLflow's download reports a disk that filled mid-way (another writer took the room require_space saw, or
        # the inodes ran out) as "Failed to download artifacts", its OSError swallowed: the disk itself tells
        full = isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT) or _cannot_hold(tmp, needed)
        shutil.rmtree(tmp, ignore_errors=True)  # no partial package stays behind
        if full:
            raise DiskFull(tmp.parent, needed, f"version {mv.version} of {name}") from e
        raise
    local.rename(dest) if local != tmp else tmp.rename(dest)
    verify_manifest(dest, expected)
    return mv.version, dest


def _cannot_hold(partial: Path, needed: int) -> bool:
    """After a failed download into `partial`: the disk under it has no inode left, or less room than the rest of
    the package (`needed` bytes in all, less what `partial` already holds)."""
    if not partial.parent.exists():
        return False
    written = sum(f.stat().st_size for f in partial.rglob("*") if f.is_file()) if partial.exists() else 0
    st = os.statvfs(partial.parent)
    return st.f_favail == 0 or st.f_bavail * st.f_frsize < needed - written


class DiskFull(OSError):
    """The device's disk cannot hold a package: nothing was switched, and no partial file was left."""

    def __init__(self, where: Path, needed: int, what: str) -> None:
        free = shutil.disk_usage(where).free if where.exists() else 0
        super().__init__(errno.ENOSPC, (
            f"{where}: {what} needs {needed:,} bytes ({needed / 2**20:.1f} MiB) and the disk has {free:,} free; "
            f"the serving version is untouched. Free space (old packages under {where} that no alias names can go) "
            "or point deploy.install_dir at a larger disk, then run the deploy again"))


def package_bytes(name: str, version: str) -> int:
    """Bytes of a registered version's files (MLflow's artifact listing, walked)."""
    from edgeflow.tracking.registry import client

    c = client()
    mv = c.get_model_version(name, version)
    run_id, _, root = mv.source.removeprefix("runs:/").partition("/")  # runs:/<run id>/<path>: edgeflow/tracking/registry.py
    total, pending = 0, [root]
    while pending:
        for f in c.list_artifacts(run_id, pending.pop()):
            if f.is_dir:
                pending.append(f.path)
            else:
                total += f.file_size or 0
    return total


# Room kept free beside a package: its unpacking, logs and the engine a device may build from it.
SPACE_MARGIN = 1.10


def require_space(where: Path, needed: int, what: str) -> None:
    """Refuse before downloading when the disk under `where` cannot hold `needed` bytes (plus SPACE_MARGIN)."""
    where.mkdir(parents=True, exist_ok=True)
    if shutil.disk_usage(where).free < needed * SPACE_MARGIN:
        raise DiskFull(where, int(needed * SPACE_MARGIN), what)


def package_sha256(package: Path) -> str | None:
    """The tree hash of an installed package, read from its manifest (what write_manifest returned when it was
    packaged, and fetch_version verified against the version's tag); None when it has no readable manifest."""
    from edgeflow.tracking.artifacts import MANIFEST, sha256_json

    try:
        return sha256_json(json.loads((Path(package) / MANIFEST).read_text()))
    except (OSError, ValueError):
        return None
