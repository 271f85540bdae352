"""[audit] and [tier_accuracy] in family.toml: read, checked, written by calibrate, carried in Hellos."""

from __future__ import annotations

import dataclasses
import math
import shutil
from pathlib import Path

import numpy as np
import pytest

from stratus.convert.fleet import family_fields, family_from_wire, family_to_wire
from stratus.errors import ConfigError, InvalidInput
from stratus.families.audit import TierCalibration, check_family_info
from stratus.families.description import described
from stratus.families.repository import load_family
from stratus.families.suggest import TierScores
from stratus.tiers import Tier
from stratus.tools.calibrate.tier_accuracy import tier_figures, write_tier_accuracy
from stratus.wire import fleet_pb2 as fpb

MODELS = Path(__file__).resolve().parents[2] / "models"


@pytest.fixture
def digits_toml(tmp_path: Path) -> Path:
    """The shipped digits family, its [tier_accuracy] table taken out."""
    folder = tmp_path / "digits"
    shutil.copytree(MODELS / "digits", folder)
    config = folder / "family.toml"
    config.write_text(config.read_text().split("# Per tier, of the calibration split")[0])
    return config


def with_text(path: Path, extra: str) -> Path:
    path.write_text(path.read_text() + extra)
    return path


def test_the_shipped_families_carry_their_calibrated_figures() -> None:
    digits = load_family(MODELS / "digits" / "family.toml")
    device = digits.tier_accuracy[Tier.DEVICE]
    assert device.agreement is not None and 0.9 < device.agreement <= 1.0 and device.items > 100
    assert digits.tier_accuracy[Tier.CLOUD].agreement is None  # the top tier agrees with itself
    arith = load_family(MODELS / "arith" / "family.toml")
    assert arith.audit.compare == "number"
    assert digits.audit.share is None and digits.audit.compare == ""


def test_an_audit_table_is_read_and_checked(digits_toml: Path) -> None:
    family = load_family(with_text(digits_toml, '\n[audit]\nshare = 0.2\nmax_per_s = 3\ncompare = "top1"\n'))
    assert (family.audit.share, family.audit.max_per_s, family.audit.compare) == (0.2, 3.0, "top1")
    assert family.audit.auto == ""


def test_a_family_names_its_own_auto_goal_and_the_hello_carries_it(digits_toml: Path) -> None:
    family = load_family(with_text(digits_toml, '\n[audit]\nauto = "target_accuracy 0.98"\n'))
    assert family.audit.auto == "target_accuracy 0.98"
    info = fpb.FamilyInfo(name="digits", **family_fields(family))
    assert info.audit.auto == "target_accuracy 0.98"
    assert family_from_wire(info).audit.auto == "target_accuracy 0.98"


@pytest.mark.parametrize(
    ("table", "says"),
    [
        ("[audit]\nshare = 1.5\n", "key 'audit.share': 1.5 must lie between 0 and 1"),
        ("[audit]\nmax_per_s = -1\n", "key 'audit.max_per_s'"),
        ('[audit]\ncompare = "exact"\n', "key 'audit.compare': 'exact' is not one of top1"),
        ("[audit]\nsample = 0.1\n", "key 'audit.sample': is not a known setting"),
        ('[audit]\nauto = "cheapest 0.5"\n', "key 'audit.auto': 'cheapest 0.5' is not 'target_accuracy A'"),
        ('[audit]\nauto = "target_accuracy 1.5"\n', "key 'audit.auto'"),
        ("[tier_accuracy]\nfog = { accuracy = 0.9, items = 3 }\n", "'fog' is not one of device, edge, cloud"),
        ("[tier_accuracy]\ndevice = { accuracy = 1.2, items = 3 }\n", "tier_accuracy.device.accuracy"),
        ("[tier_accuracy]\ndevice = { accuracy = 0.9 }\n", "key 'tier_accuracy.device.items': is missing"),
    ],
)
def test_a_bad_table_is_refused_naming_its_key(digits_toml: Path, table: str, says: str) -> None:
    with pytest.raises(ConfigError, match=r"family\.toml") as refused:
        load_family(with_text(digits_toml, "\n" + table))
    assert says in str(refused.value)


