"""Append-only JSONL access log with size-based rotation (one line per finished request).

    log = AccessLog(Path("access.jsonl"), max_bytes=64 << 20, backups=5); log.write({"id": "x"})

Rotation works like logging's RotatingFileHandler (`access.jsonl` -> `.1` -> `.2` … up to
`backups`), but is written here so that a line is never split across files and each line is
flushed on its own: the log doubles as a record of what the deployed model was asked and said,
and a crash must lose at most the line being written.
"""
from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any


class AccessLog:
    """Thread-safe JSONL writer; rotates before a line would push the file past `max_bytes`."""

    def __init__(self, path: Path, max_bytes: int, backups: int) -> None:
        if max_bytes <= 0:
            raise ValueError(f"access log max_bytes={max_bytes}: must be positive")
        if backups < 0:
            raise ValueError(f"access log backups={backups}: must be >= 0")
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.backups = backups
        self._lock = threading.Lock()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "ab")  # binary: the size check counts bytes, not characters
        self._size = self._file.tell()

    def write(self, record: dict[str, Any]) -> None:
        data = (json.dumps(record, ensure_ascii=False, default=str) + "\n").encode("utf-8")
        with self._lock:
            if self._file.closed:
                return
            # A single line larger than max_bytes still gets written (into a fresh file) rather
            # than dropped: losing a request record is worse than one oversized file.
            if self._size > 0 and self._size + len(data) > self.max_bytes:
                self._rotate()
            self._file.write(data)
            self._file.flush()
            self._size += len(data)

    def _rotate(self) -> None:
        self._file.close()
        if self.backups == 0:
            self.path.unlink(missing_ok=True)
        else:
            for i in range(self.backups - 1, 0, -1):
                src = self.path.with_name(f"{self.path.name}.{i}")
                if src.exists():
                    os.replace(src, self.path.with_name(f"{self.path.name}.{i + 1}"))
            os.replace(self.path, self.path.with_name(f"{self.path.name}.1"))
        self._file = open(self.path, "ab")
        self._size = 0

    def close(self) -> None:
        with self._lock:
            if not self._file.closed:
                self._file.close()
