"""A host in a network namespace of its own, joined to this one by a veth pair whose link a test can cut.

The host side of the pair has `<prefix>.1`, the namespace side `<prefix>.2` (a /30). Servers that listen on
`<prefix>.1` are reached from the namespace over the link, and from this namespace too (a local address answers
whether its link is up or down). Cutting the link is `ip link set <host side> down`: every packet between the
namespace and the servers is lost, as when a device's network goes; the processes in the namespace run on.

`forward(port)` lets this namespace's clients reach a server that listens on loopback inside the namespace (the
device's own clients, who sit on the device): a listening socket made here, handed to a forwarder that runs inside
the namespace (tests/helpers/netns_forward.py). It does not cross the link, so it answers while the link is cut.
Root only (`ip netns`).
"""
from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

FORWARDER = Path(__file__).with_name("netns_forward.py")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed ({r.returncode}): {r.stderr.strip()}")
    return r


class Link:
    def __init__(self, ns: str, prefix: str, ifname: str):
        self.ns = ns
        self.outer, self.inner = f"{ifname}-o", f"{ifname}-i"  # interface names: 15 characters at most
        self.outer_ip, self.inner_ip = f"{prefix}.1", f"{prefix}.2"
        self.forwarders: list[subprocess.Popen] = []

    def create(self) -> None:
        self.remove()  # what an earlier, killed session left
        _ip("netns", "add", self.ns)
        _ip("link", "add", self.outer, "type", "veth", "peer", "name", self.inner, "netns", self.ns)
        _ip("addr", "add", f"{self.outer_ip}/30", "dev", self.outer)
        _ip("link", "set", self.outer, "up")
        _ip("-n", self.ns, "addr", "add", f"{self.inner_ip}/30", "dev", self.inner)
        _ip("-n", self.ns, "link", "set", self.inner, "up")
        _ip("-n", self.ns, "link", "set", "lo", "up")

    def remove(self) -> None:
        for p in self.forwarders:
            p.kill()
            p.wait(10)
        self.forwarders.clear()
        _ip("link", "del", self.outer, check=False)
        _ip("netns", "del", self.ns, check=False)

    def cut(self) -> None:
        _ip("link", "set", self.outer, "down")

    def restore(self) -> None:
        _ip("link", "set", self.outer, "up")

    def is_up(self) -> bool:
        flags = _ip("-o", "link", "show", self.outer).stdout.split("<", 1)[1].split(">", 1)[0]
        return "UP" in flags.split(",")

    def enter(self) -> list[str]:
        """The prefix that runs a command inside the namespace."""
        return ["ip", "netns", "exec", self.ns]

    def listeners(self, port: int) -> list[int]:
        """The pids listening on TCP `port` inside the namespace (psutil sees only this namespace's sockets)."""
        import re

        out = subprocess.run([*self.enter(), "ss", "-ltnpH", f"sport = :{port}"], capture_output=True, text=True, check=True).stdout
        return sorted({int(pid) for pid in re.findall(r"pid=(\d+)", out)})

    def forward(self, port: int) -> None:
        """127.0.0.1:port here → 127.0.0.1:port inside the namespace, until remove()."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
        sock.listen(64)
        try:
            self.forwarders.append(subprocess.Popen([*self.enter(), sys.executable, str(FORWARDER), str(sock.fileno()), str(port)],
                                                    pass_fds=[sock.fileno()]))
        finally:
            sock.close()  # the forwarder holds its own copy