def test_calibrate_replaces_the_table_and_keeps_the_rest(digits_toml: Path) -> None:
    before = digits_toml.read_text()
    figures = {
        Tier.DEVICE: TierCalibration(accuracy=0.97129, agreement=0.98, items=250),
        Tier.CLOUD: TierCalibration(accuracy=0.5, agreement=None, items=4),
    }
    write_tier_accuracy(digits_toml, figures)
    write_tier_accuracy(digits_toml, figures)  # twice: one table, not two
    text = digits_toml.read_text()
    assert text.count("[tier_accuracy]") == 1 and text.count("# Per tier, of the calibration split") == 1
    assert "device = { accuracy = 0.9712, agreement = 0.9800, items = 250 }" in text  # rounded down
    family = load_family(digits_toml)
    assert family.tier_accuracy[Tier.DEVICE] == TierCalibration(accuracy=0.9712, agreement=0.98, items=250)
    assert Tier.EDGE not in family.tier_accuracy
    assert text.split("# Per tier, of the calibration split")[0].rstrip() == before.rstrip()


def scores(tier: Tier, confidence: list[float], answers: list[int], labels: list[int]) -> TierScores:
    return TierScores(
        tier, tier.label, np.array(confidence), np.array(answers) == np.array(labels), np.array(answers)
    )


def test_tier_figures_follow_the_cascade() -> None:
    labels = [0, 1, 2, 3, 4, 5]
    device = scores(Tier.DEVICE, [0.9, 0.9, 0.9, 0.2, 0.2, 0.2], [0, 1, 9, 3, 9, 9], labels)
    edge = scores(Tier.EDGE, [0.1, 0.1, 0.1, 0.9, 0.1, 0.1], [0, 1, 2, 3, 4, 9], labels)
    cloud = scores(Tier.CLOUD, [1.0] * 6, [0, 1, 2, 3, 4, 7], labels)
    figures = tier_figures([device, edge, cloud], [0.5, 0.5])
    # device settles items 0-2 (right on 0, 1; the cloud says 0, 1, 2): 2/3 right, 2/3 agree
    assert figures[Tier.DEVICE] == TierCalibration(accuracy=2 / 3, agreement=2 / 3, items=3)
    # edge settles item 3 alone; the cloud gets 4 and 5 (right on 4)
    assert figures[Tier.EDGE] == TierCalibration(accuracy=1.0, agreement=1.0, items=1)
    assert figures[Tier.CLOUD] == TierCalibration(accuracy=0.5, agreement=None, items=2)
    nothing = tier_figures([device, edge, cloud], [0.95, 0.5])  # the device settles nothing
    assert Tier.DEVICE not in nothing and nothing[Tier.EDGE].items == 1


def test_the_hello_carries_the_tables(repository) -> None:  # type: ignore[no-untyped-def]
    info = fpb.FamilyInfo(name="arith", **family_fields(repository.family("arith")))
    assert info.audit.compare == "number" and not info.audit.HasField("share")
    assert info.calibrated["device"].HasField("agreement") and not info.calibrated["cloud"].HasField(
        "agreement"
    )


@pytest.mark.parametrize(
    "spoil",
    [
        lambda i: setattr(i.audit, "share", math.nan),
        lambda i: setattr(i.audit, "share", 2.0),
        lambda i: setattr(i.audit, "max_per_s", 1e9),
        lambda i: setattr(i.audit, "compare", "eval"),
        lambda i: setattr(i.audit, "auto", "target_accuracy nan"),
        lambda i: i.calibrated["fog"].CopyFrom(fpb.TierCalibration(accuracy=0.5)),
        lambda i: i.calibrated["device"].CopyFrom(fpb.TierCalibration(accuracy=0.5, agreement=-0.1)),
    ],
)
def test_a_hello_with_audit_settings_out_of_range_is_refused(spoil) -> None:  # type: ignore[no-untyped-def]
    info = fpb.FamilyInfo(name="digits")
    check_family_info("device-1", info)  # nothing set: fine
    spoil(info)
    with pytest.raises(InvalidInput, match="Hello from device-1: family 'digits'"):
        check_family_info("device-1", info)


def test_every_shipped_family_reads_back_from_its_hello_as_its_files_say() -> None:
    """One codec, both directions (convert/fleet.py): what a Hello writes of a family is what
    the router reads of it, classifier or generative."""
    from stratus.families.repository import ModelRepository

    repository = ModelRepository.load(MODELS)
    arith = repository.family("arith")
    assert arith.generation is not None
    stopping = dataclasses.replace(arith, generation=dataclasses.replace(arith.generation, stop=("\n", "=")))
    for family in [*repository.families.values(), stopping]:
        read = family_from_wire(family_to_wire(described(family)))
        assert (read.name, read.inputs, read.outputs) == (family.name, family.inputs, family.outputs)
        assert dict(read.thresholds) == dict(family.thresholds)
        assert read.generation == family.generation
        assert read.escalate == family.escalate and read.offline == family.offline
        assert dict(read.tier_accuracy) == dict(family.tier_accuracy) and read.audit == family.audit
        current = family.current.get(Tier.CLOUD)
        assert read.cloud_variants[:1] == ((current,) if current else ())
