"""The alert rules and example configs, checked by the real Prometheus and Alertmanager tools (Debian packages)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import yaml

from sparkwatch.core.driver.nvrm import XID_CATALOGUE
from tests.conftest import require_tool
from tests.grafana_support import ALERTS, ALERTS_TEST, ASSETS, GRAFANA, load_rules

REQUIRED_ALERTS = {
    "SparkwatchGuardKilled",  # a kill happened
    "SparkwatchGuardWouldKill",  # dry run: the guard would have killed (a warning)
    "SparkwatchHeadroomLow",
    "SparkwatchDriverStranded",
    "SparkwatchDriverWillStrand",
    "SparkwatchCompilerBurstNoMaxJobs",
    "SparkwatchJitStalled",
    "SparkwatchDown",
    "SparkwatchGuardStuck",
    "SparkwatchTelemetryStale",
    "SparkwatchCollectorFailing",
    "SparkwatchTPPeerLost",
    "SparkwatchAlertsUndelivered",
    "SparkwatchGpuXidNeedsReset",
    "SparkwatchGpuXid",
    "SparkwatchDriverAllocFailed",
    "SparkwatchKernelLogUnreadable",
    "SparkwatchEngineNearBudget",
    "SparkwatchGroupMemberDead",  # an engine group over Ray lost a member and the rest still run
    "SparkwatchRayNodeLost",  # Ray marks a node of the cluster dead
    "SparkwatchPeerLost",  # a peer's agent gives no answer at all: its node wedged, down or cut off
    "SparkwatchEngineWedged",  # up but not serving: the one-token probe fails while the process lives
}


def run(argv: list[str], cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False, cwd=cwd)


def test_promtool_check_rules() -> None:
    result = run([require_tool("promtool"), "check", "rules", str(ALERTS)])
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(REQUIRED_ALERTS)} rules found" in result.stdout


def test_promtool_unit_tests_pass() -> None:
    result = run([require_tool("promtool"), "test", "rules", ALERTS_TEST.name], cwd=GRAFANA)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_promtool_unit_tests_catch_a_broken_rule(tmp_path: Path) -> None:
    """The unit tests bite: drop the TP rule's "this node did not kill" clause and they must fail."""
    text = ALERTS.read_text(encoding="utf-8")
    clause = (
        "unless on (job, instance)\n"
        "          (sum by (job, instance) (increase(sparkwatch_guard_kills_total[2m])) > 0)\n"
    )
    assert clause in text
    (tmp_path / ALERTS.name).write_text(text.replace(clause, ""), encoding="utf-8")
    tests_text = ALERTS_TEST.read_text(encoding="utf-8")
    shipped = "- ../sparkwatch/data/grafana/sparkwatch-alerts.yml\n"
    assert shipped in tests_text
    (tmp_path / ALERTS_TEST.name).write_text(tests_text.replace(shipped, f"- {ALERTS.name}\n"), encoding="utf-8")
    result = run([require_tool("promtool"), "test", "rules", ALERTS_TEST.name], cwd=tmp_path)
    assert result.returncode != 0
    assert "SparkwatchTPPeerLost" in result.stdout + result.stderr


def test_each_rule_has_a_firing_unit_test_and_tells_the_human_what_to_do() -> None:
    rules = load_rules()
    assert {r["alert"] for r in rules} == REQUIRED_ALERTS
    tests = yaml.safe_load(ALERTS_TEST.read_text(encoding="utf-8"))["tests"]
    fired = {case["alertname"] for t in tests for case in t["alert_rule_test"] if case["exp_alerts"]}
    quiet = {case["alertname"] for t in tests for case in t["alert_rule_test"] if not case["exp_alerts"]}
    assert fired == REQUIRED_ALERTS, f"rules with no firing test: {REQUIRED_ALERTS - fired}"
    assert quiet == REQUIRED_ALERTS, f"rules with no not-firing test: {REQUIRED_ALERTS - quiet}"
    for r in rules:
        assert r["labels"]["severity"] in ("critical", "warning"), r["alert"]
        # It names the node; a rule over a whole cluster (a group spans nodes) names the cluster instead.
        where = "{{ $labels.cluster }}" if "by (cluster" in r["expr"] else "{{ $labels.instance }}"
        assert where in r["annotations"]["summary"], r["alert"]
        # Every description names a command or a concrete action.
        assert "`" in r["annotations"]["description"], f"{r['alert']}: say what to run"


def test_xid_paging_codes_are_the_catalogue_s() -> None:
    """The rule that pages names exactly the Xid codes core.driver.nvrm says need a GPU reset or a reboot."""
    rules = {r["alert"]: r for r in load_rules()}
    pages = "|".join(str(code) for code, info in sorted(XID_CATALOGUE.items()) if info.pages)
    assert f'code=~"{pages}"' in rules["SparkwatchGpuXidNeedsReset"]["expr"]
    assert f'code!~"{pages}"' in rules["SparkwatchGpuXid"]["expr"]
    assert rules["SparkwatchGpuXidNeedsReset"]["labels"]["severity"] == "critical"


