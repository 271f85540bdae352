"""Every option of every command says what it is for, and its default (issue 21 §7)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from stratus.cli.main import build_parser


def commands(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ("stratus",)
) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from commands(sub, (*path, name))


def test_every_option_has_help_and_every_help_renders() -> None:
    missing = []
    for path, parser in commands(build_parser()):
        text = parser.format_help()  # a stray % in a help string would raise here
        for action in parser._actions:
            if action.option_strings and action.dest != "help" and not action.help:
                missing.append(f"{' '.join(path)} {action.option_strings[0]}")
            shown = action.default not in (None, False, argparse.SUPPRESS, [])
            if action.option_strings and action.help and shown and not isinstance(action.default, bool):
                assert "default" in text, (path, action.option_strings)
    assert not missing, missing


def test_defaults_are_shown() -> None:
    agent = dict(commands(build_parser()))[("stratus", "agent")].format_help()
    assert "runtime calls at once (default: 2)" in agent
    assert "the models folder (default: models)" in agent


def test_the_models_folder_has_one_name() -> None:
    parser = build_parser()
    for command in (
        ["models", "calibrate", "digits", "--target-accuracy", "0.9"],
        ["models", "import", "m.onnx"],
    ):
        args = parser.parse_args(
            [
                *command,
                "--models",
                "elsewhere",
                *(["--family", "f", "--tier", "device"] if "import" in command else []),
            ]
        )
        assert str(args.dir) == "elsewhere"


def test_choices_are_shown_and_a_switch_shows_no_default_of_its_own() -> None:
    """``--on-cloud-failure ON_CLOUD_FAILURE`` hid its choices, and ``--no-advertise`` said
    "(default: true)", the setting's default, as if the switch were on by default."""
    helps = dict(commands(build_parser()))
    router = " ".join(helps[("stratus", "router")].format_help().split())
    agent = " ".join(helps[("stratus", "agent")].format_help().split())
    assert "--on-cloud-failure {degrade,fail}" in router
    assert "--precision {fp32,fp16,int8}" in agent
    assert "--no-advertise do not advertise over zeroconf --" in router  # nothing more after it
    for path, parser in helps.items():
        for action in parser._actions:
            if action.choices is not None and action.option_strings and action.metavar is not None:
                raise AssertionError(f"{' '.join(path)} {action.option_strings[0]} hides its choices")


def test_output_into_a_closed_pipe_ends_quietly(tmp_path: Path) -> None:
    """``stratus ... | head``: the reader has gone before the output is written. It ended in a
    BrokenPipeError traceback; now it stops with 141 (128 + SIGPIPE), as Unix tools do."""
    settings = tmp_path / "router.toml"
    settings.write_text('[router]\nlisten = "127.0.0.1:0"\n')
    read_end, write_end = os.pipe()
    os.close(read_end)  # nobody will read: every write fails with EPIPE
    try:
        done = subprocess.run(
            [sys.executable, "-m", "stratus.cli", "config", "check", str(settings)],
            stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=60, check=False,
        )  # fmt: skip
    finally:
        os.close(write_end)
    assert (done.returncode, done.stderr) == (141, "")


def test_the_demo_finds_a_checkouts_or_the_images_models_and_says_so_when_neither(tmp_path: Path) -> None:
    """Outside a checkout the demo failed with "models: model repository folder does not exist"."""
    from stratus.cli.fleet_commands import demo_models
    from stratus.errors import ConfigError

    checkout, image = tmp_path / "models", tmp_path / "app-models"
    assert demo_models(tmp_path / "mine", (checkout, image)) == tmp_path / "mine"  # --models wins
    image.mkdir()
    assert demo_models(None, (checkout, image)) == image
    checkout.mkdir()
    assert demo_models(None, (checkout, image)) == checkout
    elsewhere = tmp_path / "elsewhere"  # no models/ here, and this machine has no /app/models
    elsewhere.mkdir()
    assert not Path("/app/models").exists()
    done = subprocess.run(
        [sys.executable, "-m", "stratus.cli", "demo"],
        cwd=elsewhere, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.startswith("stratus: error: stratus demo runs the models of a Stratus checkout"), done.stderr
    assert "or give --models DIR" in done.stderr
    with pytest.raises(ConfigError, match="neither is here"):
        demo_models(None, (tmp_path / "none", tmp_path / "neither"))
