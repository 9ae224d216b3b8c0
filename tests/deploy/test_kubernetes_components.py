"""deploy/kubernetes/components: the optional parts an operator adds to an overlay (PodMonitors for
the Prometheus Operator; a collector and Jaeger for traces), rendered on top of every overlay as the
README says to, validated, and checked to point at what really exists: the ports the pods name,
the Services the endpoints name, the pipeline the collector's config declares."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from tests.deploy.manifests import KUBERNETES, OVERLAYS, containers, find, render_overlay
from tests.support.cluster import REPO

pytestmark = pytest.mark.skipif(shutil.which("kubectl") is None,
                                reason="kubectl is not installed: the overlays cannot be rendered")

OPTIONAL = ["podmonitors", "tracing"]
# The Prometheus Operator's CRD, not in the Kubernetes schemas: checked field by field below.
OPERATOR_KINDS = {"PodMonitor"}
PODMONITOR_SPEC_FIELDS = {"jobLabel", "selector", "podMetricsEndpoints", "podTargetLabels", "namespaceSelector"}
ENDPOINT_FIELDS = {"port", "path", "interval"}


def render_with_components(overlay: str, extra: list[str]) -> list[dict]:
    """The overlay with `extra` appended to its components, as an operator would add them."""
    spec = yaml.safe_load((KUBERNETES / "overlays" / overlay / "kustomization.yaml").read_text())
    with tempfile.TemporaryDirectory() as tmp:
        # kustomize takes no absolute paths: each is made relative to the temporary kustomization.
        def moved(path: str) -> str:
            return os.path.relpath((KUBERNETES / "overlays" / overlay / path).resolve(), tmp)

        spec["resources"] = [moved(p) for p in spec.get("resources", [])]
        spec["components"] = [moved(p) for p in spec.get("components", [])] + [
            os.path.relpath(KUBERNETES / "components" / name, tmp) for name in extra]
        (Path(tmp) / "kustomization.yaml").write_text(yaml.safe_dump(spec))
        out = subprocess.run([shutil.which("kubectl"), "kustomize", tmp], capture_output=True, text=True,
                             timeout=120, check=True).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request) -> tuple[str, list[dict]]:
    return request.param, render_with_components(request.param, OPTIONAL)


def pods_of(docs: list[dict]) -> list[dict]:
    return [d["spec"]["template"] for d in docs if d["kind"] in ("Deployment", "StatefulSet")]


def test_with_the_optional_components_every_object_validates_in_corrals_namespace(rendered):
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    _, docs = rendered
    version = kubernetes_validate.latest_version()
    kinds = {doc["kind"] for doc in docs}
    assert {"PodMonitor", "ConfigMap", "Deployment", "Service"} <= kinds
    for doc in docs:
        if doc["kind"] not in OPERATOR_KINDS:
            kubernetes_validate.validate(doc, version, strict=True)
        if doc["kind"] not in ("Namespace", "ClusterRole", "ClusterRoleBinding"):
            assert doc["metadata"].get("namespace") == "corral", (doc["kind"], doc["metadata"]["name"])


def test_podmonitors_scrape_every_corral_service_on_a_port_its_pods_name(rendered):
    _, docs = rendered
    monitors = [d for d in docs if d["kind"] == "PodMonitor"]
    compose_jobs = {job["job_name"] for job in
                    yaml.safe_load((REPO / "deploy" / "prometheus" / "prometheus.yml").read_text())["scrape_configs"]}
    annotated = {pod["metadata"]["labels"]["app.kubernetes.io/name"] for pod in pods_of(docs)
                 if pod["metadata"].get("annotations", {}).get("prometheus.io/scrape") == "true"}
    covered = set()
    for monitor in monitors:
        assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
        spec = monitor["spec"]
        assert set(spec) <= PODMONITOR_SPEC_FIELDS, set(spec) - PODMONITOR_SPEC_FIELDS
        wanted = spec["selector"]["matchLabels"]
        matched = [pod for pod in pods_of(docs) if wanted.items() <= pod["metadata"]["labels"].items()]
        assert matched, f"{monitor['metadata']['name']} selects no pod"
        for pod in matched:
            # The job is named as compose's Prometheus names it, so the dashboard's queries hold.
            assert pod["metadata"]["labels"][spec["jobLabel"]] in compose_jobs
            ports = _named_ports(pod)
            for endpoint in spec["podMetricsEndpoints"]:
                assert set(endpoint) <= ENDPOINT_FIELDS and endpoint["path"] == "/metrics"
                assert endpoint["port"] in ports, (monitor["metadata"]["name"], ports)
                # The annotation's port is the same one: either way Prometheus reads the same page.
                assert ports[endpoint["port"]] == int(pod["metadata"]["annotations"]["prometheus.io/port"])
            covered.add(pod["metadata"]["labels"]["app.kubernetes.io/name"])
    assert covered == annotated  # every service the annotations scrape, the PodMonitors scrape


def test_traces_reach_jaeger_through_the_collector(rendered):
    _, docs = rendered
    env = find(docs, "ConfigMap", "corral-env")["data"]
    assert env["OTEL_EXPORTER_OTLP_PROTOCOL"] == "http/protobuf"
    endpoint = urlsplit(env["OTEL_EXPORTER_OTLP_ENDPOINT"])
    collector_pod = _pod_behind(docs, endpoint.hostname, endpoint.port)
    collector = containers({"spec": {"template": collector_pod}})[0]
    config_file = next(a.split("=", 1)[1] for a in collector["args"] if a.startswith("--config="))
    mount = next(m for m in collector["volumeMounts"] if config_file.startswith(m["mountPath"] + "/"))
    volume = next(v for v in collector_pod["spec"]["volumes"] if v["name"] == mount["name"])
    config_map = find(docs, "ConfigMap", volume["configMap"]["name"])
    config = yaml.safe_load(config_map["data"][config_file.rsplit("/", 1)[1]])

    # Corral sends OTLP over HTTP: the receiver listens on the port the endpoint reaches.
    target_port = _container_port(collector_pod, _service_target(docs, endpoint.hostname, endpoint.port))
    http_listen = config["receivers"]["otlp"]["protocols"]["http"]["endpoint"]
    assert int(http_listen.rsplit(":", 1)[1]) == target_port
    # Every component a pipeline names is declared, and the traces go out to the Jaeger Service.
    pipeline = config["service"]["pipelines"]["traces"]
    for section in ("receivers", "processors", "exporters"):
        assert set(pipeline[section]) <= set(config[section]), section
    assert set(config["service"]["extensions"]) <= set(config["extensions"])
    (exporter,) = [config["exporters"][name] for name in pipeline["exporters"]]
    host, port = exporter["endpoint"].rsplit(":", 1)
    jaeger_pod = _pod_behind(docs, host, int(port))
    assert containers({"spec": {"template": jaeger_pod}})[0]["image"].startswith("jaegertracing/jaeger:")
    # The collector's probes ask its health_check extension, on the port that extension listens on.
    health_port = _container_port(collector_pod, collector["readinessProbe"]["httpGet"]["port"])
    assert int(config["extensions"]["health_check"]["endpoint"].rsplit(":", 1)[1]) == health_port


def test_without_the_tracing_component_traces_go_to_the_operators_collector():
    for overlay in OVERLAYS:
        docs = render_overlay(overlay)
        endpoint = find(docs, "ConfigMap", "corral-env")["data"]["OTEL_EXPORTER_OTLP_ENDPOINT"]
        assert endpoint == "http://otel-collector.observability:4318"
        assert not any(d["kind"] == "PodMonitor" for d in docs)


def _service_target(docs: list[dict], name: str, port: int) -> str | int:
    service = find(docs, "Service", name)
    return next(p["targetPort"] for p in service["spec"]["ports"] if p["port"] == port)


def _pod_behind(docs: list[dict], service_name: str, port: int) -> dict:
    """The one pod template the Service selects, after checking it serves the Service's target port."""
    selector = find(docs, "Service", service_name)["spec"]["selector"]
    pods = [pod for pod in pods_of(docs) if selector.items() <= pod["metadata"]["labels"].items()]
    assert len(pods) == 1, f"Service {service_name} selects {len(pods)} pod templates"
    _container_port(pods[0], _service_target(docs, service_name, port))
    return pods[0]


def _named_ports(pod: dict) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for c in pod["spec"]["containers"] for p in c.get("ports", [])}


def _container_port(pod: dict, port: str | int) -> int:
    ports = _named_ports(pod)
    if isinstance(port, int):
        assert port in ports.values(), (port, ports)
        return port
    assert port in ports, (port, ports)
    return ports[port]
