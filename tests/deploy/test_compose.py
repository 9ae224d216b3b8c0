"""docker-compose.yml, resolved by a real compose implementation for every profile, and the
Dockerfile that builds what it runs. No Docker engine runs here: `config` resolves and validates
the file (schema, interpolation, anchors); nothing is started."""

from __future__ import annotations

import os
import re
import shlex

import pytest
import yaml

from tests.deploy.manifests import (
    active_services,
    compose_command,
    compose_config,
    corral_argv_of_shell,
    parse_corral,
    repo_path,
)
from tests.support.cluster import REPO

COMPOSE = compose_command()
needs_compose = pytest.mark.skipif(
    COMPOSE is None, reason="no compose implementation (docker compose / docker-compose): "
                            "scripts/install_compose.sh installs one (apt); scripts/test.sh runs it")
PROFILES = ["sim", "cpu", "gpu", "autoscale"]
ENGINE = {"sim": "sim", "cpu": "vllm", "gpu": "vllm"}
NO_HEALTH_ENDPOINT = {"autoscaler", "credentials"}  # no port (the credentials service runs once and exits)


def default_profiles() -> set[str]:
    """The profiles `docker compose up` uses with none named: COMPOSE_PROFILES in .env."""
    env_file = (REPO / ".env").read_text()
    match = re.search(r"^COMPOSE_PROFILES=(.*)$", env_file, re.M)
    return set(match.group(1).split(",")) if match else set()


@pytest.fixture(scope="module")
def resolved() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMPOSE_", "CORRAL_"))}
    return compose_config(COMPOSE, None, env)


def corral_argv(service: dict) -> list[str]:
    """The `corral …` argv a service of the corral image runs (entry point + command)."""
    entrypoint, command = service.get("entrypoint"), service.get("command") or []
    if entrypoint is None:
        return list(command)
    assert entrypoint[:2] == ["sh", "-c"], entrypoint
    return corral_argv_of_shell(entrypoint[2], [*entrypoint[3:], *command])  # sh -c SCRIPT $0 $@


def is_corral(service: dict) -> bool:
    """A service that runs a `corral` command (the credentials service runs python in the image)."""
    return re.match(r"^corral(-cuda)?:", service.get("image", "")) is not None and service.get(
        "entrypoint", [""])[0] != "python"


def published(service: dict) -> list[tuple[str, str, str]]:
    """(host address, host port, container port) of each published port, in either syntax."""
    result = []
    for port in service.get("ports", []):
        if isinstance(port, dict):
            result.append((port.get("host_ip", ""), str(port.get("published", "")), str(port["target"])))
        else:
            parts = str(port).split("/")[0].split(":")
            result.append((parts[0], parts[1], parts[2]) if len(parts) == 3 else ("", parts[0], parts[-1]))
    return result


@needs_compose
@pytest.mark.parametrize("profile", [None, *PROFILES])
def test_compose_config_resolves_for_every_profile(profile):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMPOSE_", "CORRAL_"))}
    config = compose_config(COMPOSE, profile, env)
    assert config["services"]


@needs_compose
@pytest.mark.parametrize("profile", PROFILES)
def test_each_profile_runs_one_gateway_and_its_own_llumlets(resolved, profile):
    services = active_services(resolved, {profile})
    assert {"nats", "scheduler", "prometheus", "grafana", "jaeger"} <= set(services)
    gateways = [n for n in services if n.startswith("gateway")]
    assert len(gateways) == 1, gateways
    llumlets = {n: s for n, s in services.items() if n.startswith("llumlet")}
    if profile == "autoscale":
        assert not llumlets and "autoscaler" in services
        args = parse_corral(corral_argv(services["autoscaler"]))
        assert args.provider == "local"
        llumlet = parse_corral(["llumlet", *shlex.split(args.llumlet_args)])
        assert llumlet.engine == "sim" and llumlet.kv_host == "0.0.0.0" and llumlet.kv_advertise_host == "10.0.0.7"
        assert "CORRAL_METRICS_PORT" not in services["autoscaler"]["environment"]  # its llumlets would collide
        return
    assert len(llumlets) == 1 and "autoscaler" not in services
    (name, llumlet), = llumlets.items()
    args = parse_corral(corral_argv(llumlet))
    assert args.command == "llumlet" and args.engine == ENGINE[profile]
    assert args.kv_host == "0.0.0.0" and args.kv_advertise_host == "10.0.0.7"
    if profile == "gpu":
        devices = llumlet["deploy"]["resources"]["reservations"]["devices"]
        assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
        assert llumlet["image"] == "corral-cuda:latest" and llumlet["build"]["args"]["VLLM_TARGET"] == "cuda"
        assert services[gateways[0]]["environment"]["CORRAL_MODEL_DIR"] == llumlet["environment"]["CORRAL_MODEL_DIR"]
    else:
        assert "resources" not in llumlet.get("deploy", {}) or "reservations" not in llumlet["deploy"]["resources"]
        assert llumlet["build"]["args"]["VLLM_TARGET"] == "cpu"


