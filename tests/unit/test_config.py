"""One settings loader (issue 19 step 8): a TOML file < STRATUS_ROLE_* < flags < nothing
else; each default written once, in the role's dataclass; a bad value is one line naming
where it came from."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from cloud_gateway.settings import CloudSettings
from edge_agent.settings import AgentSettings
from router.settings import OnCloudFailure, RouterSettings
from stratus.cli.config import check
from stratus.cli.main import build_parser, main
from stratus.cli.options import settings_of
from stratus.config import Flags, load
from stratus.errors import ConfigError
from stratus.families.precision import Precision
from stratus.tiers import Tier


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "stratus.toml"
    path.write_text(text, encoding="utf-8")
    return path


def server_args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


def flags(args: argparse.Namespace) -> Flags:
    return Flags(vars(args), args.flag_names)


# -- precedence ---------------------------------------------------------------------------


def test_a_flag_beats_a_variable_beats_the_file_beats_the_default(tmp_path: Path) -> None:
    path = write(tmp_path, "[router]\nkeepalive_s = 3.0\nadmit_per_s = 7.0\nhello_timeout_s = 4.0\n")
    environ = {"STRATUS_ROUTER_KEEPALIVE_S": "5", "STRATUS_ROUTER_ADMIT_PER_S": "9"}
    args = server_args("router", "--keepalive-s", "6")
    loaded = load(RouterSettings, "router", file=path, environ=environ, flags=flags(args))
    settings = loaded.built
    assert settings.keepalive_s == 6.0  # flag over variable and file
    assert settings.admit_per_s == 9.0  # variable over file
    assert settings.hello_timeout_s == 4.0  # file over default
    assert settings.max_heartbeats_per_s == RouterSettings().max_heartbeats_per_s  # default
    assert loaded.origins["keepalive_s"] == "--keepalive-s"
    assert loaded.origins["admit_per_s"] == "$STRATUS_ROUTER_ADMIT_PER_S"
    assert loaded.origins["hello_timeout_s"] == f"{path}:router.hello_timeout_s"
    assert loaded.origins["max_heartbeats_per_s"] == "default"


def test_flags_not_given_fall_through_instead_of_restating_a_default(tmp_path: Path) -> None:
    """The parser's defaults are None: a flag left out must not override the file."""
    path = write(tmp_path, "[cloud]\nconcurrency = 5\nlisten = '0.0.0.0:9'\ninsecure = true\n")
    args = server_args("cloud")
    settings = load(CloudSettings, "cloud", file=path, flags=flags(args)).built
    assert (settings.concurrency, settings.listen, settings.insecure) == (5, "0.0.0.0:9", True)


def test_nested_tables_variables_and_flags(tmp_path: Path) -> None:
    path = write(tmp_path, "[router.audit]\nshare = 0.2\nmax_per_s = 3.0\nworkers = 4\n")
    args = server_args("router", "--audit-max-per-s", "8")
    environ = {"STRATUS_ROUTER_AUDIT_SHARE": "0.3"}
    audit = load(RouterSettings, "router", file=path, environ=environ, flags=flags(args)).built.audit
    assert (audit.share, audit.max_per_s, audit.workers) == (0.3, 8.0, 4)


def test_enums_tuples_and_units_come_typed(tmp_path: Path) -> None:
    path = write(tmp_path, "[router]\non_cloud_failure = 'fail'\nopenai_hosts = ['a', 'b']\n")
    args = server_args("router", "--max-batch-delay-us", "250", "--cloud-header", "x-k=v")
    settings = settings_of(argparse.Namespace(**{**vars(args), "config": path}), RouterSettings, "router")
    assert settings.on_cloud_failure is OnCloudFailure.FAIL
    assert settings.openai_hosts == ("a", "b")
    assert settings.max_batch_delay_s == pytest.approx(250e-6)
    assert settings.cloud_headers == (("x-k", "v"),)


def test_the_agent_from_a_file_with_its_one_concurrency_default(tmp_path: Path) -> None:
    path = write(tmp_path, "[agent]\ntier = 'edge'\nrouter = '127.0.0.1:8001'\nprecision = 'int8'\n")
    settings = load(AgentSettings, "agent", file=path).built
    assert settings.tier is Tier.EDGE
    assert settings.precision is Precision.INT8
    assert settings.concurrency == 2  # the agent's capacity and its runtime calls: one number
    assert settings.name.endswith("-edge")  # HOSTNAME-TIER where none is given
    environ = {"STRATUS_AGENT_VARIANTS": "a, b", "STRATUS_AGENT_INSECURE": "yes"}
    settings = load(AgentSettings, "agent", file=path, environ=environ).built
    assert (settings.variants, settings.insecure) == (("a", "b"), True)


