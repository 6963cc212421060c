"""Run inside a network namespace: accept on an inherited listening socket (made in another namespace) and relay
each connection to 127.0.0.1:<port> here. Usage: netns_forward.py <fd> <port> (tests/helpers/netns.py starts it)."""
from __future__ import annotations

import socket
import sys
import threading


def pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s, how in ((dst, socket.SHUT_WR), (src, socket.SHUT_RD)):
            try:
                s.shutdown(how)
            except OSError:
                pass


def relay(client: socket.socket, port: int) -> None:
    try:
        upstream = socket.create_connection(("127.0.0.1", port), timeout=10)
    except OSError:
        client.close()  # nothing listens inside (yet): the client sees the connection closed
        return
    upstream.settimeout(None)
    back = threading.Thread(target=pump, args=(upstream, client), daemon=True)
    back.start()
    pump(client, upstream)
    back.join()
    client.close()
    upstream.close()


def main() -> None:
    fd, port = int(sys.argv[1]), int(sys.argv[2])
    listener = socket.socket(fileno=fd)
    while True:
        client, _ = listener.accept()
        threading.Thread(target=relay, args=(client, port), daemon=True).start()


if __name__ == "__main__":
    main()
