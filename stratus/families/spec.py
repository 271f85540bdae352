"""What a family is, as its ``family.toml`` says (``stratus.families.repository`` reads the files):
its tensors, how outputs become a confidence, its variants and their files, its thresholds
and what calibration recorded for them, and the generation settings of a text family."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from stratus import datatypes
from stratus.datatypes import Array
from stratus.errors import InvalidInput, NotFound
from stratus.families.audit import AuditSpec, TierCalibration
from stratus.families.confidence import ConfidenceMethod
from stratus.families.generation import GenerationMethod
from stratus.families.offline import OfflineSpec
from stratus.tiers import Tier


@dataclass(frozen=True, kw_only=True)
class TensorSpec:
    """A tensor a family takes or gives; ``-1`` in ``shape`` is the batch dimension."""

    name: str
    datatype: str
    shape: tuple[int, ...]

    def check(self, array: Array) -> None:
        """Refuse an input whose datatype or shape does not fit this spec."""
        datatype = datatypes.datatype_of(array)
        if datatype != self.datatype:
            raise InvalidInput(
                f"input '{self.name}': datatype is {datatype}, the model takes {self.datatype}"
            )
        fits = len(array.shape) == len(self.shape) and all(
            want in (-1, got) for want, got in zip(self.shape, array.shape, strict=True)
        )
        if not fits:
            raise InvalidInput(
                f"input '{self.name}': shape {list(array.shape)} does not fit the model's {list(self.shape)}"
            )


@dataclass(frozen=True, kw_only=True)
class ConfidenceSpec:
    output: str
    method: ConfidenceMethod
    apply_softmax: bool


@dataclass(frozen=True, kw_only=True)
class GenerationSpec:
    """How a generative family generates: greedy, at most ``max_tokens``, ending at ``stop``;
    and how its answers' confidence is read from token log-probabilities."""

    max_tokens: int
    stop: tuple[str, ...]
    method: GenerationMethod
    context: int = 512  # prompt and answer tokens together, at most


@dataclass(frozen=True, kw_only=True)
class VariantSpec:
    """One servable model: a family member for one tier, in one or more file formats."""

    name: str
    family: str
    tier: Tier
    precision: str
    files: Mapping[str, Path]
    # The FP32 variant this lower-precision one was quantized or converted from.
    parent: str | None = None
    # Divides the log-probabilities before the confidence is taken (fitted on the
    # calibration split, so a confidence of 0.9 means about 9 in 10 right).
    temperature: float = 1.0
    # The runtimes that may serve it; empty: any that reads one of its formats. Written by
    # ``models import`` when a runtime here refused the file, or as ``--runtimes`` said.
    runtimes: tuple[str, ...] = ()

    def allows(self, runtime: str) -> bool:
        """Whether ``runtime`` may serve this variant (its ``runtimes``, when it names any)."""
        return not self.runtimes or runtime in self.runtimes

    def file_stamps(self) -> tuple[tuple[int, int], ...]:
        """Size and modification time of each of its files ((-1, -1) for one that is gone):
        a reload reloads a variant whose config entry is unchanged but whose file was replaced."""
        stamps = []
        for path in sorted(self.files.values()):
            try:
                stat = path.stat()
            except OSError:
                stamps.append((-1, -1))
                continue
            stamps.append((stat.st_size, stat.st_mtime_ns))
        return tuple(stamps)


@dataclass(frozen=True, kw_only=True)
class CalibrationRecord:
    """What ``stratus models calibrate`` measured for the thresholds it wrote, on the split it
    chose them on. Kept beside them so that what the cascade promised travels with the family:
    the router exports ``cloud_share`` as the baseline of the cloud-share alert."""

    goal: str  # "target_accuracy 0.985" or "max_escalation 0.04"
    data: str  # the split the thresholds were chosen on, in words
    accuracy: float  # the cascade's accuracy on it
    cloud_share: float  # the share of its examples that reached the cloud tier


