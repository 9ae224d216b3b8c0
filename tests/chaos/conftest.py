"""Chaos fixtures: a cluster of real Corral processes on a NATS server of its own, per test
(a fault kills processes; the next test must start whole)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from shared.embedded_nats import start_nats
from tests.chaos.harness import SIM_ARGS
from tests.support.cluster import Cluster


KEPT_LOGS = Path(__file__).resolve().parents[2] / "results" / "chaos-logs"  # git-ignored


def pytest_collection_modifyitems(config, items):
    """Tests marked `chaos` (minutes long) run only when asked for: `-m chaos`."""
    if "chaos" in (config.getoption("markexpr") or ""):
        return
    skip = pytest.mark.skip(reason="a long chaos run: select it with -m chaos")
    for item in items:
        if item.get_closest_marker("chaos") is not None:
            item.add_marker(skip)


@pytest.fixture
def chaos_nats():
    server = start_nats()
    yield server
    server.stop()


@pytest.fixture
def make_cluster(chaos_nats, tiny_model_dir, tmp_path, request):
    """Start scheduler, `instances` simulated llumlets (sim-0…) and a gateway; stopped after."""
    clusters: list[Cluster] = []

    def make(instances: int = 3, llumlet_args: tuple[str, ...] = (), gateway_args: tuple[str, ...] = (),
             nats_url: str | None = None) -> Cluster:
        cluster = Cluster(nats_url or chaos_nats.url, tiny_model_dir, tmp_path / "logs")
        (tmp_path / "logs").mkdir(exist_ok=True)
        clusters.append(cluster)
        cluster.start_scheduler()
        for i in range(instances):
            cluster.start_llumlet(f"sim-{i}", *SIM_ARGS, *llumlet_args)
        cluster.start_gateway(*gateway_args)
        cluster.wait_ready(instances=instances)
        return cluster

    yield make
    for cluster in clusters:
        cluster.stop()
    # Every process's log, kept where the next test runs do not rotate it away.
    kept = KEPT_LOGS / request.node.name
    shutil.rmtree(kept, ignore_errors=True)
    shutil.copytree(tmp_path / "logs", kept, dirs_exist_ok=True)
