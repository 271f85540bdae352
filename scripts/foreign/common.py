"""What the three server scripts share: their flags, and saying READY once the model is.

Each script runs with its own server's Python (scripts/foreign_env.py); this file sits
beside them, so each imports it as ``common``.
"""

from __future__ import annotations

import argparse
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

LOOPBACK = "127.0.0.1"


def arguments(description: str, *, metrics_port: bool) -> argparse.ArgumentParser:
    """--model FILE.onnx --name NAME --grpc-port P --http-port H [--metrics-port M]."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--grpc-port", type=int, required=True)
    parser.add_argument("--http-port", type=int, required=True)
    if metrics_port:
        parser.add_argument("--metrics-port", type=int, required=True)
    return parser


def announce(grpc_port: int) -> None:
    """The line scripts/foreign_env.py waits for."""
    print(f"READY {LOOPBACK}:{grpc_port}", flush=True)


def announce_when_ready(http_port: int, grpc_port: int, name: str, *, alive: Callable[[], bool]) -> bool:
    """Poll the server's HTTP readiness for the model (the OIP's /v2/models/NAME/ready),
    then announce; False when the server ended first."""
    url = f"http://{LOOPBACK}:{http_port}/v2/models/{name}/ready"
    while alive():
        try:
            with urllib.request.urlopen(url, timeout=1.0) as response:
                if response.status == 200:
                    announce(grpc_port)
                    return True
        except OSError:
            pass
        time.sleep(0.1)
    return False
