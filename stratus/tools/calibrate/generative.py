"""``stratus models calibrate`` for a generative family: labelled prompts in, thresholds out.

Each tier's current variant answers every prompt greedily, here, in the runtime an agent
would use; an answer is right when its text (stripped) equals the expected one, and its
confidence is the family's method over its tokens' log-probabilities. From there the
thresholds are chosen exactly as for a classifier (:func:`stratus.families.suggest.for_target_accuracy`
and friends), on the calibration prompts, and reported on the held-out ones.

The shipped ``arith`` family brings its own prompts (:mod:`stratus.tools.arith`); any other
family takes ``--data FILE.jsonl``: one ``{"prompt": ..., "answer": ...}`` object per line,
split once with a fixed seed, ``CALIBRATION_SHARE`` for choosing and the rest reported.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from stratus.datatypes import Array
from stratus.errors import ConfigError, NotFound, RuntimeUnavailable
from stratus.families.generation import GenerationParams, confidence_of
from stratus.families.spec import FamilySpec, VariantSpec
from stratus.families.suggest import TierScores
from stratus.runtimes import load_generator
from stratus.runtimes.base import LoadOptions
from stratus.runtimes.generative import GenerativeRunner
from stratus.tiers import Tier
from stratus.tools.calibrate.classifier import Calibration, choose
from stratus.tools.calibrate.labelled_data import CALIBRATION_SHARE, MIN_EXAMPLES, SPLIT_SEED, LabelledData
from stratus.tools.datasets import Split


def bundled_prompts(family: FamilySpec) -> LabelledData:
    """A shipped generative family's calibration and held-out prompts, with their answers."""
    if family.name != "arith":
        raise ConfigError(f"no bundled labelled prompts for generative family '{family.name}' (only 'arith')")
    from stratus.tools.arith import arith_splits

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


def load_prompts(path: Path, *, share: float = CALIBRATION_SHARE, seed: int = SPLIT_SEED) -> LabelledData:
    """Labelled prompts from a JSON Lines file, split once with ``seed``; a bad line is
    refused with its number."""
    if not path.is_file():
        raise ConfigError(f"{path}: no such file")
    prompts, answers = [], []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}:{number}: not JSON ({exc.msg})") from None
        if not isinstance(item, dict) or not all(isinstance(item.get(k), str) for k in ("prompt", "answer")):
            raise ConfigError(f'{path}:{number}: expected {{"prompt": "...", "answer": "..."}} (strings)')
        prompts.append(item["prompt"])
        answers.append(item["answer"])
    if len(prompts) < MIN_EXAMPLES:
        raise ConfigError(
            f"{path}: too few prompts ({len(prompts)}); calibrating needs at least {MIN_EXAMPLES}"
        )
    order = np.random.default_rng(seed).permutation(len(prompts))
    cut = round(share * len(prompts))
    first, second = order[:cut], order[cut:]

    def split(indices: Array) -> Split:
        return Split(
            np.array([prompts[i] for i in indices], dtype=object),
            np.array([answers[i] for i in indices], dtype=object),
        )

    return LabelledData(
        calibration=split(first),
        report=split(second),
        calibration_name=f"{len(first)} of the {len(prompts)} prompts in {path.name} ({share:.0%}, seed {seed})",
        report_name=f"the other {len(second)} prompts in {path.name}",
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
        confidences, correct, texts = [], [], []
        try:
            for prompt, answer in zip(split.x, split.y, strict=True):
                tokens = runner.tokens(str(prompt), params)
                text = "".join(t.text for t in tokens)
                confidences.append(confidence_of(tokens, family.generation.method))
                correct.append(text.strip() == str(answer).strip())
                texts.append(text.strip())
        finally:
            runner.close()
        answers = np.array(texts, dtype=object)
        scores.append(TierScores(tier, variant.name, np.array(confidences), np.array(correct), answers))
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


def calibrate_generative(
    family: FamilySpec,
    *,
    cache: Path,
    target_accuracy: float | None = None,
    max_escalation: float | None = None,
    data_file: Path | None = None,
) -> Calibration:
    if (target_accuracy is None) == (max_escalation is None):
        raise ConfigError("give exactly one of --target-accuracy and --max-escalation")
    data = load_prompts(data_file) if data_file is not None else bundled_prompts(family)
    return choose(
        generative_scores(family, data.calibration, cache),
        lambda: generative_scores(family, data.report, cache),
        data,
        target_accuracy=target_accuracy,
        max_escalation=max_escalation,
    )
