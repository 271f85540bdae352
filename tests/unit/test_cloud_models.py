"""What the router asks a cloud for, and which of its models answers each family
(router.cloud.models): flags, names, tensor checks and the choice of route."""

from __future__ import annotations

from typing import Any

import pytest

from router.cloud.models import (
    Found,
    NamedModel,
    descriptions,
    family_of,
    mismatch,
    parse_cloud_models,
    parse_header,
    probe_names,
    routes,
    secret_headers,
)
from stratus.convert.fleet import family_from_wire
from stratus.errors import ConfigError
from stratus.families.description import FamilyDescription
from stratus.wire import fleet_pb2 as fpb
from stratus.wire import inference_pb2 as pb

Tensor = pb.ModelMetadataResponse.TensorMetadata


def described(**fields: Any) -> FamilyDescription:
    """A family as a router holds it, from the FamilyInfo fields a Hello would carry."""
    return family_from_wire(fpb.FamilyInfo(**fields))


def digits_family() -> FamilyDescription:
    return described(
        name="digits",
        inputs=[Tensor(name="input", datatype="FP32", shape=[-1, 64])],
        outputs=[Tensor(name="probabilities", datatype="FP32", shape=[-1, 10])],
    )


def metadata(
    name: str, *, inputs: list[Tensor] | None = None, outputs: list[Tensor] | None = None
) -> pb.ModelMetadataResponse:
    return pb.ModelMetadataResponse(
        name=name,
        inputs=inputs if inputs is not None else [Tensor(name="input", datatype="FP32", shape=[-1, 64])],
        outputs=outputs
        if outputs is not None
        else [Tensor(name="probabilities", datatype="FP32", shape=[-1, 10])],
    )


def test_cloud_models_take_names_and_family_name_pairs() -> None:
    assert parse_cloud_models("digits-large, defects=big-defects,") == (
        NamedModel(name="digits-large"),
        NamedModel(name="big-defects", family="defects"),
    )
    assert parse_cloud_models(None) == ()
    with pytest.raises(ValueError, match="'digits large' is not a model name"):
        parse_cloud_models("digits large")
    with pytest.raises(ValueError, match="'a/b' is not a model name"):
        parse_cloud_models("a/b=digits-large")


def test_headers_are_what_grpc_accepts() -> None:
    assert parse_header("Triton-GRPC-Protocol-Triton-Access-Token=s3=cret") == (
        "triton-grpc-protocol-triton-access-token",
        "s3=cret",
    )
    assert parse_header("authorization=Bearer abc") == ("authorization", "Bearer abc")
    for bad, why in [
        ("novalue", "expected KEY=VALUE"),
        ("=v", "expected KEY=VALUE"),
        ("grpc-timeout=1", "not starting with 'grpc-'"),
        ("token-bin=x", "nor ending with '-bin'"),
        ("bad key=x", "a key is lowercase"),
        ("k=caf\u00e9", "printable ASCII"),
        ("k=line\nbreak", "printable ASCII"),
    ]:
        with pytest.raises(ValueError, match=why):
            parse_header(bad)


def test_a_header_file_holds_key_value_lines_and_its_errors_never_show_a_value() -> None:
    text = "# Triton's access token\n\nauthorization = Bearer s3cret-abc\n  x-tenant=site-7\n"
    assert secret_headers(text) == (("authorization", "Bearer s3cret-abc"), ("x-tenant", "site-7"))
    for bad, line, key in [("ok=1\nBearer s3cret-abc\n", 2, "(no '=')"), ("grpc-x=s3cret-abc", 1, "grpc-x")]:
        with pytest.raises(ConfigError) as refused:
            secret_headers(bad)
        assert f"--cloud-header-file line {line} (key {key!r})" in str(refused.value)
        assert "s3cret" not in str(refused.value)


def test_a_name_belongs_to_the_family_it_names_or_begins_with() -> None:
    families = {"digits", "digits-extra", "defects"}
    assert family_of("digits", families) == "digits"
    assert family_of("digits-large", families) == "digits"
    assert family_of("digits-extra-large", families) == "digits-extra"  # the longest prefix
    assert family_of("digitslarge", families) is None
    assert family_of("big", families, [NamedModel(name="big", family="defects")]) == "defects"


def test_probes_ask_each_name_once_families_first() -> None:
    named = (NamedModel(name="digits-large"), NamedModel(name="digits"))
    families = {"digits": described(name="digits"), "defects": described(name="defects")}
    assert probe_names(families, named, ["zeta", "digits-large"]) == [
        "defects",
        "digits",
        "digits-large",
        "zeta",
    ]


