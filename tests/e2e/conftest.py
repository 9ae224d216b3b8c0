"""End-to-end fixtures: a real cluster of Corral processes with the simulated engine."""

from __future__ import annotations

import pytest

from tests.support.cluster import Cluster

SIM_ARGS = ("--sim-time-scale", "0.1", "--sim-num-blocks", "400", "--max-model-len", "2048")


@pytest.fixture(scope="module")
def sim_cluster(tiny_model_dir, tmp_path_factory):
    """Scheduler + 3 simulated llumlets + gateway, on a NATS server of their own (tests that
    kill services must not disturb other modules)."""
    from shared.embedded_nats import start_nats

    nats = start_nats()
    cluster = Cluster(nats.url, tiny_model_dir, tmp_path_factory.mktemp("cluster-logs"))
    cluster.start_scheduler()
    for i in range(3):
        cluster.start_llumlet(f"sim-{i}", *SIM_ARGS)
    cluster.start_gateway()
    try:
        cluster.wait_ready(instances=3)
        yield cluster
    finally:
        cluster.stop()
        nats.stop()
