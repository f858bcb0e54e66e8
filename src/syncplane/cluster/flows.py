"""A background TCP flow: ``serve ADDR PORT`` sinks bytes, ``send ADDR PORT [--mbit N]`` pushes them.

Real TCP through the emulated links, so contention is real congestion control, not a
model. A sender without ``--mbit`` is greedy; with it, it paces itself. Both run until
killed (the emulator kills them when the job ends).
"""

from __future__ import annotations

import argparse
import socket
import time

CHUNK = 1 << 16


def serve(address: str, port: int) -> None:
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind((address, port))
        server.listen(4)
        while True:
            conn, _ = server.accept()
            with conn:
                while conn.recv(1 << 20):
                    pass


def send(address: str, port: int, mbit: float | None) -> None:
    payload = b"\0" * CHUNK
    for _ in range(100):                      # the server may need a moment to listen
        try:
            conn = socket.create_connection((address, port), timeout=5)
            break
        except OSError:
            time.sleep(0.05)
    else:
        raise SystemExit(f"could not connect to {address}:{port}")
    interval = CHUNK * 8 / (mbit * 1e6) if mbit else 0.0
    next_send = time.monotonic()
    with conn:
        while True:
            conn.sendall(payload)
            if interval:
                next_send += interval
                delay = next_send - time.monotonic()
                if delay > 0:
                    time.sleep(delay)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("mode", choices=["serve", "send"])
    parser.add_argument("address")
    parser.add_argument("port", type=int)
    parser.add_argument("--mbit", type=float, default=None)
    args = parser.parse_args()
    serve(args.address, args.port) if args.mode == "serve" else send(args.address, args.port, args.mbit)


if __name__ == "__main__":
    main()