@dataclass(frozen=True, kw_only=True)
class ServedFamily:
    """What serving a family takes, wherever it is known from: its folder (:class:`FamilySpec`,
    what agents and the cloud gateway load) or what agents and a cloud say of it
    (:class:`stratus.families.description.FamilyDescription`, all a router has)."""

    name: str
    inputs: tuple[TensorSpec, ...] = ()
    outputs: tuple[TensorSpec, ...] = ()
    thresholds: Mapping[Tier, float] = field(default_factory=dict)
    # Set for a generative family (kind = "generative"): prompts in, text out; its limits and
    # confidence method.
    generation: GenerationSpec | None = None
    # [audit] and [tier_accuracy] (stratus.families.audit): how answers are audited against
    # the top tier, and each tier's figures as calibrated.
    audit: AuditSpec = field(default_factory=AuditSpec)
    tier_accuracy: Mapping[Tier, TierCalibration] = field(default_factory=dict)
    # [privacy] escalate: whether the family's inputs may leave the site for the cloud tier.
    escalate: bool = True
    # [offline]: unsure answers kept for the cloud to judge while it is away (stratus/families/offline.py).
    offline: OfflineSpec = field(default_factory=OfflineSpec)

    @property
    def generative(self) -> bool:
        return self.generation is not None


@dataclass(frozen=True, kw_only=True)
class FamilySpec(ServedFamily):
    """A family's folder as ``family.toml`` describes it: what serving it takes, and its
    variants and files, which only the processes that load models have."""

    description: str
    confidence: ConfidenceSpec
    variants: tuple[VariantSpec, ...]
    source: Path
    # Held-out accuracy a lower-precision variant may lose against its FP32 parent.
    max_accuracy_drop: float = 0.01
    # Each tier's current FP32 variant: what the tier serves unless a request pins another
    # variant or a rollout sends it a candidate. Its lower-precision children go with it.
    current: Mapping[Tier, str] = field(default_factory=dict)
    # What the thresholds gave when calibrated; None for thresholds set by hand (or before
    # calibrate recorded it): such a family has no calibrated cloud share, and no alert on it.
    calibration: CalibrationRecord | None = None

    @property
    def folder(self) -> Path:
        return self.source.parent

    def variant(self, name: str) -> VariantSpec:
        for variant in self.variants:
            if variant.name == name:
                return variant
        raise NotFound(f"family '{self.name}' has no variant '{name}'")

    def variants_for(self, tier: Tier) -> tuple[VariantSpec, ...]:
        return tuple(v for v in self.variants if v.tier is tier)

    def tiers(self) -> list[Tier]:
        return sorted({v.tier for v in self.variants})

    def current_variant(self, tier: Tier) -> VariantSpec:
        """The FP32 variant that ``tier`` serves by default."""
        name = self.current.get(tier)
        if name is None:
            raise NotFound(f"family '{self.name}' has no {tier.label} variant")
        return self.variant(name)

    def lines(self, tier: Tier) -> tuple[VariantSpec, ...]:
        """The tier's FP32 variants: the current one first, then the others (rollout candidates)."""
        roots = [v for v in self.variants_for(tier) if v.parent is None]
        return tuple(sorted(roots, key=lambda v: v.name != self.current.get(tier)))

    def line_of(self, root: VariantSpec) -> tuple[VariantSpec, ...]:
        """A FP32 variant and the lower-precision variants made from it."""
        return tuple(v for v in self.variants if root.name in (v.name, v.parent))

    def check_inputs(self, inputs: Mapping[str, Array]) -> None:
        """Refuse missing, unexpected, mistyped or misshapen inputs, naming the first found."""
        expected = {spec.name: spec for spec in self.inputs}
        for name in inputs:
            if name not in expected:
                raise InvalidInput(f"model '{self.name}' has no input '{name}'; it takes {sorted(expected)}")
        for name, spec in expected.items():
            if name not in inputs:
                raise InvalidInput(f"model '{self.name}' needs input '{name}'")
            spec.check(inputs[name])
        batches = {array.shape[0] for array in inputs.values() if array.ndim}
        if len(batches) > 1:
            raise InvalidInput(f"inputs disagree on the batch size: {sorted(batches)}")
