"""deploy/'s monitoring: the alert rules (a plain rules file and the same rules as a PrometheusRule), their
promtool unit tests, and the Grafana dashboard, checked offline with the real tool (`promtool` from Debian's
prometheus package: scripts/ci_monitoring_deps.sh) against what the real server exports.

What the server exports is read from outside: /metrics of the real `agent-server` process (fake engine), scraped
on its --metrics-port as deploy/k8s scrapes it, after a little traffic of three protocols. Not from the source:
the dashboard and the alerts must name what a deployment serves, wherever the code that serves it lives.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from websockets.sync.client import connect

from tests.agent_server.live_server import REPO, cli_server
from tests.agent_server.native_client import NativeClient
from tests.services import free_port, require

pytestmark = pytest.mark.timeout(180)

RULES = REPO / "deploy" / "prometheus" / "agent-server.rules.yaml"
PROMETHEUS_RULE = REPO / "deploy" / "k8s" / "prometheus-rule.yaml"
DASHBOARD = REPO / "deploy" / "grafana" / "agent-server.json"
ALERT_TESTS = Path(__file__).resolve().parent / "alerts_test.yaml"
K8S_SERVER = REPO / "deploy" / "k8s" / "agent-server.yaml"
SERVICE_MONITOR = REPO / "deploy" / "k8s" / "servicemonitor.yaml"

JOB = "agent-server"
TARGET_LABELS = {"instance", "job"}  # what every Prometheus adds to a scraped series (nothing else is assumed)
NOT_EXPORTED = {"up"}  # Prometheus's own series of a target
# what a dashboard's variables stand for when its queries are checked: every replica, every protocol
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$instance": ".*", "$protocol": ".*", "$model": ".*"}
INSTANCES = ("replica-a:8002", "replica-b:8002")
# the fake engine that reports its steps, as synth.Engine does (the plain one would look stalled to the alerts)
ENGINE = {"AGENT_SERVER_ENGINE_FACTORY": "tests.browser.support:make_stats_engine"}
SERIES_STEPS = 40  # samples per synthetic series, 15 s apart: 10 minutes


def promtool() -> str:
    return require("promtool", installer="scripts/ci_monitoring_deps.sh")


def run_promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([promtool(), *args], check=False, capture_output=True, text=True, cwd=cwd, timeout=60)


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def alert_rules() -> list[dict[str, Any]]:
    return [rule for group in load_yaml(RULES)["groups"] for rule in group["rules"] if "alert" in rule]


def dashboard_targets() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every query of the dashboard, rows' panels included."""
    out: list[tuple[str, str]] = []
    for panel in load_yaml(DASHBOARD)["panels"]:
        for inner in [panel, *panel.get("panels", [])]:
            out.extend((inner["title"], target["expr"]) for target in inner.get("targets", []))
    return out


def grafana_to_promql(expr: str) -> str:
    for variable, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    assert "$" not in expr, f"an unknown Grafana variable in {expr}"
    return expr


# ---- PromQL, as far as names go -------------------------------------------------------------------------

GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
SELECTOR = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)?\s*\{([^}]*)\}")
MATCHER = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)\s*\"(?:[^\"\\]|\\.)*\"")
IDENTIFIER = re.compile(r"(?<![\w.])([a-zA-Z_:][a-zA-Z0-9_:]*)(?![\w(])(?!\s*\()")
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool", "offset",
            "inf", "nan", "Inf", "NaN"}


@dataclass(frozen=True)
class Names:
    """What a PromQL expression names: each selector's metric and its matchers' labels, and the labels it groups
    or matches on."""

    selectors: list[tuple[str, set[str]]]
    grouping: set[str]


def names_in(expr: str) -> Names:
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # ranges and subquery steps
    grouping = {label.strip() for labels in GROUPING.findall(expr) for label in labels.split(",") if label.strip()}
    expr = GROUPING.sub(" ", expr)
    selectors: list[tuple[str, set[str]]] = []
    for name, matchers in SELECTOR.findall(expr):
        assert name, f"a selector without a metric name: {{{matchers}}}"
        selectors.append((name, set(MATCHER.findall(matchers))))
    expr = SELECTOR.sub(" ", expr)
    expr = re.sub(r"\"(?:[^\"\\]|\\.)*\"", " ", expr)  # string arguments
    expr = re.sub(r"\b\d+(?:\.\d+)?(?:e[+-]?\d+)?\b", " ", expr)  # numbers
    selectors += [(name, set()) for name in IDENTIFIER.findall(expr) if name not in KEYWORDS]
    return Names(selectors, grouping)


