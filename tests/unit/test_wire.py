"""The committed stubs match the .proto files, and tritonclient lives beside them."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_committed_stubs_are_up_to_date(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("generate_stubs", ROOT / "scripts" / "generate_stubs.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fresh = {p.name: p.read_text() for p in module.generate(tmp_path)}
    committed = {
        p.name: p.read_text()
        for p in (ROOT / "stratus" / "wire").iterdir()
        if p.name != "__init__.py" and p.suffix in (".py", ".pyi")
    }
    assert sorted(fresh) == sorted(committed), "stub files differ from the .proto files: run make proto"
    stale = [name for name, text in fresh.items() if committed[name] != text]
    assert not stale, f"stale stubs {stale}: run make proto"


def test_tritonclient_and_stratus_wire_import_together_and_interoperate() -> None:
    """Same process, both orders: the OIP package name 'inference' must not collide."""
    script = (
        "import tritonclient.grpc.service_pb2 as t\n"
        "from stratus.wire import inference_pb2 as s, fleet_pb2\n"
        "r = t.ModelInferRequest(model_name='digits', id='7'); r.inputs.add(name='input', shape=[1, 64])\n"
        "back = s.ModelInferRequest.FromString(r.SerializeToString())\n"
        "assert (back.model_name, back.id, list(back.inputs[0].shape)) == ('digits', '7', [1, 64])\n"
        "print('ok')\n"
    )
    for source in (
        script,
        "\n".join(reversed(script.splitlines()[:2])) + "\n" + "\n".join(script.splitlines()[2:]),
    ):
        result = subprocess.run(
            [sys.executable, "-c", source], check=False, capture_output=True, text=True, timeout=60
        )
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == "ok"


@pytest.mark.parametrize(
    ("message", "fields"),
    [
        (
            "ModelInferRequest",
            {
                "model_name": 1,
                "model_version": 2,
                "id": 3,
                "parameters": 4,
                "inputs": 5,
                "outputs": 6,
                "raw_input_contents": 7,
            },
        ),
        (
            "ModelInferResponse",
            {
                "model_name": 1,
                "model_version": 2,
                "id": 3,
                "parameters": 4,
                "outputs": 5,
                "raw_output_contents": 6,
            },
        ),
        (
            "InferParameter",
            {"bool_param": 1, "int64_param": 2, "string_param": 3, "double_param": 4, "uint64_param": 5},
        ),
        ("ModelStreamInferResponse", {"error_message": 1, "infer_response": 2}),
    ],
)
def test_field_numbers_match_tritonclient(message: str, fields: dict[str, int]) -> None:
    """Our field numbers, checked against the published layout and tritonclient's own copy."""
    from tritonclient.grpc import service_pb2 as triton

    from stratus.wire import inference_pb2 as ours

    mine = {f.name: f.number for f in getattr(ours, message).DESCRIPTOR.fields}
    theirs = {f.name: f.number for f in getattr(triton, message).DESCRIPTOR.fields}
    assert mine == fields
    assert {k: theirs[k] for k in mine} == fields


def test_service_path_is_the_protocols() -> None:
    from stratus.wire import inference_pb2

    service = inference_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    assert service.full_name == "inference.GRPCInferenceService"
    assert {
        "ServerLive",
        "ServerReady",
        "ModelReady",
        "ServerMetadata",
        "ModelMetadata",
        "ModelInfer",
        "ModelStreamInfer",
        "ModelConfig",
    } <= {m.name for m in service.methods}
