"""Helm's Go SDK (helm-python-sdk) in a process of its own, for tests/unit/test_helm_chart.py.

Loading its Go runtime into the pytest process, beside gRPC's threads from earlier tests,
crashed gRPC's event engine (a segfault in cygrpc), so the chart's tests talk to one worker
process that never imports gRPC: one JSON line per call each way. The names mirror
helm_python's (``lint``, ``Chart.load(...).render``, ``parse_set_string``, ``HelmError``,
``HelmRenderError``), so the tests read as if they called Helm directly.

Run as ``python -m tests.unit.helm_worker`` it is the worker.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


class HelmError(Exception):
    """Helm refused (helm_python.HelmError in the worker)."""


class HelmRenderError(HelmError):
    """A template failed (helm_python.HelmRenderError in the worker)."""


class _Worker:
    def __init__(self) -> None:
        self._process: subprocess.Popen[str] | None = None
        self._lock = threading.Lock()

    def call(self, op: str, **arguments: Any) -> Any:
        with self._lock:
            process = self._started()
            assert process.stdin is not None and process.stdout is not None
            process.stdin.write(json.dumps({"op": op, **arguments}) + "\n")
            process.stdin.flush()
            line = process.stdout.readline()
        if not line:
            raise RuntimeError(f"the Helm worker died (exit {process.poll()})")
        answer = json.loads(line)
        if "error" in answer:
            kind = HelmRenderError if answer["error"] == "HelmRenderError" else HelmError
            raise kind(answer["message"])
        return answer["result"]

    def _started(self) -> subprocess.Popen[str]:
        if self._process is None or self._process.poll() is not None:
            self._process = subprocess.Popen(
                [sys.executable, "-m", "tests.unit.helm_worker"],
                cwd=ROOT,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            atexit.register(self.stop)
        return self._process

    def stop(self) -> None:
        if self._process is not None and self._process.poll() is None:
            assert self._process.stdin is not None
            self._process.stdin.close()
            self._process.wait(timeout=10)


_WORKER = _Worker()


def lint(path: Path, values: dict[str, Any], **options: Any) -> dict[str, Any]:
    result: dict[str, Any] = _WORKER.call("lint", path=str(path), values=values, options=options)
    return result


def parse_set_string(expression: str) -> dict[str, Any]:
    result: dict[str, Any] = _WORKER.call("parse_set_string", expression=expression)
    return result


def parse_set_string_values(expression: str) -> dict[str, Any]:
    result: dict[str, Any] = _WORKER.call("parse_set_string_values", expression=expression)
    return result


class Chart:
    """A chart folder; each render is Helm's own, in the worker."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @classmethod
    @contextlib.contextmanager
    def load(cls, path: Path) -> Iterator[Chart]:
        _WORKER.call("check", path=str(path))  # a chart that does not load fails here, as in Helm
        yield cls(path)

    def render(self, values: dict[str, Any], *, name: str, namespace: str) -> dict[str, str]:
        result: dict[str, str] = _WORKER.call(
            "render", path=str(self.path), values=values, name=name, namespace=namespace
        )
        return result


# -- the worker ----------------------------------------------------------------------------------
def _serve(request: dict[str, Any]) -> Any:
    import helm_python as helm

    op = request["op"]
    if op == "lint":
        return helm.lint(request["path"], request["values"], **request["options"])
    if op in ("parse_set_string", "parse_set_string_values"):
        return getattr(helm, op)(request["expression"])
    with helm.Chart.load(request["path"]) as chart:
        if op == "check":
            return None
        return chart.render(request["values"], name=request["name"], namespace=request["namespace"])


def main() -> None:
    import helm_python as helm

    for line in sys.stdin:
        try:
            answer = {"result": _serve(json.loads(line))}
        except helm.HelmError as exc:
            kind = "HelmRenderError" if isinstance(exc, helm.HelmRenderError) else "HelmError"
            answer = {"error": kind, "message": str(exc)}
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
