"""The autoscaler's Kubernetes provider against a stand-in API server (real REST shapes): scale out
names the new pod, scale in removes exactly the drained pod, conflicts are retried, and it asks
for nothing its Role does not grant."""

from __future__ import annotations

import pytest

pytest.importorskip("kubernetes")

from services.autoscaler.kubernetes_provider import (  # noqa: E402
    DELETION_COST,
    KubernetesProvider,
    KubernetesSettings,
)
from services.autoscaler.providers import ProviderError  # noqa: E402
from tests.deploy.kube_api_standin import KubeApiStandIn  # noqa: E402


def provider_for(api: KubeApiStandIn, **settings) -> KubernetesProvider:
    return KubernetesProvider(KubernetesSettings(api.namespace, api.deployment, api.url, **settings))


def test_scale_out_returns_the_new_pod_once_the_controller_creates_it():
    with KubeApiStandIn(replicas=2, pod_creation_delay_s=0.5) as api:
        provider = provider_for(api)
        before = provider.managed()
        assert len(before) == 2
        new = provider.start_instance()
        assert new not in before and new in {p.name for p in api.live_pods()}
        assert api.replicas == 3
        second = provider.start_instance()
        assert second not in before | {new} and api.replicas == 4
        assert provider.managed() == before | {new, second}
        # Patches carry a patch media type the API server accepts (the client's default, JSON
        # patch, would be refused with a dict body).
        patches = [ctype for method, _, ctype in api.requests if method == "PATCH"]
        assert patches and set(patches) == {"application/merge-patch+json"}


def test_scale_in_removes_the_drained_pod_not_the_one_the_controller_would_pick():
    with KubeApiStandIn(replicas=3) as api:
        provider = provider_for(api)
        oldest = min(api.live_pods(), key=lambda p: p.created).name
        # Without the annotation the controller deletes the newest pod; the drained one is the oldest.
        provider.stop_instance(oldest)
        assert api.deleted == [oldest]
        assert api.pods[oldest].annotations[DELETION_COST] == str(-(2**31))
        assert api.replicas == 2
        assert oldest not in provider.managed() and len(provider.managed()) == 2
        provider.stop_all()  # the Deployment outlives the autoscaler: nothing is scaled
        assert api.replicas == 2


def test_a_pod_marked_to_go_is_not_managed_before_the_controller_deletes_it():
    with KubeApiStandIn(replicas=3) as api:
        marked = min(api.live_pods(), key=lambda p: p.created).name
        api.pods[marked].annotations[DELETION_COST] = str(-(2**31))  # an earlier autoscaler's stop, mid-way
        managed = provider_for(api).managed()  # a restarted autoscaler's provider
        assert marked not in managed and len(managed) == 2


def test_a_concurrent_replica_change_is_read_again_not_overwritten():
    with KubeApiStandIn(replicas=2) as api:
        provider = provider_for(api)
        api.conflicts_to_inject = 2
        provider.start_instance()
        assert api.replicas == 3
        assert sum(1 for m, path, _ in api.requests if m == "PATCH" and path.endswith("/scale")) == 3


def test_a_pod_already_gone_still_takes_one_replica_away():
    with KubeApiStandIn(replicas=2) as api:
        provider = provider_for(api)
        gone = sorted(provider.managed())[0]
        api.remove_pod(gone)
        provider.stop_instance(gone)
        assert api.replicas == 1


def test_no_pod_appearing_is_a_provider_error_not_a_hang():
    with KubeApiStandIn(replicas=1, pod_creation_delay_s=30) as api:
        provider = provider_for(api, pod_appear_timeout_s=0.5)
        with pytest.raises(ProviderError, match="no new pod"):
            provider.start_instance()


def test_an_unreachable_api_server_is_a_provider_error():
    from tests.support.cluster import free_port

    provider = KubernetesProvider(KubernetesSettings("corral", "corral-llumlet", f"http://127.0.0.1:{free_port()}",
                                                     request_timeout_s=1.0))
    with pytest.raises(ProviderError):
        provider.managed()


async def test_the_autoscaler_adopts_the_deployment_pods_instead_of_adding_its_initial_count(nats_url):
    from services.autoscaler.config import AutoscalerConfig
    from services.autoscaler.service import Autoscaler

    with KubeApiStandIn(replicas=2) as api:
        autoscaler = Autoscaler(AutoscalerConfig(nats_url, initial_instances=3, tick_s=3600), provider_for(api))
        await autoscaler.start()
        try:
            assert api.replicas == 3  # two were there: one more, not three
            assert len(autoscaler._starting) == 1
        finally:
            await autoscaler.stop()
        assert api.replicas == 3  # stopping the autoscaler stops no llumlet