def test_the_default_profile_is_sim():
    assert default_profiles() == {"sim"}


@needs_compose
def test_every_corral_service_runs_an_entry_point_that_parses(resolved):
    commands = set()
    for name, service in resolved["services"].items():
        if is_corral(service):
            args = parse_corral(corral_argv(service))
            commands.add(args.command)
            if args.command == "autoscaler":  # the llumlets it starts take these flags
                parse_corral(["llumlet", *shlex.split(args.llumlet_args)])
    assert commands == {"scheduler", "gateway", "llumlet", "autoscaler"}


@needs_compose
def test_nothing_is_published_beyond_localhost_and_the_kv_port_not_at_all(resolved):
    for name, service in resolved["services"].items():
        for host_ip, host_port, target in published(service):
            assert host_ip == "127.0.0.1", f"{name} publishes {host_port} on {host_ip or 'every address'}"
            assert target != "7400", f"{name} publishes the KV data plane"
    assert any(p[2] == "4222" for p in published(resolved["services"]["nats"]))


@needs_compose
def test_health_checks_probe_the_ports_the_services_serve(resolved):
    for name, service in resolved["services"].items():
        if name in NO_HEALTH_ENDPOINT:
            assert "healthcheck" not in service
            continue
        assert "healthcheck" in service, f"{name} has no health check"
        if not is_corral(service):
            continue
        url = service["healthcheck"]["test"][-1]
        port = int(re.search(r":(\d+)/", url).group(1))
        args = parse_corral(corral_argv(service))
        expected = args.gateway_port if args.command == "gateway" else args.metrics_port
        assert port == expected, f"{name} probes {port}, serves {expected}"
        assert url.endswith("/ready")


@needs_compose
def test_mounted_files_exist_and_prometheus_scrapes_the_compose_services(resolved):
    for name, service in resolved["services"].items():
        for volume in service.get("volumes", []):
            source = volume["source"] if isinstance(volume, dict) else volume.split(":")[0]
            if source == "corral-credentials":  # the named volume the credentials service fills
                continue
            if "/models/gpu" in source:  # the gpu profile's model: the user's directory
                continue
            assert os.path.exists(source), f"{name} mounts {source}, which is not in the repository"
    prometheus = yaml.safe_load((REPO / "deploy" / "prometheus" / "prometheus.yml").read_text())
    services = resolved["services"]
    for job in prometheus["scrape_configs"]:
        for sd in job["dns_sd_configs"]:
            for target in sd["names"]:
                args = parse_corral(corral_argv(services[target]))
                port = args.gateway_port if args.command == "gateway" else args.metrics_port
                assert sd["port"] == port, f"{job['job_name']} scrapes {target}:{sd['port']}, it serves {port}"


def test_the_dockerfile_builds_what_compose_and_kubernetes_run():
    dockerfile = (REPO / "Dockerfile").read_text()
    for sources in re.findall(r"^COPY\s+(.+?)\s+\S+$", dockerfile, re.M):
        for source in sources.split():
            assert repo_path(source).exists(), f"Dockerfile copies {source}, which does not exist"
    assert re.search(r'^ENTRYPOINT \["corral"\]$', dockerfile, re.M)
    pyproject = (REPO / "pyproject.toml").read_text()
    assert 'corral = "services.cli:main"' in pyproject and "kubernetes = [" in pyproject
    assert '".[kubernetes]"' in dockerfile  # the autoscaler's Kubernetes provider is in the image
    # The model every profile but gpu serves is the one the image makes.
    made = re.search(r"corral make-model (\S+)", dockerfile).group(1)
    compose = (REPO / "docker-compose.yml").read_text()
    assert f"CORRAL_MODEL_DIR: {made}" in compose
    assert f"CORRAL_MODEL_DIR: {made}" in (REPO / "deploy" / "kubernetes" / "base" / "config.yaml").read_text()
    # The CPU image takes torch from the CPU index; the script it runs honours that and VLLM_TARGET.
    assert re.search(r"^ARG TORCH_CPU_INDEX_URL=https://download.pytorch.org/whl/cpu$", dockerfile, re.M)
    assert re.search(r"^ARG VLLM_TARGET=cpu$", dockerfile, re.M)
    install = (REPO / "scripts" / "install_vllm.sh").read_text()
    assert '"$TORCH_CPU_INDEX_URL"' in install and 'VLLM_TARGET="${VLLM_TARGET:-auto}"' in install
    # The build context leaves out the local virtualenv.
    assert ".venv" in (REPO / ".dockerignore").read_text().split()
    exposed = set(re.search(r"^EXPOSE (.+)$", dockerfile, re.M).group(1).split())
    assert {"8000", "9090", "7400"} <= exposed


