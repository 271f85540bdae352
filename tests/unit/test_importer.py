"""``stratus models import``: the config it writes and every refusal, on small ONNX models
built here with ``onnx.helper``."""

from __future__ import annotations

import shutil
import tomllib
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper, save

from stratus.errors import ConfigError
from stratus.families.confidence import ConfidenceMethod
from stratus.families.precision import load_verification
from stratus.families.repository import ModelRepository, load_family
from stratus.families.writer import with_current_entry
from stratus.tiers import Tier
from stratus.tools.importer import ImportOptions, ImportResult, import_model

FEATURES, CLASSES = 6, 4


def linear_onnx(
    path: Path,
    weights: np.ndarray,
    bias: np.ndarray,
    *,
    softmax: bool = False,
    input_name: str = "x",
    output_name: str = "scores",
    input_dims: Sequence[str | int] | None = None,
    elem: int = TensorProto.FLOAT,
    op: tuple[str, str] | None = None,
) -> Path:
    """``x @ weights + bias`` (then softmax, or a custom ``(domain, op_type)`` node)."""
    features, classes = weights.shape
    dtype = helper.tensor_dtype_to_np_dtype(elem)
    nodes = [
        helper.make_node("MatMul", [input_name, "w"], ["m"]),
        helper.make_node("Add", ["m", "b"], ["z"]),
    ]
    last = "z"
    if op is not None:
        nodes.append(helper.make_node(op[1], [last], ["custom"], domain=op[0]))
        last = "custom"
    if softmax:
        nodes.append(helper.make_node("Softmax", [last], [output_name], axis=-1))
    else:
        nodes.append(helper.make_node("Identity", [last], [output_name]))
    graph = helper.make_graph(
        nodes,
        path.stem,
        [helper.make_tensor_value_info(input_name, elem, list(input_dims or ["batch", features]))],
        [helper.make_tensor_value_info(output_name, elem, ["batch", classes])],
        [
            numpy_helper.from_array(weights.astype(dtype), "w"),
            numpy_helper.from_array(bias.astype(dtype), "b"),
        ],
    )
    opsets = [helper.make_opsetid("", 17)]
    if op is not None and op[0]:
        opsets.append(helper.make_opsetid(op[0], 1))
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 8
    save(model, str(path))
    return path


def random_linear(path: Path, seed: int = 0, **kwargs: object) -> Path:
    rng = np.random.default_rng(seed)
    features = FEATURES
    dims = kwargs.get("input_dims")
    if isinstance(dims, list) and isinstance(dims[1], int):
        features = dims[1]
    return linear_onnx(path, rng.normal(size=(features, CLASSES)), rng.normal(size=CLASSES), **kwargs)  # type: ignore[arg-type]


def options(root: Path, **kwargs: object) -> ImportOptions:
    settings: dict[str, object] = {"family": "toy", "tier": "device", "root": root}
    settings.update(kwargs)
    return ImportOptions(**settings)  # type: ignore[arg-type]


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "models"


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())} if folder.is_dir() else {}


# ---------------------------------------------------------------------------------------------
# The config it writes
# ---------------------------------------------------------------------------------------------


def test_a_new_family_gets_a_complete_readable_config(tmp_path: Path, root: Path) -> None:
    model = random_linear(tmp_path / "toy.onnx")
    result = import_model(model, options(root))
    config = root / "toy" / "family.toml"
    family = load_family(config)
    assert result.new_family and result.current
    assert result.report.ok and result.labelled is None
    assert {r.runtime for r in result.report.rows} >= {"onnxruntime", "openvino"}
    assert all(r.accuracy is None for r in result.report.rows)  # no labels: n/a
    assert family.name == "toy" and [v.name for v in family.variants] == ["toy-device"]
    assert family.current == {Tier.DEVICE: "toy-device"}
    assert [(t.name, t.datatype, t.shape) for t in family.inputs] == [("x", "FP32", (-1, FEATURES))]
    assert [(t.name, t.datatype, t.shape) for t in family.outputs] == [("scores", "FP32", (-1, CLASSES))]
    assert family.confidence.output == "scores"
    assert family.confidence.method is ConfidenceMethod.MAX_SOFTMAX
    assert family.confidence.apply_softmax  # the model gives logits: detected
    variant = family.variant("toy-device")
    assert variant.precision == "FP32" and variant.parent is None
    assert set(variant.files) == {"onnx", "openvino"}
    assert variant.files["onnx"].read_bytes() == model.read_bytes()
    assert (root / "toy" / "toy-device.bin").is_file()
    text = config.read_text()
    for table in ("[family]", "[[inputs]]", "[[outputs]]", "[confidence]", "[current]", "[[variants]]"):
        assert f"\n{table}\n" in text
    assert "# " in text and "toy.onnx" in text  # says where the variant came from
    assert not list((root / "toy").glob(".*"))  # no scratch file left behind
    assert ModelRepository.load(root).family("toy") == family


