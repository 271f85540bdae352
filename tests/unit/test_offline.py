"""Offline-first's parts (router/offline): the family table, the durable store's bounds and
recovery, the corrections log and its followers, the judge's verdicts and its share of the
cloud, and the decision record."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import numpy as np
import pytest

from router.cloud.link import CloudLink, LinkState
from router.offline.corrections import FOLLOWER_QUEUE, CorrectionLog, FileCorrections
from router.offline.decisions import SKIPPED, Decision, Hop, answered_hop, failed_hop, skipped_hops
from router.offline.judge import AGREED, CORRECTED, EXPIRED, Judge
from router.offline.provisional import cloud_was_needed, provisional_items
from router.offline.store import FULL_BYTES, FULL_ITEMS, SUFFIX, LocalDeferredStore, new_key
from router.policy.climb import ClimbState
from stratus.convert.parameters import (
    EXPLAIN,
    PROVISIONAL,
    REQUEST_ID,
    VARIANT,
    RequestOptions,
    Served,
    set_parameter,
)
from stratus.convert.tensors import Tensors
from stratus.errors import ConfigError, DeadlineExceeded, InvalidInput, Overloaded, Unavailable
from stratus.families.description import FamilyDescription
from stratus.families.offline import OfflineSpec
from stratus.families.repository import ModelRepository
from stratus.families.spec import TensorSpec
from stratus.tiers import Tier
from stratus.wire import fleet_pb2 as fpb
from stratus.wire import inference_pb2 as pb

MODELS = Path(__file__).resolve().parents[2] / "models"


# -- [offline] ---------------------------------------------------------------------------------


def _family_with(tmp_path: Path, table: str) -> Path:
    import shutil

    shutil.copytree(MODELS / "digits", tmp_path / "digits")
    toml = tmp_path / "digits" / "family.toml"
    toml.write_text(toml.read_text() + "\n" + table)
    return tmp_path


def test_offline_table_is_read_with_its_bounds(tmp_path: Path) -> None:
    models = _family_with(
        tmp_path, "[offline]\ndefer = true\nmax_items = 7\nmax_bytes = 4096\nmax_age_s = 60\n"
    )
    spec = ModelRepository.load(models).families["digits"].offline
    assert spec == OfflineSpec(defer=True, max_items=7, max_bytes=4096, max_age_s=60.0)


def test_offline_is_off_without_the_table() -> None:
    assert not ModelRepository.load(MODELS).families["digits"].offline.defer


@pytest.mark.parametrize(
    ("table", "named"),
    [
        ("[offline]\ndefer = 1\n", "offline.defer"),
        ("[offline]\nmax_items = 0\n", "offline.max_items"),
        ("[offline]\nmax_age_s = -1\n", "offline.max_age_s"),
        ("[offline]\nkeep = true\n", "offline.keep"),
    ],
)
def test_a_bad_offline_table_is_refused_by_key(tmp_path: Path, table: str, named: str) -> None:
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        ModelRepository.load(_family_with(tmp_path, table))


def test_the_hello_carries_the_table_to_the_router(tmp_path: Path) -> None:
    from stratus.convert.fleet import family_from_wire, family_to_wire
    from stratus.families.description import described

    spec = ModelRepository.load(_family_with(tmp_path, "[offline]\ndefer = true\nmax_items = 9\n")).families[
        "digits"
    ]
    assert family_from_wire(family_to_wire(described(spec))).offline == OfflineSpec(defer=True, max_items=9)
    old = family_to_wire(described(spec))
    old.ClearField("offline")  # an agent of before says nothing: nothing is deferred
    assert not family_from_wire(old).offline.defer


# -- request and response parameters ----------------------------------------------------------


def test_explain_is_a_bool_parameter() -> None:
    assert RequestOptions.from_values({EXPLAIN: True}).explain
    assert not RequestOptions.from_values({}).explain
    with pytest.raises(InvalidInput, match=r"stratus\.explain' must be a bool"):
        RequestOptions.from_values({EXPLAIN: "yes"})


def test_a_provisional_answer_names_its_request_id() -> None:
    served = Served(tier=Tier.DEVICE, agent="a", variant="v", confidence=0.2, path=[Tier.DEVICE], degraded=True,
                    provisional=True, request_id="r1")  # fmt: skip
    values = served.values()
    assert values[PROVISIONAL] is True and values[REQUEST_ID] == "r1"
    plain = Served(
        tier=Tier.DEVICE, agent="a", variant="v", confidence=0.9, path=[Tier.DEVICE], request_id="r1"
    )
    assert PROVISIONAL not in plain.values() and REQUEST_ID not in plain.values()
    assert Served.from_values(values).provisional and Served.from_values(values).request_id == "r1"


# -- the durable store --------------------------------------------------------------------------


def _record(
    family: str = "digits", items: int = 1, created: float = 1000.0, size: int = 64
) -> fpb.DeferredRequest:
    inputs = pb.ModelInferRequest(model_name=family)
    inputs.inputs.add(name="input", datatype="UINT8", shape=[items, size])
    inputs.raw_input_contents.append(b"x" * size * items)
    answers = [fpb.ProvisionalAnswer(tier="device", label=i, confidence=0.5) for i in range(items)]
    return fpb.DeferredRequest(key=new_key(created), request_id=f"r{created}", family=family, model=family,
                               created_unix=created, inputs=inputs,
                               items=[fpb.DeferredItem(index=i, answers=[a]) for i, a in enumerate(answers)])  # fmt: skip


def test_the_store_keeps_within_bounds_and_refuses_past_them(tmp_path: Path) -> None:
    async def run() -> list[str | None]:
        store = LocalDeferredStore(tmp_path)
        await store.start()
        bounds = OfflineSpec(defer=True, max_items=3, max_bytes=10_000)
        made = [await store.keep(_record(items=1, created=1000.0 + i), bounds) for i in range(4)]
        made.append(await store.keep(_record(family="other", items=2, created=2000.0), bounds))
        tight = OfflineSpec(defer=True, max_items=100, max_bytes=200)
        made.append(await store.keep(_record(family="third", size=500, created=3000.0), tight))
        return made

    assert asyncio.run(run()) == [None, None, None, FULL_ITEMS, None, FULL_BYTES]
    assert len(list(tmp_path.glob(f"*{SUFFIX}"))) == 4  # three of one family, one of another


def test_the_store_reads_back_what_an_earlier_run_kept_and_skips_the_rest(tmp_path: Path) -> None:
    async def first() -> None:
        store = LocalDeferredStore(tmp_path)
        await store.start()
        for created in (5.0, 3.0, 4.0):
            assert await store.keep(_record(created=created), OfflineSpec(defer=True)) is None

    asyncio.run(first())
    (tmp_path / f".{new_key(1.0)}{SUFFIX}.abc.tmp").write_bytes(b"half")  # a write cut short
    (tmp_path / f"{new_key(2.0)}{SUFFIX}").write_bytes(b"\xff\xff not a record")

    async def second() -> tuple[list[float], fpb.DeferredRequest | None]:
        store = LocalDeferredStore(tmp_path)
        await store.start()
        claimed = await store.claim(10, frozenset({"digits"}))
        return [r.created_unix for r in claimed], claimed[0]

    created, loaded = asyncio.run(second())
    assert created == [3.0, 4.0, 5.0]  # oldest first; the scratch and the unreadable one are not among them
    assert loaded.request_id == "r3.0"
    assert not list(tmp_path.glob("*.tmp")) and len(list(tmp_path.glob("*.bad"))) == 1


def test_the_store_forgets_what_is_removed_and_finds_what_expired(tmp_path: Path) -> None:
    async def run() -> tuple[dict[str, tuple[int, float | None]], list[float]]:
        store = LocalDeferredStore(tmp_path)
        await store.start()
        for created in (10.0, 20.0, 30.0):
            await store.keep(_record(items=2, created=created), OfflineSpec(defer=True))
        (first,) = await store.claim(1, frozenset({"digits"}))
        await store.remove(first.key)
        (claimed,) = await store.claim(1, frozenset({"digits"}))  # the next; claimed: not expired
        assert claimed.created_unix == 20.0 and store.expired(100.0, {"digits": 75.0}) == []
        await store.release(claimed.key)
        late = store.expired(100.0, {"digits": 75.0})  # older than 75 s at t=100: created before 25
        return store.outstanding(), [k.created for k in late]

    outstanding, late = asyncio.run(run())
    assert outstanding == {"digits": (4, 20.0)}
    assert late == [20.0]
    assert len(list(tmp_path.glob(f"*{SUFFIX}"))) == 2


# -- corrections --------------------------------------------------------------------------------


def _correction(request_id: str, judged: float, family: str = "digits") -> fpb.Correction:
    return fpb.Correction(
        request_id=request_id, family=family, judged_unix=judged, provisional_unix=judged - 1
    )


def test_corrections_are_kept_in_a_file_and_read_since_a_time(tmp_path: Path) -> None:
    path = tmp_path / "corrections.jsonl"

    async def run() -> tuple[list[str], list[str]]:
        log = CorrectionLog(FileCorrections(path))
        await log.start()
        await log.add(
            [_correction("a", 10.0), _correction("b", 20.0, family="other"), _correction("c", 30.0)]
        )
        again = CorrectionLog(FileCorrections(path))  # a restart reads the file back
        await again.start()
        since = [c.request_id async for c in again.read(since_unix=15.0)]
        family = [c.request_id async for c in again.read(family="digits")]
        return since, family

    assert asyncio.run(run()) == (["b", "c"], ["a", "c"])
    with path.open("a") as handle:
        handle.write('{"request_id": "half')  # a crash mid-line: skipped, the rest still read
    assert [c.request_id for c in asyncio.run(_read_all(path))] == ["a", "b", "c"]


async def _read_all(path: Path) -> list[fpb.Correction]:
    log = CorrectionLog(FileCorrections(path))
    await log.start()
    return list(log.kept)


def test_a_follower_gets_the_past_then_each_new_one() -> None:
    async def run() -> list[str]:
        log = CorrectionLog()
        await log.add([_correction("old", 1.0)])
        got: list[str] = []

        async def follow() -> None:
            async for correction in log.read(follow=True):
                got.append(correction.request_id)
                if len(got) == 3:
                    return

        task = asyncio.create_task(follow())
        await asyncio.sleep(0.01)
        await log.add([_correction("new1", 2.0), _correction("new2", 3.0)])
        await asyncio.wait_for(task, 2)
        return got

    assert asyncio.run(run()) == ["old", "new1", "new2"]


def test_a_follower_that_falls_behind_is_cut_off_with_a_reason() -> None:
    async def run() -> None:
        log = CorrectionLog()
        reading = log.read(follow=True)
        first = asyncio.ensure_future(reading.__anext__())
        await asyncio.sleep(0.01)
        await log.add([_correction(str(i), float(i)) for i in range(FOLLOWER_QUEUE + 5)])
        await first
        with pytest.raises(Overloaded, match=r"fell .* behind"):
            async for _ in reading:
                pass

    asyncio.run(run())


# -- the judge ----------------------------------------------------------------------------------


class FakeCloud(CloudLink):
    """The cloud as the judge sees it: one gateway's link, connected (or down), serving digits,
    whose calls answer ``labels`` (or raise ``error``) instead of reaching a gateway; the
    judge's own logic, and its choice of gateway, run as they do in the router."""

    def __init__(self, labels: list[int], *, ready: bool = True, capacity: int = 20, in_flight: int = 0,
                 error: Exception | None = None) -> None:  # fmt: skip
        super().__init__("cloud.test:8001", max_pending=capacity)
        self.state = LinkState.CONNECTED if ready else LinkState.DOWN
        self.models = {"digits": True}
        self.labels, self.busy, self.error = labels, in_flight, error
        self.calls = 0

    @property
    def in_flight(self) -> int:
        return self.busy

    async def infer(self, request: pb.ModelInferRequest, *, timeout_s: float | None) -> pb.ModelInferResponse:
        self.calls += 1
        if self.error is not None:
            raise self.error
        scores = np.eye(10, dtype=np.float32)[self.labels]
        response = pb.ModelInferResponse(model_name=request.model_name, id=request.id)
        response.outputs.add(name="probabilities", datatype="FP32", shape=list(scores.shape))
        response.raw_output_contents.append(scores.tobytes())
        set_parameter(response.parameters, VARIANT, "digits-large")
        return response


