"""``stratus certs``: the files it writes, what the certificates say, and a real gRPC mutual-TLS
handshake with them on loopback (the router's certificate serving, an agent's dialling)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import ipaddress
import ssl
import stat
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509 import verification
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from stratus.cli.certs import add_parser
from stratus.cli.pki import Identity, issue
from stratus.errors import ConfigError
from stratus.serving.auth import role_server_name, spiffe_identity

HOSTS = ["router-a", "cloud.example.internal", "10.1.2.3"]


def certs(argv: list[str]) -> tuple[int, str]:
    """``stratus certs ARGV`` through its own parser, as cli.py wires it; (exit code, stdout)."""
    parser = argparse.ArgumentParser(prog="stratus")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["certs", *argv])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = args.handler(args)
    return code, out.getvalue()


def parse_error(argv: list[str]) -> str:
    """What argparse says about a refused command line (it exits 2)."""
    parser = argparse.ArgumentParser(prog="stratus")
    add_parser(parser.add_subparsers(dest="command", required=True))
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exited:
        parser.parse_args(["certs", *argv])
    assert exited.value.code == 2
    return err.getvalue()


def load(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default fleet, with the server names the compose file needs."""
    out = tmp_path_factory.mktemp("certs") / "fleet"
    code, _ = certs(["--out", str(out), *(f"--host={h}" for h in HOSTS)])
    assert code == 0
    return out


@pytest.fixture(scope="module")
def stranger(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Another fleet: its own CA, the same names."""
    out = tmp_path_factory.mktemp("certs") / "stranger"
    issue(out, [Identity("agent", "device-1"), Identity("router", "router")])
    return out


# -- files and contents --------------------------------------------------------------------------


def test_default_fleet_files_and_modes(fleet: Path) -> None:
    stems = [
        "router-router",
        "cloud-cloud",
        "operator-operator",
        "client-client",
        "agent-device-1",
        "agent-device-2",
        "agent-edge-1",
    ]
    assert sorted(p.name for p in fleet.iterdir()) == sorted(
        ["ca.pem", "private", *(f"{s}.pem" for s in stems), *(f"{s}.key" for s in stems)]
    )
    # the CA's key apart from the leaves a machine is given (issue 34 §5: it sat beside them)
    assert [p.name for p in (fleet / "private").iterdir()] == ["ca.key"]
    assert stat.S_IMODE(fleet.stat().st_mode) == stat.S_IMODE((fleet / "private").stat().st_mode) == 0o700
    for key in [*fleet.glob("*.key"), fleet / "private" / "ca.key"]:
        assert stat.S_IMODE(key.stat().st_mode) == 0o600, key.name


def test_every_leaf_chains_to_the_ca_as_client_and_as_server(fleet: Path) -> None:
    """cryptography's own path validation (RFC 5280 and the Web PKI profile), both ways."""
    store = verification.Store([load(fleet / "ca.pem")])
    builder = verification.PolicyBuilder().store(store)
    for pem in fleet.glob("*-*.pem"):
        leaf = load(pem)
        verified = builder.build_client_verifier().verify(leaf, [])
        uris = [n.value for n in verified.subjects or [] if isinstance(n, x509.UniformResourceIdentifier)]
        assert uris == [f"spiffe://stratus/{pem.stem.replace('-', '/', 1)}"], pem.name
    for stem in ("router-router", "cloud-cloud"):
        server = builder.build_server_verifier(verification.DNSName("router-a"))
        server.verify(load(fleet / f"{stem}.pem"), [])
        builder.build_server_verifier(verification.IPAddress(ipaddress.ip_address("127.0.0.1"))).verify(
            load(fleet / f"{stem}.pem"), []
        )


@pytest.mark.parametrize("role", ["router", "cloud", "agent"])
def test_only_a_roles_own_leaves_carry_its_role_name(fleet: Path, role: str) -> None:
    """security2 N2: every agent leaf once carried the routers' names, so a stolen agent key
    served as the router. Clients with the fleet CA check a server against its role's name."""
    store = verification.Store([load(fleet / "ca.pem")])
    verifier = verification.PolicyBuilder().store(store).build_server_verifier(
        verification.DNSName(role_server_name(role))
    )
    for pem in sorted(fleet.glob("*-*.pem")):
        if pem.name.startswith(f"{role}-"):
            verifier.verify(load(pem), [])
        else:
            with pytest.raises(verification.VerificationError):
                verifier.verify(load(pem), [])


def test_an_agent_leaf_carries_no_host_given_for_the_servers(fleet: Path) -> None:
    store = verification.Store([load(fleet / "ca.pem")])
    builder = verification.PolicyBuilder().store(store)
    with pytest.raises(verification.VerificationError):
        builder.build_server_verifier(verification.DNSName("router-a")).verify(load(fleet / "agent-edge-1.pem"), [])
    builder.build_server_verifier(verification.DNSName("localhost")).verify(load(fleet / "agent-edge-1.pem"), [])


def test_a_leaf_of_another_ca_does_not_verify(fleet: Path, stranger: Path) -> None:
    store = verification.Store([load(fleet / "ca.pem")])
    verifier = verification.PolicyBuilder().store(store).build_client_verifier()
    with pytest.raises(verification.VerificationError):
        verifier.verify(load(stranger / "agent-device-1.pem"), [])


def test_leaf_names_key_and_extensions(fleet: Path) -> None:
    agent = load(fleet / "agent-device-1.pem").extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert agent.get_values_for_type(x509.DNSName) == ["agent.stratus.spiffe.invalid", "localhost"]
    assert agent.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1")]
    cert = load(fleet / "router-router.pem")
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "router"
    assert cert.subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)[0].value == "router"
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.UniformResourceIdentifier) == ["spiffe://stratus/router/router"]
    assert san.get_values_for_type(x509.DNSName) == [
        "router.stratus.spiffe.invalid",
        "localhost",
        "router-a",
        "cloud.example.internal",
    ]
    assert san.get_values_for_type(x509.IPAddress) == [
        ipaddress.ip_address("127.0.0.1"),
        ipaddress.ip_address("10.1.2.3"),
    ]
    public = cert.public_key()
    assert isinstance(public, ec.EllipticCurvePublicKey) and public.curve.name == "secp256r1"
    assert cert.signature_hash_algorithm is not None and cert.signature_hash_algorithm.name == "sha256"
    constraints = cert.extensions.get_extension_for_class(x509.BasicConstraints)
    assert constraints.critical and constraints.value.ca is False
    usage = cert.extensions.get_extension_for_class(x509.KeyUsage).value
    assert usage.digital_signature and not usage.key_cert_sign
    eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert set(eku) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    days = (cert.not_valid_after_utc - cert.not_valid_before_utc).days
    assert days == 825


