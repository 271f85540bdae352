"""``stratus models verify`` for generative families: every variant in every generative
runtime here, on labelled held-out prompts.

The router may send one prompt to a llama.cpp device today and an OpenVINO GenAI one
tomorrow, and one threshold per tier judges the answers. What verify promises is what a
client can tell: on at least ``1 - max_accuracy_drop`` of the held-out prompts (99% for
arith) two runtimes *serve alike*, that is they make the same escalation decision and,
where the answer is accepted on this tier, give the same text (a prompt both escalate is
answered above, whatever either wrote); and each runtime's own exact-match accuracy lies
within ``max_accuracy_drop`` of the best runtime's on the same file. So the runtime
choice moves a cascade's accuracy by at most what the family allows for a precision, on
any CPU. A broken runtime (garbage text, wrong log-probabilities) fails one of the two.

Measured here (1,000 held-out prompts): with F32 arithmetic and an F32 KV cache both
runtimes serve arith alike on 100% of prompts on an AMX CPU. Before OpenVINO GenAI was
asked for F32 arithmetic, that CPU's bf16 default served arith-small alike on 86.6%; with
an F16 KV cache (the fallback where a plugin refuses F32) 99.0%.

Rows reuse :class:`stratus.tools.verify.report.VerifyRow`: ``accuracy`` is exact-match on the held-out
prompts, ``runtime_agreement`` the lowest share of prompts served alike by another
runtime, ``accuracy_gap`` how far its accuracy lies below the best runtime's,
``max_abs_diff`` the largest confidence difference on identical answers, ``latency_ms``
the median per prompt (``b1``) and the mean per token.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from stratus.errors import ConfigError
from stratus.families.generation import GenerationParams, Token, confidence_of
from stratus.families.spec import FamilySpec, VariantSpec
from stratus.runtimes import GENERATORS, generative_order
from stratus.runtimes.base import LoadOptions
from stratus.runtimes.generative import GenerativeRunner
from stratus.tools.datasets import Split
from stratus.tools.verify.report import VerifyRow


@dataclass
class _Run:
    """One runtime's answers, their confidences, and how long they took."""

    runtime: str
    path: Path
    texts: list[str] = field(default_factory=list)
    confidences: list[float] = field(default_factory=list)
    prompt_ms: list[float] = field(default_factory=list)
    tokens: int = 0
    error: str | None = None
    kv_cache: str = ""


def usable_generators() -> tuple[set[str], dict[str, str]]:
    """The generative runtimes here, and why each of the others is not."""
    usable, skipped = set(), {}
    for name, cls in GENERATORS.items():
        status = cls.availability()
        if status.available:
            usable.add(name)
        else:
            skipped[name] = status.reason
    return usable, skipped


def bundled_prompts_held_out(family: FamilySpec) -> Split | None:
    """A shipped generative family's held-out prompts and answers; None for any other."""
    from stratus.tools.calibrate.generative import bundled_prompts

    try:
        return bundled_prompts(family).report
    except ConfigError:
        return None


def verify_generative_family(
    family: FamilySpec, data: Split, usable: set[str], cache: Path
) -> list[VerifyRow]:
    """Every variant that ships a file a usable runtime reads, in each such runtime."""
    rows = []
    for variant in family.variants:
        runs = [_run(family, variant, runtime, data, cache) for runtime in _runtimes(variant, usable)]
        rows += [_row(family, variant, run, runs, data) for run in runs]
    return rows


def _runtimes(variant: VariantSpec, usable: set[str]) -> list[str]:
    return [r for r, fmt in generative_order(variant.tier) if r in usable and fmt in variant.files]


