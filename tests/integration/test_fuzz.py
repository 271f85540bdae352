"""Property-based fuzzing of a real router, its front door and its AgentLink.

A router of this module's own (a fuzzed peer joins, drains and leaves it; the shared fleet
must not see that), with two real agents. For every generated input:

1. ModelInfer and ModelStreamInfer answer, or fail with a precise status (``CLEAR``) whose
   details are a message, never a traceback; never INTERNAL or UNKNOWN.
2. A raw AgentLink peer sending a generated Hello and what follows (answers for Work it
   never had, heartbeats, chunks, a second Hello; and a Result for Work it did get, for a
   client waiting on it) is kept, or ended alone with a clear status; the real agents stay
   ready and an ordinary digits request is still answered correctly.
3. Over the whole module: no traceback in the router's log, the router's event loop never
   stalls (a ServerLive prober in a process of its own), its RSS grows less than 50 MB, and
   it exits cleanly.

Runs are reproducible: ``derandomize=True`` and no example database.
"""

from __future__ import annotations

import math
import subprocess
import sys
import threading
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from queue import Queue
from typing import Any

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from stratus.convert import codec
from stratus.convert.parameters import set_parameter
from stratus.devtools.launcher import Launched
from stratus.serving.channels import grpc_options
from stratus.wire import fleet_pb2 as fpb
from stratus.wire import inference_pb2 as pb
from stratus.wire import inference_pb2_grpc as pb_grpc

from .cluster import Cluster, fleet_status, ready_count, wait_until

ROOT = Path(__file__).resolve().parents[2]
AGENTS = {"dev-1": "device", "edge-1": "edge"}

# The statuses Stratus gives on purpose (stratus/errors.py, mapped once in stratus/serving/interceptor.py),
# less INTERNAL (a bug, by its definition there) and the credential codes (this router takes
# no token, so UNAUTHENTICATED or PERMISSION_DENIED would be wrong here). gRPC itself adds
# RESOURCE_EXHAUSTED for a message over the limit. OUT_OF_RANGE is mapped nowhere in Stratus;
# it stays allowed as the issue lists it (gRPC's core uses it for out-of-range reads).
CLEAR = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.OUT_OF_RANGE,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.DEADLINE_EXCEEDED,
    }
)
CLIENT_DEADLINE_S = 20.0
# What gRPC's client says when its own deadline, not the router, ended a call.
CLIENT_DEADLINE = "Deadline Exceeded"

# The loop-stall bound. The target is 100 ms, but on the 2-core machine this suite
# runs on (router, two agents, this process and the prober sharing both cores) the worst
# ServerLive round trip over a whole run, with no input known to stall the loop, measured
# 40-170 ms in five runs (the worst examples were 1-2 KB requests refused at once, a
# different one each run: scheduling, not the loop). A real stall (F5's O(N^2) name check,
# a decode on the loop) costs seconds, and the garbage collection that frees retained
# requests (see test_refused_requests_are_not_kept_in_memory) 100-370 ms. So: 250 ms.
MAX_STALL_MS = 250.0
MAX_RSS_GROWTH_MB = 50.0
PROBE_INTERVAL_S = 0.015
INFER_EXAMPLES, STREAM_EXAMPLES, LINK_EXAMPLES = 400, 80, 120

# -- what the router is sent --------------------------------------------------------------

# Any text protobuf can carry (valid UTF-8: no lone surrogates), newlines and all.
texts = st.text(st.characters(exclude_categories=["Cs"]), max_size=24)
long_texts = st.builds(
    lambda unit, count: unit * count,
    st.sampled_from(["x", "é", "\n", "\U0001f600", "\x00"]),
    st.integers(129, 70_000),
)
names = st.one_of(texts, long_texts)
MODELS = [
    "digits",
    "digits-small",
    "digits-small-int8",
    "digits-medium",
    "digits-large",
    "defects",
    "arith",
    "",
]
model_names = st.one_of(st.sampled_from(MODELS), names)
DATATYPES = [
    "FP32",
    "FP16",
    "FP64",
    "BF16",
    "INT8",
    "INT16",
    "INT32",
    "INT64",
    "UINT8",
    "UINT64",
    "BOOL",
    "BYTES",
]
datatypes = st.one_of(st.sampled_from(DATATYPES), st.sampled_from(["", "fp32", "FP8", "STRING"]), texts)
dims = st.one_of(
    st.integers(-3, 70), st.sampled_from([0, 64, 1 << 31, 1 << 40, 2**63 - 1, -(2**63), -(1 << 40)])
)
shapes = st.one_of(
    st.lists(dims, max_size=4),
    st.lists(dims, min_size=5, max_size=20),  # past the rank limit
    st.just([0, 2**40, 2**40]),  # no elements, but a huge size (F18)
    st.builds(lambda items: [items, 64], st.integers(0, 8)),
)
TYPED: dict[str, st.SearchStrategy[Any]] = {
    "bool_contents": st.booleans(),
    "int_contents": st.integers(-(2**31), 2**31 - 1),
    "int64_contents": st.integers(-(2**63), 2**63 - 1),
    "uint_contents": st.integers(0, 2**32 - 1),
    "uint64_contents": st.integers(0, 2**64 - 1),
    "fp32_contents": st.floats(width=32),
    "fp64_contents": st.floats(),
    "bytes_contents": st.binary(max_size=16),
}
INPUT_NAMES = ["input", "text_input", "stream", "", "x"]


