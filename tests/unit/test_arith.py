"""The generated ``arith`` problems: deterministic, right, graded exactly, and split so that
no operand pair (a sum in either order) is both trained or calibrated on and held out."""

from __future__ import annotations

import pytest

from stratus.tools.arith import (
    CALIBRATION_SIZE,
    HELD_OUT_SIZE,
    MAX_ANSWER_CHARS,
    ArithSplits,
    Example,
    all_examples,
    arith_splits,
    grade,
    solve,
)


@pytest.fixture(scope="module")
def splits() -> ArithSplits:
    return arith_splits()


def _pair(prompt: str) -> tuple[str, int, int]:
    """The operand pair, written independently of the module: a sum's two orders are one pair."""
    operator = "+" if "+" in prompt else "-"
    left, right = (int(n) for n in prompt.rstrip("=").split(operator))
    if operator == "+":
        return operator, min(left, right), max(left, right)
    return operator, left, right


def test_the_same_seed_gives_the_same_splits_and_another_seed_others(splits: ArithSplits) -> None:
    assert arith_splits() == splits
    other = arith_splits(11)
    assert other.held_out != splits.held_out
    assert sorted(other.fit + other.calibration + other.held_out) == sorted(all_examples())


def test_sizes_and_every_problem_in_exactly_one_split(splits: ArithSplits) -> None:
    assert HELD_OUT_SIZE <= len(splits.held_out) <= HELD_OUT_SIZE + 1
    assert CALIBRATION_SIZE <= len(splits.calibration) <= CALIBRATION_SIZE + 1
    everything = splits.fit + splits.calibration + splits.held_out
    assert len(everything) == len(set(everything)) == len(all_examples()) == 100 * 100 + 5050


def test_splits_share_no_operand_pair(splits: ArithSplits) -> None:
    fit, cal, held = (
        {_pair(e.prompt) for e in split} for split in (splits.fit, splits.calibration, splits.held_out)
    )
    assert not fit & cal and not fit & held and not cal & held
    assert ("+", 37, 48) in fit | cal | held


def test_both_operators_in_every_split(splits: ArithSplits) -> None:
    for split in (splits.fit, splits.calibration, splits.held_out):
        sums = sum("+" in e.prompt for e in split)
        assert 0.5 < sums / len(split) < 0.75  # 10,000 sums and 5,050 differences overall


def test_answers_are_right_and_short(splits: ArithSplits) -> None:
    for prompt, answer in splits.held_out + splits.calibration:
        left, operator, right = prompt[:-1].partition("+") if "+" in prompt else prompt[:-1].partition("-")
        assert int(answer) == (int(left) + int(right) if operator == "+" else int(left) - int(right))
        assert 1 <= len(answer) <= MAX_ANSWER_CHARS and int(answer) >= 0 and prompt.endswith("=")


def test_examples_unpack_as_prompt_and_answer() -> None:
    example = Example(prompt="37+48=", answer="85")
    assert (example.prompt, example.answer) == ("37+48=", "85")
    prompt, answer = example  # in that order
    assert (prompt, answer) == ("37+48=", "85")


@pytest.mark.parametrize(
    ("prompt", "text", "right"),
    [
        ("37+48=", "85", True),
        ("37+48=", " 85\n", True),
        ("37+48=", "86", False),
        ("37+48=", "085", False),
        ("37+48=", "85 85", False),
        ("37+48=", "", False),
        ("99+99=", "198", True),
        ("48-37=", "11", True),
        ("5-5=", "0", True),
        ("0+0=", "0", True),
    ],
)
def test_grading_is_exact_after_strip(prompt: str, text: str, right: bool) -> None:
    assert grade(prompt, text) is right


@pytest.mark.parametrize("prompt", ["37*48=", "100+1=", "37+48", "3-7=", "", "a+b="])
def test_foreign_prompts_are_refused(prompt: str) -> None:
    with pytest.raises(ValueError, match="not an arith prompt"):
        solve(prompt)
