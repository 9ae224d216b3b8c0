"""Prefill/decode pools on Kubernetes (issue 19 §2, issue 17 §1): the autoscaler's pools provider
scales a Deployment per role on one stand-in API server (real REST shapes), stops a drained pod
through its own pool's Deployment (also after an autoscaler restart), and the autoscaler counts
the pods each pool already has."""

from __future__ import annotations

import argparse
from dataclasses import replace

import pytest

pytest.importorskip("kubernetes")

from services.autoscaler.config import add_arguments as add_autoscaler_arguments  # noqa: E402
from services.autoscaler.config import config_from_args  # noqa: E402
from services.autoscaler.kubernetes_pools import KubernetesPools  # noqa: E402
from services.autoscaler.kubernetes_provider import DELETION_COST, KubernetesProvider, KubernetesSettings  # noqa: E402
from services.autoscaler.providers import ProviderError, provider_from_args  # noqa: E402
from services.autoscaler.providers import add_arguments as add_provider_arguments  # noqa: E402
from services.autoscaler.service import Autoscaler  # noqa: E402
from shared.messages import InstanceRole  # noqa: E402
from tests.deploy.kube_api_standin import KubeApiStandIn  # noqa: E402

PREFILL, DECODE = "corral-llumlet-prefill", "corral-llumlet-decode"


def standin(prefill: int = 1, decode: int = 1) -> KubeApiStandIn:
    return KubeApiStandIn(deployment=PREFILL, replicas=prefill, more={DECODE: decode})


def pools_for(api: KubeApiStandIn) -> KubernetesPools:
    return KubernetesPools({
        InstanceRole.PREFILL: KubernetesProvider(KubernetesSettings(api.namespace, PREFILL, api.url)),
        InstanceRole.DECODE: KubernetesProvider(KubernetesSettings(api.namespace, DECODE, api.url)),
    })


def pod_names(api: KubeApiStandIn, deployment: str) -> set[str]:
    return {pod.name for pod in api.live_pods(deployment)}


def test_each_role_scales_its_own_deployment():
    with standin() as api:
        pools = pools_for(api)
        assert pools.managed_in(InstanceRole.PREFILL) == pod_names(api, PREFILL)
        assert pools.managed() == pod_names(api, PREFILL) | pod_names(api, DECODE)
        new_decode = pools.start_instance(InstanceRole.DECODE)
        assert new_decode in pod_names(api, DECODE)
        assert (api.deployments[PREFILL].replicas, api.deployments[DECODE].replicas) == (1, 2)
        new_prefill = pools.start_instance(InstanceRole.PREFILL)
        assert new_prefill in pod_names(api, PREFILL)
        assert (api.deployments[PREFILL].replicas, api.deployments[DECODE].replicas) == (2, 2)
        with pytest.raises(ProviderError, match="pool"):
            pools.start_instance(None)


def test_a_drained_pod_goes_through_its_own_pools_deployment_also_after_a_restart():
    with standin(prefill=3, decode=2) as api:
        oldest_decode = min(api.live_pods(DECODE), key=lambda p: p.created).name
        oldest_prefill = min(api.live_pods(PREFILL), key=lambda p: p.created).name
        pools = pools_for(api)
        pools.managed()  # (the autoscaler lists before it drains a victim)
        pools.stop_instance(oldest_decode)
        assert api.deployments[DECODE].deleted == [oldest_decode] and api.deployments[DECODE].replicas == 1
        assert api.deployments[PREFILL].replicas == 3 and api.deployments[PREFILL].deleted == []
        restarted = pools_for(api)  # knows no pod yet: finds the pool from the Deployments' pod lists
        restarted.stop_instance(oldest_prefill)
        assert api.deployments[PREFILL].deleted == [oldest_prefill]
        assert api.pods[oldest_prefill].annotations[DELETION_COST] == str(-(2**31))
        assert (api.deployments[PREFILL].replicas, api.deployments[DECODE].replicas) == (2, 1)
        restarted.stop_instance("not-a-pod-of-either")  # logged; no Deployment is scaled for it
        assert (api.deployments[PREFILL].replicas, api.deployments[DECODE].replicas) == (2, 1)


def autoscaler_config(*argv: str):
    parser = argparse.ArgumentParser()
    add_autoscaler_arguments(parser)
    add_provider_arguments(parser)
    return parser.parse_args(["--nats-url", "nats://unused:4222", *argv])


def test_the_kubernetes_provider_with_pool_counts_is_the_pools_provider():
    args = autoscaler_config("--provider", "kubernetes", "--k8s-namespace", "corral", "--k8s-api-url",
                             "http://127.0.0.1:1", "--initial-prefill", "2", "--initial-decode", "1")
    provider = provider_from_args(args, config_from_args(args))
    assert isinstance(provider, KubernetesPools)
    assert {role: p.settings.deployment for role, p in provider.pools.items()} == {
        InstanceRole.PREFILL: PREFILL, InstanceRole.DECODE: DECODE}
    same = autoscaler_config("--provider", "kubernetes", "--k8s-namespace", "corral", "--initial-prefill", "1",
                             "--initial-decode", "1", "--k8s-prefill-deployment", "x", "--k8s-decode-deployment", "x")
    with pytest.raises(SystemExit, match="a Deployment each"):
        provider_from_args(same, config_from_args(same))


async def test_the_autoscaler_starts_only_what_each_pool_lacks(nats_url):
    with standin(prefill=1, decode=2) as api:  # pods that outlived an earlier autoscaler
        args = autoscaler_config("--initial-prefill", "2", "--initial-decode", "1", "--max-instances", "4",
                                 "--tick-s", "60")
        config = config_from_args(args)
        scaler = Autoscaler(replace(config, nats_url=nats_url), pools_for(api))
        await scaler.start()
        try:
            assert (api.deployments[PREFILL].replicas, api.deployments[DECODE].replicas) == (2, 2)
            assert list(scaler._roles.values()) == [InstanceRole.PREFILL]
        finally:
            await scaler.stop()
