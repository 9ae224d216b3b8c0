"""deploy/kubernetes: every overlay renders with kubectl's kustomize and validates against the
Kubernetes schemas (kubernetes-validate bundles them: offline); the commands run are `corral`
entry points with flags that exist; probes, drain and RBAC agree with what the code does."""

from __future__ import annotations

import copy
import re
import shutil

import pytest
import yaml

from tests.deploy.manifests import (
    KUBERNETES,
    OVERLAYS,
    containers,
    find,
    llumlet_deployments,
    parse_corral,
    render_overlay,
)
from tests.support.cluster import REPO

pytestmark = pytest.mark.skipif(shutil.which("kubectl") is None,
                                reason="kubectl is not installed: the overlays cannot be rendered")

CORRAL_IMAGE = re.compile(r"^corral(-cuda)?(:|$)")


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request) -> tuple[str, list[dict]]:
    return request.param, render_overlay(request.param)


def test_the_overlays_exist():
    assert set(OVERLAYS) == {"cpu-sim", "cpu-vllm", "gpu", "cpu-sim-pd", "cpu-vllm-pd", "gpu-pd"}


PD_OVERLAYS = [name for name in OVERLAYS if name.endswith("-pd")]
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding"}


def test_every_object_lands_in_corrals_namespace_with_what_its_pods_claim(rendered):
    """Components add objects of their own (pools, the model's volume claim): the overlay's
    namespace must reach them, or a pod would claim a volume in a namespace it is not in."""
    _, docs = rendered
    namespaced = [d for d in docs if d["kind"] not in CLUSTER_SCOPED]
    assert {d["metadata"].get("namespace") for d in namespaced} == {"corral"}
    for doc in docs:
        if doc["kind"] not in ("Deployment", "StatefulSet"):
            continue
        for volume in doc["spec"]["template"]["spec"].get("volumes", []):
            if "persistentVolumeClaim" in volume:
                find(docs, "PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"])