class Counted:
    def __init__(self) -> None:
        self.judged_items: dict[tuple[str, str, str], int] = {}
        self.dropped: dict[tuple[str, str], int] = {}

    def judged(self, family: str, tier: str, verdict: str, items: int) -> None:
        key = (family, tier, verdict)
        self.judged_items[key] = self.judged_items.get(key, 0) + items

    def deferred_dropped(self, family: str, reason: str, items: int) -> None:
        self.dropped[(family, reason)] = self.dropped.get((family, reason), 0) + items


DIGITS = FamilyDescription(name="digits", inputs=(TensorSpec(name="input", datatype="FP32", shape=(-1, 64)),),
                           outputs=(TensorSpec(name="probabilities", datatype="FP32", shape=(-1, 10)),),
                           offline=OfflineSpec(defer=True, max_age_s=50.0))  # fmt: skip


def _judge(
    tmp_path: Path, cloud: FakeCloud, *, share: float = 0.1, clock: float = 100.0
) -> tuple[Judge, Counted]:
    counted = Counted()
    store = LocalDeferredStore(tmp_path / "deferred")
    judge = Judge(store, CorrectionLog(), cloud=lambda: cloud, describe=lambda f: DIGITS if f == "digits" else None,  # type: ignore[arg-type,return-value]
                  share=share, observer=counted, clock=lambda: clock)  # fmt: skip
    return judge, counted