def test_probabilities_are_detected_and_flags_and_method_are_kept(tmp_path: Path, root: Path) -> None:
    probs = import_model(random_linear(tmp_path / "p.onnx", softmax=True), options(root, family="p"))
    assert not probs.family.confidence.apply_softmax
    forced = import_model(
        random_linear(tmp_path / "l.onnx"),
        options(root, family="l", logits=False, method=ConfidenceMethod.ENTROPY, variant="l-one"),
    )
    assert not forced.family.confidence.apply_softmax
    assert forced.family.confidence.method is ConfidenceMethod.ENTROPY
    assert forced.variant.name == "l-one"
    assert "--probabilities" in (root / "l" / "family.toml").read_text()


def test_extending_a_family_appends_a_variant_and_its_tier(tmp_path: Path, root: Path) -> None:
    import_model(random_linear(tmp_path / "a.onnx", 1), options(root))
    before = (root / "toy" / "family.toml").read_text()
    result = import_model(random_linear(tmp_path / "b.onnx", 2), options(root, tier="cloud"))
    after = (root / "toy" / "family.toml").read_text()
    assert not result.new_family and result.current
    family = load_family(root / "toy" / "family.toml")
    assert [v.name for v in family.variants] == ["toy-device", "toy-cloud"]
    assert family.current == {Tier.DEVICE: "toy-device", Tier.CLOUD: "toy-cloud"}
    assert family.variant("toy-cloud").tier is Tier.CLOUD
    # The file grew: every line that was there is still there, in order.
    old_lines = [line for line in before.splitlines() if line]
    new_lines = iter(after.splitlines())
    assert all(any(line == n for n in new_lines) for line in old_lines)


def test_a_second_variant_of_a_tier_is_added_but_not_current(tmp_path: Path, root: Path) -> None:
    import_model(random_linear(tmp_path / "a.onnx", 1), options(root))
    result = import_model(random_linear(tmp_path / "b.onnx", 2), options(root, variant="toy-device-v2"))
    family = result.family
    assert not result.current
    assert family.current[Tier.DEVICE] == "toy-device"
    assert [v.name for v in family.lines(Tier.DEVICE)] == ["toy-device", "toy-device-v2"]
    assert any("toy-device-v2 is served only when pinned by name" in note for note in result.notes)


def test_a_family_without_current_gets_its_choice_written_down(tmp_path: Path, root: Path) -> None:
    """A tier's only variant is current implicitly; adding a second must name the first."""
    import_model(random_linear(tmp_path / "a.onnx", 1), options(root))
    config = root / "toy" / "family.toml"
    lines = config.read_text().splitlines(keepends=True)
    start = lines.index("[current]\n")
    end = next(i for i in range(start + 1, len(lines)) if lines[i].strip() == "")
    config.write_text("".join(lines[:start] + lines[end:]))
    assert "[current]" not in config.read_text()
    result = import_model(random_linear(tmp_path / "b.onnx", 2), options(root, variant="toy-new"))
    assert not result.current
    assert tomllib.loads(config.read_text())["current"] == {"device": "toy-device"}


def test_with_current_entry_edits_only_the_current_table() -> None:
    text = (
        '[family]\nname = "f"\n\n# chosen by hand\n[current]\n# comment\ndevice = "a"\n\n'
        "# the thresholds\n[thresholds]\ndevice = 0.5\n"
    )
    edited = with_current_entry(text, Tier.EDGE, "b")
    assert edited == text.replace('device = "a"\n', 'device = "a"\nedge = "b"\n')
    created = with_current_entry('[family]\nname = "f"\n\n[[variants]]\nname = "a"\n', Tier.CLOUD, "a")
    assert tomllib.loads(created)["current"] == {"cloud": "a"}
    assert created.index("[current]") < created.index("[[variants]]")