def test_names_in_reads_what_a_query_names() -> None:
    names = names_in('histogram_quantile(0.95, sum by (protocol, le) (rate(tts_x_bucket{instance=~"a.*", '
                     'protocol!="riva"}[5m]))) > 1 and on (protocol) sum(increase(tts_x_count[5m])) >= 20 '
                     'or up{job="agent-server"} == 0 or tts_y')
    assert sorted((n, sorted(ls)) for n, ls in names.selectors) == [
        ("tts_x_bucket", ["instance", "protocol"]), ("tts_x_count", []), ("tts_y", []), ("up", ["job"])]
    assert names.grouping == {"protocol", "le"}


# ---- the server's own series -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Scrape:
    """One /metrics of the real server: (sample name, labels, value, the family's type) per sample."""

    samples: list[tuple[str, dict[str, str], float, str]]

    @classmethod
    def parse(cls, text: str) -> Scrape:
        return cls([(s.name, dict(s.labels), float(s.value), family.type)
                    for family in text_string_to_metric_families(text) for s in family.samples])

    def labels_of(self) -> dict[str, set[str]]:
        out: dict[str, set[str]] = {}
        for name, labels, _, _ in self.samples:
            out.setdefault(name, set()).update(labels)
        return out

    def value(self, name: str, **labels: str) -> float:
        return sum(v for n, ls, v, _ in self.samples if n == name and labels.items() <= ls.items())

    def input_series(self, instance: str) -> list[dict[str, str]]:
        """promtool input series of this scrape as one replica's: counters (and histograms) climb by their
        scraped value every step, so that rates exist; gauges hold their value. With its target's `up`."""
        series = [{"series": f'up{{instance="{instance}",job="{JOB}"}}', "values": f"1x{SERIES_STEPS}"}]
        for name, labels, value, kind in self.samples:
            if name.endswith("_created") or not math.isfinite(value):
                continue
            all_labels = {**labels, "instance": instance, "job": JOB}
            selector = name + "{" + ",".join(f"{k}={json.dumps(v)}" for k, v in sorted(all_labels.items())) + "}"
            number = format(value, ".17g")
            values = f"0+{number}x{SERIES_STEPS}" if kind in ("counter", "histogram") else f"{number}x{SERIES_STEPS}"
            series.append({"series": selector, "values": values})
        return series


def scrape(port: int, host: str = "127.0.0.1") -> Scrape:
    deadline_s = time.monotonic() + 10
    while True:
        try:
            response = httpx.get(f"http://{host}:{port}/metrics", timeout=2)
            break
        except httpx.ConnectError:
            assert time.monotonic() < deadline_s, "the metrics port does not answer"
            time.sleep(0.05)
    assert response.status_code == 200
    return Scrape.parse(response.text)


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scrape]:
    """The real server's /metrics (its metrics port) after an OpenAI HTTP request, a Deepgram WebSocket turn and a job
    (native's series exist from the start)."""
    tmp_path = tmp_path_factory.mktemp("exported")
    metrics_port = free_port()
    with cli_server(tmp_path, ENGINE, "--metrics-port", str(metrics_port)) as (_, port, _):
        speech = {"model": "tts-1", "voice": "alloy", "input": "Hello there.", "response_format": "pcm"}
        response = httpx.post(f"http://127.0.0.1:{port}/v1/audio/speech", json=speech, timeout=30)
        assert response.status_code == 200 and response.content
        with connect(f"ws://127.0.0.1:{port}/v1/speak", open_timeout=10) as ws:
            ws.send(json.dumps({"type": "Speak", "text": "Hello there. "}))
            ws.send(json.dumps({"type": "Close"}))
            for _ in ws:
                pass
        job = httpx.post(f"http://127.0.0.1:{port}/v1/jobs", json={"text": "Hello there. A job."}, timeout=30)
        assert job.status_code == 202, job.text
        deadline_s = time.monotonic() + 20
        while True:  # (the per-key usage is read every few seconds)
            scraped = scrape(metrics_port)
            if (scraped.value("tts_contexts_finished_total", protocol="deepgram") >= 1
                    and scraped.value("tts_jobs_finished_total", status="done") >= 1
                    and "tts_jobs_key_unfinished" in scraped.labels_of()):
                break
            assert time.monotonic() < deadline_s, "the Deepgram turn or the job never finished"
            time.sleep(0.05)
        yield scraped


