"""Every option of every command says what it is for, and its default (issue 21 §7)."""

from __future__ import annotations

import argparse
from collections.abc import Iterator

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