def test_probes_ask_for_the_cloud_variants_the_families_name() -> None:
    """A cloud that lists nothing (PyTriton, KServe) is asked for each family's cloud
    variants, as agents described them, after the operator's names."""
    families = {
        "digits": described(name="digits", cloud_variants=["digits-large", "digits-large-fp16"]),
        "defects": described(name="defects", cloud_variants=["defects-large"]),
    }
    assert probe_names(families, (NamedModel(name="mine"),), []) == [
        "defects",
        "digits",
        "mine",
        "defects-large",
        "digits-large",
        "digits-large-fp16",
    ]


def test_tensors_must_be_the_familys() -> None:
    family = digits_family()
    assert mismatch(family, metadata("digits-large")) is None
    fixed = metadata("m", inputs=[Tensor(name="input", datatype="FP32", shape=[8, 64])])
    assert mismatch(family, fixed) is None  # -1 fits any size
    assert "no input 'input'" in str(
        mismatch(family, metadata("m", inputs=[Tensor(name="x", datatype="FP32", shape=[-1, 64])]))
    )
    assert "is FP16" in str(
        mismatch(family, metadata("m", inputs=[Tensor(name="input", datatype="FP16", shape=[-1, 64])]))
    )
    narrow = metadata("m", outputs=[Tensor(name="probabilities", datatype="FP32", shape=[-1, 9])])
    assert "output 'probabilities' has shape [-1, 9]" in str(mismatch(family, narrow))
    assert "shape [64]" in str(
        mismatch(family, metadata("m", inputs=[Tensor(name="input", datatype="FP32", shape=[64])]))
    )
    text = described(name="arith", kind="generative")
    assert "does not take 'text_input'" in str(mismatch(text, metadata("arith-large")))


def test_a_family_goes_to_its_own_name_where_the_cloud_serves_it() -> None:
    families = {"digits": digits_family()}
    found = [
        Found(name="digits", metadata=metadata("digits")),
        Found(name="digits-large", metadata=metadata("x")),
    ]
    wire, refused = routes(found, families, ())
    assert wire == {"digits": "digits", "digits-large": "digits-large"} and refused == []


def test_a_foreign_cloud_serves_a_family_under_a_variants_name() -> None:
    families = {"digits": digits_family()}
    found = [Found(name="digits-large", metadata=metadata("digits-large"))]
    assert routes(found, families, ())[0] == {"digits": "digits-large", "digits-large": "digits-large"}


def test_the_operators_name_comes_first_and_a_misfit_is_passed_over_with_why() -> None:
    families = {"digits": digits_family()}
    wrong = metadata("digits", outputs=[Tensor(name="logits", datatype="FP32", shape=[-1, 10])])
    found = [
        Found(name="digits", metadata=wrong),
        Found(name="digits-large", metadata=metadata("a")),
        Found(name="digits-huge", metadata=metadata("b")),
    ]
    wire, refused = routes(found, families, (NamedModel(name="digits-huge"),))
    assert wire["digits"] == "digits-huge"
    wire, refused = routes(found, families, ())
    assert wire["digits"] == "digits-large"  # not the cloud's own 'digits', whose tensors differ
    assert "digits" not in {k for k, v in wire.items() if v == "digits"}
    assert refused == ["digits for digits: no output 'probabilities' (it has ['logits'])"]


def test_an_undescribed_model_is_taken_only_when_named() -> None:
    families = {"digits": digits_family()}
    silent = [Found(name="digits-large", metadata=None)]
    wire, refused = routes(silent, families, ())
    assert "digits" not in wire and "name it with --cloud-models" in refused[0]
    assert routes(silent, families, (NamedModel(name="digits-large"),))[0]["digits"] == "digits-large"


def test_nothing_fits_means_the_cloud_does_not_serve_the_family() -> None:
    families = {"digits": digits_family(), "defects": described(name="defects")}
    wire, _ = routes([Found(name="other", metadata=metadata("other"))], families, ())
    assert wire == {"other": "other"}


def test_each_name_the_cloud_serves_is_described_as_the_cloud_describes_its_model() -> None:
    """Its own tensors, not the family's: a foreign cloud's shapes (here [-1, -1]) stand."""
    loose = [Tensor(name="input", datatype="FP32", shape=[-1, -1])]
    found = [
        Found(name="digits-large", metadata=metadata("digits-large", inputs=loose)),
        Found(name="opaque", metadata=pb.ModelMetadataResponse(name="opaque")),  # describes nothing
        Found(name="silent", metadata=None),
    ]
    wire = {"digits": "digits-large", "digits-large": "digits-large", "opaque": "opaque", "silent": "silent"}
    text = described(name="digits-large", kind="generative")  # as CloudLink learns a text model
    said = descriptions(found, wire, {})
    assert set(said) == {"digits", "digits-large"}
    assert [list(t.shape) for t in said["digits-large"].inputs] == [[-1, -1]]
    assert said["digits"].name == "digits" and said["digits-large"].outputs[0].name == "probabilities"
    assert descriptions(found, wire, {"digits-large": text})["digits-large"] is text