def unknown_names(expr: str, exported: Scrape) -> list[str]:
    """What `expr` names that the server does not export: metrics, a metric's labels, grouping labels."""
    labels_of = exported.labels_of()
    names = names_in(expr)
    problems = [f"metric {name}" for name, _ in names.selectors if name not in labels_of and name not in NOT_EXPORTED]
    problems += [f"label {label} of {name}" for name, labels in names.selectors for label in labels
                 if label not in labels_of.get(name, set()) | TARGET_LABELS and name not in NOT_EXPORTED]
    named = set().union(*(labels_of.get(name, set()) for name, _ in names.selectors))
    problems += [f"grouping label {label}" for label in names.grouping if label not in named | TARGET_LABELS]
    return problems


# ---- the alert rules --------------------------------------------------------------------------------------


def test_the_rules_pass_promtool_check(tmp_path: Path) -> None:
    result = run_promtool("check", "rules", str(RULES))
    assert result.returncode == 0 and "SUCCESS" in result.stdout, result.stdout + result.stderr
    spec = tmp_path / "spec.rules.yaml"  # the PrometheusRule's own rules, as Prometheus will load them
    spec.write_text(yaml.safe_dump(load_yaml(PROMETHEUS_RULE)["spec"]))
    result = run_promtool("check", "rules", str(spec))
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_prometheus_rule_is_the_plain_rules_file() -> None:
    rule = load_yaml(PROMETHEUS_RULE)
    assert (rule["apiVersion"], rule["kind"]) == ("monitoring.coreos.com/v1", "PrometheusRule")
    assert rule["spec"] == load_yaml(RULES), "deploy/k8s/prometheus-rule.yaml: run scripts/gen_prometheus_rule.py"
    check = subprocess.run([sys.executable, str(REPO / "scripts" / "gen_prometheus_rule.py"), "--check"],
                           check=False, capture_output=True, text=True)
    assert check.returncode == 0, check.stderr


def test_the_alerts_unit_tests_pass() -> None:
    """tests/deploy/alerts_test.yaml: each alert fires on a fleet in trouble, and not on healthy series."""
    result = run_promtool("test", "rules", str(ALERT_TESTS))
    assert result.returncode == 0 and "SUCCESS" in result.stdout, result.stdout + result.stderr


def test_every_alert_has_a_case_that_fires_and_one_that_does_not() -> None:
    """promtool passes a test of an alert that does not exist (nothing fires): so every alertname tested must
    be a rule, and every rule must be seen firing and seen silent."""
    rules = {rule["alert"]: rule for rule in alert_rules()}
    assert {"TTSFirstAudioP95OverBudget", "TTSBusyRefusals", "TTSEngineDown", "TTSSharedStateDown",
            "TTSDrainStuck"} <= set(rules)
    firing: set[str] = set()
    silent: set[str] = set()
    for case in load_yaml(ALERT_TESTS)["tests"]:
        for check in case["alert_rule_test"]:
            assert check["alertname"] in rules, f"alerts_test.yaml tests {check['alertname']}, which is no rule"
            (firing if check["exp_alerts"] else silent).add(check["alertname"])
    assert firing == set(rules), f"never seen firing: {set(rules) - firing}"
    assert silent == set(rules), f"never seen silent: {set(rules) - silent}"
    for name, rule in rules.items():
        assert rule["labels"]["severity"] in ("warning", "critical"), name
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], name


def test_the_alerts_and_their_tests_name_what_the_server_exports(exported: Scrape) -> None:
    for rule in alert_rules():
        assert not unknown_names(rule["expr"], exported), (rule["alert"], unknown_names(rule["expr"], exported))
        if "up" in {name for name, _ in names_in(rule["expr"]).selectors}:
            assert f'up{{job="{JOB}"}}' in rule["expr"], "up must be ours: the other targets have one too"
    labels_of = exported.labels_of()
    for case in load_yaml(ALERT_TESTS)["tests"]:  # a unit test on made-up series would test nothing real
        for series in case["input_series"]:
            ((name, labels),) = names_in(series["series"]).selectors
            if name in NOT_EXPORTED:
                continue
            assert name in labels_of, f"alerts_test.yaml: {name} is not exported"
            assert labels <= labels_of[name] | TARGET_LABELS, f"alerts_test.yaml: {series['series']}"


