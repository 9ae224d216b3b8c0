"""Instances as the pods of one llumlet Deployment (the official `kubernetes` client).

Scale out: one more replica, through the Deployment's `scale` subresource, with the resourceVersion
read just before as a precondition (two writers cannot both add "one" to the same count). The
ReplicaSet controller names the new pod; we wait for a pod we have not seen and return its name,
which is the instance id the llumlet reports under (`CORRAL_INSTANCE_ID` from `metadata.name`).

Scale in: the autoscaler stops a pod only once it is drained and empty. We mark that pod with the
lowest `controller.kubernetes.io/pod-deletion-cost` and then take one replica away, so the
ReplicaSet controller deletes that pod and not another (the controller deletes not-ready pods
first, and a draining llumlet reports not ready, so the two agree). Its `preStop` drain then finds
it empty and returns at once.

The autoscaler going away does not stop any pod: the Deployment outlives it (`stop_all` is a no-op).
RBAC (deploy/kubernetes/base/autoscaler.yaml): get/patch `deployments/scale` on this Deployment,
list/patch `pods` in the namespace — nothing else.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass

import urllib3

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from services.autoscaler.providers import ProviderError

log = logging.getLogger(__name__)

DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
LOWEST_DELETION_COST = str(-(2**31))  # the annotation is an int32
_MERGE_PATCH = "application/merge-patch+json"


@dataclass
class KubernetesSettings:
    namespace: str
    deployment: str
    api_url: str | None = None  # None: in-cluster service account (or ~/.kube/config)
    pod_appear_timeout_s: float = 30.0
    request_timeout_s: float = 10.0


def api_client_for(settings: KubernetesSettings) -> client.ApiClient:
    if settings.api_url:  # an API server reached directly (kubectl proxy, or the tests' stand-in)
        configuration = client.Configuration()
        configuration.host = settings.api_url
        return client.ApiClient(configuration)
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return client.ApiClient()


class KubernetesProvider:
    def __init__(self, settings: KubernetesSettings, api: client.ApiClient | None = None) -> None:
        self.settings = settings
        api = api or api_client_for(settings)
        self.apps = client.AppsV1Api(api)
        self.core = client.CoreV1Api(api)
        self._claimed: set[str] = set()  # pods already returned by start_instance
        self._selector_cache: str | None = None

    # -- InstanceProvider -------------------------------------------------------------------------

    def start_instance(self, role=None) -> str:
        if role is not None:  # (refused at start-up: provider_from_args)
            raise ProviderError("one Deployment holds one role: prefill/decode pools are KubernetesPools")
        before = {pod.metadata.name for pod in self._pods()}
        self._change_replicas(+1)
        deadline = time.monotonic() + self.settings.pod_appear_timeout_s
        while time.monotonic() < deadline:
            new = sorted(name for name in self.managed() if name not in before and name not in self._claimed)
            if new:
                self._claimed.add(new[0])
                log.info("scaled %s out: pod %s", self.settings.deployment, new[0])
                return new[0]
            time.sleep(0.2)
        raise ProviderError(f"no new pod of deployment {self.settings.deployment} appeared within "
                            f"{self.settings.pod_appear_timeout_s:g} s (quota? admission?)")

    def stop_instance(self, instance_id: str) -> None:
        try:
            self.core.patch_namespaced_pod(
                instance_id, self.settings.namespace,
                {"metadata": {"annotations": {DELETION_COST: LOWEST_DELETION_COST}}},
                _content_type=_MERGE_PATCH, _request_timeout=self.settings.request_timeout_s)
        except urllib3.exceptions.HTTPError as exc:
            raise ProviderError(f"cannot mark pod {instance_id} for deletion: {exc}") from exc
        except ApiException as exc:
            if exc.status != 404:
                raise ProviderError(f"cannot mark pod {instance_id} for deletion: {exc.status} {exc.reason}") from exc
            # Gone already (its replacement, if any, is not ready and goes first).
            log.warning("pod %s is gone; taking one replica away all the same", instance_id)
        self._change_replicas(-1)
        self._claimed.discard(instance_id)
        log.info("scaled %s in: pod %s goes", self.settings.deployment, instance_id)

    def managed(self) -> set[str]:
        """Pods of the Deployment that are not being deleted, nor marked to go by a stop (this
        process's or, before a restart, an earlier one's) that the controller has not acted on yet."""
        return {pod.metadata.name for pod in self._pods() if pod.metadata.deletion_timestamp is None
                and (pod.metadata.annotations or {}).get(DELETION_COST) != LOWEST_DELETION_COST}

    def managed_in(self, role=None) -> set[str]:
        if role is not None:
            raise ProviderError("one Deployment holds one role: prefill/decode pools are KubernetesPools")
        return self.managed()

    def stop_all(self) -> None:
        """Nothing: the llumlets belong to the Deployment, not to this autoscaler process."""

    # -- API calls --------------------------------------------------------------------------------

    def _pods(self) -> list:
        selector = self._selector()
        with _api_errors("list the llumlet pods"):
            return self.core.list_namespaced_pod(self.settings.namespace, label_selector=selector,
                                                 _request_timeout=self.settings.request_timeout_s).items

    def _selector(self) -> str:
        """The Deployment's pod selector, as its scale subresource states it (read once)."""
        if self._selector_cache is not None:
            return self._selector_cache
        with _api_errors(f"read deployment {self.settings.deployment}"):
            scale = self.apps.read_namespaced_deployment_scale(self.settings.deployment, self.settings.namespace,
                                                              _request_timeout=self.settings.request_timeout_s)
        if not scale.status.selector:
            raise ProviderError(f"deployment {self.settings.deployment} has no pod selector")
        self._selector_cache = scale.status.selector
        return self._selector_cache

    def _change_replicas(self, delta: int, attempts: int = 5) -> int:
        """Add `delta` to the replica count; retried when another writer changed it meanwhile."""
        name, namespace, timeout = self.settings.deployment, self.settings.namespace, self.settings.request_timeout_s
        for _ in range(attempts):
            try:
                scale = self.apps.read_namespaced_deployment_scale(name, namespace, _request_timeout=timeout)
                replicas = max(0, (scale.spec.replicas or 0) + delta)
                body = {"metadata": {"resourceVersion": scale.metadata.resource_version}, "spec": {"replicas": replicas}}
                self.apps.patch_namespaced_deployment_scale(name, namespace, body, _content_type=_MERGE_PATCH,
                                                            _request_timeout=timeout)
                return replicas
            except ApiException as exc:
                if exc.status == 409:  # resourceVersion moved on: read again
                    continue
                raise ProviderError(f"cannot scale deployment {name}: {exc.status} {exc.reason}") from exc
            except urllib3.exceptions.HTTPError as exc:
                raise ProviderError(f"cannot scale deployment {name}: {exc}") from exc
        raise ProviderError(f"cannot scale deployment {name}: the replica count kept changing")


@contextlib.contextmanager
def _api_errors(what: str) -> Iterator[None]:
    """An API server that refuses or is away becomes a ProviderError (the autoscaler retries)."""
    try:
        yield
    except ApiException as exc:
        raise ProviderError(f"cannot {what}: {exc.status} {exc.reason}") from exc
    except urllib3.exceptions.HTTPError as exc:
        raise ProviderError(f"cannot {what}: {exc}") from exc