def test_the_judge_records_a_correction_for_each_item_the_cloud_answers_otherwise(tmp_path: Path) -> None:
    cloud = FakeCloud([3, 5])

    async def run() -> tuple[Judge, list[fpb.Correction]]:
        judge, _ = _judge(tmp_path, cloud)
        await judge.store.start()
        record = _record(items=2, created=90.0)  # provisional labels 0 and 1
        record.items[1].answers[0].label = 5
        await judge.store.keep(record, DIGITS.offline)
        await judge._send()
        await asyncio.gather(*judge.judging.values())
        return judge, list(judge.corrections.kept)

    judge, made = asyncio.run(run())
    assert [(c.item, c.provisional.label, c.cloud.label) for c in made] == [
        (0, 0, 3)
    ]  # item 1 agreed (5 = 5)
    assert made[0].cloud.variant == "digits-large" and made[0].judged_unix == 100.0
    assert not judge.store.backlogs  # judged: removed


def test_the_judge_counts_verdicts_and_keeps_what_the_cloud_could_not_answer(tmp_path: Path) -> None:
    async def run(cloud: FakeCloud) -> tuple[Judge, Counted]:
        judge, counted = _judge(tmp_path / str(id(cloud)), cloud)
        await judge.store.start()
        await judge.store.keep(_record(items=1, created=90.0), DIGITS.offline)
        await judge._send()
        await asyncio.gather(*judge.judging.values())
        return judge, counted

    judge, counted = asyncio.run(run(FakeCloud([0])))
    assert counted.judged_items == {("digits", "device", AGREED): 1} and not judge.store.backlogs
    for error in (Unavailable("gone"), Overloaded("full"), DeadlineExceeded("slow")):
        judge, counted = asyncio.run(run(FakeCloud([0], error=error)))
        assert judge.store.backlogs and not counted.judged_items  # kept for the next try
        assert not judge.store.claimed  # ... and claimable again
    judge, counted = asyncio.run(run(FakeCloud([0], error=InvalidInput("shape"))))
    assert not judge.store.backlogs and counted.dropped == {("digits", "refused_by_cloud"): 1}
    assert CORRECTED not in {k[2] for k in counted.judged_items}