def alert_conditions(tmp_path: Path, scenarios: dict[str, tuple[Scrape, dict[str, list[dict[str, str]]]]]) -> None:
    """Each alert's expression (without its `for`, labels and annotations) evaluated by promtool on the series
    of real scrapes. `scenarios`: name -> (a scrape, the labels each alert must fire with; [] for silent)."""
    rules = tmp_path / "conditions.rules.yaml"
    rules.write_text(yaml.safe_dump({"groups": [{"name": "conditions", "rules": [
        {"alert": rule["alert"], "expr": rule["expr"]} for rule in alert_rules()]}]}))
    tests = []
    for scraped, expected in scenarios.values():
        checks = [{"eval_time": "9m", "alertname": rule["alert"],
                   "exp_alerts": [{"exp_labels": labels} for labels in expected.get(rule["alert"], [])]}
                  for rule in alert_rules()]
        tests.append({"interval": "15s", "input_series": scraped.input_series(INSTANCES[0]),
                      "alert_rule_test": checks})
    test_file = tmp_path / "conditions_test.yaml"
    test_file.write_text(yaml.safe_dump({"rule_files": [rules.name], "evaluation_interval": "15s", "tests": tests}))
    result = run_promtool("test", "rules", str(test_file))
    assert result.returncode == 0, f"scenarios {list(scenarios)}:\n{result.stdout}{result.stderr}"


def test_no_alert_condition_holds_on_a_healthy_server(exported: Scrape, tmp_path: Path) -> None:
    alert_conditions(tmp_path, {"healthy": (exported, {})})


def test_the_drain_alert_sees_a_real_draining_server(tmp_path: Path) -> None:
    """A real draining replica, scraped on its metrics port: not ready with a session open: what TTSDrainStuck
    (and, without its quarter of an hour, TTSEngineDown) looks for. Ready while speaking beforehand: neither."""
    env = {**ENGINE, "FAKE_ENGINE_OPTIONS": json.dumps({"realtime_factor": 1.0})}
    metrics_port = free_port()
    with cli_server(tmp_path, env, "--shutdown-grace-s", "60", "--metrics-port", str(metrics_port)) as (proc, port, _):

        async def scrapes_around_sigterm() -> tuple[Scrape, Scrape]:
            client = await NativeClient.connect(f"ws://127.0.0.1:{port}/v1/stream")
            try:
                log = await client.open("long", text="A long answer that takes many seconds to speak. " * 8)
                await client.end("long")
                while not log.frames:
                    await asyncio.sleep(0.01)
                speaking = await asyncio.to_thread(scrape, metrics_port)
                proc.send_signal(signal.SIGTERM)
                deadline_s = time.monotonic() + 10
                while (draining := await asyncio.to_thread(scrape, metrics_port)).value("tts_server_ready") != 0:
                    assert time.monotonic() < deadline_s, "never saw the drain"
                    await asyncio.sleep(0.05)
                assert log.done is None, "the turn ended before the drain was seen: make it longer"
                proc.send_signal(signal.SIGTERM)  # the second one cuts the drain short
                await asyncio.wait_for(log.finished.wait(), 10)
                return speaking, draining
            finally:
                await client.close()

        speaking, draining = asyncio.run(scrapes_around_sigterm())
        proc.wait(20)
    assert speaking.value("tts_server_ready") == 1 and speaking.value("tts_sessions_active", protocol="native") == 1
    assert draining.value("tts_sessions_active", protocol="native") == 1
    target = {"instance": INSTANCES[0], "job": JOB}
    alert_conditions(tmp_path, {"speaking": (speaking, {}),
                                "draining": (draining, {"TTSDrainStuck": [target], "TTSEngineDown": [target]})})


def test_the_shared_state_alert_sees_a_real_server_without_its_redis(tmp_path: Path) -> None:
    redis_url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    metrics_port = free_port()
    with cli_server(tmp_path, {**ENGINE, "AGENT_SERVER_REDIS_URL": redis_url}, "--metrics-port", str(metrics_port)):
        scraped = scrape(metrics_port)
    assert scraped.value("tts_shared_state_up", backend="redis") == 0
    alert_conditions(tmp_path, {"redis down": (scraped, {
        "TTSSharedStateDown": [{"backend": "redis", "instance": INSTANCES[0], "job": JOB}]})})


def test_the_drain_alert_fits_the_grace_and_the_kill() -> None:
    """TTSDrainStuck waits past the grace (a drain that uses its whole grace is no alert), and fires before the
    kubelet kills the pod (preStop + `for` + a scrape and an evaluation interval of lag)."""
    docs = [d for d in yaml.safe_load_all(K8S_SERVER.read_text()) if d]
    config = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "agent-server")["data"]
    pod = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"]
    pre_stop_s = int(pod["containers"][0]["lifecycle"]["preStop"]["exec"]["command"][-1])
    (group,) = load_yaml(RULES)["groups"]
    (rule,) = [r for r in group["rules"] if r.get("alert") == "TTSDrainStuck"]
    (endpoint,) = load_yaml(SERVICE_MONITOR)["spec"]["endpoints"]
    for_s = seconds(rule["for"])
    assert for_s > float(config["AGENT_SERVER_SHUTDOWN_GRACE_S"])
    lag_s = seconds(endpoint["interval"]) + seconds(group["interval"])
    assert pre_stop_s + for_s + lag_s <= pod["terminationGracePeriodSeconds"]


