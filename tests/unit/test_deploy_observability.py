"""The Prometheus rules and the Grafana dashboard in deploy/: they load, parse, and use only real metrics.

``promtool check rules`` and ``promtool test rules`` (Debian's ``prometheus`` package) run when
promtool is installed and are skipped, saying so, when it is not. Every PromQL expression, in the
rules and in the dashboard's panels, is parsed with ``promql-parser`` and may only select metrics
that Stratus exports (README, "### Metrics"), the recording rules in rules.yml, or the one external
metric the CPU rule documents (node_exporter's ``node_cpu_seconds_total``).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import promql_parser
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "rules.yml"
RULES_TEST = ROOT / "deploy" / "prometheus" / "rules_test.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "stratus.json"

COUNTERS = {
    "stratus_router_requests",
    "stratus_router_deferred",
    "stratus_router_deferred_dropped_items",
    "stratus_router_judged_items",
    "stratus_router_escalations",
    "stratus_router_degraded_answers",
    "stratus_router_refusals",
    "stratus_work",
    "stratus_model_load_failures",
    "stratus_router_rollout_requests",
    "stratus_router_rollout_rollbacks",
    "stratus_router_generated_tokens",
    "stratus_generation_tokens",
    "stratus_router_audits",
    "stratus_router_captured",
    "stratus_router_capture_dropped",
}
HISTOGRAMS = {
    "stratus_router_request_duration_seconds",
    "stratus_router_tier_duration_seconds",
    "stratus_router_confidence",
    "stratus_router_batch_items",
    "stratus_inference_duration_seconds",
    "stratus_inference_batch_items",
    "stratus_router_first_text_seconds",
    "stratus_generation_first_token_seconds",
    "stratus_generation_duration_seconds",
    "stratus_generation_queue_seconds",
}
GAUGES = {
    "stratus_router_agents",
    "stratus_router_agent_in_flight_items",
    "stratus_router_agent_queued_items",
    "stratus_router_agent_trusted_capacity",
    "stratus_router_cloud_breaker",
    "stratus_queue_items",
    "stratus_in_flight_items",
    "stratus_process_resident_memory_bytes",
    "stratus_router_rollout_share_percent",
    "stratus_upstream_requests",
    "stratus_build_info",
    "stratus_router_family_calibrated_cloud_share",
    "stratus_generation_waiting",
    "stratus_generation_running",
    "stratus_router_audit_agreement",
    "stratus_router_audit_agreement_lower",
    "stratus_router_audit_agreement_upper",
    "stratus_router_audit_window_audits",
    "stratus_router_audit_calibrated_agreement",
    "stratus_router_threshold_version",
    "stratus_router_threshold",
    "stratus_router_deferred_items",
    "stratus_router_deferred_oldest_age_seconds",
    "stratus_router_deferred_max_age_seconds",
}
# The series names Prometheus stores: counters end in _total; a classic histogram has no series
# under its own name, only _bucket, _sum and _count.
EXPORTED = (
    {f"{name}_total" for name in COUNTERS}
    | {f"{name}{suffix}" for name in HISTOGRAMS for suffix in ("_bucket", "_sum", "_count")}
    | GAUGES
)
# Documented in rules.yml (StratusCPUSaturated): Stratus exports no CPU metric of its own.
EXTERNAL = {"node_cpu_seconds_total"}

# Values for Grafana's variables, so that a panel's query is plain PromQL.
GRAFANA_VARIABLES = {
    "family": "digits",
    "__rate_interval": "1m",
    "__interval": "15s",
    "__interval_ms": "15000",
    "__range": "1h",
    "__range_s": "3600",
    "__range_ms": "3600000",
}
VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\[\[(\w+)\]\]|\$(\w+)")

promtool = pytest.mark.skipif(
    shutil.which("promtool") is None, reason="promtool not installed (apt-get install prometheus)"
)


def substitute(query: str) -> str:
    """The query with Grafana's variables replaced by valid values; an unknown variable is an error."""

    def value(match: re.Match[str]) -> str:
        name = next(group for group in match.groups() if group is not None)
        if name not in GRAFANA_VARIABLES:
            raise ValueError(f"unknown Grafana variable ${name} in {query!r}")
        return GRAFANA_VARIABLES[name]

    return VARIABLE.sub(value, query)