def test_the_judge_takes_only_its_share_of_the_cloud_and_waits_while_it_is_away(tmp_path: Path) -> None:
    judge, _ = _judge(tmp_path, FakeCloud([0], capacity=100, in_flight=0), share=0.1)
    assert judge.room() == 10
    judge, _ = _judge(tmp_path, FakeCloud([0], capacity=100, in_flight=7), share=0.1)
    assert judge.room() == 3  # live calls count against it
    judge, _ = _judge(tmp_path, FakeCloud([0], capacity=100, in_flight=40), share=0.1)
    assert judge.room() == 0  # live work first
    judge, _ = _judge(tmp_path, FakeCloud([0], capacity=4), share=0.1)
    assert judge.room() == 1  # at least one while the cloud is idle
    judge, _ = _judge(tmp_path, FakeCloud([0], ready=False))
    assert judge.room() == 0
    judge, _ = _judge(tmp_path, FakeCloud([0]), share=0.0)
    assert judge.room() == 0


def test_expired_items_are_dropped_and_counted(tmp_path: Path) -> None:
    async def run() -> tuple[Judge, Counted]:
        judge, counted = _judge(tmp_path, FakeCloud([0], ready=False), clock=100.0)
        await judge.store.start()
        await judge.store.keep(_record(items=2, created=10.0), DIGITS.offline)  # 90 s old, bound 50 s
        await judge.store.keep(_record(items=1, created=80.0), DIGITS.offline)
        await judge._expire()
        return judge, counted

    judge, counted = asyncio.run(run())
    assert counted.dropped == {("digits", EXPIRED): 2}
    assert judge.store.outstanding() == {"digits": (1, 80.0)}


