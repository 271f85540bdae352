"""The Open Inference Protocol over HTTP/REST on the router (``--http``), through
``tritonclient.http`` as Triton's and KServe's REST users call it, and through plain HTTP for
what that client never sends: the same data plane, credentials, limits and errors as gRPC."""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton_http
from tritonclient.utils import InferenceServerException

from stratus.devtools.launcher import free_port
from stratus.serving.channels import TlsSettings
from stratus.serving.rest import MAX_BODY_BYTES

from .cluster import Cluster, infer, ready_count, wait_until
from .pki import tls_args


@dataclass(frozen=True)
class RestFleet:
    grpc: str
    http: str


@pytest.fixture(scope="module")
def rest_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RestFleet]:
    """A router serving REST beside gRPC, one device agent (digits, arith) and a cloud gateway."""
    cluster = Cluster(tmp_path_factory.mktemp("rest-logs"))
    try:
        cloud = cluster.cloud().address
        http = f"127.0.0.1:{free_port()}"
        router = cluster.router("--cloud", cloud, "--http", http, "--audit-share", "0").address
        cluster.agent("dev-1", router)
        wait_until(lambda: ready_count(router) == 1, 60)
        wait_until(lambda: triton_http.InferenceServerClient(http).is_model_ready("digits-large"), 30)
        yield RestFleet(grpc=router, http=http)
    finally:
        cluster.stop_all()