# ---------------------------------------------------------------------------------------------
# Refusals: each names the file and what is wrong, and leaves nothing behind
# ---------------------------------------------------------------------------------------------


def refused(source: Path, opts: ImportOptions, match: str) -> None:
    folder = opts.root / opts.family
    before = snapshot(folder)
    with pytest.raises(ConfigError, match=match):
        import_model(source, opts)
    assert snapshot(folder) == before


def test_a_dynamic_dimension_other_than_the_batch_is_refused(tmp_path: Path, root: Path) -> None:
    model = random_linear(tmp_path / "dyn.onnx", input_dims=["batch", "features"])
    refused(model, options(root), r"dyn\.onnx: input 'x' has a dynamic dimension 1 \(features\)")
    fixed = random_linear(tmp_path / "one.onnx", input_dims=[1, FEATURES])
    refused(fixed, options(root), r"one\.onnx: input 'x' has a fixed batch dimension \(1\)")


def test_unsupported_operators_are_named(tmp_path: Path, root: Path) -> None:
    custom = random_linear(tmp_path / "custom.onnx", op=("my.custom", "Frobnicate"))
    refused(
        custom, options(root), r"custom\.onnx: unsupported operator 'Frobnicate' \(custom domain 'my\.custom'"
    )
    unknown = random_linear(tmp_path / "unknown.onnx", op=("", "NotAnOp"))
    refused(unknown, options(root), r"unknown\.onnx: unsupported operator 'NotAnOp'.*not an ONNX operator")


def test_a_model_that_does_not_fit_the_family_is_refused(tmp_path: Path, root: Path) -> None:
    import_model(random_linear(tmp_path / "a.onnx"), options(root))
    wider = random_linear(tmp_path / "wider.onnx", input_dims=["batch", FEATURES + 1])
    refused(
        wider,
        options(root, tier="edge"),
        rf"wider\.onnx: does not fit family 'toy': input 'x' is FP32 \[-1, {FEATURES + 1}\], "
        rf"the family's is FP32 \[-1, {FEATURES}\]",
    )
    renamed = random_linear(tmp_path / "renamed.onnx", input_name="pixels")
    refused(renamed, options(root, tier="edge"), r"its inputs are \['pixels'\], the family's are \['x'\]")
    double = random_linear(tmp_path / "double.onnx", elem=TensorProto.DOUBLE)
    refused(double, options(root, tier="edge"), r"input 'x' is FP64 \[-1, 6\], the family's is FP32")
    probabilities = random_linear(tmp_path / "probs.onnx", softmax=True)
    refused(probabilities, options(root, tier="edge"), r"probs\.onnx: gives probabilities .* takes logits")


def test_files_names_and_tiers_are_checked(tmp_path: Path, root: Path) -> None:
    model = random_linear(tmp_path / "a.onnx")
    refused(tmp_path / "missing.onnx", options(root), r"missing\.onnx: no such file")
    (tmp_path / "model.pt").write_bytes(b"torch")
    refused(tmp_path / "model.pt", options(root), r"model\.pt: unknown model format '\.pt'")
    (tmp_path / "ir.xml").write_text("<net/>")
    refused(tmp_path / "ir.xml", options(root), r"ir\.xml: its weights .*ir\.bin are missing")
    (tmp_path / "junk.onnx").write_bytes(b"not a model")
    refused(tmp_path / "junk.onnx", options(root), r"junk\.onnx: not a readable ONNX model")
    refused(model, options(root, tier="fog"), r"a\.onnx: bad tier 'fog': expected one of device, edge, cloud")
    refused(model, options(root, family="no/slash"), r"a\.onnx: bad family name 'no/slash'")
    import_model(model, options(root))
    refused(model, options(root), r"a\.onnx: variant name 'toy-device' is already used .*--variant")
    refused(model, options(root, family="toy-device"), r"'toy-device' is a variant of family 'toy'")
    refused(
        model,
        options(root, variant="x2", method=ConfidenceMethod.MARGIN),
        r"--method margin: family 'toy' already uses max_softmax",
    )


