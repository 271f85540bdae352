"""How much of Stratus's own Python one request runs through in a router: the walk, counted.

A router serving the edge tier in its own process (``--local-tier edge``, ``digits-large`` on
ONNX Runtime in FP32, as ``benchmarks/peers.py`` runs it) is started on this process's event
loop, and a gRPC client on the same loop sends it held-out digits one at a time. Around each
request, ``sys.setprofile`` records every call into Stratus's code (``router/``, ``stratus/``
less the generated ``stratus/wire/``, ``edge_agent/``, ``cloud_gateway/``) on the loop's
thread: the servicer, the data plane, the cascade, the batcher and the in-process agent.
gRPC's own Python, asyncio and the runtime are left out; so are the executor threads (the
small digits model runs on the loop).

Per request it counts:

* **entries**: calls into Stratus's functions, each resumption of a coroutine counting again
  (what the interpreter does for the request, in Stratus's code);
* **functions** and **files**: the distinct ones entered;
* **returns**: each time the walk comes back into a file it had left (the file on top of the
  stack changes to one seen before in the same request).

The table gives the median, least and most over ``--requests`` requests (a heartbeat or a
timer that fires inside a request's window adds its own calls to that one), then the
functions of the median request in the order first entered, and the files entered most.
This is a dynamic count of everything that runs, so it is larger than a walk read by hand
that follows one argument; it is the number the cost per request (issue 37) comes down to.

It then counts the review's walk (reviews/structure2.md §2) as it runs: the request
``RouterDataPlane.infer`` is handed, followed through every call that is handed it or the
wire message inside it (:class:`Followed`), until ``infer`` answers. The review read its walk
from the source, every branch at once (the generative path's too), so its figures are larger
than one classifier request's; this tool gave 23 stays, 4 rooms and 11 returns at ``758dc97``,
the commit the review measured 75, 17 and 58 at. With ``--agent`` it counts the agent's walk
too, in a real edge agent process: the Work ``serve_work`` is handed (``walk_hook/``); 10 stays,
4 rooms and 3 returns at ``758dc97``. With each request read into values at the door (``1b73aeb``):
13 stays, 4 rooms, 4 returns in the router, 8, 4 and 2 in the agent; with an agent's Result read
into a value at the link's door too (``604c5ea``): 11, 4 and 3 in the router, 6, 4 and 1 in the agent.

    python benchmarks/walk.py [--requests 200] [--list] [--agent]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, TypeVar

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import grpc  # noqa: E402
from loadgen import QUIET  # noqa: E402
from peers import MODELS, SAME_MODEL, local_flags  # noqa: E402
from walk_follow import Followed  # noqa: E402

import router.app  # noqa: E402
from router.settings import RouterSettings  # noqa: E402
from stratus.cli.main import build_parser  # noqa: E402
from stratus.cli.options import cpu_hardware, settings_of  # noqa: E402
from stratus.convert import codec  # noqa: E402
from stratus.devtools.launcher import launch  # noqa: E402
from stratus.serving.channels import grpc_options  # noqa: E402
from stratus.tools.datasets import digits_splits  # noqa: E402
from stratus.wire import inference_pb2 as pb  # noqa: E402
from stratus.wire import inference_pb2_grpc as pb_grpc  # noqa: E402

OURS = tuple(str(ROOT / folder) + "/" for folder in ("router", "stratus", "edge_agent", "cloud_gateway"))
GENERATED = str(ROOT / "stratus" / "wire") + "/"


@dataclass
class Walk:
    """One request's calls into Stratus's code, as the profiler saw them."""

    entries: list[tuple[str, str]] = field(default_factory=list)  # (file, qualified name), in order
    returns: int = 0
    _stack: list[str] = field(default_factory=list)  # the file of each Stratus frame entered
    _seen: set[str] = field(default_factory=set)
    _current: str = ""

    def profile(self, frame: FrameType, event: str, arg: Any) -> None:
        if event not in ("call", "return"):
            return
        filename = frame.f_code.co_filename
        if not filename.startswith(OURS) or filename.startswith(GENERATED):
            return
        if event == "call":
            self.entries.append((filename, frame.f_code.co_qualname))
            self._stack.append(filename)
        elif self._stack:
            self._stack.pop()
        self._arrive(self._stack[-1] if self._stack else "")

    def _arrive(self, filename: str) -> None:
        if filename and filename != self._current:
            if filename in self._seen:
                self.returns += 1
            self._seen.add(filename)
        self._current = filename

    def functions(self) -> list[tuple[str, str]]:
        return list(dict.fromkeys(self.entries))

    def files(self) -> set[str]:
        return {filename for filename, _ in self.entries}


def router_settings(extra: list[str], *, local: bool = True) -> RouterSettings:
    tier = ["--local-tier", "edge", *local_flags()] if local else []
    argv = ["router", "--listen", "127.0.0.1:0", "--no-advertise", "--models", str(MODELS),
            *tier, "--log-level", "WARNING", *extra]  # fmt: skip
    args = build_parser().parse_args(argv)
    return settings_of(args, RouterSettings, "router", hardware=cpu_hardware())


async def started_router(settings: RouterSettings, stop: asyncio.Event) -> tuple[asyncio.Task[None], str]:
    """The router's serve() as a task on this loop, and the address it announced."""
    announced: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    router.app.announce = lambda role, address: announced.set_result(address)  # type: ignore[attr-defined]
    task = asyncio.create_task(router.app.serve(settings, stop))
    address = await asyncio.wait_for(announced, 120)
    return task, address


