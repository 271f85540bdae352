"""``models calibrate --data FILE.npz`` on a family of the user's: refusals, the split, and
thresholds that, once written, give exactly the shares that were printed."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnxruntime
import pytest

from stratus.cli.main import main
from stratus.errors import ConfigError
from stratus.families.confidence import ConfidenceMethod
from stratus.families.repository import ModelRepository, load_family
from stratus.families.spec import FamilySpec
from stratus.tiers import Tier
from stratus.tools.calibrate import classifier, labelled_data
from stratus.tools.importer import ImportOptions, ImportResult, import_model

from .test_importer import linear_onnx

FEATURES, CLASSES = 6, 4
# Each tier sees more of the features: a cascade with something to choose.
TIERS = (("device", 2), ("edge", 4), ("cloud", 6))


def labelled(rng: np.random.Generator, teacher: np.ndarray, count: int) -> tuple[np.ndarray, np.ndarray]:
    x = rng.normal(size=(count, FEATURES)).astype(np.float32)
    y = (x @ teacher + rng.gumbel(size=(count, CLASSES))).argmax(axis=1)  # noisy: nobody is always right
    return x, y


def fit(x: np.ndarray, y: np.ndarray, steps: int = 300, rate: float = 0.5) -> tuple[np.ndarray, np.ndarray]:
    """Softmax regression by gradient descent."""
    w, b = np.zeros((x.shape[1], CLASSES)), np.zeros(CLASSES)
    onehot = np.eye(CLASSES)[y]
    for _ in range(steps):
        z = x @ w + b
        p = np.exp(z - z.max(axis=1, keepdims=True))
        gradient = (p / p.sum(axis=1, keepdims=True) - onehot) / len(x)
        w -= rate * x.T @ gradient
        b -= rate * gradient.sum(axis=0)
    return w, b


@pytest.fixture(scope="module")
def imported(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path, dict[str, ImportResult]]:
    """(repository, labelled .npz, cache, what each import said): family 'user' imported
    tier by tier from ONNX."""
    tmp = tmp_path_factory.mktemp("user")
    rng = np.random.default_rng(7)
    teacher = rng.normal(size=(FEATURES, CLASSES)) * 1.5
    x_fit, y_fit = labelled(rng, teacher, 1500)
    x, y = labelled(rng, teacher, 500)
    np.savez(tmp / "data.npz", x=x, labels=y)
    root = tmp / "models"
    results: dict[str, ImportResult] = {}
    for tier, seen in TIERS:
        w, b = fit(x_fit[:, :seen], y_fit)
        padded = np.vstack([w, np.zeros((FEATURES - seen, CLASSES))])
        model = linear_onnx(tmp / f"{tier}.onnx", padded, b)
        results[tier] = import_model(
            model, ImportOptions(family="user", tier=tier, root=root, data=tmp / "data.npz")
        )
    return root, tmp / "data.npz", tmp / "cache", results


@pytest.fixture(scope="module")
def user(imported: tuple[Path, Path, Path, dict[str, ImportResult]]) -> tuple[Path, Path, Path]:
    """(repository, labelled .npz, cache)."""
    return imported[:3]


def family_of(root: Path) -> FamilySpec:
    return ModelRepository.load(root).family("user")


def everything_to_the_top(family: FamilySpec, split: classifier.Split, cache: Path) -> float:
    return float(classifier.tier_scores(family, split, cache)[-1].correct.mean())


# ---------------------------------------------------------------------------------------------
# Reading the file
# ---------------------------------------------------------------------------------------------


def good(count: int = 40) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "x": rng.normal(size=(count, FEATURES)).astype(np.float32),
        "labels": np.arange(count) % CLASSES,
    }


def changed(**arrays: object) -> Callable[[], dict[str, object]]:
    def make() -> dict[str, object]:
        content: dict[str, object] = dict(good())
        for key, value in arrays.items():
            if value is None:
                del content[key]
            else:
                content[key] = value
        return content

    return make


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (
            changed(x=None, pixels=np.zeros((40, FEATURES), np.float32)),
            r"no array 'x' \(the family's input\); the file holds \['labels', 'pixels'\]",
        ),
        (changed(labels=None), r"no array 'labels' \(the class of each example"),
        (changed(x=np.zeros((40, FEATURES))), r"array 'x' is float64; the family's input is FP32"),
        (
            changed(x=np.zeros((40, FEATURES + 1), np.float32)),
            rf"array 'x' has shape \[40, {FEATURES + 1}\]; the family's input takes \['N', {FEATURES}\]",
        ),
        (changed(x=np.zeros((40, 2, 3), np.float32)), r"array 'x' has shape \[40, 2, 3\]"),
        (changed(labels=np.zeros(40)), r"array 'labels' is float64; labels must be integers"),
        (changed(labels=np.zeros(39, np.int64)), r"array 'labels' has shape \[39\]; it must be \[40\]"),
        (
            changed(labels=np.full(40, CLASSES)),
            rf"label {CLASSES} is out of range: the output has {CLASSES} classes \(0\.\.{CLASSES - 1}\)",
        ),
        (changed(labels=np.full(40, -1)), r"label -1 is out of range"),
        (lambda: good(10), r"too few examples \(10\); calibrating needs at least 20"),
    ],
)
def test_bad_files_are_refused_precisely(
    user: tuple[Path, Path, Path], tmp_path: Path, content: Callable[[], dict[str, np.ndarray]], message: str
) -> None:
    path = tmp_path / "bad.npz"
    np.savez(path, **content())
    with pytest.raises(ConfigError, match=rf"bad\.npz: {message}"):
        labelled_data.load_npz(family_of(user[0]), path)


def test_what_is_not_a_npz_archive_is_refused(user: tuple[Path, Path, Path], tmp_path: Path) -> None:
    family = family_of(user[0])
    with pytest.raises(ConfigError, match=r"nothing\.npz: no such file"):
        labelled_data.load_npz(family, tmp_path / "nothing.npz")
    np.save(tmp_path / "single.npy", np.zeros(3))
    with pytest.raises(ConfigError, match=r"single\.npy: holds a single array, not a \.npz archive"):
        labelled_data.load_npz(family, tmp_path / "single.npy")
    (tmp_path / "text.npz").write_text("labels,x\n")
    with pytest.raises(ConfigError, match=r"text\.npz: not a readable \.npz archive"):
        labelled_data.load_npz(family, tmp_path / "text.npz")


def test_the_split_is_stratified_disjoint_and_repeatable() -> None:
    labels = np.repeat(np.arange(3), [50, 30, 7])
    first, second = labelled_data.stratified_split(labels, 0.6, 0)
    assert len(np.intersect1d(first, second)) == 0
    assert sorted([*first, *second]) == list(range(len(labels)))
    assert [int((labels[first] == c).sum()) for c in range(3)] == [30, 18, 4]  # 60% of 50, 30 and 7
    again = labelled_data.stratified_split(labels, 0.6, 0)
    assert np.array_equal(first, again[0]) and np.array_equal(second, again[1])
    other = labelled_data.stratified_split(labels, 0.6, 1)
    assert not np.array_equal(first, other[0])


# ---------------------------------------------------------------------------------------------
# Calibrating a family that is not digits
# ---------------------------------------------------------------------------------------------


def test_import_measured_accuracy_on_the_report_part(
    imported: tuple[Path, Path, Path, dict[str, ImportResult]],
) -> None:
    """The fixture imported with --data: what verify reported is each model's accuracy on the
    report part, counted here with onnxruntime straight from the source file."""
    root, npz, _cache, results = imported
    report = labelled_data.load_npz(family_of(root), npz).report
    for tier, result in results.items():
        assert result.labelled is not None and "the report part of --data" in result.labelled
        session = onnxruntime.InferenceSession(str(npz.parent / f"{tier}.onnx"))
        (probabilities,) = session.run(None, {session.get_inputs()[0].name: report.x})
        expected = float((probabilities.argmax(axis=1) == report.y).mean())
        rows = [r for r in result.report.rows if r.name == result.variant.name]
        assert rows and 0.0 < expected < 1.0
        for row in rows:
            assert row.accuracy == pytest.approx(expected, abs=1.5 / len(report)), (tier, row)


@pytest.mark.parametrize("goal", ["target_accuracy", "max_escalation"])
def test_written_thresholds_reproduce_the_printed_shares(
    user: tuple[Path, Path, Path], tmp_path: Path, goal: str
) -> None:
    root, npz, cache = user
    family = family_of(root)
    data = labelled_data.load_npz(family, npz)
    top = everything_to_the_top(family, data.calibration, cache)
    kwargs = {"target_accuracy": top - 0.02} if goal == "target_accuracy" else {"max_escalation": 0.3}
    result = classifier.calibrate(family, cache=cache, data=data, **kwargs)  # type: ignore[arg-type]
    printed = classifier.describe(result)
    before = family.source.read_text()
    try:
        classifier.write(family, result)
        written = load_family(family.source)
    finally:
        family.source.write_text(before)
    assert written.thresholds == result.thresholds
    tiers = sorted({v.tier for v in written.variants})
    chosen = [written.thresholds[t] for t in tiers[:-1]]
    for split, outcome, name in (
        (data.calibration, result.calibration, "calibration"),
        (data.report, result.held_out, "report"),
    ):
        again = classifier.cascade(classifier.tier_scores(written, split, cache), chosen)
        assert again.reached == outcome.reached and again.accuracy == outcome.accuracy
        shares = ", ".join(f"{t.label} {r:.1%}" for t, r in zip(tiers, again.reached, strict=True))
        assert f"{name:<12} accuracy {again.accuracy:.4f}; requests reaching: {shares}" in printed
        if name == "calibration":  # what is recorded beside the thresholds, as the router will export it
            assert written.calibration is not None and Tier.CLOUD in tiers
            assert written.calibration.cloud_share == round(again.reached[tiers.index(Tier.CLOUD)], 4)
            assert written.calibration.accuracy == round(again.accuracy, 4)
            assert written.calibration.data == data.calibration_name
    assert written.calibration.goal == (
        f"target_accuracy {top - 0.02:g}" if goal == "target_accuracy" else "max_escalation 0.3"
    )
    if goal == "target_accuracy":
        assert result.calibration.accuracy >= top - 0.02
    else:
        assert result.calibration.reached[-1] <= 0.3


def test_the_output_says_which_split_chooses_and_which_is_reported(
    user: tuple[Path, Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    root, npz, cache = user
    labels = np.load(npz)["labels"]
    first, second = labelled_data.stratified_split(labels, labelled_data.CALIBRATION_SHARE, labelled_data.SPLIT_SEED)
    before = (root / "user" / "family.toml").read_text()
    args = ["models", "calibrate", "user", "--dir", str(root), "--data", str(npz), "--cache-dir", str(cache)]
    assert main([*args, "--max-escalation", "0.5", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"thresholds chosen on: {len(first)} of the {len(labels)} examples in data.npz" in out
    assert f"reported on:          the other {len(second)} examples in data.npz" in out
    assert main([*args, "--max-escalation", "0.5", "--compare-methods"]) == 2
    assert "--compare-methods needs --target-accuracy" in capsys.readouterr().err
    assert (root / "user" / "family.toml").read_text() == before
    assert (
        main(["models", "calibrate", "user", "--dir", str(root), "--target-accuracy", "0.5", "--dry-run"])
        == 2
    )
    assert "pass --data FILE.npz with arrays 'x' and 'labels'" in capsys.readouterr().err


def test_compare_methods_reports_each_method_and_writes_nothing(user: tuple[Path, Path, Path]) -> None:
    root, npz, cache = user
    family = family_of(root)
    data = labelled_data.load_npz(family, npz)
    target = everything_to_the_top(family, data.calibration, cache) - 0.03
    before = family.source.read_text()
    results = classifier.compare_methods(family, cache=cache, target_accuracy=target, data=data)
    assert [r.method for r in results] == list(ConfidenceMethod)
    calibration = classifier.tier_outputs(family, data.calibration, cache)
    for r in results:
        assert r.thresholds is not None and r.calibration is not None and r.report is not None
        scores = classifier.scored(family, calibration, data.calibration.y, r.method)
        again = classifier.cascade(scores, list(r.thresholds.values()))
        assert again == r.calibration and again.accuracy >= target
    shares = {r.method: r.calibration.reached[-1] for r in results if r.calibration}
    assert len(set(shares.values())) > 1  # the methods do differ on this family
    out = classifier.describe_comparison(results, family=family, target=target, data=data)
    for r in results:
        assert r.calibration is not None and r.report is not None
        assert f"{r.method.value:<13}{r.calibration.reached[-1]:>16.1%}{r.calibration.accuracy:>11.4f}" in out
    assert "to cloud (cal)" in out and "nothing is written" in out
    assert family.source.read_text() == before


def test_verify_measures_accuracy_on_the_report_part_of_data(
    user: tuple[Path, Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    root, npz, cache = user
    family = family_of(root)
    report = labelled_data.load_npz(family, npz).report
    expected = {s.variant: float(s.correct.mean()) for s in classifier.tier_scores(family, report, cache)}
    assert main(["models", "verify", str(root), "--json", "--data", f"user={npz}"]) == 0
    # The FP32 variants calibrate chooses among; import added their INT8/FP16 children beside them.
    rows = [r for r in json.loads(capsys.readouterr().out)["variants"] if r["parent"] is None]
    assert {r["name"] for r in rows} == set(expected)
    for row in rows:
        assert row["accuracy"] == pytest.approx(expected[row["name"]])
    assert main(["models", "verify", str(root), "--data", f"user{npz}"]) == 2
    assert "expected FAMILY=FILE.npz" in capsys.readouterr().err