def test_client_certificates_carry_no_server_names(fleet: Path) -> None:
    for stem in ("operator-operator", "client-client"):
        san = load(fleet / f"{stem}.pem").extensions.get_extension_for_class(x509.SubjectAlternativeName)
        assert san.value.get_values_for_type(x509.DNSName) == [], stem
        assert san.value.get_values_for_type(x509.IPAddress) == [], stem


def test_the_ca(fleet: Path) -> None:
    ca = load(fleet / "ca.pem")
    constraints = ca.extensions.get_extension_for_class(x509.BasicConstraints)
    assert constraints.critical and constraints.value.ca is True and constraints.value.path_length == 0
    assert ca.extensions.get_extension_for_class(x509.KeyUsage).value.key_cert_sign
    assert (ca.not_valid_after_utc - ca.not_valid_before_utc).days >= 3650


def test_openssl_reads_the_files(fleet: Path) -> None:
    """The stdlib's ssl module is OpenSSL: it loads each certificate with its key (the pair
    must match) and the CA."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.load_verify_locations(cafile=fleet / "ca.pem")
    for pem in fleet.glob("*-*.pem"):
        context.load_cert_chain(pem, pem.with_suffix(".key"))
    with pytest.raises(ssl.SSLError):
        context.load_cert_chain(fleet / "agent-device-1.pem", fleet / "agent-device-2.key")


# -- reuse, refusal, names ----------------------------------------------------------------------


def test_a_second_run_reuses_the_ca_and_adds_only_what_it_is_asked(tmp_path: Path) -> None:
    out = tmp_path / "certs"
    assert certs(["--out", str(out), "--agent", "device-1"])[0] == 0
    ca_pem, ca_key = (out / "ca.pem").read_bytes(), (out / "private" / "ca.key").read_bytes()
    code, printed = certs(["--out", str(out), "--agent", "device-9"])
    assert code == 0 and "(reused)" in printed and "device-9" in printed
    assert (out / "ca.pem").read_bytes() == ca_pem and (out / "private" / "ca.key").read_bytes() == ca_key
    assert sorted(p.name for p in out.iterdir()) == [
        "agent-device-1.key",
        "agent-device-1.pem",
        "agent-device-9.key",
        "agent-device-9.pem",
        "ca.pem",
        "private",
    ]
    ca = load(out / "ca.pem")
    store = verification.Store([ca])
    verification.PolicyBuilder().store(store).build_client_verifier().verify(
        load(out / "agent-device-9.pem"), []
    )
    assert load(out / "agent-device-9.pem").issuer == ca.subject


def test_every_role_flag_repeats_and_a_run_names_the_roles_the_folder_still_lacks(tmp_path: Path) -> None:
    """`--router router-a --router router-b` kept only router-b; a run giving only agents made
    no operator certificate and did not say so."""
    out = tmp_path / "certs"
    code, printed = certs(["--out", str(out), "--router", "router-a", "--router", "router-b", "--agent", "device-1"])
    assert code == 0
    assert {"router-router-a.pem", "router-router-b.pem", "agent-device-1.pem"} <= {p.name for p in out.iterdir()}
    notes = [line for line in printed.splitlines() if line.startswith("note: ")]
    assert notes == [
        f"note: no client certificate here (applications calling the router need one): stratus certs --out {out} --client client",
        f"note: no cloud certificate here (the cloud gateway serves the routers with one): stratus certs --out {out} --cloud cloud",
        f"note: no operator certificate here (stratus fleet drain, reload, rollout and thresholds need one): "
        f"stratus certs --out {out} --operator operator",
        f"note: {out / 'private' / 'ca.key'} signs new certificates: keep it off the fleet's machines (each needs ca.pem and its own pair only)",
    ]
    code, printed = certs(["--out", str(out), "--cloud", "cloud", "--operator", "operator", "--client", "client"])
    assert code == 0 and not [line for line in printed.splitlines() if "no " in line and line.startswith("note: ")]


def test_an_existing_leaf_is_kept_unless_forced(tmp_path: Path) -> None:
    out = tmp_path / "certs"
    certs(["--out", str(out), "--agent", "device-1"])
    before = (out / "agent-device-1.pem").read_bytes()
    with pytest.raises(ConfigError, match=r"agent-device-1\.pem, agent-device-1\.key: pass --force"):
        certs(["--out", str(out), "--agent", "device-2", "--agent", "device-1"])
    assert (out / "agent-device-1.pem").read_bytes() == before
    assert not (out / "agent-device-2.pem").exists(), "nothing is written when one leaf is refused"
    certs(["--out", str(out), "--agent", "device-1", "--force"])
    assert (out / "agent-device-1.pem").read_bytes() != before
    assert stat.S_IMODE((out / "agent-device-1.key").stat().st_mode) == 0o600
    assert not list(out.glob(".*")), "no scratch file is left behind"


def test_a_ca_half_present_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "certs"
    certs(["--out", str(out), "--client", "c1"])
    (out / "private" / "ca.key").unlink()
    with pytest.raises(ConfigError, match=r"ca\.pem exists without .*private/ca\.key: restore it \(or say where it is with --ca-key\)"):
        certs(["--out", str(out), "--client", "c2"])


def test_a_key_that_is_not_the_cas_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "certs"
    certs(["--out", str(out), "--client", "c1"])
    (out / "private" / "ca.key").write_bytes((out / "client-c1.key").read_bytes())
    with pytest.raises(ConfigError, match="is not the key of"):
        certs(["--out", str(out), "--client", "c2"])


def test_a_folder_from_before_keeps_its_ca_key_beside_the_leaves_and_is_told_how_to_move_it(tmp_path: Path) -> None:
    out = tmp_path / "certs"
    certs(["--out", str(out), "--client", "c1"])
    (out / "private" / "ca.key").rename(out / "ca.key")  # the layout every earlier run wrote
    (out / "private").rmdir()
    code, printed = certs(["--out", str(out), "--client", "c2"])
    assert code == 0 and "(reused)" in printed and not (out / "private").exists()
    assert f"note: {out / 'ca.key'} sits beside the leaves, so a copy of the folder carries it: move it with " in printed
    moved = f"mkdir -m 700 {out / 'private'} && mv {out / 'ca.key'} {out / 'private'}/"
    assert moved in printed
    (out / "private").mkdir(mode=0o700)
    (out / "ca.key").rename(out / "private" / "ca.key")  # as the note says
    code, printed = certs(["--out", str(out), "--client", "c3"])
    assert code == 0 and "(reused)" in printed and "sits beside the leaves" not in printed
    (out / "ca.key").write_bytes((out / "private" / "ca.key").read_bytes())
    with pytest.raises(ConfigError, match="holds two CA keys"):
        certs(["--out", str(out), "--client", "c4"])


def test_the_ca_key_lives_where_ca_key_says(tmp_path: Path) -> None:
    out, vault = tmp_path / "certs", tmp_path / "vault" / "fleet-ca.key"
    code, printed = certs(["--out", str(out), "--client", "c1", "--ca-key", str(vault)])
    assert code == 0 and "(created)" in printed and vault.exists() and not (out / "private").exists()
    assert stat.S_IMODE(vault.stat().st_mode) == 0o600
    code, printed = certs(["--out", str(out), "--client", "c2", "--ca-key", str(vault)])
    assert code == 0 and "(reused)" in printed
    with pytest.raises(ConfigError, match=r"ca\.pem exists without .*private/ca\.key"):
        certs(["--out", str(out), "--client", "c3"])  # not given: the default place has none


@pytest.mark.parametrize("bad", ["../evil", "-dash", "a/b", "", "x" * 129, "dev ice", "ü"])
def test_bad_names_are_refused_with_a_clear_message(bad: str, tmp_path: Path) -> None:
    said = parse_error(["--out", str(tmp_path / "c"), f"--agent={bad}"])
    assert "argument --agent" in said and "is not a valid name" in said
    with pytest.raises(ConfigError, match="is not a valid name"):
        Identity("agent", bad)
    assert not (tmp_path / "c").exists()


def test_bad_hosts_and_days_are_refused(tmp_path: Path) -> None:
    assert "neither a DNS name nor an IP address" in parse_error(["--out", str(tmp_path), "--host", "a_b"])
    assert "neither a DNS name nor an IP address" in parse_error(["--out", str(tmp_path), "--host=-a.b"])
    with pytest.raises(ConfigError, match="at least one day"):
        issue(tmp_path / "c", [Identity("client", "c")], days=0)
    with pytest.raises(ConfigError, match="outlives the CA"):
        issue(tmp_path / "c", [Identity("client", "c")], days=20_000)


def test_stratus_certs_is_a_subcommand_of_stratus(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from stratus.cli.main import main

    out = tmp_path / "certs"
    assert main(["certs", "--out", str(out), "--operator", "alice"]) == 0
    printed = capsys.readouterr().out
    assert f"--tls-cert {out / 'operator-alice.pem'} --tls-key {out / 'operator-alice.key'}" in printed
    assert main(["certs", "--out", str(out), "--operator", "alice"]) == 2, "refused: it exists"
    assert "pass --force" in capsys.readouterr().err


# -- spiffe_identity -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ids", "expected"),
    [
        ([b"spiffe://stratus/agent/device-1"], ("agent", "device-1")),
        ([b"spiffe://example.org/operator/alice"], ("operator", "alice")),
        ([b"spiffe://stratus/router/r.1_x"], ("router", "r.1_x")),
        ([], None),
        ([b"spiffe://stratus/agent/a", b"spiffe://stratus/agent/b"], None),
        ([b"spiffe://stratus/admin/root"], None),
        ([b"spiffe://stratus/agent/device-1/extra"], None),
        ([b"spiffe://stratus/agent/"], None),
        ([b"spiffe://stratus/agent/-x"], None),
        ([b"spiffe://Stratus/agent/a"], None),
        ([b"spiffe:///agent/a"], None),
        ([b"https://stratus/agent/a"], None),
        ([b"spiffe://stratus/agent/\xff"], None),
        ([b"spiffe://stratus/agent/a\nb"], None),
    ],
)
def test_spiffe_identity(ids: list[bytes], expected: tuple[str, str] | None) -> None:
    assert spiffe_identity({"peer_spiffe_id": ids, "x509_common_name": [b"ignored"]}) == expected


def test_spiffe_identity_without_the_property() -> None:
    assert spiffe_identity({"transport_security_type": [b"ssl"]}) is None


# -- a real gRPC mutual-TLS handshake ------------------------------------------------------------


WHO = "/stratus.test.Echo/Who"


async def _who(request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
    identity = spiffe_identity(context.auth_context())
    return b"none" if identity is None else "/".join(identity).encode()


@contextlib.asynccontextmanager
async def mtls_server(certs_dir: Path) -> AsyncIterator[int]:
    """A grpc.aio server on 127.0.0.1:0 with the router's certificate, requiring a client
    certificate from the fleet CA; yields its port."""
    server = grpc.aio.server()
    handler = grpc.method_handlers_generic_handler(
        "stratus.test.Echo", {"Who": grpc.unary_unary_rpc_method_handler(_who)}
    )
    server.add_generic_rpc_handlers((handler,))
    credentials = grpc.ssl_server_credentials(
        [((certs_dir / "router-router.key").read_bytes(), (certs_dir / "router-router.pem").read_bytes())],
        root_certificates=(certs_dir / "ca.pem").read_bytes(),
        require_client_auth=True,
    )
    port = server.add_secure_port("127.0.0.1:0", credentials)
    await server.start()
    try:
        yield port
    finally:
        await server.stop(None)


async def ask(port: int, *, ca: Path, cert: Path | None, key: Path | None) -> bytes:
    credentials = grpc.ssl_channel_credentials(
        root_certificates=ca.read_bytes(),
        private_key=key.read_bytes() if key else None,
        certificate_chain=cert.read_bytes() if cert else None,
    )
    async with grpc.aio.secure_channel(f"127.0.0.1:{port}", credentials) as channel:
        answer: bytes = await channel.unary_unary(WHO)(b"", timeout=5.0)
        return answer


async def outcome(port: int, *, ca: Path, cert: Path | None, key: Path | None) -> grpc.StatusCode | bytes:
    """The answer, or the status code of the refusal. Only the code leaves: an exception kept
    (pytest.raises' traceback) would hold the channel, and with it grpc.aio's poller thread."""
    try:
        return await ask(port, ca=ca, cert=cert, key=key)
    except grpc.aio.AioRpcError as exc:
        return exc.code()


def test_grpc_mutual_tls_names_the_agent(fleet: Path) -> None:
    async def main() -> bytes:
        async with mtls_server(fleet) as port:
            return await ask(
                port, ca=fleet / "ca.pem", cert=fleet / "agent-device-1.pem", key=fleet / "agent-device-1.key"
            )

    assert asyncio.run(main()) == b"agent/device-1"


def test_grpc_refuses_a_certificate_of_another_ca(fleet: Path, stranger: Path) -> None:
    """Same name, other CA: the handshake fails, so the call never reaches the handler."""

    async def main() -> tuple[grpc.StatusCode | bytes, ...]:
        async with mtls_server(fleet) as port:
            foreign = await outcome(
                port,
                ca=fleet / "ca.pem",
                cert=stranger / "agent-device-1.pem",
                key=stranger / "agent-device-1.key",
            )
            anonymous = await outcome(port, ca=fleet / "ca.pem", cert=None, key=None)
            own = await outcome(
                port, ca=fleet / "ca.pem", cert=fleet / "agent-edge-1.pem", key=fleet / "agent-edge-1.key"
            )
            return foreign, anonymous, own

    foreign, anonymous, own = asyncio.run(main())
    assert foreign == grpc.StatusCode.UNAVAILABLE
    assert anonymous == grpc.StatusCode.UNAVAILABLE, "a client without a certificate is refused too"
    assert own == b"agent/edge-1", "while the fleet's own agent gets through on the same server"


def test_grpc_client_refuses_a_server_of_another_ca(fleet: Path, stranger: Path) -> None:
    """The agent's side: a server whose certificate is not from the fleet CA is not a router."""

    async def main() -> grpc.StatusCode | bytes:
        async with mtls_server(stranger) as port:
            return await outcome(
                port, ca=fleet / "ca.pem", cert=fleet / "agent-device-1.pem", key=fleet / "agent-device-1.key"
            )

    assert asyncio.run(main()) == grpc.StatusCode.UNAVAILABLE
