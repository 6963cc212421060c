"""Append-only JSONL access log, cut into immutable segments that a shipper takes home (one line per finished request).

    log = AccessLog(Path("access.jsonl"), max_bytes=64 << 20, backups=5, rotate_s=3600); log.write({"id": "x"})

The active file is `access.jsonl`. It is rotated before a line would push it past `max_bytes`, and once its first
line is `rotate_s` old (a timer checks, so a quiet device still produces segments). Rotation renames it to a segment,
`access-<UTC stamp of its first line>-<n>.jsonl` next to it, which is never written or renamed again: a shipper
(edgeflow/device/logship.py) hashes and uploads it, then marks it shipped with `mark_shipped` (a sidecar
`access-<stamp>-<n>.shipped` holding its sha256). A segment is deleted only once shipped, or when the segments
waiting to ship exceed the retention budget of `backups` × `max_bytes` bytes (the oldest go first, with a warning
naming each one): the same disk the log used before segments existed, however many small hourly segments it holds.
`backups=0` keeps no segment (nothing is shipped).

Each line is one write, flushed on its own: the log doubles as a record of what the deployed model was asked and
said, and a crash must lose at most the line being written. A write the disk refuses (full, over quota) leaves no
half line behind: the file is cut back to where the line began, and `write` raises OSError for the caller to count
(edgeflow/serving/state.py: the request is served all the same; a metric and an alert say records are being lost). Blue and green servers of one device share the file:
every write and rotation holds an exclusive lock on `.access.lock`, and a writer whose open file was rotated
away by the other process reopens `access.jsonl` before writing, so no line lands in a segment after it was cut.
"""
from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import threading
import time
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterator

log = logging.getLogger("edgeflow.access_log")

SHIPPED_SUFFIX = ".shipped"
STAMP_FORMAT = "%Y%m%dT%H%M%SZ"
_SEGMENT = re.compile(r"^(?P<stem>.+)-(?P<stamp>\d{8}T\d{6}Z)-(?P<n>\d+)$")
_FIRST_LINE_LIMIT = 1 << 20  # bytes read looking for the first line's `ts`


