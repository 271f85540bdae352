"""The OpenAI API keeps strangers and browsers out (the security review's F14): a key where
one is set (and one is required off loopback), JSON bodies only, loopback Host names only
without a key, and bad bodies answered 400 in OpenAI's shape, never 500."""

from __future__ import annotations

import http.client
import json
import socket
import ssl
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from router.api.openai.door import IDLE_CONNECTION_S
from stratus.devtools.launcher import free_port
from stratus.errors import Unavailable

from .cluster import Cluster, wait_until
from .pki import make_ca, make_leaf

KEY = "sk-stratus-test"


def call(api: str, path: str, body: bytes | None = None, **headers: str) -> tuple[int, dict[str, object]]:
    """(status, JSON body) of one request to the API."""
    request = urllib.request.Request(f"http://{api}{path}", data=body, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def completion(**extra: object) -> bytes:
    return json.dumps({"model": "arith", "prompt": "37+48=", "max_tokens": 4, **extra}).encode()


@pytest.fixture
def keyless(cluster: Cluster) -> str:
    api = f"127.0.0.1:{free_port()}"
    router = cluster.router("--openai", api).address
    cluster.agent("dev-1", router)
    wait_until(lambda: call(api, "/v1/models")[0] == 200 and bool(call(api, "/v1/models")[1]["data"]), timeout_s=30)
    return api


def test_without_a_key_only_json_bodies_for_loopback_names_are_taken(keyless: str) -> None:
    json_type = {"Content-Type": "application/json"}
    status, answer = call(keyless, "/v1/completions", completion(), **json_type)
    assert status == 200 and answer["choices"]
    status, refused = call(keyless, "/v1/completions", completion(), **{"Content-Type": "text/plain"})
    assert status == 415 and refused["error"]["message"] == "the body must be Content-Type: application/json"  # type: ignore[index]
    status, refused = call(keyless, "/v1/models", Host="attacker.example")  # a name rebound to 127.0.0.1
    assert status == 421 and "'attacker.example' is not one this API serves" in refused["error"]["message"]  # type: ignore[index]
    assert call(keyless, "/v1/models", Host="localhost:8080")[0] == 200


def test_bodies_that_used_to_give_500_are_400s_in_openais_shape(keyless: str) -> None:
    json_type = {"Content-Type": "application/json"}
    status, refused = call(keyless, "/v1/completions", b"[" * 200_000, **json_type)
    assert status == 400 and refused["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    huge = completion().replace(b'"max_tokens": 4', b'"max_tokens": 4, "stratus": {"budget_ms": 1' + b"0" * 400 + b"}")
    status, refused = call(keyless, "/v1/completions", huge, **json_type)
    assert status == 400 and refused["error"]["message"] == "'stratus.budget_ms' is out of range"  # type: ignore[index]
    # an empty prompt gave a 503 carrying OpenVINO GenAI's assertion and its build path
    for path, body, param in (
        ("/v1/completions", completion(prompt=""), "prompt"),
        ("/v1/completions", completion(prompt=["1+1=", ""]), "prompt"),
        ("/v1/chat/completions", json.dumps({"model": "arith", "messages": [{"role": "user", "content": ""}]}).encode(), "messages"),
    ):  # fmt: skip
        status, refused = call(keyless, path, body, **json_type)
        assert status == 400 and refused["error"]["param"] == param, refused  # type: ignore[index]
        assert "empty: a generation needs a prompt" in refused["error"]["message"]  # type: ignore[index]


def test_with_a_key_every_call_needs_it(cluster: Cluster, tmp_path: Path) -> None:
    key_file = tmp_path / "openai.key"
    key_file.write_text(KEY + "\n")
    api = f"127.0.0.1:{free_port()}"
    cluster.router("--openai", api, "--openai-api-key-file", str(key_file))
    wait_until(lambda: call(api, "/v1/models", Authorization=f"Bearer {KEY}")[0] == 200, timeout_s=30)
    json_type = {"Content-Type": "application/json"}
    refusals = ({}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"})
    for headers in refusals:  # the bare key and another scheme are refused: only "Bearer KEY" is the key
        for path, body in (("/v1/models", None), ("/v1/completions", completion()), ("/v1/chat/completions", b"{}")):
            status, refused = call(api, path, body, **headers, **(json_type if body else {}))
            assert status == 401 and refused["error"]["type"] == "authentication_error", (path, headers)  # type: ignore[index]
    status, answered = call(api, "/v1/completions", b"{}", Authorization=f"Bearer {KEY}", **json_type)
    assert status == 400, answered  # past the key: the body itself is what is refused
    # with a key, any Host: a page elsewhere cannot make a browser send the key
    assert call(api, "/v1/models", Authorization=f"Bearer {KEY}", Host="router.site.example")[0] == 200
    # /health alone is open, as vLLM's is, for probes: it says only whether the router serves
    status, health = call(api, "/health")
    assert status in (200, 503) and set(health) == {"status"}, health
    assert call(api, "/health?x=1", Authorization="Bearer sk-wrong")[0] in (200, 503)
    assert call(api, "/health/../v1/models")[0] == 401  # no path but /health itself is open


def test_off_loopback_the_api_does_not_start_without_a_key(cluster: Cluster) -> None:
    with pytest.raises(Unavailable) as refused:
        cluster.router("--openai", f"0.0.0.0:{free_port()}")
    assert "is off loopback: give it a key (--openai-api-key-file, or STRATUS_OPENAI_API_KEY)" in str(refused.value)


def test_off_loopback_a_short_key_is_refused(cluster: Cluster, tmp_path: Path) -> None:
    """security2 N15: a key of one character served the API off loopback."""
    key_file = tmp_path / "openai.key"
    key_file.write_text("k\n")
    with pytest.raises(Unavailable) as refused:
        cluster.router("--openai", f"0.0.0.0:{free_port()}", "--openai-api-key-file", str(key_file))
    assert "with a key of 1 characters: give one of at least 32" in str(refused.value)


def test_a_connection_that_sends_no_request_or_half_of_one_is_closed(keyless: str) -> None:
    """security2 N10: a silent TCP connection, or one that sends part of a request line and goes
    silent (slowloris), was held for aiohttp's hour; both are closed after IDLE_CONNECTION_S."""
    host, port = keyless.rsplit(":", 1)
    silent = socket.create_connection((host, int(port)))
    partial = socket.create_connection((host, int(port)))
    partial.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # no blank line: never ends
    started = time.monotonic()
    try:
        for held in (silent, partial):
            held.settimeout(IDLE_CONNECTION_S + 10)
            assert held.recv(1024) == b""  # closed by the server, with nothing sent
        assert time.monotonic() - started < IDLE_CONNECTION_S + 5
    finally:
        silent.close()
        partial.close()
    assert call(keyless, "/v1/models")[0] == 200  # the next client is served


def test_with_a_certificate_the_api_is_https_only(cluster: Cluster, tmp_path: Path) -> None:
    """--openai-tls-cert/--openai-tls-key (security2 N15): the key and prompts never cross in
    clear; a client that trusts the CA gets answers, plain HTTP on that port gets none."""
    ca_path, ca_key, ca = make_ca(tmp_path, "openai-ca")
    leaf = make_leaf(tmp_path, "openai", ca_key, ca, role="client")  # localhost and 127.0.0.1
    assert leaf.cert is not None and leaf.key is not None
    key_file = tmp_path / "api-key.txt"
    key_file.write_text(KEY + "\n")
    api = f"127.0.0.1:{free_port()}"
    tls = ("--openai-tls-cert", str(leaf.cert), "--openai-tls-key", str(leaf.key))
    router = cluster.router("--openai", api, "--openai-api-key-file", str(key_file), *tls).address
    cluster.agent("dev-1", router)
    trusted = ssl.create_default_context(cafile=str(ca_path))

    def https(path: str, body: bytes | None = None) -> tuple[int, dict[str, object]]:
        headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
        request = urllib.request.Request(f"https://{api}{path}", data=body, headers=headers)
        with urllib.request.urlopen(request, timeout=30, context=trusted) as response:
            return response.status, json.loads(response.read())

    wait_until(lambda: bool(https("/v1/models")[1]["data"]), timeout_s=30)
    status, answer = https("/v1/completions", completion())
    assert status == 200 and answer["choices"]
    with pytest.raises((urllib.error.URLError, ConnectionError, http.client.HTTPException)):
        call(api, "/v1/models", Authorization=f"Bearer {KEY}")  # plain HTTP to a TLS port
    untrusting = ssl.create_default_context()  # the system's CAs: this one is not among them
    with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
        urllib.request.urlopen(f"https://{api}/v1/models", timeout=30, context=untrusting)


def test_one_client_holds_no_more_of_the_openai_api_than_of_the_grpc_port(cluster: Cluster) -> None:
    """security2 F21: the per-client limits bound the OpenAI API too (it had only the router's
    global 4,096). While one completion of three prompts holds a client's three item places
    (a slowed agent: 400 ms a token), its next call is refused 429, streamed or not; once it is
    answered, the next is served."""
    api = f"127.0.0.1:{free_port()}"
    router = cluster.router("--openai", api, "--max-items-per-client", "3").address
    cluster.agent("dev-1", router, "--emulate-slow-ms", "400")
    wait_until(lambda: call(api, "/v1/models")[0] == 200 and bool(call(api, "/v1/models")[1]["data"]), timeout_s=30)
    json_type = {"Content-Type": "application/json"}
    with ThreadPoolExecutor(1) as pool:
        holding = pool.submit(call, api, "/v1/completions", completion(prompt=["1+1=", "2+2=", "3+3="]), **json_type)
        time.sleep(0.6)  # it reached the router; its first tokens take 400 ms each
        refusals = [call(api, "/v1/completions", completion(stream=stream), **json_type) for stream in (False, True)]
        status, answer = holding.result(timeout=60)
    assert status == 200 and len(answer["choices"]) == 3  # type: ignore[arg-type]
    for status, refused in refusals:
        assert status == 429, (status, refused)
        assert "items in requests in flight here, the most one client may" in refused["error"]["message"]  # type: ignore[index]
    assert call(api, "/v1/completions", completion(), **json_type)[0] == 200  # its places came back