def _run(family: FamilySpec, variant: VariantSpec, runtime: str, data: Split, cache: Path) -> _Run:
    assert family.generation is not None
    cls = GENERATORS[runtime]
    path = variant.files[cls.formats[0]]
    run = _Run(runtime=runtime, path=path)
    params = GenerationParams(max_tokens=family.generation.max_tokens, stop=family.generation.stop)
    try:
        runner = cls(
            variant=variant,
            path=path,
            options=LoadOptions(tier=variant.tier, cache_dir=cache),
            context=family.generation.context,
        )
    except Exception as exc:  # every failure is reported on its row, whatever raised it
        run.error = f"{type(exc).__name__}: {exc}"
        return run
    run.kv_cache = runner.kv_cache_precision
    try:
        runner.warmup()
        for prompt in data.x:
            tokens, elapsed = _timed(runner, str(prompt), params)
            run.texts.append("".join(t.text for t in tokens))
            run.confidences.append(confidence_of(tokens, family.generation.method))
            run.prompt_ms.append(elapsed)
            run.tokens += len(tokens)
    except Exception as exc:
        run.error = f"{type(exc).__name__}: {exc}"
    finally:
        runner.close()
    return run


def _timed(runner: GenerativeRunner, prompt: str, params: GenerationParams) -> tuple[list[Token], float]:
    started = time.perf_counter()
    tokens = runner.tokens(prompt, params)
    return tokens, (time.perf_counter() - started) * 1000.0


def _row(family: FamilySpec, variant: VariantSpec, run: _Run, runs: Sequence[_Run], data: Split) -> VerifyRow:
    others = [r for r in runs if r is not run and r.error is None]
    done = run.error is None
    threshold = family.thresholds.get(variant.tier)
    agreements = [_agreement(run, other, threshold) for other in others] if done else []
    accuracy = _accuracy(run.texts, data) if done else None
    best = max(
        (a for r in runs if r.error is None and (a := _accuracy(r.texts, data)) is not None), default=None
    )
    return VerifyRow(
        name=variant.name,
        tier=variant.tier.label,
        precision=variant.precision,
        runtime=run.runtime,
        format=run.path.suffix.lstrip(".") or "dir",
        accuracy=accuracy,
        max_abs_diff=max((diff for _, diff in agreements), default=0.0),
        runtime_agreement=min((share for share, _ in agreements), default=1.0),
        required_agreement=1.0 - family.max_accuracy_drop,
        accuracy_gap=best - accuracy if best is not None and accuracy is not None else None,
        max_accuracy_gap=family.max_accuracy_drop,
        kv_cache=run.kv_cache,
        parent=variant.parent,
        size_kib=run.path.stat().st_size / 1024.0 if run.path.is_file() else 0.0,
        latency_ms=_latency(run) if done and run.prompt_ms else {},
        error=run.error,
        kind="generative",
    )


def _agreement(run: _Run, other: _Run, threshold: float | None) -> tuple[float, float]:
    """(share of prompts served alike, largest confidence difference among identical answers).

    Served alike: the same verdict against ``threshold`` (every answer is accepted on a tier
    without one), and the same text where that verdict is to accept."""
    pairs = list(zip(run.texts, other.texts, run.confidences, other.confidences, strict=True))
    if not pairs:
        return 1.0, 0.0
    alike = sum(1 for text_a, text_b, a, b in pairs if _served_alike(text_a, text_b, a, b, threshold))
    same = [(a, b) for text_a, text_b, a, b in pairs if text_a == text_b]
    return alike / len(pairs), max((abs(a - b) for a, b in same), default=0.0)


def _served_alike(text_a: str, text_b: str, a: float, b: float, threshold: float | None) -> bool:
    accept_a = threshold is None or a >= threshold
    accept_b = threshold is None or b >= threshold
    return accept_a == accept_b and (not accept_a or text_a == text_b)


def _accuracy(texts: Sequence[str], data: Split) -> float | None:
    if not len(data.y):
        return None
    right = [text.strip() == str(answer).strip() for text, answer in zip(texts, data.y, strict=True)]
    return sum(right) / len(right)


def _latency(run: _Run) -> dict[str, float]:
    return {
        "b1": statistics.median(run.prompt_ms),
        "token": sum(run.prompt_ms) / max(1, run.tokens),
    }