class AccessLog:
    """Thread- and process-safe JSONL writer; rotates on size and on age into immutable, shippable segments."""

    def __init__(self, path: Path, max_bytes: int, backups: int, rotate_s: float = 3600,
                 clock: Callable[[], float] = time.time) -> None:
        if max_bytes <= 0:
            raise ValueError(f"access log max_bytes={max_bytes}: must be positive")
        if backups < 0:
            raise ValueError(f"access log backups={backups}: must be >= 0")
        if rotate_s < 0:
            raise ValueError(f"access log rotate_s={rotate_s}: must be >= 0 (0 rotates on size only)")
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.backups = backups
        self.rotate_s = rotate_s
        self.dropped: list[str] = []  # segments deleted unshipped by the retention budget
        self._clock = clock
        self._lock = threading.Lock()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lockfile = open(lock_path(self.path), "ab")
        self._born: float | None = None  # when the active file's first line was written (epoch seconds)
        with self._exclusive():
            self._open()
            self._prune()
        self._stop = threading.Event()
        self._timer: threading.Thread | None = None
        if rotate_s > 0:
            self._timer = threading.Thread(target=self._age_loop, name="access-log-rotation", daemon=True)
            self._timer.start()

    @property
    def budget_bytes(self) -> int:
        """Bytes of unshipped segments kept before the oldest are deleted."""
        return self.backups * self.max_bytes

    def write(self, record: dict[str, Any]) -> None:
        data = (json.dumps(record, ensure_ascii=False, default=str) + "\n").encode("utf-8")
        with self._lock:
            if self._file.closed:
                return
            with self._exclusive():
                self._follow()
                size = os.fstat(self._file.fileno()).st_size  # the other server of the device may have appended
                # A single line larger than max_bytes still gets written (into a fresh file) rather
                # than dropped: losing a request record is worse than one oversized file.
                if size > 0 and (size + len(data) > self.max_bytes or self._due(self._clock())):
                    self._rotate()
                    size = 0
                if size == 0:
                    self._born = _record_time(record) or self._clock()
                self._append(data, size)

    def rotate(self) -> Path | None:
        """Cut the active file into a segment now (if it holds a line); returns the segment."""
        with self._lock:
            if self._file.closed:
                return None
            with self._exclusive():
                self._follow()
                return self._rotate()

    def maybe_rotate(self, now: float | None = None) -> Path | None:
        """Rotate if the active file's first line is `rotate_s` old at `now` (default: the clock); the timer calls this."""
        with self._lock:
            if self._file.closed:
                return None
            with self._exclusive():
                self._follow()
                return self._rotate() if self._due(self._clock() if now is None else now) else None

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            if not self._file.closed:
                self._file.close()
            if not self._lockfile.closed:
                self._lockfile.close()

    # -- internals (called with both locks held) --------------------------------------------------------------

    def _due(self, now: float) -> bool:
        return self.rotate_s > 0 and self._born is not None and now - self._born >= self.rotate_s

    def _append(self, data: bytes, size: int) -> None:
        """Write `data` at the end, whole or not at all: on a refused write the file is cut back to `size`."""
        fd, done = self._file.fileno(), 0
        try:
            while done < len(data):
                done += os.write(fd, data[done:])
        except OSError:
            if done:
                try:
                    os.ftruncate(fd, size)  # needs no free space: no half line for the shipper to choke on
                except OSError:
                    log.exception("access log: could not cut the half-written line off %s", self.path)
            raise

    def _open(self) -> None:
        # binary (the size check counts bytes, not characters) and unbuffered: each line is one os.write
        self._file = open(self.path, "ab", buffering=0)
        st = os.fstat(self._file.fileno())
        self._born = (first_line_time(self.path) or st.st_mtime) if st.st_size else None

    def _follow(self) -> None:
        """Reopen `path` when the file this writer holds was rotated away (by the other server of the device)."""
        try:
            moved = os.stat(self.path).st_ino != os.fstat(self._file.fileno()).st_ino
        except FileNotFoundError:
            moved = True
        if moved:
            self._file.close()
            self._open()

    def _rotate(self) -> Path | None:
        if os.fstat(self._file.fileno()).st_size == 0:
            return None
        self._file.close()
        segment = None
        if self.backups == 0:
            self.path.unlink(missing_ok=True)
        else:
            stamp = datetime.fromtimestamp(first_line_time(self.path) or self._born or self._clock(), timezone.utc)
            segment = _free_name(self.path, stamp.strftime(STAMP_FORMAT))
            os.rename(self.path, segment)  # under the lock, to a name that does not exist: nothing is overwritten
        self._open()
        self._prune()
        return segment

    def _prune(self) -> None:
        """Delete shipped segments; then the oldest unshipped ones while they exceed the retention budget."""
        remove_shipped(self.path, held=True)
        waiting = [(s, s.stat().st_size) for s in segments(self.path)]
        total = sum(size for _, size in waiting)
        for seg, size in waiting:
            if total <= self.budget_bytes:
                break
            seg.unlink(missing_ok=True)
            total -= size
            self.dropped.append(seg.name)
            log.warning("access log: deleted segment %s (%d bytes) before it was shipped: unshipped segments exceed "
                        "access_log_backups=%d x access_log_max_bytes=%d bytes; ship more often (edgeflow/pipeline/ship_logs.py) "
                        "or raise access_log_backups", seg.name, size, self.backups, self.max_bytes)

    @contextmanager
    def _exclusive(self) -> Iterator[None]:
        fcntl.flock(self._lockfile.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._lockfile.fileno(), fcntl.LOCK_UN)

    def _age_loop(self) -> None:
        interval = max(1.0, min(60.0, self.rotate_s / 10))
        while not self._stop.wait(interval):
            try:
                self.maybe_rotate()
            except Exception:  # a full disk must not end the timer: the next write reports it to the request
                log.exception("access log: age rotation of %s failed", self.path)


# -- the segment protocol, shared with the shipper (edgeflow/device/logship.py) --------------------------------------


def lock_path(path: Path) -> Path:
    """The lock every writer, rotation and shipper of one access log holds."""
    return Path(path).with_name(f".{Path(path).name.removesuffix('.jsonl')}.lock")  # not *.jsonl*: no log reader takes it


@contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold the access log's lock (for a process that is not its writer: the shipper)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path(path), "ab") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _segment_key(p: Path) -> tuple[str, int] | None:
    m = _SEGMENT.match(p.name[: -len(".jsonl")] if p.name.endswith(".jsonl") else "")
    return (m["stamp"], int(m["n"])) if m else None


def segments(path: Path) -> list[Path]:
    """The rotated segments of the access log at `path` not yet marked shipped, oldest first."""
    path = Path(path)
    stem = path.name.removesuffix(".jsonl")
    found = []
    for p in path.parent.glob(f"{stem}-*.jsonl"):
        key = _segment_key(p)
        if key and p.name.startswith(f"{stem}-{key[0]}-") and not shipped_marker(p).exists():
            found.append((key, p))
    return [p for _, p in sorted(found)]


def shipped_marker(segment: Path) -> Path:
    """The sidecar that says a segment is home: `<segment without .jsonl>.shipped`, holding its sha256."""
    return Path(segment).with_name(Path(segment).name.removesuffix(".jsonl") + SHIPPED_SUFFIX)


def identity(segment: Path) -> tuple[int, int, int]:
    """What tells one segment file from another of the same name (inode, size, mtime): the retention budget may
    delete a segment while it ships, and a later rotation may reuse its name."""
    st = os.stat(segment)
    return st.st_ino, st.st_size, st.st_mtime_ns


def mark_shipped(segment: Path, sha256: str, expected: tuple[int, int, int] | None = None) -> bool:
    """Record that the store holds `segment` (its sha256 written into the marker, atomically), under the log's
    lock. With `expected` (its `identity` when it was hashed), a segment that is gone or is another file by now is
    not marked: returns False."""
    segment = Path(segment)
    name = segment.name.removesuffix(".jsonl")
    marker = shipped_marker(segment)
    with locked(segment.with_name(f"{_SEGMENT.match(name)['stem']}.jsonl") if _SEGMENT.match(name) else segment):
        try:
            if expected is not None and identity(segment) != expected:
                return False
        except FileNotFoundError:
            return False
        tmp = marker.with_name(f".{marker.name}.tmp")
        tmp.write_text(sha256 + "\n")
        os.replace(tmp, marker)
    return True


def remove_shipped(path: Path, held: bool = False) -> list[str]:
    """Delete the shipped segments of the log at `path` and their markers (and markers left without a segment);
    `held`: the caller already holds the log's lock."""
    path = Path(path)
    stem = path.name.removesuffix(".jsonl")

    def sweep() -> list[str]:
        removed = []
        for marker in path.parent.glob(f"{stem}-*{SHIPPED_SUFFIX}"):
            seg = marker.with_name(marker.name.removesuffix(SHIPPED_SUFFIX) + ".jsonl")
            if seg.exists():
                seg.unlink()
                removed.append(seg.name)
            marker.unlink(missing_ok=True)
        return removed

    if held:
        return sweep()
    with locked(path):
        return sweep()


def _free_name(path: Path, stamp: str) -> Path:
    """The next segment name of this stamp: one past the highest number it has (a deleted one's is not taken again
    while a later one of the same second remains; `identity` covers the rest)."""
    stem = path.name.removesuffix(".jsonl")
    taken = [int(m["n"]) for p in path.parent.glob(f"{stem}-{stamp}-*")
             if (m := _SEGMENT.match(p.name.removesuffix(".jsonl").removesuffix(SHIPPED_SUFFIX))) and m["stem"] == stem]
    return path.with_name(f"{stem}-{stamp}-{max(taken, default=0) + 1}.jsonl")


def _record_time(record: dict[str, Any]) -> float | None:
    ts = record.get("ts")
    if not isinstance(ts, str):
        return None
    try:
        t = datetime.fromisoformat(ts.replace("Z", "+00:00"))
    except ValueError:
        return None
    return t.timestamp() if t.tzinfo else None


def first_line_time(path: Path) -> float | None:
    """The `ts` of the file's first line (epoch seconds), or None when it has none."""
    try:
        with open(path, "rb") as f:
            line = f.readline(_FIRST_LINE_LIMIT)
    except FileNotFoundError:
        return None
    try:
        rec = json.loads(line)
    except ValueError:
        return None
    return _record_time(rec) if isinstance(rec, dict) else None