def metric_names(query: str) -> set[str]:
    """Every metric a PromQL query selects (parse errors raise ValueError)."""
    names: set[str] = set()

    def visit(node: promql_parser.Expr) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            if node.name is not None:
                names.add(node.name)
                return
            exact = [
                m.value
                for m in node.matchers.matchers
                if m.name == "__name__" and m.op == promql_parser.MatchOp.Equal
            ]
            if not exact:
                raise ValueError(f"selector without an exact metric name in {query!r}")
            names.update(exact)

    promql_parser.walk(promql_parser.parse(query), visit)
    return names


def unknown_metrics(query: str, known: set[str]) -> set[str]:
    """The metrics a query selects that are not in ``known``."""
    return metric_names(query) - known


def load_rules() -> list[dict[str, Any]]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


def recorded() -> set[str]:
    return {rule["record"] for rule in load_rules() if "record" in rule}


def known_metrics() -> set[str]:
    return EXPORTED | EXTERNAL | recorded()


def load_dashboard() -> dict[str, Any]:
    dashboard: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return dashboard


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel that shows data (rows and the panels collapsed inside them included)."""
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            yield from panels({"panels": panel.get("panels", [])})
        else:
            yield panel


def queries(dashboard: dict[str, Any]) -> Iterator[tuple[str, str]]:
    for panel in panels(dashboard):
        for target in panel["targets"]:
            yield panel["title"], target["expr"]


# --- promtool ---------------------------------------------------------------------------------


@promtool
def test_promtool_checks_the_rules() -> None:
    done = subprocess.run(
        ["promtool", "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr


@promtool
def test_promtool_unit_tests_fire_and_stay_quiet() -> None:
    done = subprocess.run(
        ["promtool", "test", "rules", str(RULES_TEST)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr


# --- rules.yml --------------------------------------------------------------------------------


def test_every_alert_has_for_severity_and_what_to_look_at() -> None:
    alerts = [rule for rule in load_rules() if "alert" in rule]
    assert len(alerts) >= 9
    for rule in alerts:
        assert "for" in rule, rule["alert"]
        assert rule["labels"]["severity"] in {"critical", "warning"}, rule["alert"]
        assert rule["annotations"]["summary"].strip(), rule["alert"]
        assert len(rule["annotations"]["description"]) > 80, rule["alert"]


def test_rule_expressions_use_only_known_metrics() -> None:
    known = known_metrics()
    for rule in load_rules():
        name = rule.get("alert") or rule["record"]
        assert not unknown_metrics(rule["expr"], known), name


def test_every_alert_is_tested_firing_and_quiet() -> None:
    cases: dict[str, set[bool]] = {}
    for test in yaml.safe_load(RULES_TEST.read_text())["tests"]:
        for case in test.get("alert_rule_test", []):
            cases.setdefault(case["alertname"], set()).add(bool(case.get("exp_alerts")))
    alerts = {rule["alert"] for rule in load_rules() if "alert" in rule}
    assert alerts == set(cases)
    for alert in alerts:
        assert cases[alert] == {True, False}, f"{alert} needs a case that fires and one that does not"


def test_the_calibrated_cloud_share_comes_from_what_routers_export() -> None:
    """No share is written into the rules: one rule takes every family's from the routers'
    gauge (which agents' family.toml files feed), so a family without one has no baseline."""
    (rule,) = [rule for rule in load_rules() if rule.get("record") == "stratus:calibrated_cloud_share"]
    assert metric_names(rule["expr"]) == {"stratus_router_family_calibrated_cloud_share"}
    assert "labels" not in rule


def test_committed_families_record_what_their_thresholds_send_to_the_cloud(  # type: ignore[no-untyped-def]
    repository, tmp_path: Path
) -> None:
    """Each shipped family's [calibration] is what its committed thresholds give on its
    calibration split, measured again here (arith's takes 40 s of generation: only its
    presence is checked)."""
    from stratus.tools.calibrate import classifier, labelled_data

    for name in ("digits", "defects"):
        family = repository.family(name)
        assert family.calibration is not None, name
        tiers = family.tiers()
        data = labelled_data.bundled_data(family)
        outcome = classifier.cascade(
            classifier.tier_scores(family, data.calibration, tmp_path),
            [family.thresholds[t] for t in tiers[:-1]],
        )
        assert family.calibration.cloud_share == pytest.approx(outcome.reached[-1], abs=0.00005), name
        assert family.calibration.accuracy == pytest.approx(outcome.accuracy, abs=0.00005), name
        assert family.calibration.data == data.calibration_name
    arith = repository.family("arith").calibration
    assert arith is not None and arith.goal == "target_accuracy 0.985"


def scrape_intervals() -> dict[str, timedelta]:
    """The scrape interval of compose's Prometheus and of the Kubernetes ServiceMonitor."""
    config = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    intervals = {"prometheus.yml": config["global"]["scrape_interval"]}
    monitor = yaml.safe_load((ROOT / "deploy" / "k8s" / "servicemonitor.yaml").read_text())
    intervals |= {f"servicemonitor {e['port']}": e["interval"] for e in monitor["spec"]["endpoints"]}
    return {where: duration(text) for where, text in intervals.items()}


def duration(text: str) -> timedelta:
    """A Prometheus duration of one unit ("30s", "2m")."""
    units = {"s": "seconds", "m": "minutes", "h": "hours"}
    return timedelta(**{units[text[-1]]: float(text[:-1])})


def rate_windows(query: str) -> list[timedelta]:
    """The range of every rate(), irate(), increase() and deriv() in a query: functions
    that need two samples in their window (max_over_time needs one)."""
    windows: list[timedelta] = []

    def visit(node: promql_parser.Expr) -> None:
        if isinstance(node, promql_parser.Call) and node.func.name in {"rate", "irate", "increase", "deriv"}:
            windows.extend(a.range for a in node.args if isinstance(a, promql_parser.MatrixSelector))

    promql_parser.walk(promql_parser.parse(query), visit)
    return windows


def test_every_rate_window_spans_four_scrapes() -> None:
    """A window of four scrape intervals always holds the two samples rate() needs, even with
    a late or a missed scrape: at the shipped 30 s, the p99 alert's 2-minute window."""
    windows = [
        (rule.get("alert") or rule["record"], w) for rule in load_rules() for w in rate_windows(rule["expr"])
    ]
    assert len(windows) >= 8
    for where, interval in scrape_intervals().items():
        assert interval == timedelta(seconds=30), where
        short = [(name, str(w)) for name, w in windows if w < 4 * interval]
        assert not short, (
            f"{where} scrapes every {interval}; these rates see fewer than four scrapes: {short}"
        )
    assert rate_windows("rate(x[10s]) + max_over_time(y[1m])") == [timedelta(seconds=10)]


# --- the dashboard ----------------------------------------------------------------------------


def test_dashboard_structure() -> None:
    dashboard = load_dashboard()
    assert dashboard["uid"] and dashboard["title"]
    assert isinstance(dashboard["schemaVersion"], int)  # the classic JSON model, not schema v2
    assert [i["name"] for i in dashboard["__inputs"]] == ["DS_PROMETHEUS"]
    assert dashboard["__inputs"][0]["pluginId"] == "prometheus"
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"
    assert variables["DS_PROMETHEUS"]["query"] == "prometheus"
    family = variables["family"]
    assert family["type"] == "query"
    assert family["datasource"]["uid"] == "${DS_PROMETHEUS}"
    definition = family["query"]["query"] if isinstance(family["query"], dict) else family["query"]
    assert definition == "label_values(stratus_router_requests_total, family)"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    shown = list(panels(dashboard))
    assert shown
    for panel in shown:
        assert panel["title"], panel
        assert panel["targets"], panel["title"]
        assert panel["datasource"]["uid"] == "${DS_PROMETHEUS}", panel["title"]
        for target in panel["targets"]:
            assert target["expr"].strip(), panel["title"]
            assert target["datasource"]["uid"] == "${DS_PROMETHEUS}", panel["title"]


def test_dashboard_has_the_panels_operators_need() -> None:
    titles = " | ".join(p["title"].lower() for p in panels(load_dashboard()))
    for wanted in (
        "requests by tier",
        "cloud share",
        "calibrated",
        "escalations by reason",
        "p50 / p99 per tier",
        "degraded",
        "refusals",
        "agents by state",
        "queues",
        "batch sizes",
        "generated tokens",
        "time to first text",
        "time to first token",
        "tokens per second",
        "generations waiting",
        "work by family and variant",
        "version",
        "live agreement with the top tier against the calibrated line",
        "audits by outcome",
    ):
        assert wanted in titles, wanted


def test_dashboard_queries_parse_and_use_only_known_metrics() -> None:
    known = known_metrics()
    problems = []
    for title, query in queries(load_dashboard()):
        try:
            unknown = unknown_metrics(substitute(query), known)
        except ValueError as error:
            problems.append(f"{title}: {query!r} does not parse: {error}")
            continue
        if unknown:
            problems.append(f"{title}: {query!r} uses {sorted(unknown)}")
    assert not problems, "\n".join(problems)
    variable = next(v for v in load_dashboard()["templating"]["list"] if v["name"] == "family")
    assert not unknown_metrics(variable["definition"].split("(", 1)[1].split(",")[0], known)


def test_family_labelled_panels_follow_the_family_variable() -> None:
    per_family = {
        "stratus_router_requests_total",
        "stratus_router_escalations_total",
        "stratus_router_degraded_answers_total",
        "stratus_router_request_duration_seconds_bucket",
        "stratus_router_tier_duration_seconds_bucket",
        "stratus_router_confidence_bucket",
        "stratus:cloud_share:rate10m",
        "stratus:calibrated_cloud_share",
        "stratus_router_generated_tokens_total",
        "stratus_router_first_text_seconds_bucket",
        "stratus_generation_first_token_seconds_bucket",
        "stratus_generation_tokens_total",
        "stratus_generation_waiting",
        "stratus_generation_queue_seconds_bucket",
        "stratus_router_audit_agreement",
        "stratus_router_audit_calibrated_agreement",
        "stratus_router_audits_total",
    }
    used = 0
    for title, query in queries(load_dashboard()):
        if metric_names(substitute(query)) & per_family:
            used += 1
            assert '"$family"' in query, f"{title}: {query!r} ignores $family"
    assert used >= 6


# --- the checks can fail ----------------------------------------------------------------------


def test_the_checks_reject_what_is_wrong() -> None:
    known = known_metrics()
    good = 'sum by (tier) (rate(stratus_router_requests_total{family=~"$family"}[$__rate_interval]))'
    assert unknown_metrics(substitute(good), known) == set()
    # A made-up metric, one misspelt, and a histogram named without its series suffix.
    assert unknown_metrics("rate(stratus_router_made_up_total[5m])", known) == {
        "stratus_router_made_up_total"
    }
    assert unknown_metrics("stratus_router_request_total", known) == {"stratus_router_request_total"}
    assert unknown_metrics("stratus_router_confidence", known) == {"stratus_router_confidence"}
    assert unknown_metrics('{__name__="made_up"} + stratus_queue_items', known) == {"made_up"}
    assert unknown_metrics("process_cpu_seconds_total", known) == {"process_cpu_seconds_total"}
    with pytest.raises(ValueError, match="selector without an exact metric name"):
        metric_names('{__name__=~"stratus_.*"}')  # no exact name: cannot be checked
    with pytest.raises(ValueError, match="unclosed left parenthesis"):  # the PromQL parser's words
        metric_names("sum(rate(stratus_queue_items[5m])")  # unbalanced
    with pytest.raises(ValueError, match=r"unexpected character inside brackets: '\$'"):
        metric_names(good)  # Grafana variables left in: not PromQL
    with pytest.raises(ValueError, match=r"unknown Grafana variable \$__made_up"):
        substitute("rate(stratus_work_total[$__made_up])")


def collector_gauges() -> set[str]:
    """The gauges that custom collectors build at each scrape (``gauge("name", ...)``), read
    from the source: they exist only on a live router, agent or gateway."""
    pattern = re.compile(r'\bgauge\(\s*"(stratus_\w+)"')
    return {
        name
        for folder in ("stratus", "router", "cloud_gateway", "edge_agent")
        for path in (ROOT / folder).rglob("*.py")
        for name in pattern.findall(path.read_text())
    }


def test_the_whitelist_is_what_the_code_registers() -> None:
    from stratus.obs.metrics import Metrics, ModelMetrics, RouterMetrics

    metrics = Metrics()
    RouterMetrics(metrics)
    ModelMetrics(metrics)
    registered = set()
    for family in metrics.registry.collect():
        if family.type == "counter":
            registered.add(f"{family.name}_total")
        elif family.type == "histogram":
            registered |= {f"{family.name}{suffix}" for suffix in ("_bucket", "_sum", "_count")}
        else:
            registered.add(family.name)
    registered |= collector_gauges()
    assert "stratus_router_agents" in registered  # the source scan finds the collectors' gauges
    assert registered == EXPORTED, (registered - EXPORTED, EXPORTED - registered)
