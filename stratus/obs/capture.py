"""Captured items as Parquet files: what the device model should learn next (issue 20 §4).

The router hands a :class:`CaptureWriter` one :class:`CapturedItem` per audited or escalated
item; a thread of the writer's own turns them into Parquet row groups, so the request path
never waits on a disk: the hand-over is a ``put_nowait`` into a bounded queue, and an item
that finds it full is dropped and counted.

Files are written as ``*.parquet.tmp`` and renamed once closed (after an fsync), so a reader
only ever sees whole files and a crash leaves at most a ``.tmp`` behind, which the next
writer on that folder deletes. A file is closed when it reaches ``max_file_bytes`` or gets
``max_file_age_s`` old; then the oldest files are deleted until the folder is under
``max_total_bytes``.

Reading back (:func:`read_dataset`) gives the inputs and, as labels, the top tier's answers.
Those labels are the largest model's opinion, not the truth: a model fine-tuned on them
learns to agree with the cloud, including its mistakes.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import numpy as np

log = logging.getLogger("stratus.capture")

SUFFIX: Final = ".parquet"
PARTIAL: Final = ".parquet.tmp"
ROWS_PER_GROUP: Final = 256
FLUSH_S: Final = 1.0  # a row group is written at least this often while items arrive


@dataclass(frozen=True, kw_only=True)
class TierAnswer:
    """What one tier answered for the item: a class (classifiers) or a text (generative)."""

    tier: str
    variant: str
    agent: str
    confidence: float
    label: int | None = None
    text: str | None = None


@dataclass(frozen=True, kw_only=True)
class CapturedItem:
    """One item and every answer it got; ``top`` is the top tier's (the audit's reference)."""

    family: str
    source: str  # "audit" (an unbiased sample) or "escalated" (an unsure item)
    inputs: Mapping[str, np.ndarray]  # this item's tensors, without the batch dimension
    answers: Sequence[TierAnswer]
    top: TierAnswer
    request_id: str = ""
    prompt: str | None = None
    time_ms: int = field(default_factory=lambda: int(time.time() * 1000))


def _schema() -> Any:
    import pyarrow as pa

    answer = pa.struct(
        [("tier", pa.string()), ("variant", pa.string()), ("agent", pa.string()),
         ("confidence", pa.float64()), ("label", pa.int64()), ("text", pa.string())]
    )  # fmt: skip
    tensor = pa.struct(
        [("name", pa.string()), ("dtype", pa.string()), ("shape", pa.list_(pa.int64())), ("data", pa.binary())]
    )
    return pa.schema(
        [("time_ms", pa.int64()), ("family", pa.string()), ("source", pa.string()),
         ("request_id", pa.string()), ("prompt", pa.string()), ("inputs", pa.list_(tensor)),
         ("answers", pa.list_(answer)), ("top", answer)]
    )  # fmt: skip


def _answer_row(answer: TierAnswer) -> dict[str, Any]:
    return {
        "tier": answer.tier, "variant": answer.variant, "agent": answer.agent,
        "confidence": float(answer.confidence), "label": answer.label, "text": answer.text,
    }  # fmt: skip


def _row(item: CapturedItem) -> dict[str, Any]:
    tensors = []
    for name, value in item.inputs.items():
        array = np.ascontiguousarray(value)
        tensors.append({"name": name, "dtype": array.dtype.str, "shape": list(array.shape), "data": array.tobytes()})
    return {
        "time_ms": item.time_ms, "family": item.family, "source": item.source,
        "request_id": item.request_id, "prompt": item.prompt, "inputs": tensors,
        "answers": [_answer_row(a) for a in item.answers], "top": _answer_row(item.top),
    }  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class RowFormat:
    """What a writer's files hold: their name's prefix, their schema, and an item's row."""

    prefix: str
    schema: Callable[[], Any]
    row: Callable[[Any], dict[str, Any]]


@dataclass(frozen=True, kw_only=True)
class CaptureLimits:
    max_file_bytes: int = 64 << 20
    max_file_age_s: float = 300.0
    max_total_bytes: int = 1 << 30
    queue_items: int = 4096


