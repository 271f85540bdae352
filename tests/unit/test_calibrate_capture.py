"""``models calibrate/verify --data DIR`` on a router's capture folder: the examples are the
captured inputs, the labels the top tier's answers (not the truth), filtered by source; a
folder without the family's items is refused, naming what to do."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from stratus.cli.main import main
from stratus.errors import ConfigError
from stratus.families.spec import FamilySpec, VariantSpec
from stratus.obs.capture import CapturedItem, CaptureWriter, TierAnswer
from stratus.runtimes import LoadOptions, load_runner
from stratus.tools.calibrate import classifier, labelled_data
from stratus.tools.datasets import Split

from .test_calibrate_data import family_of, imported, user  # noqa: F401  (fixtures)

AUDITED = 90
ESCALATED = 30


def capture(folder: Path, x: np.ndarray, labels: np.ndarray, *, family: str = "user") -> None:
    """The first AUDITED rows as audits, the next ESCALATED as escalations; the top tier's
    answer is ``labels`` (the device's is always class 0, to tell the two apart)."""
    writer = CaptureWriter(folder)
    for n in range(AUDITED + ESCALATED):
        device = TierAnswer(tier="device", variant="user-device", agent="d", confidence=0.4, label=0)
        top = TierAnswer(tier="cloud", variant="user-cloud", agent="c", confidence=0.9, label=int(labels[n]))
        writer.offer(CapturedItem(family=family, source="audit" if n < AUDITED else "escalated",
                                  inputs={"x": x[n]}, answers=(device, top), top=top, request_id=f"r{n}"))  # fmt: skip
    writer.close()
    assert writer.written == AUDITED + ESCALATED


@pytest.fixture
def captured(user: tuple[Path, Path, Path], tmp_path: Path) -> tuple[Path, np.ndarray, np.ndarray]:  # noqa: F811
    """(folder, inputs, top answers): the .npz's examples labelled as the router would label
    them, by the top tier's (the cloud variant's) own answers, which are not always the truth."""
    root, npz, cache = user
    with np.load(npz) as data:
        x, truth = data["x"], data["labels"]
    answers = classifier.tier_scores(family_of(root), Split(x, truth), cache)[-1].answers
    assert answers is not None
    top = answers.astype(np.int64)
    assert (top != truth).any()  # a reader taking the file's labels would be caught
    capture(tmp_path / "capture", x, top)
    return tmp_path / "capture", x, top


def test_a_folder_gives_the_captured_inputs_labelled_by_the_top_tier(
    user: tuple[Path, Path, Path],  # noqa: F811
    captured: tuple[Path, np.ndarray, np.ndarray],
) -> None:
    folder, x, top = captured
    family = family_of(user[0])
    for source, rows in (("audit", range(AUDITED)), ("escalated", range(AUDITED, AUDITED + ESCALATED))):
        arrays = labelled_data.captured_arrays(family, folder, source)
        np.testing.assert_array_equal(arrays["x"], x[list(rows)])
        np.testing.assert_array_equal(arrays["labels"], top[list(rows)])
    data = labelled_data.load_labelled(family, folder, source="all")
    assert len(data.calibration) + len(data.report) == AUDITED + ESCALATED
    seen = np.concatenate([data.calibration.y, data.report.y])
    assert sorted(seen.tolist()) == sorted(top[: AUDITED + ESCALATED].tolist())


def test_calibrate_reads_a_folder_as_it_reads_the_same_examples_in_a_file(
    user: tuple[Path, Path, Path],  # noqa: F811
    captured: tuple[Path, np.ndarray, np.ndarray],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    root, _, cache = user
    folder, x, top = captured
    same = tmp_path / "capture.npz"
    np.savez(same, x=x[:AUDITED], labels=top[:AUDITED])  # what --data-source audit should read
    common = ["models", "calibrate", "user", "--models", str(root), "--target-accuracy", "0.8", "--dry-run",
              "--cache-dir", str(cache)]  # fmt: skip
    assert main([*common, "--data", str(same)]) == 0
    from_file = capsys.readouterr().out
    assert main([*common, "--data", str(folder)]) == 0
    from_folder = capsys.readouterr().out
    assert from_folder == from_file.replace(f"in {same.name}", "in capture")  # the same examples, the same result
    assert main([*common, "--data", str(folder), "--data-source", "all"]) == 0
    assert f"of the {AUDITED + ESCALATED} examples" in capsys.readouterr().out


def test_a_folder_without_the_family_is_refused_by_name(
    user: tuple[Path, Path, Path],  # noqa: F811
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    root = user[0]
    family = family_of(root)
    folder = tmp_path / "other"
    x = np.zeros((AUDITED + ESCALATED, 6), np.float32)
    capture(folder, x, np.zeros(len(x), np.int64), family="digits")
    with pytest.raises(ConfigError, match=r"holds no captured audit items of 'user' \(a router writes them "
                       r"with --capture .* --capture-families user\)"):  # fmt: skip
        labelled_data.load_labelled(family, folder)
    assert main(["models", "calibrate", "user", "--models", str(root), "--target-accuracy", "0.8",
                 "--dry-run", "--data", str(folder)]) == 2  # fmt: skip
    assert "holds no captured audit items of 'user'" in capsys.readouterr().err
    assert main(["models", "verify", str(root), "--data", str(folder)]) == 2
    assert "holds no captured audit items of any classifier family" in capsys.readouterr().err


def test_verify_measures_accuracy_against_the_top_tier_on_a_folder(
    user: tuple[Path, Path, Path],  # noqa: F811
    captured: tuple[Path, np.ndarray, np.ndarray],
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Every variant verify lists (each tier's FP32 parent and the INT8/FP16 children the import
    made) is scored on the folder's report part against the top tier's captured answers."""
    root, _, cache = user
    folder = captured[0]
    family = family_of(root)
    report = labelled_data.load_labelled(family, folder).report
    expected = {variant.name: accuracy_of(family, variant, report, cache) for variant in family.variants}
    parents = {s.variant: float(s.correct.mean()) for s in classifier.tier_scores(family, report, cache)}
    assert parents.items() <= expected.items()  # the parents as calibrate scores them
    assert len(expected) > len(parents)  # children too, or this would test only the parents
    for data in (str(folder), f"user={folder}"):
        assert main(["models", "verify", str(root), "--json", "--data", data]) == 0
        rows = json.loads(capsys.readouterr().out)["variants"]
        assert {r["name"]: r["accuracy"] for r in rows} == pytest.approx(expected)


def accuracy_of(family: FamilySpec, variant: VariantSpec, split: Split, cache: Path) -> float:
    """The share of ``split`` whose label is the variant's top class, run here in its runtime."""
    runner = load_runner(family, variant, LoadOptions(tier=variant.tier, cache_dir=cache))
    try:
        outputs = runner.infer({family.inputs[0].name: split.x})[family.confidence.output]
    finally:
        runner.close()
    return float((outputs.argmax(axis=1) == split.y).mean())