@st.composite
def tensors(draw: st.DrawFn, message: pb.ModelInferRequest, raw: bool) -> None:
    """One more input on ``message``: any name, datatype and shape, with contents raw,
    typed (of any kind, whatever the datatype), both, or none, of any length."""
    tensor = message.inputs.add(
        name=draw(st.one_of(st.sampled_from(INPUT_NAMES), texts)),
        datatype=draw(datatypes),
        shape=draw(shapes),
    )
    if raw:
        message.raw_input_contents.append(draw(st.binary(max_size=600)))
    kind = draw(st.sampled_from([None, *TYPED]))
    if kind is not None:
        getattr(tensor.contents, kind).extend(draw(st.lists(TYPED[kind], max_size=80)))
    if draw(st.integers(0, 15)) == 0:  # many packed zeros: 1 byte each on the wire (F6)
        tensor.contents.int64_contents.extend([0] * draw(st.sampled_from([70_000, 2_000_000])))


def digits_input(message: pb.ModelInferRequest, pixels: bytes) -> None:
    """A well-formed digits input (random pixels): the base the other draws break."""
    x = np.frombuffer(pixels, np.uint8).astype(np.float32).reshape(-1, 64) / 255.0
    codec.encode_request_inputs(message, {"input": x})


PARAMETER_KEYS = [
    "stratus.budget_ms",
    "stratus.min_confidence",
    "stratus.max_tier",
    "stratus.min_tier",
    "stratus.bogus",
    "stratus.",
    "stream",
    "max_tokens",
    "padding",
]
numbers = st.one_of(
    st.floats(),  # NaN and the infinities included
    st.sampled_from(
        [math.nan, math.inf, -math.inf, 1e12, 600_000.0, 600_000.1, 1e-300, 5e-324, -0.0, 1.0, 0.5]
    ),
    st.integers(-(2**63), 2**63 - 1),
)
tier_names = st.sampled_from(["device", "edge", "cloud", "DEVICE", "sky", "", "device\n"])


def set_any(parameter: pb.InferParameter, kind: str, value: object) -> None:
    setattr(parameter, kind, value)


@st.composite
def parameters(draw: st.DrawFn, target: Any) -> None:
    """Stratus's keys with values of every type (NaN, infinite and huge budgets), unknown
    stratus.* keys, and others that pass through."""
    keys = st.one_of(
        st.sampled_from(PARAMETER_KEYS[:4]),
        st.sampled_from(PARAMETER_KEYS),
        texts.map(lambda t: f"stratus.{t}"),
        texts,
    )
    for key in draw(st.lists(keys, max_size=4, unique=True)):
        kind, values = draw(
            st.sampled_from(
                [
                    ("double_param", numbers.map(float)),
                    ("double_param", numbers.map(float)),
                    ("int64_param", st.integers(-(2**63), 2**63 - 1)),
                    ("uint64_param", st.integers(0, 2**64 - 1)),
                    ("bool_param", st.booleans()),
                    ("string_param", st.one_of(tier_names, texts)),
                ]
            )
        )
        set_any(target[key], kind, draw(values))