# -- what a cascade keeps ---------------------------------------------------------------------


class _Answer:
    def __init__(self, tier: Tier, scores: np.ndarray) -> None:
        response = pb.ModelInferResponse()
        response.outputs.add(name="probabilities", datatype="FP32", shape=list(scores.shape))
        response.raw_output_contents.append(scores.astype(np.float32).tobytes())
        self.tier, self.agent, self.variant = tier, f"{tier.label}-1", f"digits-{tier.label}"
        self.outputs = Tensors.from_response(response)
        self.confidences = tuple(float(r.max()) for r in scores)


def test_each_unsure_item_is_kept_with_every_answer_on_its_way_up() -> None:
    device = _Answer(Tier.DEVICE, np.eye(10)[[1, 2, 3]] * 0.5)  # items 0, 1, 2
    edge = _Answer(Tier.EDGE, np.eye(10)[[7, 8]] * 0.6)  # items 1 and 2 climbed
    kept = provisional_items([device, edge], [[0, 1, 2], [1, 2]], [2], "probabilities")
    assert [item.index for item in kept] == [2]
    assert [(a.tier, a.label) for a in kept[0].answers] == [("device", 3), ("edge", 8)]
    assert kept[0].answers[-1].confidence == pytest.approx(0.6)


def test_the_cloud_was_needed_only_where_it_could_have_answered() -> None:
    class Cloud:
        def __init__(self, models: dict[str, bool]) -> None:
            self.models = models

    state = ClimbState()
    assert cloud_was_needed(Cloud({"digits": True}), "digits", state)  # type: ignore[arg-type]
    assert cloud_was_needed(Cloud({}), "digits", state)  # type: ignore[arg-type]  # not learnt yet
    assert not cloud_was_needed(Cloud({"other": True}), "digits", state)  # type: ignore[arg-type]
    assert not cloud_was_needed(None, "digits", state)
    assert not cloud_was_needed(Cloud({"digits": True}), "digits", ClimbState(max_tier=Tier.EDGE))  # type: ignore[arg-type]
    answered = ClimbState()
    answered.answered.append(Tier.CLOUD)
    assert not cloud_was_needed(Cloud({"digits": True}), "digits", answered)  # type: ignore[arg-type]


# -- decision records ---------------------------------------------------------------------------


def test_hops_say_what_each_tier_did() -> None:
    hop = answered_hop(Tier.DEVICE, target="d", variant="v", confidences=(0.9, 0.3), accepted=(True, False),
                       thresholds={Tier.DEVICE: 0.7}, ms=1.23456)  # fmt: skip
    assert (hop.outcome, hop.items, hop.unsure, hop.confidence, hop.threshold, hop.ms) == (
        "unsure",
        2,
        1,
        0.3,
        0.7,
        1.235,
    )
    assert (
        failed_hop(Tier.EDGE, target="e", items=1, error=DeadlineExceeded("late"), ms=5).outcome == "too_slow"
    )
    assert failed_hop(Tier.EDGE, target="e", items=1, error=Unavailable("gone"), ms=5).outcome == "failed"
    skipped = skipped_hops(frozenset({Tier.DEVICE, Tier.EDGE, Tier.CLOUD}), lowest=Tier.DEVICE, before=Tier.CLOUD,
                           tried=["device"])  # fmt: skip
    assert [(h.tier, h.outcome) for h in skipped] == [("edge", SKIPPED)]


