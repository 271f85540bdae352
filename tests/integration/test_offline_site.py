"""Offline-first at a site (issue 36 §1): deferred requests and corrections in the site's NATS
JetStream, against a real nats-server. The store's bounds refuse the new, two routers' judges
never take the same request, one not acknowledged goes to the other; and a whole site: router A
answers provisionally and dies, router B judges A's backlog once the cloud is back, and B's
corrections name A's requests."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np

from router.offline.corrections import CorrectionLog
from router.offline.store import FULL_ITEMS, new_key
from router.site.deferred import NatsCorrections, NatsDeferredStore
from router.site.nats import NatsSiteState
from stratus.convert import codec
from stratus.devtools.launcher import free_port
from stratus.families.offline import OfflineSpec
from stratus.serving.channels import open_sync_channel
from stratus.wire import fleet_pb2 as fpb
from stratus.wire import fleet_pb2_grpc as fpb_grpc
from stratus.wire import inference_pb2 as pb

from .cluster import Cluster, infer, ready_count, wait_until
from .natsd import NatsServer
from .test_offline import cloud_labels
from .variants import copy_digits


def record(created: float, family: str = "digits") -> fpb.DeferredRequest:
    inputs = pb.ModelInferRequest(model_name=family)
    inputs.inputs.add(name="input", datatype="FP32", shape=[1, 64])
    inputs.raw_input_contents.append(np.zeros((1, 64), np.float32).tobytes())
    answer = fpb.ProvisionalAnswer(tier="device", label=1, confidence=0.4)
    return fpb.DeferredRequest(key=new_key(created), request_id=f"r{created:g}", family=family, model=family,
                               created_unix=created, inputs=inputs, items=[fpb.DeferredItem(index=0, answers=[answer])])  # fmt: skip


async def connected(url: str) -> NatsSiteState:
    state = NatsSiteState(url)
    await state.start()
    for _ in range(200):
        if state.connected:
            return state
        await asyncio.sleep(0.05)
    raise AssertionError(f"no connection to {url}")


def test_the_site_store_bounds_claims_once_and_hands_back(nats: NatsServer) -> None:
    async def run() -> None:
        one, two = await connected(nats.url), await connected(nats.url)
        a, b = NatsDeferredStore(one), NatsDeferredStore(two)
        bounds = OfflineSpec(defer=True, max_items=4)
        made = [await a.keep(record(100.0 + i), bounds) for i in range(5)]
        assert made == [None, None, None, None, FULL_ITEMS]  # the server refuses the new one
        everyone = frozenset({"digits"})
        first = await a.claim(2, everyone)
        second = await b.claim(10, everyone)  # the other router's judge: what A holds is not offered
        assert [r.created_unix for r in first] == [100.0, 101.0]
        assert sorted(r.created_unix for r in second) == [102.0, 103.0]
        await a.remove(first[0].key)  # judged
        await a.release(first[1].key)  # the cloud failed it: back, after a short delay
        for r in second:
            await b.remove(r.key)
        await asyncio.sleep(1.5)
        again = await b.claim(10, everyone)
        assert [r.created_unix for r in again] == [101.0]
        await b.remove(again[0].key)
        assert await a.keep(record(200.0), bounds) is None  # room again once judged
        await a._refresh()
        assert a.outstanding() == {"digits": (1, 200.0)}
        for store in (a, b):
            await store.close()
        await one.close()
        await two.close()

    asyncio.run(run())


def test_corrections_made_by_one_router_reach_every_router(nats: NatsServer) -> None:
    async def run() -> None:
        one, two = await connected(nats.url), await connected(nats.url)
        here, there = CorrectionLog(NatsCorrections(one)), CorrectionLog(NatsCorrections(two))
        await here.start()
        await there.start()
        await here.add([fpb.Correction(request_id="x", family="digits", judged_unix=5.0)])
        for _ in range(100):
            if there.kept and here.kept:
                break
            await asyncio.sleep(0.05)
        assert [c.request_id for c in there.kept] == ["x"] and [c.request_id for c in here.kept] == ["x"]
        late = CorrectionLog(NatsCorrections(two))  # a router started later reads the past too
        await late.start()
        for _ in range(100):
            if late.kept:
                break
            await asyncio.sleep(0.05)
        assert [c.request_id for c in late.kept] == ["x"]
        for log in (here, there, late):
            await log.close()
        await one.close()
        await two.close()

    asyncio.run(run())


def test_a_dead_routers_provisional_answers_are_judged_by_another(  # type: ignore[no-untyped-def]
    cluster: Cluster, tmp_path: Path, nats: NatsServer, digits
) -> None:
    cloud_address = f"127.0.0.1:{free_port()}"
    models = copy_digits(tmp_path / "models")
    toml = models / "digits" / "family.toml"
    toml.write_text(toml.read_text() + "\n[offline]\ndefer = true\n")
    cloud = cluster.cloud("--listen", cloud_address)
    site = ["--cloud", cloud_address, "--site-state", nats.url]
    a = cluster.router(*site, role="router-a", env={"STRATUS_ROUTER_NAME": "router-a"}).address
    b = cluster.router(*site, role="router-b").address
    cluster.agent("dev-1", f"{a},{b}", "--models", str(models))
    wait_until(lambda: ready_count(a) == 1 and ready_count(b) == 1, 60)
    cloud.kill()
    x = digits.held_out.x[:200].astype(np.float32)
    device: dict[str, int] = {}  # request id -> the device's answer
    rows: dict[str, int] = {}
    for row in range(len(x)):
        response, served = infer(a, x[row : row + 1], min_confidence=1.0)
        if served.provisional:
            device[served.request_id] = int(codec.decode_response_outputs(response)["probabilities"].argmax())
            rows[served.request_id] = row
    assert len(device) >= 100, len(device)  # almost every item is unsure at 1.0
    cluster.latest("router-a").kill()
    cluster.cloud("--listen", cloud_address, role="cloud-again")
    wait_until(lambda: _waiting(nats.url) == 0, 60)  # every one of A's judged, by B
    wait_until(lambda: bool(_corrections(b)), 10)
    (variant,) = {c.cloud.variant for c in _corrections(b)}  # what the cloud ran (FP32, or a child)
    truth = dict(zip(rows, cloud_labels(variant, x[list(rows.values())]), strict=True))
    expected = {request_id for request_id, label in device.items() if truth[request_id] != label}
    assert expected, "the device was right on every item: nothing to correct, nothing proven"
    wait_until(lambda: {c.request_id for c in _corrections(b)} == expected, 10)
    assert {c.router for c in _corrections(b)} == {"router-a"}  # A's answers, judged by B


def _waiting(url: str) -> int:
    async def count() -> int:
        state = await connected(url)
        store = NatsDeferredStore(state)
        await store._refresh()
        await state.close()
        return sum(n for n, _ in store.outstanding().values())

    return asyncio.run(count())


def _corrections(router: str) -> list[fpb.Correction]:
    with open_sync_channel(router) as channel:
        return list(fpb_grpc.FleetStub(channel).Corrections(fpb.CorrectionsRequest(), timeout=10))