@st.composite
def requests(draw: st.DrawFn) -> pb.ModelInferRequest:
    message = pb.ModelInferRequest(model_name=draw(model_names), id=draw(st.one_of(st.just(""), names)))
    raw = draw(st.booleans())
    if draw(st.booleans()):
        items = draw(st.integers(1, 4))
        digits_input(message, draw(st.binary(min_size=items * 64, max_size=items * 64)))
        message.model_name = draw(
            st.sampled_from(["digits", "digits-small", "digits-medium", message.model_name])
        )
        raw = bool(message.raw_input_contents)
    count = draw(st.one_of(st.integers(0, 3), st.just(0), st.integers(60, 70)))
    if count > 3:  # many inputs: cheap ones, names repeating (F5)
        for index in range(count):
            message.inputs.add(
                name=f"x{index % draw(st.sampled_from([1, 7, 1000]))}", datatype="FP32", shape=[0]
            )
    else:
        for _ in range(count):
            draw(tensors(message, raw))
    if raw and draw(st.booleans()):  # one buffer too many, or one too few
        if draw(st.booleans()) or not message.raw_input_contents:
            message.raw_input_contents.append(draw(st.binary(max_size=64)))
        else:
            del message.raw_input_contents[-1]
    for name in draw(st.lists(st.sampled_from(["probabilities", "text_output", "nope", ""]), max_size=2)):
        message.outputs.add(name=name)
    draw(parameters(message.parameters))
    return message


# -- what is checked --------------------------------------------------------------------------


def check_clear(
    code: grpc.StatusCode, details: str | None, *, also: frozenset[grpc.StatusCode] = frozenset()
) -> None:
    """A precise status, with a message a person can act on and no traceback."""
    assert code in CLEAR | also, (code, details)
    assert details and details.strip(), (code, details)
    assert "Traceback" not in details and 'File "' not in details, details
    assert details != CLIENT_DEADLINE, "the router left the client waiting until its own deadline"


def check_stream_error(text: str) -> None:
    code, _, message = text.partition(": ")
    event(f"stream {code}: {message[:40]}")
    check_clear(getattr(grpc.StatusCode, code, grpc.StatusCode.UNKNOWN), message)


class LogTail:
    """The router's log, read on from where the previous look stopped."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0

    def new(self) -> str:
        with self.path.open("rb") as log:
            log.seek(self.offset)
            text = log.read()
        self.offset += len(text)
        return text.decode(errors="replace")


class Prober:
    """tests/integration/liveness.py, in a process of its own."""

    def __init__(self, address: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.integration.liveness", address, str(PROBE_INTERVAL_S)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        assert self.process.stdout is not None
        assert self.process.stdout.readline().strip() == "READY"

    def take(self) -> tuple[float, int, int]:
        """(worst ms, probes, failed probes) since the previous take."""
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write("\n")
        self.process.stdin.flush()
        worst, probes, failed = self.process.stdout.readline().split()
        return float(worst), int(probes), int(failed)

    def stop(self) -> None:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.close()
        self.process.wait(timeout=10)
        self.process.stdout.close()


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024.0
    raise AssertionError(f"no VmRSS for {pid}")


@dataclass(repr=False)
class Site:
    router: Launched
    rows: np.ndarray  # digits the device tier answers correctly: the check after each example
    labels: np.ndarray
    log: LogTail
    prober: Prober
    rss_before_mb: float
    # Per example: its worst ServerLive round trip, and what it was (for the report).
    stalls: list[tuple[float, str]] = field(default_factory=list)
    examples: int = 0

    @property
    def address(self) -> str:
        return self.router.address

    def __repr__(self) -> str:  # printed with each failing example
        return f"Site(router at {self.address})"

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:  # hypothesis's printer
        printer.text(repr(self))

    def no_traceback_yet(self) -> None:
        new = self.log.new()
        assert "Traceback" not in new, f"the router logged a traceback:\n{new[-4000:]}"
        assert self.router.process.poll() is None, f"the router died:\n{self.router.log()[-4000:]}"

    def example(self, what: str) -> None:
        """After each example: no traceback, router alive; note the example's worst stall."""
        self.no_traceback_yet()
        worst, _, _ = self.prober.take()
        self.stalls.append((worst, what[:300]))
        self.examples += 1

    def held_up(self) -> None:
        """The whole run so far: the loop never stalled, memory stayed, nothing was logged."""
        self.no_traceback_yet()
        worst, probes, failed = self.prober.take()
        self.stalls.append((worst, "(between examples)"))
        assert failed == 0, f"{failed} of {probes} ServerLive probes failed"
        stalls = sorted(self.stalls, reverse=True)[:3]
        assert stalls[0][0] < MAX_STALL_MS, f"the router's loop stalled; worst examples: {stalls}"
        growth = rss_mb(self.router.process.pid) - self.rss_before_mb
        assert growth < MAX_RSS_GROWTH_MB, f"router RSS grew {growth:.1f} MB over {self.examples} examples"

    def still_serves(self) -> None:
        """The real agents are ready, and an ordinary request gets the right digits."""
        states = {a.id: a.state for a in fleet_status(self.address).agents}
        assert all(states.get(name) == fpb.AGENT_STATE_READY for name in AGENTS), states
        assert answer(self.address, self.rows) == self.labels.tolist()