def test_every_rendered_object_validates_against_the_kubernetes_schemas(rendered):
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    name, docs = rendered
    version = kubernetes_validate.latest_version()
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)
    # The validator does reject what is wrong (a misspelt field), so passing means something.
    broken = copy.deepcopy(llumlet_deployments(docs)[0])
    broken["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, version, strict=True)


def test_every_corral_container_runs_a_corral_entry_point_that_parses(rendered):
    _, docs = rendered
    seen = set()
    for doc in docs:
        if doc["kind"] not in ("Deployment", "StatefulSet"):
            continue
        for container in containers(doc):
            if not CORRAL_IMAGE.match(container["image"]):
                continue
            assert "command" not in container, "the image's entry point is `corral`: set args only"
            args = parse_corral(container["args"])
            seen.add(args.command)
            pre_stop = container.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command")
            if pre_stop:
                assert pre_stop[0] == "corral"
                seen.add(parse_corral(pre_stop[1:]).command)
    assert seen == {"scheduler", "gateway", "llumlet", "autoscaler", "drain"}
    # The same entry points `corral up` starts as its children (`python -m services.cli <service>`,
    # i.e. the `corral` script), besides the preStop's drain.
    supervisor = (REPO / "services" / "supervisor.py").read_text()
    assert '"-m", "services.cli"' in supervisor
    started_by_up = set(re.findall(r'\[\s*"(\w+)", \*common', supervisor))
    assert started_by_up == seen - {"drain"}, started_by_up


def test_engine_per_overlay(rendered):
    name, docs = rendered
    for deployment in llumlet_deployments(docs):
        llumlet = containers(deployment)[0]
        args = parse_corral(llumlet["args"])
        resources = llumlet["resources"]
        if name.startswith("gpu"):
            assert args.engine == "vllm" and llumlet["image"] == "corral-cuda:latest" and args.vllm_kv_cache_gib == 16
            assert resources["limits"]["nvidia.com/gpu"] == "1"
            assert find(docs, "ConfigMap", "corral-env")["data"]["CORRAL_MODEL_DIR"] == "/models/served"
        else:
            assert args.engine == ("vllm" if name.startswith("cpu-vllm") else "sim") and llumlet["image"] == "corral:latest"
            assert "nvidia.com/gpu" not in str(resources)


def test_llumlet_probes_drain_and_grace_period_fit_together(rendered):
    _, docs = rendered
    for deployment in llumlet_deployments(docs):  # (one, or a prefill and a decode pool)
        _check_llumlet_pod(docs, deployment)


def _check_llumlet_pod(docs: list[dict], deployment: dict) -> None:
    pod = deployment["spec"]["template"]
    llumlet = pod["spec"]["containers"][0]
    args = parse_corral(llumlet["args"])
    ports = {p["name"]: p["containerPort"] for p in llumlet["ports"]}
    assert ports["metrics"] == args.metrics_port and ports["kv"] == args.kv_port
    assert args.kv_host == "0.0.0.0"
    assert llumlet["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "metrics"}
    assert llumlet["livenessProbe"]["httpGet"]["path"] == "/health"
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == str(args.metrics_port)
    env = {e["name"]: e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") for e in llumlet["env"]}
    assert env["CORRAL_INSTANCE_ID"] == "metadata.name"  # what `corral drain` in preStop reads
    assert env["CORRAL_KV_ADVERTISE_HOST"] == "status.podIP"
    drain = parse_corral(llumlet["lifecycle"]["preStop"]["exec"]["command"][1:])
    assert drain.command == "drain" and drain.instance_id is None  # from the environment in the pod
    # The drain's own deadline (plus its NATS allowance) ends before the kubelet's SIGKILL.
    assert drain.timeout_s + 5 + 30 <= pod["spec"]["terminationGracePeriodSeconds"]
    pdb = find(docs, "PodDisruptionBudget", deployment["metadata"]["name"])
    assert pdb["spec"]["selector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]


def test_gateway_probes_paths_it_serves(rendered):
    _, docs = rendered
    gateway = containers(find(docs, "Deployment", "corral-gateway"))[0]
    args = parse_corral(gateway["args"])
    assert gateway["ports"][0]["containerPort"] == args.gateway_port and args.gateway_host == "0.0.0.0"
    app = (REPO / "services" / "gateway" / "app.py").read_text()
    for probe in ("livenessProbe", "readinessProbe"):
        assert f'Route("{gateway[probe]["httpGet"]["path"]}"' in app


def test_nats_is_a_three_node_cluster_routing_through_its_headless_service(rendered):
    _, docs = rendered
    nats = find(docs, "StatefulSet", "nats")
    assert nats["spec"]["replicas"] == 3 and nats["spec"]["serviceName"] == "nats-headless"
    conf = find(docs, "ConfigMap", "nats-config")["data"]["nats.conf"]
    routes = re.findall(r"nats://(nats-\d)\.nats-headless:6222", conf)
    assert routes == [f"nats-{i}" for i in range(3)]
    assert find(docs, "ConfigMap", "corral-env")["data"]["CORRAL_NATS_URL"] == "nats://nats:4222"
    find(docs, "Service", "nats")


def test_schedulers_share_dispatch_and_elect_one_pairer(rendered):
    _, docs = rendered
    schedulers = find(docs, "Deployment", "corral-scheduler")
    assert schedulers["spec"]["replicas"] == 2
    assert not [d for d in docs if d["metadata"]["name"] == "corral-scheduler-pairing"]
    assert parse_corral(containers(schedulers)[0]["args"]).enable_migration is True
    # Each replica's id is its pod name: the election among them picks the lowest live one.
    env = {e["name"]: e for e in containers(schedulers)[0]["env"]}
    assert env["SCHEDULER_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    # Replicas answer dispatch as one queue group and pair only while they lead.
    from shared import subjects

    source = (REPO / "services" / "global_scheduler" / "service.py").read_text()
    assert "queue=subjects.SCHEDULER_QUEUE" in source and subjects.SCHEDULER_QUEUE
    assert "leads=self.leadership.leads" in source


def test_every_corral_setting_in_the_manifests_is_one_the_code_reads(rendered):
    _, docs = rendered
    names = set(find(docs, "ConfigMap", "corral-env")["data"])
    for doc in docs:
        if doc["kind"] == "Deployment":
            for container in containers(doc):
                names |= {e["name"] for e in container.get("env", [])}
    code = "\n".join(p.read_text() for p in (REPO / "services").rglob("*.py")) + \
        "\n".join(p.read_text() for p in (REPO / "shared").rglob("*.py"))
    for name in sorted(n for n in names if n.startswith("CORRAL_")):
        short = name.removeprefix("CORRAL_")
        assert f'env("{short}"' in code or f'"{name}"' in code, f"{name} is read nowhere"


def test_autoscaler_role_grants_what_the_provider_uses_and_nothing_else():
    """The Role, against the API calls the provider makes on the stand-in API server."""
    pytest.importorskip("kubernetes")
    from services.autoscaler.kubernetes_provider import KubernetesProvider, KubernetesSettings
    from tests.deploy.kube_api_standin import KubeApiStandIn

    docs = [d for d in yaml.safe_load_all((KUBERNETES / "base" / "autoscaler.yaml").read_text()) if d]
    role = find(docs, "Role", "corral-autoscaler")
    args = parse_corral(containers(find(docs, "Deployment", "corral-autoscaler"))[0]["args"])
    assert args.provider == "kubernetes"
    granted = {(group, resource, verb) for rule in role["rules"] for group in rule["apiGroups"]
               for resource in rule["resources"] for verb in rule["verbs"]}
    with KubeApiStandIn(deployment=args.k8s_deployment, replicas=2) as api:
        provider = KubernetesProvider(KubernetesSettings(api.namespace, args.k8s_deployment, api.url))
        victim = provider.start_instance()
        provider.stop_instance(victim)
        provider.managed()
        used = {_rbac_of(method, path) for method, path, _ in api.requests}
    assert used == granted
    scale_rule = next(r for r in role["rules"] if r["resources"] == ["deployments/scale"])
    assert scale_rule["resourceNames"] == [args.k8s_deployment]
    llumlets = [d for d in yaml.safe_load_all((KUBERNETES / "base" / "llumlet" / "llumlet.yaml").read_text()) if d]
    find(llumlets, "Deployment", args.k8s_deployment)


@pytest.mark.parametrize("overlay", PD_OVERLAYS)
def test_the_pools_overlays_role_grants_what_the_pools_provider_uses_and_nothing_else(overlay):
    """The -pd overlays: the autoscaler scales both pools' Deployments, and its Role names both."""
    pytest.importorskip("kubernetes")
    from services.autoscaler.kubernetes_pools import KubernetesPools
    from services.autoscaler.kubernetes_provider import KubernetesProvider, KubernetesSettings
    from shared.messages import InstanceRole
    from tests.deploy.kube_api_standin import KubeApiStandIn

    docs = render_overlay(overlay)
    role = find(docs, "Role", "corral-autoscaler")
    args = parse_corral(containers(find(docs, "Deployment", "corral-autoscaler"))[0]["args"])
    assert args.provider == "kubernetes" and args.initial_prefill >= 1 and args.initial_decode >= 1
    names = {InstanceRole.PREFILL: args.k8s_prefill_deployment, InstanceRole.DECODE: args.k8s_decode_deployment}
    granted = {(group, resource, verb, name) for rule in role["rules"] for group in rule["apiGroups"]
               for resource in rule["resources"] for verb in rule["verbs"] for name in rule.get("resourceNames", ["*"])}
    with KubeApiStandIn(deployment=names[InstanceRole.PREFILL], replicas=1,
                        more={names[InstanceRole.DECODE]: 1}) as api:
        pools = KubernetesPools({role: KubernetesProvider(KubernetesSettings(api.namespace, name, api.url))
                                 for role, name in names.items()})
        for pool in names:
            pools.stop_instance(pools.start_instance(pool))
        pools.managed()
        used = {(*_rbac_of(method, path), _name_of(path)) for method, path, _ in api.requests}
    assert used == granted
    # Each pool's Deployment: its role, a selector of its own, no replica count of its own.
    for pool, name in names.items():
        deployment = find(docs, "Deployment", name)
        env = {e["name"]: e.get("value") for e in containers(deployment)[0]["env"]}
        assert env["CORRAL_ROLE"] == pool.value and "replicas" not in deployment["spec"]
    selectors = [find(docs, "Deployment", name)["spec"]["selector"]["matchLabels"] for name in names.values()]
    assert selectors[0] != selectors[1] and {d["metadata"]["name"] for d in llumlet_deployments(docs)} == set(
        names.values())


def _name_of(path: str) -> str:
    """The object a scale call names (RBAC's resourceNames); '*' for the pod calls, granted on all pods."""
    parts = path.strip("/").split("/")
    return parts[6] if "deployments" in parts else "*"


def _rbac_of(method: str, path: str) -> tuple[str, str, str]:
    """(API group, resource[/subresource], verb) of a REST call, as RBAC names them."""
    parts = path.strip("/").split("/")
    group = "" if parts[0] == "api" else parts[1]
    rest = parts[2:] if parts[0] == "api" else parts[3:]
    assert rest[0] == "namespaces"
    resource_parts = rest[2:]
    resource = resource_parts[0] + (f"/{resource_parts[2]}" if len(resource_parts) > 2 else "")
    named = len(resource_parts) > 1
    verb = {"GET": "get" if named else "list", "PATCH": "patch", "PUT": "update", "POST": "create",
            "DELETE": "delete"}[method]
    return group, resource, verb


def test_nats_and_the_kv_port_admit_only_corral_pods(rendered):
    """Neither NATS nor the KV data plane authenticates: network policies keep them in."""
    _, docs = rendered
    nats_policy = find(docs, "NetworkPolicy", "nats-clients")
    admitted = nats_policy["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"]
    for doc in docs:
        if doc["kind"] in ("Deployment", "StatefulSet"):  # every Corral pod may reach NATS
            labels = doc["spec"]["template"]["metadata"]["labels"]
            assert admitted.items() <= labels.items(), doc["metadata"]["name"]
    kv_policy = find(docs, "NetworkPolicy", "corral-llumlet-kv")
    rules = {tuple(p["port"] for p in rule["ports"]): rule.get("from") for rule in kv_policy["spec"]["ingress"]}
    every_llumlet = {"app.kubernetes.io/name": "corral-llumlet"}  # (both pools: P/D hand-offs cross them)
    assert rules[("kv",)] == [{"podSelector": {"matchLabels": every_llumlet}}]
    assert kv_policy["spec"]["podSelector"]["matchLabels"] == every_llumlet
    for llumlet in llumlet_deployments(docs):
        assert every_llumlet.items() <= llumlet["spec"]["selector"]["matchLabels"].items()
    assert rules[("metrics",)] is None  # Prometheus and probes from anywhere


def test_llumlet_count_is_the_autoscalers_not_the_manifests(rendered):
    """`kubectl apply` must not reset the count the autoscaler set: the Deployment it scales names
    none (as with a HorizontalPodAutoscaler), and the autoscaler brings a fresh one (1 pod) up to
    its initial count."""
    _, docs = rendered
    autoscaler = parse_corral(containers(find(docs, "Deployment", "corral-autoscaler"))[0]["args"])
    if autoscaler.initial_prefill:  # prefill/decode pools: a Deployment each
        scaled = [find(docs, "Deployment", autoscaler.k8s_prefill_deployment),
                  find(docs, "Deployment", autoscaler.k8s_decode_deployment)]
        initial = [autoscaler.initial_prefill, autoscaler.initial_decode]
    else:
        scaled, initial = [find(docs, "Deployment", autoscaler.k8s_deployment)], [autoscaler.initial_instances]
    assert all("replicas" not in deployment["spec"] for deployment in scaled)
    assert all(1 <= autoscaler.min_instances <= count <= autoscaler.max_instances for count in initial)