def seconds(duration: str) -> float:
    units = {"s": 1, "m": 60, "h": 3600}
    return sum(float(n) * units[u] for n, u in re.findall(r"(\d+)([smh])", duration))


# ---- the dashboard ----------------------------------------------------------------------------------------


def test_the_dashboard_names_what_the_server_exports(exported: Scrape) -> None:
    targets = dashboard_targets()
    assert len(targets) >= 20
    for title, expr in targets:
        assert not unknown_names(grafana_to_promql(expr), exported), (title, unknown_names(expr, exported))
    labels_of = exported.labels_of()
    for variable in load_yaml(DASHBOARD)["templating"]["list"]:
        if variable["type"] == "query":
            match = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", variable["query"]["query"])
            assert match is not None, variable["name"]
            metric, label = match.groups()
            assert label in labels_of[metric] | TARGET_LABELS, variable["name"]


def test_the_dashboard_queries_return_data_from_the_servers_series(exported: Scrape, tmp_path: Path) -> None:
    """Every query, its variables set to everything, is PromQL (promtool check rules) and returns a series
    when Prometheus holds two replicas' real /metrics (promtool test rules: `absent(query)` must stay silent).
    A misspelt metric or label value returns nothing and fails here."""
    queries = [(f"Q{i}", title, grafana_to_promql(expr)) for i, (title, expr) in enumerate(dashboard_targets())]
    rules = tmp_path / "dashboard.rules.yaml"
    rules.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": [
        {"alert": name, "expr": f"absent({expr})"} for name, _, expr in queries]}]}))
    result = run_promtool("check", "rules", str(rules))
    assert result.returncode == 0, result.stdout + result.stderr
    test_file = tmp_path / "dashboard_test.yaml"
    series = [s for instance in INSTANCES for s in exported.input_series(instance)]
    test_file.write_text(yaml.safe_dump({"rule_files": [rules.name], "evaluation_interval": "15s", "tests": [{
        "interval": "15s", "input_series": series,
        "alert_rule_test": [{"eval_time": "9m", "alertname": name, "exp_alerts": []} for name, _, _ in queries]}]}))
    result = run_promtool("test", "rules", str(test_file))
    report = result.stdout + result.stderr
    empty = {name: f"{title}: {expr}" for name, title, expr in queries if f"alertname: {name}," in report}
    assert result.returncode == 0, f"queries that return nothing: {empty}\n{report[-3000:]}"


def test_the_dashboard_shows_what_an_operator_expects() -> None:
    """First audio p50/p95/p99, audio per second, slots, busy refusals; per protocol and per replica."""
    dashboard = load_yaml(DASHBOARD)
    exprs = [re.sub(r"\s+", " ", expr) for _, expr in dashboard_targets()]

    def shown(pattern: str) -> bool:
        return any(re.search(pattern, expr) for expr in exprs)

    ttfa = r"tts_time_to_first_audio_seconds_bucket"
    for quantile in ("0.5", "0.95", "0.99"):
        assert shown(rf"histogram_quantile\({quantile}, sum by \(le\) \(rate\({ttfa}"), quantile
    assert shown(rf"by \(protocol, le\) \(rate\({ttfa}") and shown(rf"by \(instance, le\) \(rate\({ttfa}")
    assert shown(r"by \(instance\) \(rate\(tts_engine_audio_seconds_total") and shown(r"tts_audio_sent_seconds_total")
    assert shown(r"tts_engine_slots_in_use") and shown(r"tts_engine_max_slots")
    assert shown(r"by \(protocol, scope\) \(rate\(tts_busy_rejections_total")
    assert shown(r"by \(instance\) \(rate\(tts_busy_rejections_total")
    assert shown(r"rate\(tts_jobs_audio_seconds_total") and shown(r"tts_jobs_queue_depth")
    assert shown(r"tts_jobs_running")
    # a dashboard that loads anywhere: its Prometheus is a variable, panel ids are unique, every panel is placed
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    panels = [p for top in dashboard["panels"] for p in [top, *top.get("panels", [])]]
    assert len({p["id"] for p in panels}) == len(panels)
    for panel in panels:
        assert {"h", "w", "x", "y"} <= set(panel["gridPos"]), panel["title"]
        if panel["type"] != "row":
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
            assert all(t["datasource"] == panel["datasource"] for t in panel["targets"]), panel["title"]
    for _, expr in dashboard_targets():
        if "tts_" in expr:
            assert '$instance"' in expr, f"not filtered by the replica variable: {expr}"
