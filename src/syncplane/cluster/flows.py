"""A background TCP flow: ``serve ADDR PORT`` sinks bytes, ``send ADDR PORT [--mbit N]`` pushes them.

Real TCP through the emulated links, so contention is real congestion control, not a
model. A sender without ``--mbit`` is greedy; with it, it paces itself. Both run until
stopped: on SIGTERM (what the emulator sends when the job ends) each prints how many
bytes it moved and at what rate, so a run's log shows what the background traffic
actually took from the links while the job ran.
"""

from __future__ import annotations

import argparse
import signal
import socket
import sys
import time
from types import FrameType

CHUNK = 1 << 16


class _Meter:
    """Bytes moved since the flow's first byte; reported once, when the flow is stopped."""

    def __init__(self, mode: str) -> None:
        self.mode, self.bytes, self.start = mode, 0, 0.0

    def add(self, n: int) -> None:
        if not self.start:
            self.start = time.monotonic()
        self.bytes += n

    def report(self, signum: int, frame: FrameType | None) -> None:
        seconds = time.monotonic() - self.start if self.start else 0.0
        mbit = self.bytes * 8 / seconds / 1e6 if seconds else 0.0
        print(f"flow {self.mode}: {self.bytes} bytes in {seconds:.2f} s ({mbit:.2f} Mbit/s)", flush=True)
        sys.exit(0)


def serve(address: str, port: int, meter: _Meter) -> None:
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind((address, port))
        server.listen(4)
        while True:
            conn, _ = server.accept()
            with conn:
                while data := conn.recv(1 << 20):
                    meter.add(len(data))


def send(address: str, port: int, mbit: float | None, meter: _Meter) -> None:
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
            meter.add(CHUNK)
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
    meter = _Meter(args.mode)
    signal.signal(signal.SIGTERM, meter.report)
    if args.mode == "serve":
        serve(args.address, args.port, meter)
    else:
        send(args.address, args.port, args.mbit, meter)


if __name__ == "__main__":
    main()