def test_models_stratus_cannot_serve_are_refused(tmp_path: Path, root: Path) -> None:
    two_inputs = tmp_path / "two.onnx"
    graph = helper.make_graph(
        [helper.make_node("Add", ["a", "b"], ["y"])],
        "two",
        [
            helper.make_tensor_value_info("a", TensorProto.FLOAT, ["batch", 2]),
            helper.make_tensor_value_info("b", TensorProto.FLOAT, ["batch", 2]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 2])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    save(model, str(two_inputs))
    refused(two_inputs, options(root), r"two\.onnx: has 2 inputs \(a, b\); import takes single-input models")
    one_class = linear_onnx(tmp_path / "one.onnx", np.ones((FEATURES, 1)), np.zeros(1))
    refused(
        one_class, options(root), r"one\.onnx: output 'scores' is FP32 \[-1, 1\]; .*\[batch, classes >= 2\]"
    )


def test_a_tflite_and_an_openvino_ir_import_too(models_dir: Path, root: Path) -> None:
    """The shipped digits files stand in for a user's: both formats read, IR converted."""
    tflite = import_model(models_dir / "digits" / "digits-small.tflite", options(root, family="d"))
    assert set(tflite.variant.files) >= {"tflite"}
    assert tflite.report.ok and {r.runtime for r in tflite.report.rows} >= {"litert"}
    ir: ImportResult = import_model(
        models_dir / "digits" / "digits-medium.xml", options(root, family="d", tier="edge")
    )
    assert set(ir.variant.files) == {"openvino"}
    assert (root / "d" / "d-edge.bin").is_file()
    assert not ir.family.confidence.apply_softmax  # digits gives probabilities


def test_a_refusal_after_the_files_were_placed_removes_what_it_made(tmp_path: Path) -> None:
    """Bad --data is found once the files are copied: the folders it made go too."""
    root = tmp_path / "new" / "models"
    np.savez(
        tmp_path / "bad.npz", features=np.zeros((30, FEATURES), np.float32), labels=np.zeros(30, np.int64)
    )
    with pytest.raises(ConfigError, match=r"bad\.npz: no array 'x' \(the family's input\)"):
        import_model(random_linear(tmp_path / "a.onnx"), options(root, data=tmp_path / "bad.npz"))
    assert not (tmp_path / "new").exists()


def test_synthetic_inputs_follow_the_input_spec(tmp_path: Path) -> None:
    """Verify without labels feeds what the model takes: an INT64 input gets integers."""
    from stratus.tools.verify.classifier import synthetic_inputs

    family = load_family(_config(tmp_path, datatype="INT64", shape=[-1, 3, 2]))
    first = synthetic_inputs(family, 5)
    assert first.x.dtype == np.int64 and first.x.shape == (5, 3, 2) and len(first.y) == 0
    assert first.x.min() >= 0 and first.x.max() < 10
    assert np.array_equal(first.x, synthetic_inputs(family, 5).x)  # fixed seed
    floats = synthetic_inputs(load_family(_config(tmp_path, datatype="FP16", shape=[-1, 4])), 3)
    assert floats.x.dtype == np.float16 and floats.x.shape == (3, 4)


def _config(folder: Path, *, datatype: str, shape: list[int]) -> Path:
    (folder / "m.onnx").write_bytes(b"")
    path = folder / "family.toml"
    path.write_text(
        '[family]\nname = "f"\n\n'
        f'[[inputs]]\nname = "x"\ndatatype = "{datatype}"\nshape = {shape}\n\n'
        '[[outputs]]\nname = "y"\ndatatype = "FP32"\nshape = [-1, 2]\n\n'
        '[confidence]\noutput = "y"\nmethod = "margin"\n\n'
        '[[variants]]\nname = "f-device"\ntier = "device"\nfiles = { onnx = "m.onnx" }\n'
    )
    return path


def test_a_second_variant_for_digits_is_verified_on_its_bundled_data(
    models_dir: Path, tmp_path: Path
) -> None:
    shutil.copytree(models_dir / "digits", tmp_path / "digits")
    config = tmp_path / "digits" / "family.toml"
    before = load_family(config)
    result = import_model(
        models_dir / "digits" / "digits-small.onnx",
        ImportOptions(family="digits", tier="edge", variant="digits-edge-v2", root=tmp_path),
    )
    assert not result.current and result.family.current == before.current
    assert result.labelled is not None and "bundled held-out split of 'digits'" in result.labelled
    assert all(r.accuracy is not None and r.accuracy > 0.9 for r in result.report.rows)
    after = load_family(config)
    assert after.variants[: len(before.variants)] == before.variants  # the others untouched, in order
    # its children, calibrated on the bundled calibration split (no --data given)
    assert [(v.name, v.parent) for v in after.variants[len(before.variants) :]] == [
        ("digits-edge-v2", None),
        ("digits-edge-v2-int8", "digits-edge-v2"),
        ("digits-edge-v2-fp16", "digits-edge-v2"),
    ]
    assert any("calibrated (MinMax) on the bundled calibration split of 'digits'" in n for n in result.notes)
    shipped, record = load_verification(models_dir / "digits"), load_verification(tmp_path / "digits")
    assert shipped is not None and record is not None
    assert {name: record.variants[name] for name in shipped.variants} == shipped.variants  # kept as they were
    assert record.variants["digits-edge-v2-int8"].within_tolerance
    assert after.thresholds == before.thresholds and after.confidence == before.confidence
    # fitted on the bundled calibration split, as models/build/ fitted digits-small's own
    assert result.variant.temperature == before.variant("digits-small").temperature != 1.0
    assert any("temperature" in note and "calibration split" in note for note in result.notes)


def test_the_import_command_warns_that_a_tier_without_a_threshold_answers_everything(
    tmp_path: Path, root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Imported without thresholds, a tier settled every answer and the cloud was never asked,
    silently; the command now says so and what chooses one."""
    from stratus.cli.main import main

    model = random_linear(tmp_path / "toy.onnx")
    args = ["models", "import", str(model), "--family", "toy", "--tier", "device", "--models", str(root)]
    assert main(args) == 0
    said = capsys.readouterr().out
    assert (
        "warning: the device tier has no threshold yet: every device answer is final and nothing climbs "
        "to a tier above, until `stratus models calibrate toy --target-accuracy 0.97 --data FILE.npz` "
        "chooses one (or `stratus fleet thresholds toy --apply device=0.9` sets one on a running fleet)"
    ) in said
    assert "warning: the cloud" not in said
    cloud = random_linear(tmp_path / "big.onnx", seed=1)
    assert main(["models", "import", str(cloud), "--family", "toy", "--tier", "cloud", "--models", str(root)]) == 0
    assert "no threshold" not in capsys.readouterr().out  # the top tier answers whatever its confidence


def external_data_model(tmp_path: Path) -> Path:
    """What ``torch.onnx.export`` writes for a model past its size threshold: ``toy.onnx``
    holding the graph, and ``toy.onnx.data`` beside it holding the weights."""
    from onnx import load, save_model

    (tmp_path / "one").mkdir()
    one_file = random_linear(tmp_path / "one" / "toy.onnx")
    split = tmp_path / "exported" / "toy.onnx"
    split.parent.mkdir()
    save_model(load(str(one_file)), str(split), save_as_external_data=True, location="toy.onnx.data", size_threshold=0)
    return split


def test_a_model_with_external_data_is_imported_as_one_file(tmp_path: Path, root: Path) -> None:
    """It was refused ("keeps weights in external data files; save the model as one file")."""
    import onnx
    import onnxruntime as ort

    model = external_data_model(tmp_path)
    data = model.with_name("toy.onnx.data")
    assert data.stat().st_size >= FEATURES * CLASSES * 4  # the weights are out of the .onnx file
    result = import_model(model, options(root))
    assert result.report.ok
    placed = root / "toy" / "toy-device.onnx"
    assert [p.name for p in sorted((root / "toy").glob("*.data"))] == []  # one file, nothing beside
    inline = onnx.load(str(placed), load_external_data=False)
    assert all(t.data_location != onnx.TensorProto.EXTERNAL for t in inline.graph.initializer)
    assert any(f"with its external data (toy.onnx.data) into one file, {placed}" in n for n in result.notes)
    x = np.random.default_rng(3).normal(size=(5, FEATURES)).astype(np.float32)
    original = ort.InferenceSession(str(model)).run(None, {"x": x})[0]
    imported = ort.InferenceSession(str(placed)).run(None, {"x": x})[0]
    np.testing.assert_array_equal(imported, original)  # the same weights, not a copy of the graph alone


def test_a_model_whose_external_data_is_missing_is_refused_by_name(tmp_path: Path, root: Path) -> None:
    model = external_data_model(tmp_path)
    model.with_name("toy.onnx.data").unlink()
    with pytest.raises(ConfigError) as refused:
        import_model(model, options(root))
    assert str(refused.value) == (
        f"{model}: keeps its weights in 'toy.onnx.data', which is not beside it: copy the .onnx file "
        "with its data file(s), as the export wrote them"
    )
    assert not (root / "toy").exists()  # nothing imported