def answer(address: str, rows: np.ndarray) -> list[int]:
    message = pb.ModelInferRequest(model_name="digits")
    codec.encode_request_inputs(message, {"input": rows})
    set_parameter(message.parameters, "stratus.max_tier", "device")
    with grpc.insecure_channel(address, options=grpc_options()) as channel:
        response = pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(message, timeout=10)
    probabilities = codec.decode_response_outputs(response)["probabilities"]
    return [int(i) for i in probabilities.argmax(axis=1)]


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    from stratus.tools.datasets import digits_splits

    cluster = Cluster(tmp_path_factory.mktemp("fuzz"))
    try:
        router = cluster.router()
        for name, tier in AGENTS.items():
            cluster.agent(name, router.address, tier=tier)
        wait_until(lambda: ready_count(router.address) == len(AGENTS), timeout_s=60)
        held_out = digits_splits().held_out
        x, y = held_out.x[:16].astype(np.float32), held_out.y[:16]
        right = np.array(answer(router.address, x)) == y
        prober = Prober(router.address)
        try:
            built = Site(
                router=router,
                rows=x[right][:4],
                labels=y[right][:4],
                log=LogTail(router.log_path),
                prober=prober,
                rss_before_mb=rss_mb(router.process.pid),
            )
            built.still_serves()
            yield built
        finally:
            prober.stop()
        assert router.stop() == 0, f"the router did not exit cleanly:\n{router.log()[-4000:]}"
    finally:
        cluster.stop_all()


FUZZ = settings(
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
    ],
)

# -- 1. the inference front door --------------------------------------------------------------


def infer_clearly(address: str, message: pb.ModelInferRequest) -> str:
    """Send; check the refusal, if any; what happened, in a few words (for the statistics)."""
    with grpc.insecure_channel(address, options=grpc_options()) as channel:
        try:
            pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(message, timeout=CLIENT_DEADLINE_S)
        except grpc.RpcError as error:
            check_clear(error.code(), error.details())
            return f"{error.code().name}: {(error.details() or '')[:40]}"
    return "answered"


def summary(message: pb.ModelInferRequest) -> str:
    inputs = [(t.name[:20], t.datatype[:10], list(t.shape)[:6]) for t in message.inputs[:4]]
    size = message.ByteSize()
    return f"ModelInfer {message.model_name[:40]!r} ({size} bytes) inputs {inputs} params {sorted(message.parameters)[:4]}"


def fuzzed(site: Site, run: Callable[[], None]) -> None:
    """Run a property's examples, then check the router they were sent to: in one test, so
    the check never depends on which tests ran before it (a fresh router proves nothing)."""
    before = site.examples
    run()
    assert site.examples > before, "no example reached the router"
    site.still_serves()
    site.held_up()


def test_model_infer_answers_or_refuses_precisely_and_leaves_the_router_whole(site: Site) -> None:
    @settings(FUZZ, max_examples=INFER_EXAMPLES)
    @given(message=requests())
    def each(message: pb.ModelInferRequest) -> None:
        event(infer_clearly(site.address, message))
        site.example(summary(message))

    fuzzed(site, each)


def test_model_stream_infer_answers_each_request_precisely_and_leaves_the_router_whole(site: Site) -> None:
    @settings(FUZZ, max_examples=STREAM_EXAMPLES)
    @given(batch=st.lists(st.tuples(requests(), st.booleans()), min_size=1, max_size=5))
    def each(batch: list[tuple[pb.ModelInferRequest, bool]]) -> None:
        stream_clearly(site, batch)

    fuzzed(site, each)


def stream_clearly(site: Site, batch: list[tuple[pb.ModelInferRequest, bool]]) -> None:
    """Every request on a stream gets its answers or one clear error; the stream stays."""
    for index, (message, decoupled) in enumerate(batch):
        message.id = str(index)
        if decoupled:  # Triton's decoupled mode: many responses (a generative family's chunks)
            message.parameters["stream"].bool_param = True
    answered: dict[str, list[pb.ModelStreamInferResponse]] = defaultdict(list)
    with grpc.insecure_channel(site.address, options=grpc_options()) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        try:
            for response in stub.ModelStreamInfer(iter([m for m, _ in batch]), timeout=CLIENT_DEADLINE_S):
                answered[response.infer_response.id].append(response)
        except grpc.RpcError as error:  # only a message the transport refuses ends the stream
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, (error.code(), error.details())
            check_clear(error.code(), error.details())
            site.example("ModelStreamInfer (refused by the transport) " + "; ".join(summary(m) for m, _ in batch))
            return
    # a stream that ended OK answered every request: a silent one is a lost request
    assert sorted(answered) == sorted(m.id for m, _ in batch)
    for responses in answered.values():
        for response in responses:
            if response.error_message:
                check_stream_error(response.error_message)
    site.example("ModelStreamInfer " + "; ".join(summary(m) for m, _ in batch))


