"""The ``arith`` family's data: short arithmetic whose answers can be graded.

A prompt is two numbers from 0 to 99 and an operator, ``"37+48="``; the answer is the
result in decimal, ``"85"`` (a difference only where it is not negative, ``"48-37="`` ->
``"11"``). The models end an answer with their end-of-sequence token, which every runtime
stops on by itself; an answer is right when it equals the result after stripping spaces.

Every problem is in exactly one split, chosen by a seeded hash of its operand pair (both
orders of a sum go together, so ``48+37=`` is never held out while ``37+48=`` is trained
on). The hash is SHA-256, not a random-number stream, so the splits do not move with the
numpy or Python version. Nothing trains on ``calibration`` (thresholds and temperatures
are chosen there) and nothing trains or calibrates on ``held_out``.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Final, NamedTuple

LARGEST: Final = 99  # operands are 0..LARGEST
SEED: Final = 10  # issue 10
CALIBRATION_SIZE: Final = 1000
HELD_OUT_SIZE: Final = 1000
# The longest answer ("198") in characters; the models use one token per character.
MAX_ANSWER_CHARS: Final = 3

_PROMPT = re.compile(r"^\s*(\d{1,2})\s*([+-])\s*(\d{1,2})\s*=\s*$")


class Example(NamedTuple):
    """One graded problem; unpacks as ``(prompt, answer)``."""

    prompt: str
    answer: str


@dataclass(frozen=True)
class ArithSplits:
    """Trained on, calibrated on, and held out: disjoint by operand pair."""

    fit: list[Example]
    calibration: list[Example]
    held_out: list[Example]


def solve(prompt: str) -> str:
    """The right answer to ``prompt``; ``ValueError`` if it is not one of ours."""
    operator, left, right = _operands(prompt)
    result = left + right if operator == "+" else left - right
    if result < 0:
        raise ValueError(f"not an arith prompt (negative result): {prompt!r}")
    return str(result)


def grade(prompt: str, answer_text: str) -> bool:
    """True when ``answer_text`` is exactly the right answer, ignoring surrounding space."""
    return answer_text.strip() == solve(prompt)


def all_examples() -> list[Example]:
    """Every problem once, in a fixed order: sums first, then differences."""
    sums = [_example(a, "+", b) for a in range(LARGEST + 1) for b in range(LARGEST + 1)]
    differences = [_example(a, "-", b) for a in range(LARGEST + 1) for b in range(a + 1)]
    return sums + differences


def arith_splits(
    seed: int = SEED, *, calibration: int = CALIBRATION_SIZE, held_out: int = HELD_OUT_SIZE
) -> ArithSplits:
    """Held-out first, then calibration, from the operand pairs in seeded-hash order; fit
    gets the rest. Sizes are met to within one problem (a sum and its mirror stay together)."""
    groups: dict[tuple[str, int, int], list[Example]] = {}
    for example in all_examples():
        groups.setdefault(_group(example.prompt), []).append(example)
    ordered = [groups[g] for g in sorted(groups, key=lambda g: _rank(seed, g))]
    held, rest = _split_off(ordered, held_out)
    cal, rest = _split_off(rest, calibration)
    return ArithSplits(fit=_flat(rest), calibration=_flat(cal), held_out=_flat(held))


def _example(left: int, operator: str, right: int) -> Example:
    prompt = f"{left}{operator}{right}="
    return Example(prompt, solve(prompt))


def _operands(prompt: str) -> tuple[str, int, int]:
    match = _PROMPT.match(prompt)
    if match is None:
        raise ValueError(f"not an arith prompt: {prompt!r}")
    return match[2], int(match[1]), int(match[3])


def _group(prompt: str) -> tuple[str, int, int]:
    """The operand pair a problem belongs to; a sum's two orders share one."""
    operator, left, right = _operands(prompt)
    if operator == "+":
        left, right = min(left, right), max(left, right)
    return operator, left, right


def _rank(seed: int, group: tuple[str, int, int]) -> bytes:
    return hashlib.sha256(f"{seed}:{group[0]}:{group[1]}:{group[2]}".encode()).digest()


def _split_off(groups: list[list[Example]], size: int) -> tuple[list[list[Example]], list[list[Example]]]:
    """The fewest groups from the front that hold at least ``size`` problems, and the rest."""
    count = 0
    for used, group in enumerate(groups):
        if count >= size:
            return groups[:used], groups[used:]
        count += len(group)
    return groups, []


def _flat(groups: list[list[Example]]) -> list[Example]:
    """A split's problems in a readable, stable order: by operator, then operands."""
    return sorted((e for g in groups for e in g), key=lambda e: _operands(e.prompt))
