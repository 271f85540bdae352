"""A ServerLive prober in a process of its own: how long a router's event loop stalls.

ServerLive does nothing but answer on the router's loop, so its round trip is the loop's
responsiveness. The prober runs apart from the test process so that the test's own work
(building messages, holding the GIL in protobuf) is not counted against the router.

Run as ``python -m tests.integration.liveness HOST:PORT INTERVAL_S``. Each line read on
stdin is answered on stdout with ``WORST_MS PROBES FAILED`` since the previous line, and
the figures restart; end of stdin stops it.
"""

from __future__ import annotations

import sys
import threading
import time

import grpc

from stratus.wire import inference_pb2 as pb
from stratus.wire import inference_pb2_grpc as pb_grpc


class Worst:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.worst_ms = 0.0
        self.probes = 0
        self.failed = 0

    def add(self, ms: float, *, ok: bool) -> None:
        with self._lock:
            self.worst_ms = max(self.worst_ms, ms)
            self.probes += 1
            self.failed += 0 if ok else 1

    def take(self) -> str:
        with self._lock:
            line = f"{self.worst_ms:.3f} {self.probes} {self.failed}"
            self.worst_ms, self.probes, self.failed = 0.0, 0, 0
        return line


def probe(address: str, interval_s: float, worst: Worst, stop: threading.Event) -> None:
    with grpc.insecure_channel(address) as channel:
        live = pb_grpc.GRPCInferenceServiceStub(channel).ServerLive
        live(pb.ServerLiveRequest(), timeout=10)  # connected before the first timed probe
        while not stop.is_set():
            started = time.perf_counter()
            try:
                ok = live(pb.ServerLiveRequest(), timeout=30).live
            except grpc.RpcError:
                ok = False
            worst.add((time.perf_counter() - started) * 1000.0, ok=ok)
            stop.wait(interval_s)


def main(address: str, interval_s: float) -> None:
    worst, stop = Worst(), threading.Event()
    prober = threading.Thread(target=probe, args=(address, interval_s, worst, stop), name="liveness-probe")
    prober.start()
    print("READY", flush=True)
    try:
        for _ in sys.stdin:
            print(worst.take(), flush=True)
    finally:
        stop.set()
        prober.join()


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]))
