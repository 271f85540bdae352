"""``models calibrate`` for a generative family with the user's own labelled prompts."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from stratus.errors import ConfigError
from stratus.families.repository import ModelRepository, load_family
from stratus.families.suggest import TierScores, cascade
from stratus.tools.arith import arith_splits, solve
from stratus.tools.calibrate.classifier import describe, write
from stratus.tools.calibrate.generative import calibrate_generative, generative_scores, load_prompts

MODELS = Path(__file__).resolve().parents[2] / "models"


def write_prompts(path: Path, count: int) -> Path:
    prompts = [prompt for prompt, _ in arith_splits().held_out[:count]]
    path.write_text("".join(json.dumps({"prompt": p, "answer": solve(p)}) + "\n" for p in prompts))
    return path


def climbed_by_hand(scores: list[TierScores], thresholds: list[float]) -> tuple[float, list[float]]:
    """(accuracy, share reaching each tier) of a cascade, each prompt walked up the tiers: it
    stops on the first tier sure enough (or the top) and is right if that tier was."""
    prompts = len(scores[0].correct)
    right, reached = 0, [0] * len(scores)
    for i in range(prompts):
        for index, tier in enumerate(scores):
            reached[index] += 1
            if index == len(scores) - 1 or tier.confidence[i] >= thresholds[index]:
                right += bool(tier.correct[i])
                break
    return right / prompts, [r / prompts for r in reached]


def test_prompts_split_sixty_forty_with_a_fixed_seed(tmp_path: Path) -> None:
    path = write_prompts(tmp_path / "prompts.jsonl", 50)
    data = load_prompts(path)
    assert (len(data.calibration.x), len(data.report.x)) == (30, 20)
    assert sorted([*data.calibration.x, *data.report.x]) == sorted(p for p, _ in arith_splits().held_out[:50])
    assert all(solve(p) == a for p, a in zip(data.report.x, data.report.y, strict=True))
    again = load_prompts(path)
    assert list(again.report.x) == list(data.report.x)
    assert "30 of the 50 prompts in prompts.jsonl" in data.calibration_name


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        ('{"prompt": "1+1=", "answer": "2"}\nnot json\n', r"prompts.jsonl:2: not JSON"),
        ('{"prompt": "1+1=", "answer": 2}\n', r"prompts.jsonl:1: expected"),
        ('{"prompt": "1+1=", "answer": "2"}\n' * 5, r"too few prompts \(5\)"),
    ],
)
def test_bad_prompt_files_are_refused_with_the_line(tmp_path: Path, content: str, problem: str) -> None:
    path = tmp_path / "prompts.jsonl"
    path.write_text(content)
    with pytest.raises(ConfigError, match=problem):
        load_prompts(path)


def test_thresholds_from_a_prompt_file_reproduce_the_printed_shares(tmp_path: Path) -> None:
    root = tmp_path / "models"
    shutil.copytree(MODELS / "arith", root / "arith")
    family = ModelRepository.load(root).family("arith")
    path = write_prompts(tmp_path / "prompts.jsonl", 150)
    result = calibrate_generative(family, cache=tmp_path, max_escalation=0.25, data_file=path)
    assert result.calibration.reached[-1] <= 0.25 + 1e-9  # the constraint holds where it was chosen
    assert result.data.report_name == "the other 60 prompts in prompts.jsonl"
    printed = describe(result)
    write(family, result)
    written = load_family(family.source)
    assert written.thresholds == result.thresholds
    # What the written file does on the report prompts is what was printed for them.
    scores = generative_scores(written, load_prompts(path).report, tmp_path)
    replay = cascade(scores, [written.thresholds[t] for t in result.tiers[:-1]])
    assert replay.accuracy == pytest.approx(result.held_out.accuracy)
    assert replay.reached == pytest.approx(result.held_out.reached)
    # ... and what the prompts themselves say, followed one by one (not calibrate's simulation)
    thresholds = [written.thresholds[t] for t in result.tiers[:-1]]
    accuracy, reached = climbed_by_hand(scores, thresholds)
    assert (accuracy, reached) == (
        pytest.approx(result.held_out.accuracy),
        pytest.approx(result.held_out.reached),
    )
    shares = ", ".join(f"{t.label} {r:.1%}" for t, r in zip(result.tiers, replay.reached, strict=True))
    assert f"report       accuracy {replay.accuracy:.4f}; requests reaching: {shares}" in printed
