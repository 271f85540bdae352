"""Mutation testing of the modules where a silent bug costs most (`make mutation`).

Each target is a set of modules and the unit tests that cover them. mutmut (3.x) changes one
thing at a time in those modules (an operator, a constant, a condition, a returned value) and
runs the tests that reach the changed function; a mutant the tests do not fail on *survived*.
A survivor is either a missing test or an equivalent mutant (one that changes no behaviour
anyone could observe); equivalent ones are listed in ``tests/mutation/<target>.toml``, each
with the mutated line as mutmut shows it and why it changes nothing, and leave the score's
denominator. An entry whose mutant no longer survives, or no longer makes that change (a
function edited since renumbers its mutants), is reported stale and fails the run:

    [[equivalent]]
    mutant = "stratus.families.confidence.x_softmax__mutmut_2"
    mutated = "shifted = logits + logits.max(axis=-1, keepdims=True)"
    why = "softmax is invariant to a constant added along its axis"

Each target runs in a scratch folder of its own under ``build/mutation/`` (mutmut reads its
settings from the working folder's ``pyproject.toml`` and writes its copies to ``mutants/``),
from scratch every time: a figure from a cached run could describe old tests.

    python scripts/mutation.py                      # every target, then the table
    python scripts/mutation.py --target confidence  # one
    python scripts/mutation.py --survivors          # and each survivor's diff

The table is printed and written to ``build/mutation/table.md``; ``--json`` prints the rows.
Exit status 1 when a target is below the goal (90% of its non-equivalent mutants killed) or
an equivalent entry went stale.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("stratus", "router", "edge_agent", "cloud_gateway")
ALSO_COPY = ("models", "proto")  # read by tests through paths relative to the checkout
EQUIVALENT_DIR = ROOT / "tests" / "mutation"
GOAL = 0.90
SPINNER = re.compile(r"^\s*[⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏]")  # mutmut's progress lines, left out of a failure's log tail
# Lines left alone, as regular expressions (mutmut widens each to its whole statement): log
# calls. What an operator reads in the log is checked where it matters by integration tests
# against real processes; mutating its wording here would only measure string assertions.
NOT_MUTATED = (r"\blog\.(debug|info|warning|error|exception|critical)\(",)


@dataclass(frozen=True)
class Target:
    """Modules mutated together, and the unit tests run against them."""

    name: str
    modules: tuple[str, ...]
    tests: tuple[str, ...]


TARGETS: tuple[Target, ...] = (
    Target(
        "climb",
        ("router/policy/__init__.py", "router/policy/climb.py"),
        (
            "tests/unit/test_policy.py",
            "tests/unit/test_climb.py",
            "tests/unit/cascade",
            "tests/unit/test_climb_mutants.py",
        ),
    ),
    Target(
        "cascades",
        (
            "router/cascade/classify.py",
            "router/cascade/generate.py",
            "router/cascade/common.py",
            "router/cascade/gray.py",
            "router/cascade/unsure.py",
            "router/cascade/text_requests.py",
        ),
        ("tests/unit/cascade",),
    ),
    Target(
        "confidence",
        ("stratus/families/confidence.py",),
        (
            "tests/unit/test_confidence.py",
            "tests/unit/test_policy.py",
            "tests/unit/test_calibrate.py",
            "tests/unit/cascade/test_classify.py",
            "tests/unit/test_confidence_mutants.py",
        ),
    ),
    Target(
        "auth",
        ("stratus/serving/auth.py", "stratus/serving/exposure.py"),
        (
            "tests/unit/test_auth.py",
            "tests/unit/test_site_revocations.py",
            "tests/unit/test_threshold_pushes.py",
            "tests/unit/test_auth_mutants.py",
        ),
    ),
    Target(
        "request-bounds",
        ("stratus/convert/wire_scan.py", "stratus/convert/tensors.py", "stratus/convert/inference.py"),
        (
            "tests/unit/test_wire_scan.py",
            "tests/unit/test_tensors.py",
            "tests/unit/test_inference_requests.py",
            "tests/unit/test_codec.py",
            "tests/unit/convert",
        ),
    ),
    Target(
        "rollout-judge",
        ("router/rollout/judge.py",),
        (
            "tests/unit/test_rollout.py",
            "tests/unit/test_rollout_records.py",
            "tests/unit/test_rollout_judge.py",
        ),
    ),
)

KILLED = ("killed",)
DETECTED = ("killed", "timeout", "segfault", "caught by type check")


@dataclass
class Row:
    """One module's outcome in its target's run, as counted from mutmut's own verdicts."""

    target: str
    module: str
    mutants: int = 0
    counts: dict[str, int] = field(default_factory=dict)
    equivalent: int = 0
    stale_equivalents: list[str] = field(default_factory=list)
    survivors: list[str] = field(default_factory=list)  # not listed as equivalent
    seconds: float = 0.0

    @property
    def detected(self) -> int:
        return sum(self.counts.get(status, 0) for status in DETECTED)

    @property
    def score(self) -> float:
        """Killed (or timed out) among the mutants that are not equivalent."""
        considered = self.mutants - self.equivalent
        return self.detected / considered if considered else 1.0

    @property
    def meets_goal(self) -> bool:
        return self.score >= GOAL and not self.stale_equivalents


