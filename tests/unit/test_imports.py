"""Imports between Stratus's packages, read from the source: no cycles, no import running up
a layer, as DESIGN.md lays them out ("The parts and where they live").

* ``stratus/`` is what every tier shares and imports none of the three apps, except
  ``stratus/cli/main.py``, lazily, one subcommand each.
* The three apps (``router``, ``edge_agent``, ``cloud_gateway``) never import each other.
* ``stratus/wire`` holds generated stubs only, which import nothing hand-written; the
  domain modules that DESIGN keeps free of the wire (the pure routing policy, tiers, the
  exception tree, the batcher's plan) do not import it.

An import inside a function runs when the function is called, and one under
``if TYPE_CHECKING:`` never runs: both still tie two modules together, so every kind counts
toward a cycle, while the imports that run at import time must form no cycle at all.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("stratus", "router", "edge_agent", "cloud_gateway")
APPS = ("router", "edge_agent", "cloud_gateway")
# Modules DESIGN keeps off the wire: pure decisions and domain types.
OFF_THE_WIRE = ("router.policy", "router.policy.climb", "stratus.tiers", "stratus.errors", "stratus.sched.batching", "stratus.families.generation")


@dataclass(frozen=True, kw_only=True)
class Import:
    source: str
    target: str
    line: int
    lazy: bool  # inside a function: runs when it is called
    typing: bool  # under ``if TYPE_CHECKING:``: never runs

    @property
    def at_import(self) -> bool:
        return not (self.lazy or self.typing)

    def __str__(self) -> str:
        kind = " (lazy)" if self.lazy else " (TYPE_CHECKING)" if self.typing else ""
        return f"{self.source} -> {self.target} at line {self.line}{kind}"


@cache
def modules() -> dict[str, Path]:
    """Every first-party module, by its dotted name."""
    found: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


@cache
def all_imports() -> tuple[Import, ...]:
    return tuple(edge for name, path in modules().items() for edge in _imports_of(name, path))


def _imports_of(name: str, path: Path) -> Iterator[Import]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    for node, lazy, typing in _walk(tree.body, lazy=False, typing=False):
        for target in _targets(node, package):
            yield Import(source=name, target=target, line=node.lineno, lazy=lazy, typing=typing)


def _walk(
    nodes: Iterable[ast.AST], *, lazy: bool, typing: bool
) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool, bool]]:
    """Each import statement, with whether it sits in a function or a TYPE_CHECKING block."""
    for node in nodes:
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node, lazy, typing
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from _walk(node.body, lazy=lazy, typing=True)
            yield from _walk(node.orelse, lazy=lazy, typing=typing)
        else:
            inner = lazy or isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
            yield from _walk(ast.iter_child_nodes(node), lazy=inner, typing=typing)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _targets(node: ast.Import | ast.ImportFrom, package: str) -> Iterator[str]:
    """The first-party modules a statement imports (a name imported from a module is that module)."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            yield from _known(alias.name)
        return
    base = node.module or ""
    if node.level:
        anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join([*anchor, *([base] if base else [])])
    for alias in node.names:
        submodule = f"{base}.{alias.name}"
        yield from _known(submodule if submodule in modules() else base)


def _known(name: str) -> Iterator[str]:
    """``name``, or the longest first-party module it lies in; nothing for a third-party one."""
    parts = name.split(".")
    while parts and ".".join(parts) not in modules():
        parts.pop()
    if parts:
        yield ".".join(parts)


def _graph(edges: Iterable[Import]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {name: set() for name in modules()}
    for edge in edges:
        if edge.source != edge.target:
            graph[edge.source].add(edge.target)
    return graph


def cycles(graph: Mapping[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected parts of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[frozenset[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            part = []
            while (top := stack.pop()) != node:
                part.append(top)
            if part:
                found.append(frozenset([*part, node]))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def described(part: frozenset[str], edges: Iterable[Import]) -> str:
    """Every import that ties the modules of one cycle together, one per line."""
    return "\n  ".join(
        str(e) for e in edges if e.source in part and e.target in part and e.source != e.target
    )


def _offending(edges: Iterable[Import]) -> str:
    return "\n  ".join(str(edge) for edge in edges)


def test_the_scan_sees_the_kinds_of_import_it_tells_apart() -> None:
    """The facts the tests below rest on, as the source has them today."""
    edges = all_imports()
    at_import = {(e.source, e.target) for e in edges if e.at_import}
    lazy = {(e.source, e.target) for e in edges if e.lazy}
    typing = {(e.source, e.target) for e in edges if e.typing}
    assert ("router.api.link", "router.fleet.registry") in at_import and ("stratus.cli.router", "router.app") in lazy
    assert ("router.dataplane", "router.audit.auditor") in typing - at_import
    assert {"stratus.wire.fleet_pb2", "router.cloud.link"} <= set(modules())


def test_no_cycle_among_the_imports_that_run_at_import_time() -> None:
    edges = [edge for edge in all_imports() if edge.at_import]
    found = cycles(_graph(edges))
    assert not found, "import cycles:\n  " + "\n\n  ".join(described(part, edges) for part in found)


def test_no_import_cycle_at_all() -> None:
    """Lazy and TYPE_CHECKING imports count: a module imported only inside a function, or
    only for its types, still belongs above or below the other (issue 19 opened the last
    three cycles: router dataplane/generate, verify/verify_generative, auth/channels)."""
    edges = all_imports()
    found = cycles(_graph(edges))
    assert not found, "import cycles:\n  " + "\n\n  ".join(described(part, edges) for part in found)


def test_stratus_imports_no_app_but_the_cli_lazily() -> None:
    upward = [
        edge
        for edge in all_imports()
        if edge.source.split(".")[0] == "stratus"
        and edge.target.split(".")[0] in APPS
        and not (edge.source.startswith("stratus.cli.") and edge.lazy)
    ]
    assert not upward, "stratus/ imports an app:\n  " + _offending(upward)


def test_the_apps_never_import_each_other() -> None:
    across = [
        edge
        for edge in all_imports()
        if edge.source.split(".")[0] in APPS
        and edge.target.split(".")[0] in APPS
        and edge.source.split(".")[0] != edge.target.split(".")[0]
    ]
    assert not across, "one app imports another:\n  " + _offending(across)


def test_no_app_imports_the_model_tooling() -> None:
    """``stratus/tools`` is what ``stratus models`` runs (runtimes opened on data sets, files
    written); a server never needs it, lazily or not: the threshold search a router runs on its
    audit rows is the domain's (``stratus/families/suggest.py``)."""
    found = [
        str(edge)
        for edge in all_imports()
        if edge.source.split(".")[0] in APPS and edge.target.startswith("stratus.tools")
    ]
    assert not found, "apps importing stratus.tools:\n  " + "\n  ".join(found)


def test_the_generated_wire_imports_nothing_hand_written() -> None:
    out = [
        e
        for e in all_imports()
        if e.source.startswith("stratus.wire") and not e.target.startswith("stratus.wire")
    ]
    assert not out, "stratus/wire imports beyond itself:\n  " + _offending(out)


def test_only_generated_stubs_live_in_the_wire_package() -> None:
    handwritten = [
        path.name
        for name, path in modules().items()
        if name.startswith("stratus.wire.") and not path.read_text().startswith("# Generated by")
    ]
    assert handwritten == []


def test_the_domain_modules_stay_off_the_wire() -> None:
    """Including through what they import: protobuf types are converted at the boundary."""
    graph = _graph(all_imports())
    reached = {name: _reachable(graph, name) for name in OFF_THE_WIRE}
    on_wire = {
        name: sorted(m for m in seen if m.startswith("stratus.wire")) for name, seen in reached.items()
    }
    assert {name: wire for name, wire in on_wire.items() if wire} == {}


def _reachable(graph: Mapping[str, set[str]], start: str) -> set[str]:
    seen: set[str] = set()
    todo = [start]
    while todo:
        for nxt in graph[todo.pop()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    return seen


# stratus/ by role (its map is in stratus/__init__.py): each module's layer, by the longest
# prefix that names it. A module imports from its own layer or the ones below, never above.
LAYERS = {
    "stratus": 0,  # the package itself (its version)
    "stratus.errors": 0,
    "stratus.tiers": 0,
    "stratus.config": 0,
    "stratus.config_values": 0,
    "stratus.datatypes": 0,
    "stratus.process": 0,
    "stratus.wire": 0,
    "stratus.convert": 1,
    "stratus.families": 1,
    "stratus.sched": 1,  # the queue owners serve no one: the boundary computes their batch keys
    "stratus.obs.stats": 1,  # pure estimates, which the boundary reads heartbeats into
    "stratus.obs": 2,
    "stratus.runtimes": 2,
    "stratus.execution": 2,
    "stratus.serving": 2,
    "stratus.cli": 3,
    "stratus.tools": 3,
    "stratus.devtools": 3,
    "stratus.probe": 3,
}
LAYER_NAMES = ("core", "domain, boundary and queues", "machinery", "front")


def layer_of(module: str) -> int:
    parts = module.split(".")
    for end in range(len(parts), 0, -1):
        prefix = ".".join(parts[:end])
        if prefix in LAYERS:
            return LAYERS[prefix]
    raise AssertionError(f"{module} is in no layer of stratus/: add it to LAYERS and the map")


def test_every_module_of_stratus_has_a_layer() -> None:
    for name in modules():
        if name.split(".")[0] == "stratus":
            layer_of(name)


def test_no_module_of_stratus_imports_from_a_layer_above_it() -> None:
    """Lazy and TYPE_CHECKING imports count too."""
    upward = [
        f"{edge} ({LAYER_NAMES[layer_of(edge.source)]} -> {LAYER_NAMES[layer_of(edge.target)]})"
        for edge in all_imports()
        if edge.source.split(".")[0] == "stratus"
        and edge.target.split(".")[0] == "stratus"
        and layer_of(edge.target) > layer_of(edge.source)
    ]
    assert not upward, "imports up a layer of stratus/:\n  " + "\n  ".join(upward)


# router/ by role (docs/architecture.md, "The parts and where they live"): each folder's floor. A
# room imports from its own floor or the ones below, never above; the composition root on top.
ROUTER_LAYERS = {
    "router": 0,  # the package itself
    "router.policy": 0,  # the pure climb
    "router.observer": 0,  # what the data plane and cascades tell the metrics, as events
    "router.rollout": 0,
    "router.cloud": 0,
    "router.backends": 1,
    "router.fleet": 2,
    "router.offline": 3,
    "router.catalog": 3,  # names resolved: what agents and the cloud serve, merged
    "router.metadata": 4,  # what a client is told of a model, from the catalog's description
    "router.cascade": 4,
    "router.audit": 5,
    "router.thresholds": 6,
    "router.site": 7,
    "router.dataplane": 8,
    "router.api": 9,
    "router.settings": 9,
    "router.app": 10,
    "router.parts": 10,  # each part of a router built from its settings, for app.serve to wire
    "router.workers": 10,  # --workers: the parent of several router processes, beside the one it copies
}


def router_layer_of(module: str) -> int:
    parts = module.split(".")
    for end in range(len(parts), 0, -1):
        prefix = ".".join(parts[:end])
        if prefix in ROUTER_LAYERS:
            return ROUTER_LAYERS[prefix]
    raise AssertionError(f"{module} is in no floor of router/: add its folder to ROUTER_LAYERS")


def test_every_module_of_the_router_has_a_floor() -> None:
    rooms = [name for name in modules() if name.split(".")[0] == "router"]
    assert len(rooms) > 40
    for name in rooms:
        router_layer_of(name)


def test_no_module_of_the_router_imports_from_a_floor_above_it() -> None:
    """Lazy and TYPE_CHECKING imports count too."""
    upward = [
        str(edge)
        for edge in all_imports()
        if edge.source.split(".")[0] == "router"
        and edge.target.split(".")[0] == "router"
        and router_layer_of(edge.target) > router_layer_of(edge.source)
    ]
    assert not upward, "imports up a floor of router/:\n  " + "\n  ".join(upward)