Profiler = TypeVar("Profiler", Walk, Followed)


def plane_walk() -> Followed:
    """The review's router walk: the request ``RouterDataPlane.infer`` is handed."""
    return Followed("RouterDataPlane.infer", "request", OURS, GENERATED)


async def profiled(stub: Any, message: pb.ModelInferRequest, profiler: Profiler) -> Profiler:
    """One request sent with ``profiler`` watching this thread's calls until its answer."""
    sys.setprofile(profiler.profile)
    try:
        await stub.ModelInfer(message)
    finally:
        sys.setprofile(None)
    return profiler


async def walks(address: str, requests: int) -> tuple[list[Walk], list[Followed]]:
    x = digits_splits().held_out.x
    messages = []
    for index in range(requests + 50):
        message = pb.ModelInferRequest(model_name="digits", id=str(index))
        codec.encode_request_inputs(message, {"input": x[index % len(x) : index % len(x) + 1]})
        messages.append(message)
    async with grpc.aio.insecure_channel(address, options=grpc_options()) as channel:
        stub: Any = pb_grpc.GRPCInferenceServiceStub(channel)
        for _ in range(600):  # the in-process agent registers a moment after the router listens
            if (await stub.ModelReady(pb.ModelReadyRequest(name="digits"))).ready:
                break
            await asyncio.sleep(0.1)
        for message in messages[:50]:  # warm: first calls compile and fill caches
            await stub.ModelInfer(message)
        counted = [await profiled(stub, message, Walk()) for message in messages[50:]]
        followed = [await profiled(stub, message, plane_walk()) for message in messages[50:60]]
    return counted, followed


def short(filename: str) -> str:
    return str(Path(filename).relative_to(ROOT))


