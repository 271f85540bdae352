"""Steady client load on a router from a few threads, every outcome counted."""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass

import grpc
import numpy as np

from stratus.convert.parameters import Served
from stratus.serving.channels import open_sync_channel
from stratus.tiers import Tier
from stratus.wire import inference_pb2_grpc as pb_grpc

from .cluster import request


@dataclass(frozen=True)
class Answered:
    at: float  # time.monotonic() when the answer arrived
    variant: str
    tier: Tier


class Load:
    """``clients`` threads, each sending one held-out row at a time until stopped."""

    def __init__(self, router: str, x: np.ndarray, *, clients: int = 4) -> None:
        self.router = router
        self.x = x
        self.errors: Counter[str] = Counter()
        self.answers: list[Answered] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._client, args=(i,), name=f"load-{i}") for i in range(clients)
        ]

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=30)
        hung = [t.name for t in self._threads if t.is_alive()]
        assert not hung, f"load threads still running 30 s after the stop: {hung}"

    def _client(self, index: int) -> None:
        with open_sync_channel(self.router) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            row = index
            while not self._stop.is_set():
                row = (row + len(self._threads)) % len(self.x)
                try:
                    response = stub.ModelInfer(request(self.x[row : row + 1]), timeout=10.0)
                except grpc.RpcError as exc:
                    with self._lock:
                        self.errors[f"{exc.code().name}: {exc.details()}"] += 1
                    continue
                served = Served.read(response.parameters)
                with self._lock:
                    self.answers.append(Answered(time.monotonic(), served.variant, served.tier))

    def device_variants(self, *, after: float = 0.0) -> Counter[str]:
        """Which variants answered on the device tier (answers that did not climb)."""
        with self._lock:
            return Counter(a.variant for a in self.answers if a.at >= after and a.tier is Tier.DEVICE)
