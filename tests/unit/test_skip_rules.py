"""The skip rules of tests/conftest.py hold: a skip or an expected failure whose reason
tests/skips.py does not allow fails the run; an allowed one stays a skip (tests2 §2)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from xml.etree import ElementTree

ROOT = Path(__file__).resolve().parents[2]
PYTEST = [sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p", "no:cacheprovider", "-q"]

CASES = """
import pytest

def test_skip_not_allowed():
    pytest.skip("llama_cpp is not installed")

def test_skip_allowed():
    pytest.skip("torch is not installed (a CPU wheel of 190 MB)")

@pytest.mark.skipif(True, reason="promtool not installed")
def test_skipif_not_allowed():
    pass

@pytest.mark.xfail(reason="someday")
def test_xfail_marker():
    assert False

def test_xfail_imperative():
    pytest.xfail("not in stratus.cli yet")

def test_importorskip():
    pytest.importorskip("a_module_nobody_has")

def test_passes():
    pass
"""

MODULE_SKIP = """
import pytest

pytest.skip("Triton could not be installed", allow_module_level=True)

def test_never_collected():
    pass
"""


def outcomes(folder: Path) -> dict[str, str]:
    """Test (or, for a collection error, file) -> how it ended, under this suite's hooks, as
    pytest's JUnit report gives it: passed, skipped, failure (in the test) or error (around it)."""
    report = folder / "report.xml"
    run = subprocess.run(
        [*PYTEST, "--continue-on-collection-errors", f"--junitxml={report}", str(folder)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert report.exists(), run.stdout + run.stderr
    found = {}
    for case in ElementTree.parse(report).getroot().iter("testcase"):
        ended = [child.tag for child in case if child.tag in ("skipped", "failure", "error")]
        # a collection error is named by the file's dotted path, which runs from the root
        # only where the folder lies under it (not for a checkout in /tmp): its last part
        name = (case.get("name") or case.get("classname", "")).rsplit(".", 1)[-1]
        found[name] = ended[0] if ended else "passed"
    return found


def test_only_allowed_reasons_skip(tmp_path: Path) -> None:
    (tmp_path / "test_cases.py").write_text(CASES)
    (tmp_path / "test_module_skip.py").write_text(MODULE_SKIP)
    found = outcomes(tmp_path)
    assert found.pop("test_skip_allowed") == "skipped"
    assert found.pop("test_passes") == "passed"
    assert found == {
        "test_skip_not_allowed": "failure",
        "test_skipif_not_allowed": "error",  # a marker skips in setup: the failure is reported there
        "test_xfail_marker": "failure",
        "test_xfail_imperative": "failure",
        "test_importorskip": "failure",
        "test_module_skip": "error",  # a file skipped at collection fails the run too
    }