@needs_compose
def test_grafana_is_provisioned_with_the_dashboard_and_prometheus(resolved):
    grafana = resolved["services"]["grafana"]
    mounts = {}
    for volume in grafana["volumes"]:
        source, target = (volume["source"], volume["target"]) if isinstance(volume, dict) else volume.split(":")[:2]
        mounts[target] = source
    provisioning = repo_path(mounts["/etc/grafana/provisioning"])
    provider = yaml.safe_load((provisioning / "dashboards" / "corral.yml").read_text())["providers"][0]
    dashboards = [t for t, s in mounts.items() if s.endswith(".json")]
    assert dashboards and all(t.startswith(provider["options"]["path"] + "/") for t in dashboards)
    assert grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"] in dashboards
    source = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())["datasources"][0]
    prometheus_port = published(resolved["services"]["prometheus"])[0][2]
    assert source["type"] == "prometheus" and source["url"] == f"http://prometheus:{prometheus_port}"


def test_prometheus_config_is_valid_for_promtool():
    import shutil
    import subprocess

    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (scripts/install_prometheus.sh installs it)")
    done = subprocess.run([promtool, "check", "config", str(REPO / "deploy" / "prometheus" / "prometheus.yml")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


@needs_compose
def test_every_corral_service_reads_its_roles_nats_credentials(resolved):
    """Each Corral service gets its own role's file from the credentials volume, the NATS server
    the configuration made with them, the llumlets the KV secret (SECURITY.md)."""
    from shared.nats_auth import ROLES

    services = resolved["services"]
    assert services["credentials"]["entrypoint"][:3] == ["python", "-m", "shared.nats_auth"]
    assert "/run/corral/nats-server.conf" in services["nats"]["command"]
    for name, service in services.items():
        if not is_corral(service):
            continue
        args = parse_corral(corral_argv(service))
        creds = service["environment"]["CORRAL_NATS_CREDS"]
        assert creds == f"/run/corral/{args.command}.creds" and args.command in ROLES, (name, creds)
        assert service["environment"]["CORRAL_KV_SECRET_FILE"] == "/run/corral/kv.secret"
        assert any("corral-credentials" in (v.get("source", "") if isinstance(v, dict) else v)
                   for v in service["volumes"]), name
        if args.command == "autoscaler":
            assert "--nats-creds /run/corral/llumlet.creds" in args.llumlet_args


def duration_s(text: str) -> float:
    """A compose duration ("150s", "2m30s", "1m") in seconds."""
    parts = re.findall(r"(\d+(?:\.\d+)?)(h|ms|m|s|us)", str(text))
    assert parts and "".join(n + u for n, u in parts) == str(text), f"not a compose duration: {text!r}"
    scale = {"h": 3600, "m": 60, "s": 1, "ms": 1e-3, "us": 1e-6}
    return sum(float(n) * scale[u] for n, u in parts)


@needs_compose
def test_services_stop_gracefully_before_docker_kills_them(resolved):
    """Compose's stand-in for Kubernetes' preStop drain: a llumlet's own SIGTERM drain (it reports
    itself draining and the scheduler migrates its requests out for --stop-grace-s; the behaviour
    is tests/chaos/test_instance_stop.py's) must end, with the engine's stop, before Docker's
    SIGKILL at stop_grace_period. Without one Docker kills after 10 s, mid-migration."""
    from services.gateway.server import GRACEFUL_SHUTDOWN_S

    services = resolved["services"]
    llumlets = {n: s for n, s in services.items() if n.startswith("llumlet")}
    assert set(llumlets) == {"llumlet", "llumlet-cpu", "llumlet-gpu"}
    for name, service in llumlets.items():
        args = parse_corral(corral_argv(service))
        assert service.get("stop_signal", "SIGTERM") == "SIGTERM", name  # what services.runner handles
        assert args.stop_grace_s >= 60, f"{name} drains for {args.stop_grace_s} s: too short to migrate out"
        assert duration_s(service["stop_grace_period"]) >= args.stop_grace_s + 20, name
    for name in ("gateway", "gateway-gpu"):  # streams end, then NATS drains
        assert duration_s(services[name]["stop_grace_period"]) >= GRACEFUL_SHUTDOWN_S + 10, name
    autoscaler = services["autoscaler"]
    args = parse_corral(corral_argv(autoscaler))
    children = parse_corral(["llumlet", *shlex.split(args.llumlet_args)])
    # Its local provider stops its llumlets one after another, each allowed 30 s before a kill
    # (services/autoscaler/providers.py), so a child's own drain must fit in that.
    assert children.stop_grace_s + 10 <= 30
    assert duration_s(autoscaler["stop_grace_period"]) >= args.max_instances * 30


def test_compose_durations_parse():
    assert duration_s("150s") == 150 and duration_s("2m30s") == 150 and duration_s("1h") == 3600
    with pytest.raises(AssertionError):
        duration_s("150")