@dataclass(frozen=True)
class Equivalent:
    """A surviving mutant that changes no behaviour, and why."""

    mutant: str
    mutated: str  # the line as the mutant has it, stripped
    why: str


def equivalents(folder: Path = EQUIVALENT_DIR) -> dict[str, Equivalent]:
    """Every listed equivalent mutant, by name (``tests/mutation/*.toml``)."""
    found: dict[str, Equivalent] = {}
    for path in sorted(folder.glob("*.toml")):
        for entry in tomllib.loads(path.read_text()).get("equivalent", []):
            listed = Equivalent(str(entry["mutant"]), str(entry["mutated"]).strip(), str(entry["why"]))
            if not listed.why.strip():
                raise SystemExit(f"{path}: {listed.mutant} is listed without a reason")
            found[listed.mutant] = listed
    return found


def mutated_lines(scratch: Path, name: str) -> list[str]:
    """The lines ``name`` changes, as they read mutated (``mutmut show``'s ``+`` lines)."""
    shown = subprocess.run(
        [*mutmut(), "show", name], check=False, cwd=scratch, capture_output=True, text=True
    )
    return [
        line[1:].strip()
        for line in shown.stdout.splitlines()
        if line.startswith("+") and not line.startswith("+++")
    ]


def mutmut_settings(target: Target) -> str:
    """The ``[tool.mutmut]`` table mutmut reads from its working folder."""

    def toml_list(values: tuple[str, ...] | list[str]) -> str:
        return "[" + ", ".join(json.dumps(v) for v in values) + "]"

    return "\n".join(
        [
            "[tool.mutmut]",
            f"source_paths = {toml_list(PACKAGES)}",
            f"only_mutate = {toml_list(target.modules)}",
            f"also_copy = {toml_list(ALSO_COPY)}",
            f"pytest_add_cli_args_test_selection = {toml_list(target.tests)}",
            f"do_not_mutate_patterns = {toml_list(NOT_MUTATED)}",
            # -x: one failing test kills the mutant; the rest need not run
            'pytest_add_cli_args = ["-p", "no:cacheprovider", "-q", "-x"]',
            # gRPC's core is not fork-safe: fork workers from a server that never ran a test
            'process_isolation = "forkserver"',
            "",
        ]
    )


def prepare(target: Target, scratch: Path) -> None:
    """A folder holding links to the checkout and the target's settings, with no old copies."""
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    for name in (*PACKAGES, *ALSO_COPY, "tests"):
        (scratch / name).symlink_to(ROOT / name)
    (scratch / "pyproject.toml").write_text(mutmut_settings(target))


def mutmut() -> list[str]:
    """mutmut beside this interpreter (the project's virtual environment)."""
    found = Path(sys.executable).with_name("mutmut")
    if not found.exists():
        raise SystemExit(f"mutmut is not installed beside {sys.executable}: run `make .venv/.installed`")
    return [str(found)]


def verdicts(scratch: Path) -> dict[str, str]:
    """Mutant name -> mutmut's verdict, from ``mutmut results --all true``."""
    listed = subprocess.run(
        [*mutmut(), "results", "--all", "true"], cwd=scratch, capture_output=True, text=True, check=True
    )
    found: dict[str, str] = {}
    for line in listed.stdout.splitlines():
        name, sep, status = line.strip().rpartition(": ")
        if sep and "__mutmut_" in name:
            found[name] = status
    return found


def run_target(target: Target, *, workers: int, known: dict[str, Equivalent], log: Path) -> list[Row]:
    scratch = ROOT / "build" / "mutation" / target.name
    prepare(target, scratch)
    started = time.monotonic()
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    with log.open("w") as output:
        ran = subprocess.run(
            [*mutmut(), "run", "--max-children", str(workers)],
            check=False,
            cwd=scratch,
            stdout=output,
            stderr=subprocess.STDOUT,
            env=env,
        )
    if ran.returncode != 0:
        lines = log.read_text(errors="replace").replace("\r", "\n").splitlines()
        tail = "\n".join(line for line in lines if line.strip() and not SPINNER.match(line))[-2000:]
        raise SystemExit(
            f"mutmut failed on {target.name} (exit {ran.returncode}); its log {log} ends:\n{tail}"
        )
    found = verdicts(scratch)
    seconds = round(time.monotonic() - started, 1)
    rows = []
    for module in target.modules:
        mine = {n: status for n, status in found.items() if module_of(n) == module_name(module)}
        row = Row(target=target.name, module=module, mutants=len(mine), seconds=seconds)
        row.counts = dict(Counter(mine.values()))
        counted: set[str] = set()
        for name in sorted(n for n in known if module_of(n) == module_name(module)):
            if mine.get(name) != "survived":
                row.stale_equivalents.append(f"{name}: {mine.get(name, 'no such mutant')}")
            elif known[name].mutated not in mutated_lines(scratch, name):
                row.stale_equivalents.append(f"{name}: no longer mutates to {known[name].mutated!r}")
            else:
                row.equivalent += 1
                counted.add(name)
        row.survivors = sorted(n for n, s in mine.items() if s not in DETECTED and n not in counted)
        rows.append(row)
    strays = sorted(n for n in found if module_of(n) not in {module_name(m) for m in target.modules})
    if strays:
        raise SystemExit(f"{target.name}: mutants of no module of the target: {strays[:5]}")
    return rows


def module_name(path: str) -> str:
    """``router/policy/__init__.py`` -> ``router.policy``, as mutmut names its mutants."""
    return path.removesuffix(".py").replace("/", ".").removesuffix(".__init__")


def module_of(mutant: str) -> str:
    """The module a mutant is of: ``router.policy.climb.x_finish__mutmut_3`` -> ``router.policy.climb``
    (a method's is ``module.xǁClassǁmethod__mutmut_N``)."""
    found = re.match(r"^(.*?)\.x[_ǁ]", mutant)
    return found.group(1) if found else mutant.rsplit(".", 1)[0]


def table(rows: list[Row]) -> str:
    head = "| target | module | mutants | killed | timed out | survived | no tests | equivalent | score | seconds |"
    lines = [head, "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        timed_out = r.counts.get("timeout", 0) + r.counts.get("segfault", 0)
        lines.append(
            f"| {r.target} | {r.module} | {r.mutants} | {r.counts.get('killed', 0)} | {timed_out} | "
            f"{r.counts.get('survived', 0)} | {r.counts.get('no tests', 0)} | {r.equivalent} | "
            f"{r.score:.1%}{'' if r.meets_goal else ' (below goal)'} | {r.seconds:.0f} |"
        )
    return "\n".join(lines)


def show_survivors(rows: list[Row]) -> None:
    for row in rows:
        scratch = ROOT / "build" / "mutation" / row.target
        for name in row.survivors:
            shown = subprocess.run(
                [*mutmut(), "show", name], check=False, cwd=scratch, capture_output=True, text=True
            )
            print(f"--- {name}\n{shown.stdout.strip()}\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target", action="append", choices=[t.name for t in TARGETS], help="repeatable")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--survivors", action="store_true", help="print each survivor's diff")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    chosen = [t for t in TARGETS if not args.target or t.name in args.target]
    known = equivalents()
    out = ROOT / "build" / "mutation"
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for target in chosen:
        if not args.json:
            print(f"mutating {', '.join(target.modules)} ...", flush=True)
        rows.extend(run_target(target, workers=args.workers, known=known, log=out / f"{target.name}.log"))
    text = table(rows)
    (out / "table.md").write_text(text + "\n")
    if args.json:
        print(
            json.dumps([{**asdict(r), "score": r.score, "meets_goal": r.meets_goal} for r in rows], indent=2)
        )
    else:
        print(text)
        for row in rows:
            for stale in row.stale_equivalents:
                print(f"stale entry in {EQUIVALENT_DIR.relative_to(ROOT)}/: {stale}")
    if args.survivors:
        show_survivors(rows)
    return 0 if all(r.meets_goal for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
