"""A free TCP port on loopback, for a server a test starts (the OS picks it; nothing else in the suite binds it)."""
from __future__ import annotations

import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