def test_example_prometheus_config(tmp_path: Path) -> None:
    for src in (ASSETS / "prometheus.yml", ALERTS):  # side by side, as step 2 puts them in /etc/prometheus
        shutil.copy(src, tmp_path / src.name)
    result = run([require_tool("promtool"), "check", "config", str(tmp_path / "prometheus.yml")])
    assert result.returncode == 0, result.stdout + result.stderr
    config = yaml.safe_load((ASSETS / "prometheus.yml").read_text(encoding="utf-8"))
    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    targets = [t for sc in jobs["sparkwatch"]["static_configs"] for t in sc["targets"]]
    assert targets == ["spark-a:9847", "spark-b:9847"]
    # the pair is one cluster (the group alerts compare by it), each node shown by its host name
    assert [sc.get("labels") for sc in jobs["sparkwatch"]["static_configs"]] == [{"cluster": "spark-pair"}]
    (relabel,) = jobs["sparkwatch"]["relabel_configs"]
    pattern = re.compile(f"^(?:{relabel['regex']})$")  # Prometheus anchors relabel regexes
    assert [pattern.sub(relabel["replacement"].replace("$1", r"\1"), t) for t in targets] == ["spark-a", "spark-b"]
    assert config["rule_files"] == ["sparkwatch-alerts.yml"]
    assert set(config) == {"rule_files", "scrape_configs"}, "a snippet to merge: nothing that would replace a setting"


# A stock /etc/prometheus/prometheus.yml as Debian and Ubuntu ship it (abridged: its global, alerting, one rule
# file and the self-scrape job), which README step 2 merges sparkwatch's part into.
STOCK_PROMETHEUS = """
global:
  scrape_interval: 15s
  evaluation_interval: 15s
alerting:
  alertmanagers:
  - static_configs:
    - targets: ['localhost:9093']
rule_files:
  - "first_rules.yml"
scrape_configs:
  - job_name: 'prometheus'
    static_configs:
      - targets: ['localhost:9090']
"""


def test_the_prometheus_snippet_merges_into_an_existing_config_and_keeps_it(tmp_path: Path) -> None:
    """What README step 2 says to do: append the snippet's two list items to the file's own lists. The result is a
    valid config with both jobs and both rule files, and the owner's settings are untouched."""
    stock = yaml.safe_load(STOCK_PROMETHEUS)
    snippet = yaml.safe_load((ASSETS / "prometheus.yml").read_text(encoding="utf-8"))
    merged = {**stock}
    merged["rule_files"] = stock["rule_files"] + snippet["rule_files"]
    merged["scrape_configs"] = stock["scrape_configs"] + snippet["scrape_configs"]
    (tmp_path / "first_rules.yml").write_text("groups: []\n", encoding="utf-8")
    shutil.copy(ALERTS, tmp_path / ALERTS.name)  # copied next to prometheus.yml as it is named
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(merged), encoding="utf-8")
    result = run([require_tool("promtool"), "check", "config", str(tmp_path / "prometheus.yml")])
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(REQUIRED_ALERTS)} rules found" in result.stdout
    assert merged["global"] == stock["global"] and merged["alerting"] == stock["alerting"]
    assert [j["job_name"] for j in merged["scrape_configs"]] == ["prometheus", "sparkwatch"]


def test_example_alertmanager_config() -> None:
    result = run([require_tool("amtool"), "check-config", str(ASSETS / "alertmanager.yml")])
    assert result.returncode == 0, result.stdout + result.stderr
    config = yaml.safe_load((ASSETS / "alertmanager.yml").read_text(encoding="utf-8"))
    receivers = {r["name"]: r for r in config["receivers"]}
    assert receivers[config["route"]["receiver"]]["webhook_configs"][0]["url"].startswith("http")
    # A lost node (Ray's word or a peer's agent's) explains the dead members of its cluster's groups: one page, not
    # one per group.
    for lost in ("SparkwatchRayNodeLost", "SparkwatchPeerLost"):
        inhibit = [r for r in config["inhibit_rules"] if r["source_matchers"] == [f'alertname="{lost}"']]
        assert [(r["target_matchers"], r["equal"]) for r in inhibit] == [
            (['alertname="SparkwatchGroupMemberDead"'], ["cluster"])
        ]


def test_provisioning_files() -> None:
    ds = yaml.safe_load((ASSETS / "provisioning" / "datasources" / "sparkwatch.yaml").read_text(encoding="utf-8"))
    assert ds["apiVersion"] == 1 and ds["datasources"][0]["type"] == "prometheus"
    assert ds["datasources"][0]["isDefault"] is False  # provisioning must not take over an existing Grafana's default
    dashboards = ASSETS / "provisioning" / "dashboards" / "sparkwatch.yaml"
    prov = yaml.safe_load(dashboards.read_text(encoding="utf-8"))
    assert prov["apiVersion"] == 1
    provider = prov["providers"][0]
    assert provider["type"] == "file" and provider["options"]["path"].startswith("/")
