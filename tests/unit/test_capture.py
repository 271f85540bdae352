"""Captured items as Parquet files: whole files only, rotation, a size cap, drops counted."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from stratus.obs.capture import (
    PARTIAL,
    CapturedItem,
    CaptureLimits,
    CaptureWriter,
    TierAnswer,
    captured_files,
    read_dataset,
    read_rows,
)


def item(n: int, *, family: str = "digits", source: str = "audit") -> CapturedItem:
    x = np.full((64,), n, dtype=np.float32)
    device = TierAnswer(tier="device", variant="digits-small", agent="dev-1", confidence=0.5, label=n % 10)
    cloud = TierAnswer(tier="cloud", variant="digits-large", agent="cloud@c:1", confidence=0.99, label=(n + 1) % 10)
    return CapturedItem(family=family, source=source, inputs={"input": x}, answers=(device,), top=cloud,
                        request_id=f"r{n}")  # fmt: skip


def test_items_come_back_with_the_top_tier_answers_as_labels(tmp_path: Path) -> None:
    writer = CaptureWriter(tmp_path)
    for n in range(50):
        assert writer.offer(item(n))
    writer.offer(item(99, family="defects"))
    writer.close()
    inputs, labels = read_dataset(tmp_path, "digits")
    assert inputs["input"].shape == (50, 64) and inputs["input"].dtype == np.float32
    assert inputs["input"][:, 0].tolist() == list(range(50))
    assert labels.tolist() == [(n + 1) % 10 for n in range(50)]  # the cloud's, not the device's
    rows = list(read_rows(tmp_path, "digits"))
    assert rows[3]["answers"][0]["label"] == 3 and rows[3]["request_id"] == "r3"
    assert writer.written == 51 and writer.dropped == 0
    assert not list(tmp_path.glob(f"*{PARTIAL}"))


def test_only_one_source_can_be_read(tmp_path: Path) -> None:
    writer = CaptureWriter(tmp_path)
    for n in range(10):
        writer.offer(item(n, source="audit" if n < 4 else "escalated"))
    writer.close()
    assert len(read_dataset(tmp_path, "digits", source="audit")[1]) == 4
    with pytest.raises(FileNotFoundError, match="no captured items of 'tabular'"):
        read_dataset(tmp_path, "tabular")


def test_files_rotate_by_size_and_the_oldest_go_past_the_cap(tmp_path: Path) -> None:
    limits = CaptureLimits(max_file_bytes=20_000, max_total_bytes=90_000)  # files of ~36 kB here
    writer = CaptureWriter(tmp_path, limits)
    for n in range(3000):
        writer.offer(item(n))
        if n % 256 == 255:
            time.sleep(0.05)  # lets the thread write a row group (rotation is checked after one)
    writer.close()
    files = captured_files(tmp_path)
    assert len(files) >= 2
    assert sum(p.stat().st_size for p in files) <= 90_000
    kept = sorted(r["request_id"] for r in read_rows(tmp_path))
    assert "r0" not in kept and "r2999" in kept  # the oldest were deleted, the newest kept
    for path in files:
        pq.read_table(path)  # every visible file is whole


def test_a_full_queue_drops_and_counts_without_waiting(tmp_path: Path) -> None:
    dropped: list[tuple[str, str]] = []
    writer = CaptureWriter(tmp_path, CaptureLimits(queue_items=4), on_drop=lambda *why: dropped.append(why))
    offered = [writer.offer(item(n)) for n in range(2000)]  # a blocking hand-over would drop none
    writer.close()
    assert offered.count(False) == writer.dropped == len(dropped) > 0
    assert set(dropped) == {("digits", "queue full")}
    assert writer.written + writer.dropped == 2000


def test_a_stale_partial_file_is_removed_and_never_read(tmp_path: Path) -> None:
    (tmp_path / f"capture-old{PARTIAL}").write_bytes(b"PAR1 half a file")
    writer = CaptureWriter(tmp_path)
    writer.offer(item(1))
    writer.close()
    assert not list(tmp_path.glob(f"*{PARTIAL}"))
    assert len(read_dataset(tmp_path, "digits")[1]) == 1


KEEP_WRITING = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    sys.path.insert(0, sys.argv[2])
    from tests.unit.test_capture import item
    from stratus.obs.capture import CaptureLimits, CaptureWriter
    writer = CaptureWriter(Path(sys.argv[1]), CaptureLimits(max_file_bytes=30_000))
    n = 0
    while True:
        writer.offer(item(n)); n += 1
        if n % 100 == 0:
            print(n, flush=True); time.sleep(0.01)
    """
)


def test_files_stay_whole_after_a_sigkill_mid_write(tmp_path: Path) -> None:
    root = str(Path(__file__).resolve().parents[2])
    writer = subprocess.Popen(
        [sys.executable, "-c", KEEP_WRITING, str(tmp_path), root], stdout=subprocess.PIPE, text=True
    )
    assert writer.stdout is not None
    while (line := writer.stdout.readline()) and int(line) < 3000:
        pass
    assert line, f"the writer ended before writing 3000 rows (exit {writer.wait()})"  # never a hang
    writer.send_signal(signal.SIGKILL)
    writer.wait()
    files = captured_files(tmp_path)
    assert files, "nothing was rotated before the kill"
    for path in files:
        assert pq.read_table(path).num_rows > 0
    survivors = list(read_rows(tmp_path))
    assert survivors and all(r["family"] == "digits" for r in survivors)