def post(address: str, path: str, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    """(status, parsed JSON body) of a POST, errors included."""
    request = urllib.request.Request(
        f"http://{address}{path}", data=body, headers=headers or {}, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def http_input(x: np.ndarray, *, binary: bool) -> triton_http.InferInput:
    tensor = triton_http.InferInput("input", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x, binary_data=binary)
    return tensor


def test_probes_metadata_config_and_index_through_tritonclient_http(rest_fleet: RestFleet) -> None:
    client = triton_http.InferenceServerClient(rest_fleet.http)
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("digits") and client.is_model_ready("digits-large")
    assert not client.is_model_ready("letters")
    assert client.get_server_metadata()["name"] == "stratus"
    metadata = client.get_model_metadata("digits")
    assert [(t["name"], t["datatype"], t["shape"]) for t in metadata["inputs"]] == [
        ("input", "FP32", [-1, 64])
    ]
    assert [(t["name"], t["shape"]) for t in metadata["outputs"]] == [("probabilities", [-1, 10])]
    # the same answers as the gRPC front's, field for field (64-bit numbers as numbers)
    grpc_config = triton_grpc.InferenceServerClient(rest_fleet.grpc).get_model_config("digits").config
    config = client.get_model_config("digits")
    assert config["name"] == "digits" and config["max_batch_size"] == grpc_config.max_batch_size
    assert [list(i["dims"]) for i in config["input"]] == [list(i.dims) for i in grpc_config.input]
    index = {m["name"]: m["state"] for m in client.get_model_repository_index()}
    assert index["digits"] == "READY" and index["digits-large"] == "READY"
    with pytest.raises(InferenceServerException) as unknown:
        client.get_model_metadata("letters")
    assert unknown.value.status() == "404" and "letters" in unknown.value.message()


def test_binary_and_json_tensors_give_the_grpc_answer(rest_fleet: RestFleet, digits) -> None:  # type: ignore[no-untyped-def]
    x = digits.held_out.x[:8]
    parameters = {"stratus.max_tier": "device"}
    grpc_client = triton_grpc.InferenceServerClient(rest_fleet.grpc)
    grpc_input = triton_grpc.InferInput("input", list(x.shape), "FP32")
    grpc_input.set_data_from_numpy(x)
    expected = grpc_client.infer("digits", [grpc_input], parameters=parameters).as_numpy("probabilities")
    client = triton_http.InferenceServerClient(rest_fleet.http)
    for binary in (True, False):
        output = triton_http.InferRequestedOutput("probabilities", binary_data=binary)
        result = client.infer(
            "digits", [http_input(x, binary=binary)], outputs=[output], request_id="7", parameters=parameters
        )
        assert np.array_equal(result.as_numpy("probabilities"), expected), binary
        response = result.get_response()
        assert response["id"] == "7"
        assert response["parameters"]["stratus.tier"] == "device"
        assert ("binary_data_size" in response["outputs"][0].get("parameters", {})) is binary
    assert (expected.argmax(axis=1) == digits.held_out.y[:8]).mean() >= 0.75


def test_a_request_climbs_to_the_cloud_through_rest(rest_fleet: RestFleet, digits) -> None:  # type: ignore[no-untyped-def]
    client = triton_http.InferenceServerClient(rest_fleet.http)
    x = digits.held_out.x[:4]
    result = client.infer("digits", [http_input(x, binary=True)], parameters={"stratus.min_tier": "cloud"})
    assert result.get_response()["parameters"]["stratus.tier"] == "cloud"
    assert (result.as_numpy("probabilities").argmax(axis=1) == digits.held_out.y[:4]).all()


def test_bad_requests_get_the_grpc_fronts_errors_and_lose_nothing(rest_fleet: RestFleet) -> None:
    wrong = {"inputs": [{"name": "input", "shape": [1, 63], "datatype": "FP32", "data": [0.0] * 63}]}
    status, body = post(rest_fleet.http, "/v2/models/digits/infer", json.dumps(wrong).encode())
    grpc_input = triton_grpc.InferInput("input", [1, 63], "FP32")
    grpc_input.set_data_from_numpy(np.zeros((1, 63), np.float32))
    with pytest.raises(InferenceServerException) as over_grpc:
        triton_grpc.InferenceServerClient(rest_fleet.grpc).infer("digits", [grpc_input])
    assert status == 400 and over_grpc.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert body["error"] == over_grpc.value.message()
    binary_input = {
        "name": "input",
        "shape": [1, 64],
        "datatype": "FP32",
        "parameters": {"binary_data_size": 256},
    }
    claims_256 = json.dumps({"inputs": [binary_input]}).encode()
    refusals = {
        "not JSON": (b"{inputs", None, 400, "not valid JSON"),
        "count": (
            json.dumps({"inputs": [{**wrong["inputs"][0], "shape": [1, 64]}]}).encode(),
            None,
            400,
            "holds 63 values",
        ),
        "binary short": (claims_256, str(len(claims_256)), 400, "claims 256 bytes of binary data, 0 remain"),
        "header past the body": (claims_256, "99999", 400, "Inference-Header-Content-Length is 99999"),
        "unknown field": (json.dumps({"input": []}).encode(), None, 400, "unknown field 'input'"),
    }
    for case, (raw, header_length, expected_status, message) in refusals.items():
        headers = {"Inference-Header-Content-Length": header_length} if header_length else {}
        status, body = post(rest_fleet.http, "/v2/models/digits/infer", raw, headers)
        assert (status, message in body["error"]) == (expected_status, True), (case, body)
    status, body = post(rest_fleet.http, "/v2/models/letters/infer", json.dumps(wrong).encode())
    assert status == 404 and "letters" in body["error"]
    status, body = post(rest_fleet.http, "/v2/models/digits/infer", b"[" * (MAX_BODY_BYTES + 1))
    assert status == 413 and str(MAX_BODY_BYTES) in body["error"]
    # ... and the router still answers
    assert triton_http.InferenceServerClient(rest_fleet.http).is_server_ready()


def test_statistics_count_rest_requests(rest_fleet: RestFleet, digits) -> None:  # type: ignore[no-untyped-def]
    client = triton_http.InferenceServerClient(rest_fleet.http)

    def executions() -> int:
        return int(client.get_inference_statistics("digits")["model_stats"][0].get("execution_count", 0))

    before = executions()
    client.infer("digits", [http_input(digits.held_out.x[:3], binary=True)])
    assert executions() == before + 1


def test_generate_and_generate_stream_answer_as_the_grpc_front(rest_fleet: RestFleet) -> None:
    asked = {"text_input": "12+30=", "parameters": {"max_tokens": 4}}
    status, whole = post(rest_fleet.http, "/v2/models/arith/generate", json.dumps(asked).encode())
    assert status == 200, whole
    grpc_client = triton_grpc.InferenceServerClient(rest_fleet.grpc)
    prompt = triton_grpc.InferInput("text_input", [1], "BYTES")
    prompt.set_data_from_numpy(np.array([b"12+30="], dtype=object))
    over_grpc = grpc_client.infer("arith", [prompt], parameters={"max_tokens": 4}).as_numpy("text_output")
    assert whole["text_output"] == over_grpc[0].decode()
    request = urllib.request.Request(
        f"http://{rest_fleet.http}/v2/models/arith/generate_stream",
        data=json.dumps(asked).encode(),
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        assert response.headers["Content-Type"].startswith("text/event-stream")
        events = [
            json.loads(line[6:])
            for line in response.read().decode().splitlines()
            if line.startswith("data: ")
        ]
    assert "".join(e["text_output"] for e in events) == whole["text_output"]
    assert [e["parameters"]["triton_final_response"] for e in events][-2:] == [False, True]
    status, empty = post(
        rest_fleet.http, "/v2/models/arith/generate", json.dumps({"text_input": ""}).encode()
    )
    assert status == 400 and "empty" in empty["error"]


def test_the_client_token_guards_rest_as_it_guards_grpc(cluster: Cluster, tmp_path: Path, digits) -> None:  # type: ignore[no-untyped-def]
    token = tmp_path / "client.token"
    token.write_text("a-client-token-of-some-length\n")
    http = f"127.0.0.1:{free_port()}"
    router = cluster.router("--http", http, "--client-token-file", str(token)).address
    cluster.agent("dev-1", router)
    wait_until(lambda: ready_count(router) == 1, 60)
    client = triton_http.InferenceServerClient(http)
    assert client.is_server_live() and client.is_server_ready()  # probes carry no secrets
    x = digits.held_out.x[:2]
    with pytest.raises(InferenceServerException) as refused:
        client.infer("digits", [http_input(x, binary=True)])
    assert refused.value.status() == "401" and "Authorization: Bearer TOKEN" in refused.value.message()
    with pytest.raises(InferenceServerException):
        client.infer(
            "digits", [http_input(x, binary=True)], headers={"Authorization": "Bearer wrong-token-of-length"}
        )
    answered = client.infer(
        "digits",
        [http_input(x, binary=True)],
        headers={"Authorization": "Bearer a-client-token-of-some-length"},
    )
    assert answered.as_numpy("probabilities").shape == (2, 10)


def _https_client(address: str, settings: TlsSettings) -> triton_http.InferenceServerClient:
    options = {"ca_certs": str(settings.ca)}
    if settings.cert is not None and settings.key is not None:
        options |= {"certfile": str(settings.cert), "keyfile": str(settings.key)}
    return triton_http.InferenceServerClient(address, ssl=True, ssl_options=options)


def test_mutual_tls_rest_takes_fleet_certificates_and_refuses_a_revoked_one(
    cluster: Cluster,
    pki: dict[str, TlsSettings],
    tmp_path: Path,
    digits,  # type: ignore[no-untyped-def]
) -> None:
    from cryptography import x509

    revoked = tmp_path / "revoked"
    revoked.write_text("# none yet\n")
    port = free_port()
    router = cluster.router(
        *tls_args(pki["router"]), "--http", f"127.0.0.1:{port}", "--revoked-certificates", str(revoked)
    ).address
    cluster.agent("dev-1", router, *tls_args(pki["dev-1"]))
    wait_until(lambda: ready_count(router, pki["operator"]) == 1, 60)
    address = f"localhost:{port}"  # the name the router's certificate carries
    x = digits.held_out.x[:2]
    answered = _https_client(address, pki["client"]).infer("digits", [http_input(x, binary=True)])
    assert answered.as_numpy("probabilities").shape == (2, 10)
    for stranger in ("no-cert", "intruder"):
        # the handshake fails (no certificate, or one of another CA): the connection is closed
        with pytest.raises((InferenceServerException, OSError, http.client.HTTPException)):
            _https_client(address, pki[stranger]).infer("digits", [http_input(x, binary=True)])
    assert pki["client"].cert is not None
    serial = x509.load_pem_x509_certificate(pki["client"].cert.read_bytes()).serial_number
    update = tmp_path / "revoked.new"
    update.write_text(f"serial:{serial:x}\n")
    update.replace(revoked)

    def refused_as_revoked() -> bool:
        try:
            _https_client(address, pki["client"]).infer("digits", [http_input(x, binary=True)])
        except InferenceServerException as error:
            return error.status() == "403" and f"serial {serial:x} is revoked" in error.message()
        return False

    wait_until(refused_as_revoked, 10)
    with pytest.raises(grpc.RpcError) as over_grpc:  # as the gRPC front refuses it
        infer(router, x, tls=pki["client"])
    assert over_grpc.value.code() == grpc.StatusCode.PERMISSION_DENIED
