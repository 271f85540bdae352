"""The models people export, imported, calibrated and served by a real fleet (router, device
agent, cloud gateway as processes): skl2onnx's default export (ZipMap) of a LogisticRegression
under an MLP, a RandomForest (``zipmap=False``) under an MLP, and a small CNN from
``torch.onnx.export`` under a wider one. Each answer must be the one the model itself gives,
from the tier the calibrated thresholds say."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as triton

from stratus.convert.parameters import Served
from stratus.families.confidence import confidence
from stratus.families.repository import load_family
from stratus.families.spec import FamilySpec
from stratus.tiers import Tier
from stratus.tools.calibrate import labelled_data
from tests import exports

from .cluster import QUIET, Cluster, fleet_status, ready_count, wait_until

CHUNK = 32


@dataclass(frozen=True)
class Family:
    name: str
    scores: str  # the output the confidence is taken from
    # Each tier's own answer (scores) on the report examples, computed without Stratus.
    device: np.ndarray
    cloud: np.ndarray


def stratus(*args: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [sys.executable, "-m", "stratus.cli", *args], check=False, capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    return done


def imported(root: Path, family: str, files: dict[str, Path], npz: Path, target: float) -> FamilySpec:
    """``models import`` of each tier's file, then ``models calibrate --target-accuracy``."""
    for tier, path in files.items():
        stratus("models", "import", str(path), "--family", family, "--tier", tier, "--dir", str(root),
                "--data", str(npz))  # fmt: skip
    stratus("models", "calibrate", family, "--dir", str(root), "--data", str(npz),
            "--target-accuracy", f"{target:.4f}", "--cache-dir", str(root / ".cache"))  # fmt: skip
    return load_family(root / family / "family.toml")


def _report(family: FamilySpec, npz: Path) -> tuple[np.ndarray, np.ndarray]:
    split = labelled_data.load_npz(family, npz).report
    return split.x, split.y


def _target(device: np.ndarray, cloud: np.ndarray, y: np.ndarray) -> float:
    """Halfway between the tiers' accuracies on the calibration examples: the device answers
    most, the cloud the rest."""
    low, high = (float((s.argmax(axis=1) == y).mean()) for s in (device, cloud))
    return low + (high - low) / 2


def _calibration(family: FamilySpec, npz: Path) -> tuple[np.ndarray, np.ndarray]:
    split = labelled_data.load_npz(family, npz).calibration
    return split.x, split.y


@dataclass(frozen=True)
class Site:
    root: Path
    router: str
    families: dict[str, Family]
    labels: np.ndarray  # the report examples' labels (the same split for every family)
    report_x: dict[str, np.ndarray]
    logs: Path


def _sklearn_families(root: Path, tmp: Path, data: exports.Digits) -> dict[str, Family]:
    models = {kind: exports.fitted(kind, data) for kind in ("logistic", "forest", "mlp")}
    npz = data.npz(tmp / "digits.npz", "X")
    families = {}
    for name, device, cloud, zipmap, scores in (
        ("lr", "logistic", "mlp", True, "output_probability"),
        ("rf", "forest", "mlp", False, "probabilities"),
    ):
        files = {
            tier: exports.skl_onnx(models[kind], tmp / f"{name}-{tier}.onnx", zipmap=zipmap)
            for tier, kind in (("device", device), ("cloud", cloud))
        }
        probe = load_family_after_import(root, name, files["device"], npz)
        tiers = {"device": models[device], "cloud": models[cloud]}
        cx, cy = _calibration(probe, npz)
        target = _target(*(m.predict_proba(cx) for m in tiers.values()), cy)
        imported(root, name, {"cloud": files["cloud"]}, npz, target)
        x, _ = _report(probe, npz)
        families[name] = Family(
            name, scores, tiers["device"].predict_proba(x), tiers["cloud"].predict_proba(x)
        )
    return families


def load_family_after_import(root: Path, family: str, path: Path, npz: Path) -> FamilySpec:
    stratus("models", "import", str(path), "--family", family, "--tier", "device", "--dir", str(root),
            "--data", str(npz))  # fmt: skip
    return load_family(root / family / "family.toml")


def _cnn_family(root: Path, tmp: Path, data: exports.Digits) -> Family | None:
    try:
        import onnxruntime as ort
        import torch  # noqa: F401 - only to know it is here
    except ImportError:
        return None
    npz = tmp / "images.npz"
    np.savez(npz, image=exports.images(data.unseen.x), labels=data.unseen.y)
    files = {
        "device": exports.torch_cnn(data, tmp / "cnn-small.onnx", channels=2, epochs=15),
        "cloud": exports.torch_cnn(data, tmp / "cnn-wide.onnx", channels=16, epochs=60),
    }
    probe = load_family_after_import(root, "cnn", files["device"], npz)
    sessions = {t: ort.InferenceSession(str(p), providers=["CPUExecutionProvider"]) for t, p in files.items()}
    cx, cy = _calibration(probe, npz)
    target = _target(*(s.run(None, {"image": cx})[0] for s in sessions.values()), cy)
    imported(root, "cnn", {"cloud": files["cloud"]}, npz, target)
    x, _ = _report(probe, npz)
    ours = {tier: session.run(None, {"image": x})[0] for tier, session in sessions.items()}
    return Family("cnn", "logits", ours["device"], ours["cloud"])


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    tmp = tmp_path_factory.mktemp("exports")
    root = tmp / "repo"
    data = exports.digits()
    families = _sklearn_families(root, tmp, data)
    cnn = _cnn_family(root, tmp, data)
    if cnn is not None:
        families["cnn"] = cnn
    lr = load_family(root / "lr" / "family.toml")
    x, y = _report(lr, tmp / "digits.npz")
    report_x = {"lr": x, "rf": x, "cnn": exports.images(x)}
    fleet = Cluster(tmp / "logs")
    try:
        # FP32 served (the model as exported, which the answers are checked against), not the
        # INT8/FP16 children import built beside it, which a CPU with native INT8 would serve.
        fp32 = ["--precision", "fp32"]
        cloud = fleet.start(
            "cloud", ["cloud", "--listen", "127.0.0.1:0", "--models", str(root), *fp32, *QUIET]
        )
        router = fleet.router("--cloud", cloud.address).address
        fleet.start("agent", ["agent", "--tier", "device", "--models", str(root), "--router", router,
                              "--name", "dev-1", *fp32, *QUIET])  # fmt: skip
        wait_until(
            lambda: ready_count(router) == 1 and fleet_status(router).cloud.state == "connected", timeout_s=60
        )
        yield Site(root, router, families, y, report_x, tmp / "logs")
    finally:
        fleet.stop_all()


