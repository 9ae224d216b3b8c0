"""Prefill/decode pools on Kubernetes (issue 19 §2 with the Kubernetes provider): one llumlet
Deployment per role, each scaled by a `KubernetesProvider` of its own (scale out by one replica,
scale in by marking the drained pod with the lowest pod-deletion cost first).

The autoscaler names a role when it starts an instance and only an instance id when it stops one:
the pool a pod belongs to is remembered from its start, or from the pools' pod lists (`managed`,
which the autoscaler reads before it drains a victim, also after a restart). The Role needs the
same grants as for one Deployment, for both (deploy/kubernetes/components/pd-pools, in the -pd overlays).
"""

from __future__ import annotations

import logging

from services.autoscaler.kubernetes_provider import KubernetesProvider
from services.autoscaler.providers import ProviderError
from shared.messages import InstanceRole

log = logging.getLogger(__name__)


class KubernetesPools:
    def __init__(self, pools: dict[InstanceRole, KubernetesProvider]) -> None:
        assert set(pools) == {InstanceRole.PREFILL, InstanceRole.DECODE}, pools
        self.pools = pools
        self._pool_of: dict[str, InstanceRole] = {}

    def start_instance(self, role: InstanceRole | None = None) -> str:
        if role not in self.pools:
            raise ProviderError(f"prefill/decode pools: an instance is started in a pool (prefill or decode), not {role}")
        instance_id = self.pools[role].start_instance()
        self._pool_of[instance_id] = role
        return instance_id

    def stop_instance(self, instance_id: str) -> None:
        role = self._pool_of.get(instance_id)
        if role is None:
            self.managed()  # (a pod started before a restart of this process)
            role = self._pool_of.get(instance_id)
        if role is None:
            log.warning("pod %s is in neither pool's Deployment: nothing to scale in", instance_id)
            return
        self.pools[role].stop_instance(instance_id)
        del self._pool_of[instance_id]

    def managed(self) -> set[str]:
        every: set[str] = set()
        for role in self.pools:
            every |= self.managed_in(role)
        return every

    def managed_in(self, role: InstanceRole | None) -> set[str]:
        if role not in self.pools:
            raise ProviderError(f"prefill/decode pools: no pool {role}")
        pods = self.pools[role].managed()
        for pod in pods:
            self._pool_of[pod] = role
        return pods

    def stop_all(self) -> None:
        """Nothing: the llumlets belong to the Deployments, not to this autoscaler process."""