def test_a_decision_is_json_without_nan() -> None:
    decision = Decision(request_id="r", family="digits", model="digits",
                        hops=[Hop(tier="device", outcome="accepted", confidence=float("nan"))], final_tier="device",
                        reason="accepted", degraded=False, provisional=False, items=1, total_ms=1.0)  # fmt: skip
    row = json.loads(decision.to_json())
    assert row["hops"][0]["confidence"] is None and row["final_tier"] == "device"


def test_decision_records_are_written_as_parquet(tmp_path: Path) -> None:
    import pyarrow.parquet as pq

    from router.offline.decisions import as_row, decision_schema
    from stratus.obs.capture import CaptureWriter, RowFormat

    writer = CaptureWriter(tmp_path, rows=RowFormat(prefix="decisions", schema=decision_schema, row=as_row))
    decision = Decision(request_id="r1", family="digits", model="digits", final_tier="cloud", reason="accepted",
                        hops=[Hop(tier="device", outcome="unsure", items=1, unsure=1), Hop(tier="cloud", outcome="accepted")],
                        degraded=False, provisional=True, items=1, total_ms=3.0)  # fmt: skip
    assert writer.offer(decision)
    writer.close()
    (written,) = tmp_path.glob("decisions-*.parquet")
    table = pq.read_table(written).to_pylist()
    assert table[0]["request_id"] == "r1" and [h["outcome"] for h in table[0]["hops"]] == [
        "unsure",
        "accepted",
    ]
    assert os.path.getsize(written) > 0


def test_a_family_kept_on_the_site_is_never_deferred(tmp_path: Path) -> None:
    from dataclasses import replace

    from router.offline import Offline, OfflineSettings

    kept_here = replace(DIGITS, escalate=False)
    families = {"digits": DIGITS, "private": replace(kept_here, name="private"), "off": replace(DIGITS, name="off",
                offline=OfflineSpec())}  # fmt: skip
    offline = Offline(
        OfflineSettings(state_dir=tmp_path), router="r", cloud=lambda: None, describe=families.get
    )
    assert offline.defers("digits") is DIGITS
    assert offline.defers("private") is None  # [privacy] escalate = false: its inputs never leave
    assert offline.defers("off") is None and offline.defers("unknown") is None


def test_the_clouds_verdicts_are_captured_as_labels(tmp_path: Path) -> None:
    from router.audit.capture import JUDGED, CaptureHook, CaptureSettings
    from stratus.obs.capture import read_dataset

    hook = CaptureHook(CaptureSettings(folder=tmp_path, families=frozenset({"digits"})))
    record = fpb.DeferredRequest(key="k", request_id="r7", family="digits", model="digits")
    record.inputs.inputs.add(name="input", datatype="FP32", shape=[2, 64])
    record.inputs.raw_input_contents.append(np.arange(128, dtype=np.float32).tobytes())
    for index, label in ((0, 3), (4, 8)):
        record.items.add(index=index).answers.add(
            tier="device", variant="digits-small", label=label, confidence=0.4
        )
    cloud = [
        fpb.ProvisionalAnswer(tier="cloud", variant="digits-large", label=label, confidence=0.9)
        for label in (5, 8)
    ]
    hook.judged(record, cloud)
    hook.judged(with_family(record, family="other"), cloud)  # a family not named: not captured
    asyncio.run(hook.close())
    inputs, labels = read_dataset(tmp_path, "digits", source=JUDGED)
    assert labels.tolist() == [5, 8]  # the cloud's answers are the labels
    assert inputs["input"].shape == (2, 64) and inputs["input"][1, 0] == 64.0  # each item's own row


def with_family(record: fpb.DeferredRequest, *, family: str) -> fpb.DeferredRequest:
    copy = fpb.DeferredRequest()
    copy.CopyFrom(record)
    copy.family = family
    return copy