def test_the_help_shows_each_flags_default_from_the_dataclass() -> None:
    parser = build_parser()
    commands = {a.dest: a for a in parser._actions if isinstance(a, argparse._SubParsersAction)}
    router = " ".join(commands["command"].choices["router"].format_help().split())
    assert f"(default: {RouterSettings().keepalive_s})" in router
    assert "(default: degrade)" in router
    agent = " ".join(commands["command"].choices["agent"].format_help().split())
    assert (
        f"runtime calls at once (default: {AgentSettings.__dataclass_fields__['concurrency'].default})"
        in agent
    )


# -- secrets ------------------------------------------------------------------------------


def test_tokens_come_from_files_named_in_the_file_or_from_variables(tmp_path: Path) -> None:
    token = tmp_path / "agent.token"
    token.write_text("s3cret\n", encoding="utf-8")
    path = write(tmp_path, f"[router]\nagent_token_file = '{token}'\n")
    loaded = load(RouterSettings, "router", file=path, environ={"STRATUS_OPERATOR_TOKEN": "op"})
    assert loaded.built.agent_token == "s3cret"
    assert loaded.built.operator_token == "op"
    assert loaded.shown["agent_token"] == f"file {token}"  # the path, never the token
    assert loaded.shown["operator_token"] == "(from $STRATUS_OPERATOR_TOKEN)"
    assert "s3cret" not in " ".join(loaded.shown.values())


def test_a_token_written_in_the_file_is_refused(tmp_path: Path) -> None:
    path = write(tmp_path, "[router]\nagent_token = 'in the clear'\n")
    with pytest.raises(ConfigError, match=r"router\.agent_token: a credential is never written"):
        load(RouterSettings, "router", file=path)


def test_the_fleet_token_stands_in_for_the_agents_own(tmp_path: Path) -> None:
    path = write(tmp_path, "[agent]\ntier = 'device'\nrouter = '127.0.0.1:1'\n")
    settings = load(AgentSettings, "agent", file=path, environ={"STRATUS_TOKEN": "fleet"}).built
    assert settings.token == "fleet"


# -- validation ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("[router]\nkeepalive = 2\n", r"stratus\.toml:router\.keepalive: unknown setting$"),
        ("[router.audit]\nshares = 2\n", r"stratus\.toml:router\.audit\.shares: unknown setting$"),
        ("[routers]\n", r"stratus\.toml:routers: unknown section"),
        ("[router]\nkeepalive_s = 'fast'\n", r"stratus\.toml:router\.keepalive_s: a number, not 'fast'$"),
        ("[router]\nkeepalive_s = 0\n", r"stratus\.toml:router\.keepalive_s: must be more than 0, not 0.0$"),
        ("[router]\nadmit_waiting = '5'\n", r"stratus\.toml:router\.admit_waiting: a whole number, not '5'$"),
        ("[router]\nadvertise = 1\n", r"stratus\.toml:router\.advertise: true or false, not 1$"),
        ("[router]\non_cloud_failure = 'retry'\n", r"on_cloud_failure: one of degrade, fail, not 'retry'$"),
        ("[router.audit]\nshare = 2.0\n", r"router\.audit: .*--audit-share"),
        ("[router]\nkeepalive_s = [\n", r"stratus\.toml: not TOML"),
    ],
)
def test_a_bad_file_is_one_line_naming_file_section_and_key(tmp_path: Path, text: str, error: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match=error) as caught:
        load(RouterSettings, "router", file=path)
    assert "\n" not in str(caught.value)


def test_a_bad_variable_or_flag_is_named_too() -> None:
    with pytest.raises(ConfigError, match=r"^\$STRATUS_CLOUD_CONCURRENCY: must be at least 1, not 0$"):
        load(CloudSettings, "cloud", environ={"STRATUS_CLOUD_CONCURRENCY": "0"})
    args = server_args("cloud", "--queue-limit", "-1")
    with pytest.raises(ConfigError, match=r"^--queue-limit: must not be negative, not -1$"):
        load(CloudSettings, "cloud", flags=flags(args))


def test_settings_built_in_code_check_themselves() -> None:
    with pytest.raises(ConfigError, match="concurrency must be at least 1"):
        CloudSettings(concurrency=0)
    with pytest.raises(ConfigError, match="keepalive_s must be more than 0"):
        RouterSettings(keepalive_s=-1.0)


