"""The Grafana dashboard reads only series Corral exports, with labels they carry, in valid PromQL."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.exported_metrics import exposition_texts

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "corral-vllm-dashboard.json"
SERIES = re.compile(r"\b((?:vllm|corral):[a-zA-Z0-9_]+)(\{[^}]*\})?")
MATCHER_LABEL = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)")
BY_LABELS = re.compile(r"\bby\s*\(([^)]*)\)")
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$model_name": ".*"}


def panel_expressions() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]


def expressions() -> list[str]:
    """The panels' PromQL and the variables' Grafana queries (`label_values(...)`)."""
    variables = json.loads(DASHBOARD.read_text())["templating"]["list"]
    return panel_expressions() + [v["query"]["query"] for v in variables if isinstance(v.get("query"), dict)]


def exported_labels() -> dict[str, set[str]]:
    """Sample name → the label names it carries, over a busy cluster's scrapes."""
    labels: dict[str, set[str]] = {}
    for text in exposition_texts():
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels.setdefault(sample.name, set()).update(sample.labels)
    return labels


def test_every_expression_names_series_corral_exports_with_their_labels():
    exported = exported_labels()
    exprs = expressions()
    assert len(exprs) > 30
    for expr in exprs:
        assert not re.search(r"\b(vllm|corral)_[a-z]", expr), f"underscore name in {expr}"
        found = SERIES.findall(expr)
        assert found, f"no Corral series in {expr}"
        carried: set[str] = set()
        for name, matchers in found:
            assert name in exported, f"{name} (in {expr}) is not exported"
            carried |= exported[name]
            for label in MATCHER_LABEL.findall(matchers):
                assert label in exported[name], f"{name} has no label {label!r}"
        for group in BY_LABELS.findall(expr):
            for label in filter(None, (part.strip() for part in group.split(","))):
                assert label in carried, f"by ({label}) in {expr}: no such label"


def test_the_dashboard_has_the_panels_the_issue_asks_for():
    text = DASHBOARD.read_text()
    for needed in ("vllm:request_success_total", "vllm:time_to_first_token_seconds_bucket",
                   "vllm:inter_token_latency_seconds_bucket", "corral:instance_freeness",
                   "corral:llumlet_migrations_total", "corral:scheduler_dispatches_total", "vllm:kv_cache_usage_perc"):
        assert needed in text, needed


@pytest.mark.skipif(shutil.which("promtool") is None,
                    reason="promtool is not installed (scripts/install_prometheus.sh installs it)")
def test_every_expression_is_valid_promql(tmp_path):
    rules = []
    for i, expr in enumerate(panel_expressions()):
        for variable, value in GRAFANA_VARIABLES.items():
            expr = expr.replace(variable, value)
        rules.append({"record": f"corral:dashboard_check_{i}", "expr": expr})
    path = tmp_path / "rules.json"  # YAML is a superset of JSON
    path.write_text(json.dumps({"groups": [{"name": "dashboard", "rules": rules}]}))
    checked = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr
