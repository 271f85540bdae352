"""A family as a router knows it: what its agents' Hellos (or a cloud's own metadata) say of
it, read once, when it arrives (``stratus.convert.fleet.family_from_wire``).

Not a :class:`~stratus.families.spec.FamilySpec`: that is a family's folder (files, variants,
a source path), which a router never has. Both are a
:class:`~stratus.families.spec.ServedFamily`, what serving the family takes (its tensors,
thresholds, how it generates, its audits, privacy and offline settings); a description adds
the names a cloud may know it by and what its calibration measured, against which its
audits are judged.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from stratus.families.spec import FamilySpec, ServedFamily
from stratus.tiers import Tier


@dataclass(frozen=True, kw_only=True)
class FamilyDescription(ServedFamily):
    # The repository's cloud-tier variants, current first: the names a router asks a cloud
    # about when the cloud does not list its models (PyTriton, KServe).
    cloud_variants: tuple[str, ...] = ()
    # What calibrate recorded the thresholds send to the cloud; None where never calibrated.
    calibrated_cloud_share: float | None = None

    @property
    def max_tokens(self) -> int:
        """The most tokens a request may ask for (at least 1); 0 for a classifier."""
        return max(1, self.generation.max_tokens) if self.generation is not None else 0

    @property
    def stop(self) -> tuple[str, ...]:
        return self.generation.stop if self.generation is not None else ()

    def under_push(self, thresholds: Mapping[Tier, float], agents: FamilyDescription) -> FamilyDescription:
        """This family served with ``thresholds`` pushed over ``agents``' own (a tier not
        named keeps theirs): a recalibrated agent's thresholds and figures are not the
        fleet's, so the first agents' figures stay, and no calibrated cloud share describes
        thresholds an operator chose."""
        return dataclasses.replace(
            self,
            thresholds={**agents.thresholds, **thresholds},
            tier_accuracy=agents.tier_accuracy,
            calibrated_cloud_share=None,
        )


def described(family: FamilySpec) -> FamilyDescription:
    """A family's folder as an agent describes it to a router: what serving it takes, its
    cloud variants (the current line first, then that line's children, then the others) and
    the cloud share its calibration recorded (None for thresholds set by hand)."""
    current = family.current.get(Tier.CLOUD)
    names = [v.name for v in family.variants_for(Tier.CLOUD)]
    cloud = sorted(names, key=lambda n: (n != current, not n.startswith(f"{current}-"), n))
    served = {f.name: getattr(family, f.name) for f in dataclasses.fields(ServedFamily)}
    return FamilyDescription(
        **served,
        cloud_variants=tuple(cloud),
        calibrated_cloud_share=family.calibration.cloud_share if family.calibration is not None else None,
    )