def served(site: Site, family: Family) -> tuple[dict[str, np.ndarray], list[Tier]]:
    """Every report example through the router, in chunks, with the tier that answered each."""
    spec = load_family(site.root / family.name / "family.toml")
    client = triton.InferenceServerClient(site.router)
    outputs: dict[str, list[np.ndarray]] = {}
    tiers: list[Tier] = []
    x = site.report_x[family.name]
    for start in range(0, len(x), CHUNK):
        chunk = x[start : start + CHUNK]
        tensor = triton.InferInput(spec.inputs[0].name, list(chunk.shape), "FP32")
        tensor.set_data_from_numpy(chunk)
        result = client.infer(family.name, [tensor], client_timeout=30)
        for output in spec.outputs:
            outputs.setdefault(output.name, []).append(result.as_numpy(output.name))
        answered = Served.read(result.get_response().parameters)
        tiers += list(answered.item_tiers) or [answered.tier] * len(chunk)
    return {name: np.concatenate(parts) for name, parts in outputs.items()}, tiers


def expected_tiers(site: Site, family: Family) -> list[Tier]:
    """What the calibrated device threshold says: the device answers when it is sure enough."""
    config = tomllib.loads((site.root / family.name / "family.toml").read_text())
    spec = load_family(site.root / family.name / "family.toml")
    threshold = config["thresholds"]["device"]
    device = spec.current_variant(Tier.DEVICE)
    sure = confidence(
        family.device,
        method=spec.confidence.method,
        apply_softmax=spec.confidence.apply_softmax,
        temperature=device.temperature,
    )
    return [Tier.DEVICE if c >= threshold else Tier.CLOUD for c in sure]


def check_family(site: Site, name: str, *, label: str | None = None) -> None:
    """``label``: the output naming each item's class, which the export carries (skl2onnx's)."""
    family = site.families[name]
    outputs, tiers = served(site, family)
    wanted = expected_tiers(site, family)
    # A confidence within float rounding of the threshold may fall either side.
    agree = float(np.mean([a == b for a, b in zip(tiers, wanted, strict=True)]))
    assert agree >= 0.99, f"{name}: {agree:.1%} of items answered on the tier the threshold says"
    assert Tier.DEVICE in tiers and Tier.CLOUD in tiers, f"{name}: one tier answered everything"
    scores = outputs[family.scores]
    on_device = np.array([t is Tier.DEVICE for t in tiers])
    mine = np.where(on_device[:, None], family.device, family.cloud)
    np.testing.assert_allclose(scores, mine, rtol=1e-4, atol=1e-4)
    y = site.labels
    fleet = float((scores.argmax(axis=1) == y).mean())
    device_alone = float((family.device.argmax(axis=1) == y).mean())
    cloud_alone = float((family.cloud.argmax(axis=1) == y).mean())
    print(
        f"\n{name}: fleet accuracy {fleet:.4f} on {len(y)} report examples "
        f"({on_device.mean():.1%} answered on the device); device model alone {device_alone:.4f}, "
        f"cloud model alone {cloud_alone:.4f}"
    )
    assert fleet >= device_alone
    if label is not None:  # the label output rides along, from the tier that answered
        assert np.array_equal(outputs[label], scores.argmax(axis=1))
    assert not {"output_label", "label"} - {label} & set(outputs), f"{name}: a label output no test expects"


def test_the_default_skl2onnx_export_zipmap_is_served_through_the_fleet(site: Site) -> None:
    config = (site.root / "lr" / "family.toml").read_text()
    assert 'output = "output_probability"' in config and 'runtimes = ["onnxruntime"]' in config
    check_family(site, "lr", label="output_label")
    for role in ("agent", "cloud"):  # each says which runtimes serve the variant
        log = (site.logs / f"{role}.log").read_text()
        assert "; runtimes onnxruntime only (family.toml)" in log, log


def test_a_random_forest_export_is_served_through_the_fleet(site: Site) -> None:
    assert load_family(site.root / "rf" / "family.toml").variant("rf-device").runtimes == ("onnxruntime",)
    check_family(site, "rf", label="label")


def test_a_cnn_exported_from_pytorch_is_served_through_the_fleet(site: Site) -> None:
    pytest.importorskip("torch", reason="torch is not installed (it is not a dev dependency)")
    family = load_family(site.root / "cnn" / "family.toml")
    assert family.confidence.apply_softmax  # logits, detected
    assert set(family.variant("cnn-device").files) == {"onnx", "openvino"}  # OpenVINO runs a CNN
    check_family(site, "cnn")