class CaptureWriter:
    """Items in, Parquet files out, on a thread of its own (see the module's docstring)."""

    def __init__(
        self,
        folder: Path,
        limits: CaptureLimits = CaptureLimits(),
        *,
        on_drop: Callable[[str, str], None] = lambda family, reason: None,
        clock: Callable[[], float] = time.monotonic,
        rows: RowFormat | None = None,
    ) -> None:
        import pyarrow  # noqa: F401  (a missing extra fails at start, not at the first item)

        self.format = rows or RowFormat(prefix="capture", schema=_schema, row=_row)
        self.folder = folder
        self.limits = limits
        self.dropped = 0
        self.written = 0
        self._on_drop = on_drop
        self._clock = clock
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=limits.queue_items)
        folder.mkdir(parents=True, exist_ok=True)
        for stale in folder.glob(f"*{PARTIAL}"):  # a crash's half-written file
            stale.unlink(missing_ok=True)
        self._sequence = 0
        self._thread = threading.Thread(target=self._run, name="stratus-capture", daemon=True)
        self._thread.start()

    def offer(self, item: Any) -> bool:
        """Hand an item (of the writer's format; it has a ``family``) over without waiting;
        False (and counted) when the queue is full."""
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            self.dropped += 1
            self._on_drop(item.family, "queue full")
            return False
        return True

    def close(self, timeout_s: float = 10.0) -> None:
        """Write what is queued, close the open file, and stop the thread."""
        self._queue.put(None)
        self._thread.join(timeout_s)

    # -- the writer's thread ---------------------------------------------------------------
    def _run(self) -> None:
        current: _OpenFile | None = None
        rows: list[dict[str, Any]] = []
        last_flush = self._clock()
        stopping = False
        while not stopping:
            item: Any
            try:
                item = self._queue.get(timeout=FLUSH_S)
            except queue.Empty:  # nothing new: a flush or a rotation may still be due
                item = _IDLE
            stopping = item is None
            if item is not None and item is not _IDLE:
                rows.append(self.format.row(item))
            if stopping or (rows and (len(rows) >= ROWS_PER_GROUP or self._clock() - last_flush >= FLUSH_S)):
                current = self._write(current, rows)
                rows, last_flush = [], self._clock()
            if current is not None and (stopping or current.full(self.limits, self._clock())):
                current.finish()
                current = None
                self._trim()

    def _write(self, current: _OpenFile | None, rows: list[dict[str, Any]]) -> _OpenFile | None:
        if not rows:
            return current
        try:
            if current is None:
                self._sequence += 1
                name = f"{self.format.prefix}-{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{os.getpid()}-{self._sequence:06d}"
                current = _OpenFile(self.folder / name, self._clock(), self.format.schema())
            current.write(rows)
            self.written += len(rows)
        except OSError as exc:  # a full disk: drop these, keep serving
            self.dropped += len(rows)
            for row in rows:
                self._on_drop(row["family"], "write failed")
            log.warning("capture %s: could not write %d items (%s)", self.folder, len(rows), exc)
        return current

    def _trim(self) -> None:
        """Delete the oldest whole files until the folder is under its cap."""
        files = sorted(self.folder.glob(f"*{SUFFIX}"), key=lambda p: (p.stat().st_mtime, p.name))
        total = sum(p.stat().st_size for p in files)
        while files and total > self.limits.max_total_bytes:
            oldest = files.pop(0)
            total -= oldest.stat().st_size
            oldest.unlink(missing_ok=True)
            log.info("capture %s: deleted %s (over %d bytes)", self.folder, oldest.name, self.limits.max_total_bytes)


_IDLE: Final = object()  # what the thread saw when the queue stayed empty


class _OpenFile:
    """A Parquet file being written under its ``.tmp`` name."""

    def __init__(self, stem: Path, opened_at: float, schema: Any) -> None:
        import pyarrow.parquet as pq

        self.schema = schema
        self.final = stem.with_suffix(SUFFIX)
        self.partial = stem.with_suffix(PARTIAL)
        self.opened_at = opened_at
        self._sink = open(self.partial, "wb")  # noqa: SIM115  (closed in finish)
        self._writer = pq.ParquetWriter(self._sink, schema)

    def write(self, rows: list[dict[str, Any]]) -> None:
        import pyarrow as pa

        self._writer.write_table(pa.Table.from_pylist(rows, schema=self.schema))
        self._sink.flush()

    def full(self, limits: CaptureLimits, now: float) -> bool:
        return self._sink.tell() >= limits.max_file_bytes or now - self.opened_at >= limits.max_file_age_s

    def finish(self) -> None:
        """Footer, fsync, then the rename that makes the file visible whole."""
        self._writer.close()
        self._sink.flush()
        os.fsync(self._sink.fileno())
        self._sink.close()
        os.replace(self.partial, self.final)


# -- reading back ----------------------------------------------------------------------------
def captured_files(folder: Path) -> list[Path]:
    """The whole files of a capture folder, oldest first (``.tmp`` ones are never read)."""
    return sorted(folder.glob(f"*{SUFFIX}"))


def read_rows(folder: Path, family: str | None = None) -> Iterator[dict[str, Any]]:
    import pyarrow.parquet as pq

    for path in captured_files(folder):
        for row in pq.read_table(path).to_pylist():
            if family is None or row["family"] == family:
                yield row


def _tensor(entry: Mapping[str, Any]) -> np.ndarray:
    return np.frombuffer(entry["data"], dtype=np.dtype(entry["dtype"])).reshape(entry["shape"])


def read_dataset(folder: Path, family: str, *, source: str | None = None) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """A classifier family's captured items as (inputs by name, labels): each label is the
    top tier's answer (see the module's docstring for what that means)."""
    inputs: dict[str, list[np.ndarray]] = {}
    labels: list[int] = []
    for row in read_rows(folder, family):
        if (source is not None and row["source"] != source) or row["top"]["label"] is None:
            continue
        for entry in row["inputs"]:
            inputs.setdefault(entry["name"], []).append(_tensor(entry))
        labels.append(int(row["top"]["label"]))
    if not labels:
        raise FileNotFoundError(f"{folder} holds no captured items of {family!r}")
    return {name: np.stack(values) for name, values in inputs.items()}, np.asarray(labels, dtype=np.int64)