def report_followed(followed: list[Followed], listing: bool) -> None:
    sizes = sorted(followed, key=lambda f: len(f.stays))
    median = sizes[len(sizes) // 2]
    print(f"\nthe request followed from RouterDataPlane.infer (the review's walk), the median of {len(followed)}:")
    print(f"  stays {len(median.stays)}, rooms {len(median.rooms())}, returns to a room left {median.returns}")
    if listing:
        for filename, name in median.stays:
            print(f"  {short(filename)}:{name}")


def report(counted: list[Walk], listing: bool) -> None:
    rows = {
        "entries (coroutine resumptions too)": [len(w.entries) for w in counted],
        "functions": [len(w.functions()) for w in counted],
        "files": [len(w.files()) for w in counted],
        "returns to a file already left": [w.returns for w in counted],
    }
    print(f"one held-out digit through a router with the in-process edge tier, {len(counted)} requests")
    print(f"{'per request':<38} {'median':>7} {'least':>6} {'most':>6}")
    for name, values in rows.items():
        print(f"{name:<38} {statistics.median(values):>7g} {min(values):>6} {max(values):>6}")
    ordered = sorted(counted, key=lambda w: len(w.entries))
    median = ordered[len(ordered) // 2]
    by_file = Counter(short(filename) for filename, _ in median.entries)
    print("\nentries by file (the median request):")
    for filename, count in by_file.most_common():
        print(f"  {count:>4}  {filename}")
    if listing:
        print("\nfunctions in the order first entered (the median request):")
        for filename, name in median.functions():
            print(f"  {short(filename)}:{name}")


async def agent_walks(requests: int, log_dir: Path) -> list[list[tuple[str, str]]]:
    """The review's agent walk, in a real agent process: a router on this loop (no tier of its
    own) and an edge agent started with ``walk_hook/`` on its path, which counts each Work's
    walk from ``serve_work`` and writes them down (the last one once the next Work begins)."""
    out = log_dir / "agent-walks.json"
    env = {"PYTHONPATH": f"{ROOT / 'benchmarks' / 'walk_hook'}:{ROOT}", "STRATUS_WALK_OUT": str(out),
           "STRATUS_WALK_BENCH": str(ROOT / "benchmarks"), "STRATUS_WALK_ROOT": str(ROOT)}  # fmt: skip
    stop = asyncio.Event()
    task, address = await started_router(router_settings([], local=False), stop)
    agent = launch(
        ["agent", "--tier", "edge", "--models", str(MODELS), "--router", address, "--name", "edge-walk",
         *SAME_MODEL, *QUIET], role="edge-walk", log_dir=log_dir, env=env,
    )  # fmt: skip
    try:
        x = digits_splits().held_out.x
        async with grpc.aio.insecure_channel(address, options=grpc_options()) as channel:
            stub: Any = pb_grpc.GRPCInferenceServiceStub(channel)
            for index in range(requests + 1):
                message = pb.ModelInferRequest(model_name="digits", id=str(index))
                codec.encode_request_inputs(message, {"input": x[index : index + 1]})
                await (_first_answer(stub, message) if index == 0 else stub.ModelInfer(message, timeout=30))
    finally:
        agent.stop()
        stop.set()
        await asyncio.wait_for(task, 60)
    return [[(f, name) for f, name in walk] for walk in json.loads(out.read_text())[:requests]]


async def _first_answer(stub: Any, message: pb.ModelInferRequest, wait_s: float = 60.0) -> None:
    """The first request, sent again until the agent has linked (it says READY once it is
    serving, which may be before its Hello reached this router): NOT_FOUND until then."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            await stub.ModelInfer(message, timeout=30)
            return
        except grpc.aio.AioRpcError as error:
            if error.code() != grpc.StatusCode.NOT_FOUND or time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)


def report_agent(walks_seen: list[list[tuple[str, str]]], listing: bool) -> None:
    median = sorted(walks_seen, key=len)[len(walks_seen) // 2]
    returns, seen = 0, set()
    for index, (filename, _) in enumerate(median):
        returns += index > 0 and median[index - 1][0] != filename and filename in seen
        seen.add(filename)
    rooms = len({filename for filename, _ in median})
    print(f"\nthe Work followed from serve_work (the review's agent walk), the median of {len(walks_seen)}:")
    print(f"  stays {len(median)}, rooms {rooms}, returns to a room left {returns}")
    if listing:
        for filename, name in median:
            print(f"  {filename}:{name}")


async def main_async(args: argparse.Namespace) -> None:
    stop = asyncio.Event()
    task, address = await started_router(router_settings([]), stop)
    try:
        counted, followed = await walks(address, args.requests)
    finally:
        stop.set()
        await asyncio.wait_for(task, 60)
    report(counted, args.list)
    report_followed(followed, args.list)
    if args.agent:
        with tempfile.TemporaryDirectory(prefix="stratus-walk-") as tmp:
            report_agent(await agent_walks(10, Path(tmp)), args.list)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--list", action="store_true", help="list the median request's functions in order")
    parser.add_argument("--agent", action="store_true", help="also the agent's walk, in a real agent process")
    asyncio.run(main_async(parser.parse_args()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