def test_a_required_setting_missing_everywhere_says_where_to_give_it() -> None:
    with pytest.raises(
        ConfigError, match=r"agent needs tier: give --tier, \$STRATUS_AGENT_TIER or tier in \[agent\]"
    ):
        load(AgentSettings, "agent", environ={"STRATUS_AGENT_ROUTER": "127.0.0.1:1"})


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (["cloud", "--concurrency", "0"], "stratus: error: --concurrency: must be at least 1, not 0\n"),
        (["agent", "--router", "127.0.0.1:1"], "stratus: error: agent needs tier: give --tier,"),
        (  # said in the flag's unit (microseconds), not the setting's
            ["cloud", "--max-batch-delay-us", "-5"],
            "stratus: error: --max-batch-delay-us: must not be negative, not -5\n",
        ),
        (
            ["cloud", "--openai-upstream", "127.0.0.1:8000"],
            "stratus: error: --openai-upstream: is an http:// or https:// URL, not '127.0.0.1:8000'\n",
        ),
    ],
)
def test_the_cli_prints_one_line_not_a_traceback(
    argv: list[str], error: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(error)
    assert err.count("\n") == 1


# -- stratus config check -----------------------------------------------------------------


def test_config_check_prints_effective_settings_with_origins(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STRATUS_CLOUD_QUEUE_LIMIT", "9")
    path = write(
        tmp_path,
        "[router]\nlisten = '0.0.0.0:8001'\nclient_token_file = '/run/secrets/none-here'\n"
        "[cloud]\nconcurrency = 4\n[agent]\nconcurrency = 3\n",
    )
    assert main(["config", "check", str(path)]) == 0
    out = capsys.readouterr().out
    assert "[router]" in out and "[cloud]" in out and "[agent]" in out
    router = out.split("[cloud]")[0]
    lines = {line.split(" = ")[0].strip(): line for line in router.splitlines() if " = " in line}
    assert lines["listen"].endswith(f"= 0.0.0.0:8001  # {path}:router.listen")
    # The token file need not exist: check never reads a credential, it shows where it is.
    assert lines["client_token"].split(" = ", 1)[1] == (
        f"file /run/secrets/none-here  # {path}:router.client_token_file"
    )
    assert "= 9  # $STRATUS_CLOUD_QUEUE_LIMIT" in out
    assert "tier              = (not set: a flag must give it)  # required" in out.split("[agent]")[1]


def test_config_check_one_role_and_its_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, "[router]\nlisten = '0.0.0.0:8001'\n[cloud]\nconcurency = 4\n")
    out = check(path, ["router"])
    assert out.startswith("[router]\n") and "[cloud]" not in out
    assert main(["config", "check", str(path)]) == 2
    assert capsys.readouterr().err == f"stratus: error: {path}:cloud.concurency: unknown setting\n"


def test_config_check_refuses_a_file_with_no_role(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no \\[router\\], \\[cloud\\], \\[agent\\] table"):
        check(write(tmp_path, "# nothing\n"))
    with pytest.raises(ConfigError, match="cannot read"):
        check(tmp_path / "missing.toml")


def test_a_tokens_flag_beats_its_variable_beats_the_files_key(tmp_path: Path) -> None:
    in_flag, in_file = tmp_path / "flag.token", tmp_path / "file.token"
    in_flag.write_text("from-flag\n", encoding="utf-8")
    in_file.write_text("from-file\n", encoding="utf-8")
    path = write(tmp_path, f"[router]\noperator_token_file = '{in_file}'\n")
    environ = {"STRATUS_OPERATOR_TOKEN": "from-variable"}
    assert load(RouterSettings, "router", file=path).built.operator_token == "from-file"
    assert load(RouterSettings, "router", file=path, environ=environ).built.operator_token == "from-variable"
    args = server_args("router", "--operator-token-file", str(in_flag))
    loaded = load(RouterSettings, "router", file=path, environ=environ, flags=flags(args))
    assert (loaded.built.operator_token, loaded.origins["operator_token"]) == ("from-flag", "--operator-token-file")


@pytest.mark.parametrize(
    ("given", "instead"),
    [
        ({"peers": "10.0.0.2:8001"}, "--peers was removed with the routers' peer protocol: give every router "
         "of the site --site-state nats://HOST:PORT"),
        ({"peer_token": "a-peer-token-of-old"}, "--peer-token-file / STRATUS_PEER_TOKEN was removed with the "
         "routers' peer protocol: the store's own credentials replace it"),
        ({"rollout_state": Path("rollouts.json")}, "--rollout-state was removed with the routers' peer "
         "protocol: give --site-state file:PATH"),
    ],
)  # fmt: skip
def test_the_peer_protocols_settings_stop_the_router_saying_what_replaced_them(
    given: dict[str, object], instead: str
) -> None:
    """An upgraded site must not go on silently sharing nothing (issue 35: the README's migration)."""
    with pytest.raises(ConfigError, match=re.escape(instead)):
        RouterSettings(**given).check_site_state()  # type: ignore[arg-type]
    RouterSettings(site_state="file:/tmp/x").check_site_state()
