"""``stratus models calibrate`` for a generative family: labelled prompts in, thresholds out.

Each tier's current variant answers every prompt greedily, here, in the runtime an agent
would use; an answer is right when its text (stripped) equals the expected one, and its
confidence is the family's method over its tokens' log-probabilities. From there the
thresholds are chosen exactly as for a classifier (:func:`stratus.calibrate.for_target_accuracy`
and friends), on the calibration prompts, and reported on the held-out ones.

The shipped ``arith`` family brings its own prompts (:mod:`stratus.arith`); nothing else
does yet.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from stratus.calibrate import Calibration, LabelledData, TierScores, choose
from stratus.datasets import Split
from stratus.errors import ConfigError, NotFound, RuntimeUnavailable
from stratus.generation import GenerationParams, Token, confidence_of
from stratus.repository import FamilySpec, VariantSpec
from stratus.runtimes.base import LoadOptions
from stratus.runtimes.generative import GenerativeRunner, load_generator
from stratus.tiers import Tier


def bundled_prompts(family: FamilySpec) -> LabelledData:
    """A shipped generative family's calibration and held-out prompts, with their answers."""
    if family.name != "arith":
        raise ConfigError(f"no bundled labelled prompts for generative family '{family.name}' (only 'arith')")
    from stratus.arith import arith_splits

    splits = arith_splits()

    def split(examples: Sequence[tuple[str, str]]) -> Split:
        prompts = np.array([p for p, _ in examples], dtype=object)
        answers = np.array([a for _, a in examples], dtype=object)
        return Split(prompts, answers)

    return LabelledData(
        calibration=split(splits.calibration),
        report=split(splits.held_out),
        calibration_name=f"the bundled calibration prompts ({len(splits.calibration)})",
        report_name=f"the bundled held-out prompts ({len(splits.held_out)})",
    )


def generative_scores(family: FamilySpec, split: Split, cache: Path) -> list[TierScores]:
    """Each tier's current variant on every prompt: its confidence, and whether it was right."""
    assert family.generation is not None
    tiers = family.tiers()
    if len(tiers) < 2:
        raise ConfigError(f"{family.source}: calibrating needs variants on at least two tiers")
    params = GenerationParams(max_tokens=family.generation.max_tokens, stop=family.generation.stop)
    scores = []
    for tier in tiers:
        variant, runner = _runnable(family, tier, cache)
        confidences, correct = [], []
        try:
            for prompt, answer in zip(split.x, split.y, strict=True):
                tokens = _answer(runner, str(prompt), params)
                text = "".join(t.text for t in tokens)
                confidences.append(confidence_of(tokens, family.generation.method))
                correct.append(text.strip() == str(answer).strip())
        finally:
            runner.close()
        scores.append(TierScores(tier, variant.name, np.array(confidences), np.array(correct)))
    return scores


def _runnable(family: FamilySpec, tier: Tier, cache: Path) -> tuple[VariantSpec, GenerativeRunner]:
    """The tier's current variant, or else the first of its lower-precision children that a
    runtime here reads (an FP32 Hugging Face folder needs vLLM; its F16 GGUF child does not)."""
    problems = []
    for variant in family.line_of(family.current_variant(tier)):
        try:
            return variant, load_generator(family, variant, LoadOptions(tier=tier, cache_dir=cache))
        except (NotFound, RuntimeUnavailable) as exc:
            problems.append(str(exc))
    raise ConfigError(f"nothing here can run the {tier.label} tier of '{family.name}': {'; '.join(problems)}")


def _answer(runner: GenerativeRunner, prompt: str, params: GenerationParams) -> list[Token]:
    tokens: list[Token] = []

    def keep(token: Token) -> bool:
        tokens.append(token)
        return True

    runner.generate(prompt, params, keep)
    return tokens


def calibrate_generative(
    family: FamilySpec,
    *,
    cache: Path,
    target_accuracy: float | None = None,
    max_escalation: float | None = None,
) -> Calibration:
    if (target_accuracy is None) == (max_escalation is None):
        raise ConfigError("give exactly one of --target-accuracy and --max-escalation")
    data = bundled_prompts(family)
    return choose(
        generative_scores(family, data.calibration, cache),
        lambda: generative_scores(family, data.report, cache),
        data,
        target_accuracy=target_accuracy,
        max_escalation=max_escalation,
    )