# -- 2. the AgentLink -----------------------------------------------------------------------

# Ids the charset allows, and ids it does not (newlines, unicode, too long, empty).
valid_ids = st.text("abcdefghijklmnopqrstuvwxyz0123456789._:@-", min_size=1, max_size=20).map(
    lambda t: f"fz-{t}"
)


def mostly(good: st.SearchStrategy[Any], bad: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """``good`` about four times in five: a Hello refused for its first bad name never
    reaches the checks behind it."""
    return st.one_of(good, good, good, good, bad)


agent_ids = mostly(valid_ids, st.one_of(st.just(""), names, st.just("a" * 129)))
tiers = st.sampled_from([fpb.TIER_DEVICE, fpb.TIER_EDGE, fpb.TIER_CLOUD, fpb.TIER_UNSPECIFIED, 7, -1])
uint32s = st.one_of(st.integers(0, 4), st.sampled_from([1024, 1025, 2**31, 2**32 - 1]))
uint64s = st.one_of(st.integers(0, 4), st.sampled_from([2**63, 2**64 - 1]))
doubles = st.one_of(st.floats(), st.sampled_from([-1.0, 0.0, 0.5, 1.0, 1.5, 1e308, -1e308]))
variant_names = mostly(
    st.one_of(
        st.sampled_from(["digits-small", "digits-small-int8", "digits-medium", "arith-small"]), valid_ids
    ),
    st.one_of(st.sampled_from(["x y", ""]), texts),
)
family_names = mostly(
    st.one_of(st.sampled_from(["digits", "defects", "arith", "fz-family"]), valid_ids),
    st.one_of(st.just(""), texts),
)


def tensor_metadata() -> st.SearchStrategy[pb.ModelMetadataResponse.TensorMetadata]:
    return st.builds(
        pb.ModelMetadataResponse.TensorMetadata,
        name=st.sampled_from(["input", "probabilities", "", "x"]),
        datatype=datatypes,
        shape=st.lists(dims, max_size=4),
    )


variant_infos = st.builds(
    fpb.VariantInfo,
    name=variant_names,
    family=family_names,
    runtime=st.sampled_from(["onnxruntime", "litert", "", "?"]),
    precision=st.sampled_from(["FP32", "INT8", "", "FP4"]),
    dynamic_batch=st.booleans(),
    max_batch=uint32s,
    line=st.one_of(st.just(""), variant_names),
    current=st.booleans(),
)
family_infos = st.builds(
    fpb.FamilyInfo,
    name=family_names,
    inputs=st.lists(tensor_metadata(), max_size=2),
    outputs=st.lists(tensor_metadata(), max_size=2),
    thresholds=st.dictionaries(st.sampled_from(["device", "edge", "cloud", "sky", ""]), doubles, max_size=3),
    kind=st.sampled_from(["", "generative", "classifier"]),
    confidence_method=st.sampled_from(["", "mean_logprob", "nope"]),
    max_tokens=uint32s,
    stop=st.lists(texts, max_size=2),
    calibrated_cloud_share=st.none() | doubles,
)
hardware_infos = st.builds(
    fpb.HardwareInfo,
    machine=st.one_of(st.sampled_from(["x86_64", "aarch64", ""]), texts),
    cpu_model=texts,
    flags=st.lists(st.one_of(st.sampled_from(["asimddp", "avx512_vnni"]), texts), max_size=40),
    flags_from=texts,
    precisions=st.lists(st.sampled_from(["FP32", "INT8", "FP16", "FP4", ""]), max_size=4),
)
hellos = st.builds(
    fpb.Hello,
    agent_id=agent_ids,
    tier=tiers,
    host=names,
    hardware=texts,
    runtimes=st.lists(texts, max_size=3),
    variants=st.lists(variant_infos, min_size=1, max_size=3) | st.just([]),
    capacity=uint32s,
    token=st.one_of(st.just(""), texts),
    version=texts,
    families=st.lists(family_infos, max_size=2),
    queue_limit=uint32s,
    unavailable=st.lists(
        st.builds(fpb.FamilyUnavailable, family=family_names, variant=variant_names, reason=names), max_size=1
    ),
    hardware_info=hardware_infos,
)
latencies = st.builds(
    fpb.LatencyEstimate, variant=variant_names, mean_ms=doubles, p50_ms=doubles, p99_ms=doubles, count=uint64s
)
CODES = [code.value[0] for code in grpc.StatusCode]
SERVED_ITEMS = 2  # rows a client asks of the fuzzed peer's own variant
WRONG_ID = "not-the-work"


@st.composite
def responses(draw: st.DrawFn, items: int) -> pb.ModelInferResponse:
    """What an agent might answer: the right outputs (values of any kind), or anything."""
    response = pb.ModelInferResponse(model_name=draw(variant_names), id=draw(texts))
    if draw(st.booleans()):
        rows = draw(st.sampled_from([items, items, 0, items + 1]))
        response.outputs.add(name="probabilities", datatype="FP32", shape=[rows, 10])
        values = draw(st.lists(st.floats(width=32), min_size=rows * 10, max_size=rows * 10))
        response.raw_output_contents.append(np.array(values, np.float32).tobytes())
        return response
    raw = draw(st.booleans())
    for _ in range(draw(st.integers(0, 3))):
        tensor = response.outputs.add(
            name=draw(st.sampled_from(["probabilities", "", "x"])),
            datatype=draw(datatypes),
            shape=draw(shapes),
        )
        if raw:
            response.raw_output_contents.append(draw(st.binary(max_size=200)))
        elif (kind := draw(st.sampled_from([None, *TYPED]))) is not None:
            getattr(tensor.contents, kind).extend(draw(st.lists(TYPED[kind], max_size=50)))
    return response


@st.composite
def results(draw: st.DrawFn) -> fpb.Result:
    """An agent's Result for its Work of ``SERVED_ITEMS`` items; ``request_id`` is filled in
    from the Work, unless it is ``WRONG_ID`` (an id the router never sent: the client then
    waits out its short budget)."""
    result = fpb.Result(
        request_id=draw(st.sampled_from([""] * 5 + [WRONG_ID])),
        variant=draw(variant_names),
        confidence=draw(doubles),
        confidences=draw(st.lists(doubles, max_size=SERVED_ITEMS + 2)),
        service_ms=draw(doubles),
        queue_ms=draw(doubles),
        batch_size=draw(uint32s),
    )
    outcome = draw(st.sampled_from(["response", "response", "error", "none"]))
    if outcome == "response":
        result.response.CopyFrom(draw(responses(SERVED_ITEMS)))
    elif outcome == "error":
        result.error.code = draw(st.one_of(st.sampled_from(CODES), st.integers(-(2**31), 2**31 - 1)))
        result.error.message = draw(names)
    return result


def after_hello(request_ids: list[str]) -> st.SearchStrategy[fpb.AgentMessage]:
    """Anything an agent may send once linked, for Work it never had among the rest."""
    unknown = st.one_of(st.sampled_from(request_ids or ["r1"]), texts, long_texts)
    return st.one_of(
        st.builds(
            fpb.Heartbeat,
            in_flight=uint32s,
            queue_length=uint32s,
            latency=st.lists(latencies, max_size=3),
            received=uint64s,
        ).map(lambda beat: fpb.AgentMessage(heartbeat=beat)),
        st.builds(
            fpb.Result,
            request_id=unknown,
            variant=variant_names,
            confidence=doubles,
            confidences=st.lists(doubles, max_size=4),
            service_ms=doubles,
            batch_size=uint32s,
            error=st.builds(fpb.Error, code=st.sampled_from(CODES), message=names),
        ).map(lambda result: fpb.AgentMessage(result=result)),
        st.builds(
            fpb.Chunk,
            request_id=unknown,
            text=names,
            logprobs=st.lists(doubles, max_size=4),
            margins=st.lists(doubles, max_size=4),
        ).map(lambda chunk: fpb.AgentMessage(chunk=chunk)),
        st.builds(fpb.Draining, reason=names).map(lambda d: fpb.AgentMessage(draining=d)),
        st.builds(fpb.ReloadFailed, message=names).map(lambda r: fpb.AgentMessage(reload_failed=r)),
        hellos.map(lambda hello: fpb.AgentMessage(hello=hello)),  # a reload, maybe of another id
        st.just(fpb.AgentMessage()),  # no kind at all: ends the link
    )


class Peer:
    """A hand-driven AgentLink peer: messages go out as they are put, the stream is read here."""

    def __init__(self, address: str, first: fpb.AgentMessage) -> None:
        self._gate: Queue[bytes | None] = Queue()
        self.send(first)
        self._channel = grpc.insecure_channel(address, options=grpc_options())
        connect = self._channel.stream_stream(
            "/stratus.v1.AgentLink/Connect", request_serializer=lambda b: b, response_deserializer=lambda b: b
        )
        self._call = connect(self._outgoing(), timeout=CLIENT_DEADLINE_S)
        self.ended: grpc.RpcError | None = None
        self.over = False

    def _outgoing(self) -> Iterator[bytes]:
        while (item := self._gate.get()) is not None:
            yield item

    def send(self, message: fpb.AgentMessage) -> None:
        self._gate.put(message.SerializeToString())

    def receive(self) -> fpb.RouterMessage | None:
        """The router's next message, or None once it has ended the stream (``ended`` says how)."""
        if self.over:
            return None
        try:
            return fpb.RouterMessage.FromString(next(self._call))
        except StopIteration:
            pass
        except grpc.RpcError as error:
            self.ended = error
        self.over = True
        return None

    def finish(self) -> None:
        """Say no more, and read until the router ends the stream."""
        self._gate.put(None)
        while self.receive() is not None:
            pass

    def close(self) -> None:
        self._gate.put(None)
        self._call.cancel()
        self._channel.close()


@dataclass
class Asked:
    """A client request sent to the fuzzed peer's variant, on a thread of its own."""

    thread: threading.Thread
    outcome: list[grpc.RpcError | None] = field(default_factory=list)


def ask(address: str, model: str, rows: np.ndarray) -> Asked:
    message = pb.ModelInferRequest(model_name=model)
    codec.encode_request_inputs(message, {"input": rows})
    set_parameter(message.parameters, "stratus.budget_ms", 300.0)

    def run() -> None:
        with grpc.insecure_channel(address, options=grpc_options()) as channel:
            try:
                pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(message, timeout=CLIENT_DEADLINE_S)
                asked.outcome.append(None)
            except grpc.RpcError as error:
                asked.outcome.append(error)

    asked = Asked(threading.Thread(target=run, name="fuzz-client"))
    asked.thread.start()
    return asked


def relayed(result: fpb.Result) -> frozenset[grpc.StatusCode]:
    """The status an agent's own error may reach the client with: the one it named."""
    if result.WhichOneof("outcome") != "error":
        return frozenset()
    return frozenset(code for code in grpc.StatusCode if code.value[0] == result.error.code) - {
        grpc.StatusCode.OK,
        grpc.StatusCode.UNKNOWN,
    }


def take_work(peer: Peer) -> fpb.Work | None:
    while (message := peer.receive()) is not None:
        if message.HasField("work"):
            return message.work
    return None


@dataclass(frozen=True)
class LinkCase:
    hello: fpb.Hello
    # With ``answer``, a client asks for the peer's own variant and the peer answers the Work
    # with it; then the rest follows.
    answer: fpb.Result | None
    follow: list[fpb.AgentMessage]


# A Hello's version is checked now (0-64 of A-Z a-z 0-9 . + _ -): a random one may refuse it.
SAFE_FIELDS = ["host", "hardware", "hardware_info", "runtimes", "capacity", "queue_limit", "token", "unavailable"]
RISKY_FIELDS = ["tier", "variants", "families", "version"]


def borrow(hello: fpb.Hello, donor: fpb.Hello, fields: list[str]) -> None:
    for name in fields:
        value = getattr(donor, name)
        if isinstance(value, int | str):
            setattr(hello, name, value)
        elif isinstance(value, fpb.HardwareInfo):
            getattr(hello, name).CopyFrom(value)
        else:
            del getattr(hello, name)[:]
            getattr(hello, name).extend(value)


@st.composite
def link_cases(draw: st.DrawFn) -> LinkCase:
    """A random Hello (most are refused by their first bad field); or one the router takes,
    with some fields borrowed from a random one; or one that also answers a client's Work."""
    donor = draw(hellos)
    mode = draw(st.sampled_from(["answers", "taken", "random"]))
    if mode == "random":
        return LinkCase(donor, None, draw(st.lists(after_hello(["r1", "r2", "g1"]), max_size=6)))
    hello = fpb.Hello(agent_id=draw(valid_ids), tier=draw(st.sampled_from([fpb.TIER_DEVICE, fpb.TIER_EDGE])))
    family = "digits" if mode == "answers" else draw(st.sampled_from(["digits", "defects", "fz-family"]))
    hello.variants.add(name=f"{hello.agent_id}-v", family=family, max_batch=draw(uint32s))
    fields = SAFE_FIELDS if mode == "answers" else SAFE_FIELDS + RISKY_FIELDS
    borrow(hello, donor, draw(st.lists(st.sampled_from(fields), unique=True, max_size=4)))
    if mode == "answers":
        hello.tier = fpb.TIER_DEVICE
    answer = draw(results()) if mode == "answers" else None
    return LinkCase(hello, answer, draw(st.lists(after_hello(["r1", "r2", "g1"]), max_size=6)))


def serving_hello(agent_id: str) -> fpb.Hello:
    hello = fpb.Hello(agent_id=agent_id, tier=fpb.TIER_DEVICE)
    hello.variants.add(name=f"{agent_id}-v", family="digits")
    return hello


def drive(site: Site, case: LinkCase) -> None:
    peer = Peer(site.address, fpb.AgentMessage(hello=case.hello))
    asked: Asked | None = None
    try:
        first = peer.receive()
        welcomed = first is not None and first.HasField("welcome")
        event(f"welcomed {welcomed}, answers Work {case.answer is not None}")
        if case.answer is not None:
            assert first is not None and first.HasField("welcome"), (first, peer.ended)
            asked = ask(site.address, case.hello.variants[0].name, site.rows[:SERVED_ITEMS])
            work = take_work(peer)
            assert work is not None, peer.ended
            result = fpb.Result()
            result.CopyFrom(case.answer)
            result.request_id = result.request_id or work.request_id
            peer.send(fpb.AgentMessage(result=result))
            asked.thread.join(timeout=CLIENT_DEADLINE_S)
        for message in case.follow:
            peer.send(message)
        peer.finish()
    finally:
        peer.close()
        if asked is not None:
            asked.thread.join(timeout=CLIENT_DEADLINE_S)
    ended = peer.ended
    event(f"link ended {ended.code().name}: {(ended.details() or '')[:40]}" if ended else "link closed OK")
    if ended is not None:  # the router ended this link: with a clear status
        check_clear(ended.code(), ended.details(), also=frozenset({grpc.StatusCode.UNAUTHENTICATED}))
    if asked is not None:
        assert asked.outcome, "the client's request never ended"
        (error,) = asked.outcome
        event(f"served: {error.code().name}: {(error.details() or '')[:40]}" if error else "served: answered")
        if error is not None:
            assert case.answer is not None
            check_clear(error.code(), error.details(), also=relayed(case.answer))


def link_summary(case: LinkCase) -> str:
    hello = case.hello
    kinds = [m.WhichOneof("kind") for m in case.follow]
    answered = case.answer.WhichOneof("outcome") if case.answer is not None else "-"
    return f"AgentLink id {hello.agent_id[:30]!r} tier {hello.tier} answer {answered} then {kinds}"


def test_agent_link_peers_end_alone_and_clearly_and_leave_the_router_whole(site: Site) -> None:
    @settings(FUZZ, max_examples=LINK_EXAMPLES)
    @given(case=link_cases())
    # Found by this test: an agent's error Result with a code that is no error (OK, 0) or no gRPC
    # code at all reaches the client as INTERNAL "agent fz-0: ...", not as a clear status.
    @example(case=LinkCase(serving_hello("fz-0"), fpb.Result(error=fpb.Error(code=0)), []))
    @example(case=LinkCase(serving_hello("fz-0"), fpb.Result(error=fpb.Error(code=2**31 - 1, message="m")), []))
    def each(case: LinkCase) -> None:
        drive(site, case)
        site.still_serves()
        site.example(link_summary(case))

    fuzzed(site, each)


def many_zeros() -> pb.ModelInferRequest:
    """The RSS property's minimal example: 2 MB on the wire (2 M packed INT64 zeros, one byte
    each), for a model nobody serves, so it is refused before anything reads its contents."""
    message = pb.ModelInferRequest(model_name="nope")
    tensor = message.inputs.add(name="input", datatype="INT64", shape=[2_000_000])
    tensor.contents.int64_contents.extend([0] * 2_000_000)
    return message


def test_refused_requests_are_not_kept_in_memory(site: Site) -> None:
    """Found by the fuzzer (its RSS check): each such refusal left about 32 MB resident, until
    a garbage collection now and then; a dozen in a row, +300 to +600 MB, still held when idle."""
    message, before = many_zeros(), rss_mb(site.router.process.pid)
    for _ in range(12):
        infer_clearly(site.address, message)
    growth = rss_mb(site.router.process.pid) - before
    assert growth < MAX_RSS_GROWTH_MB, f"router RSS grew {growth:.1f} MB over 12 refused 2 MB requests"
    site.no_traceback_yet()
