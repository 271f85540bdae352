"""`make mutation` end to end on its smallest target, so the target cannot rot unnoticed:
mutmut installed, its settings accepted, the tests it runs importable from its copy, every
mutant given a verdict, the equivalents list current and the score at the goal."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SMOKE_TARGET = "rollout-judge"  # about 20 s: one module, two test files


def test_the_smallest_target_runs_end_to_end_and_meets_the_goal() -> None:
    run = subprocess.run(
        [sys.executable, "scripts/mutation.py", "--target", SMOKE_TARGET, "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert run.stdout.strip(), run.stderr[-3000:]
    (row,) = json.loads(run.stdout)
    counts = row["counts"]
    assert row["mutants"] > 50 and sum(counts.values()) == row["mutants"], row
    assert set(counts) <= {"killed", "survived", "timeout", "no tests", "segfault"}, counts  # all judged
    detected = counts["killed"] + counts.get("timeout", 0) + counts.get("segfault", 0)
    assert counts["killed"] > 0 and row["score"] == detected / (row["mutants"] - row["equivalent"])
    listed = ROOT / "tests" / "mutation" / f"{SMOKE_TARGET}.toml"
    entries = tomllib.loads(listed.read_text()).get("equivalent", []) if listed.exists() else []
    assert row["equivalent"] == len(entries) and row["stale_equivalents"] == []
    assert row["meets_goal"] and run.returncode == 0, (row["score"], row["survivors"])
