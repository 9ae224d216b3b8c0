"""A stand-in Kubernetes API server for the few endpoints the autoscaler's provider uses, with the
real REST shapes (Scale, PodList, Pod, Status errors, merge-patch content types, resourceVersion
preconditions) and a ReplicaSet controller that creates and deletes pods as the real one ranks
them: not-ready pods first, then the lowest `controller.kubernetes.io/pod-deletion-cost`, then the
newest. No cluster runs on these machines; this is what the provider is tested against.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from tests.support.cluster import free_port

DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
PATCH_TYPES = ("application/merge-patch+json", "application/strategic-merge-patch+json")


@dataclass
class FakePod:
    name: str
    labels: dict[str, str]
    created: float
    ready: bool = True
    annotations: dict[str, str] = field(default_factory=dict)
    deleted_at: float | None = None

    def deletion_cost(self) -> int:
        return int(self.annotations.get(DELETION_COST, "0"))

    def to_json(self, namespace: str) -> dict:
        metadata = {
            "name": self.name, "namespace": namespace, "uid": f"uid-{self.name}", "labels": self.labels,
            "annotations": self.annotations, "creationTimestamp": _timestamp(self.created), "resourceVersion": "1",
        }
        if self.deleted_at is not None:
            metadata["deletionTimestamp"] = _timestamp(self.deleted_at)
        return {
            "kind": "Pod", "apiVersion": "v1", "metadata": metadata,
            "spec": {"containers": [{"name": "llumlet", "image": "corral:test"}]},
            "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True" if self.ready else "False"}]},
        }


@dataclass
class FakeDeployment:
    """A Deployment's scale subresource and its ReplicaSet controller's bookkeeping."""

    name: str
    labels: dict[str, str]  # its pods', and its selector
    replicas: int = 0
    resource_version: int = 1
    deleted: list[str] = field(default_factory=list)  # pod names, in the order the controller deleted them
    replica_history: list[int] = field(default_factory=list)
    conflicts_to_inject: int = 0  # answer this many scale patches with 409 as if another writer won
    names: itertools.count = field(default_factory=itertools.count)


class KubeApiStandIn:
    """One namespace, its llumlet Deployment(s) (their scale subresources) and their pods.

    `deployment` is the one the attributes below speak of (`replicas`, `deleted`, ...); `more`
    adds Deployments (name -> replicas) whose pods carry a label of their own, so that each
    Deployment's selector matches its pods only (prefill/decode pools)."""

    def __init__(self, namespace: str = "corral", deployment: str = "corral-llumlet", replicas: int = 2,
                 pod_creation_delay_s: float = 0.0, kubelet: Kubelet | None = None,
                 more: dict[str, int] | None = None) -> None:
        self.namespace, self.deployment = namespace, deployment
        base = {"app.kubernetes.io/name": "corral-llumlet"}
        self.deployments = {name: FakeDeployment(name, {**base, "app.kubernetes.io/component": name} if more else base)
                            for name in (deployment, *(more or {}))}
        self.pod_creation_delay_s = pod_creation_delay_s
        self.kubelet = kubelet
        self.pods: dict[str, FakePod] = {}
        self.requests: list[tuple[str, str, str]] = []  # (method, path, content type)
        self._lock = threading.RLock()
        for name, count in {deployment: replicas, **(more or {})}.items():
            self._set_replicas(self.deployments[name], count, delay=False)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        prefix = f"/apis/apps/v1/namespaces/{namespace}/deployments/{{deployment}}/scale"
        app = Starlette(routes=[
            Route(prefix, self._get_scale, methods=["GET"]),
            Route(prefix, self._patch_scale, methods=["PATCH"]),
            Route(f"/api/v1/namespaces/{namespace}/pods", self._list_pods, methods=["GET"]),
            Route(f"/api/v1/namespaces/{namespace}/pods/{{name}}", self._patch_pod, methods=["PATCH"]),
        ])
        app.add_middleware(_Recorder, requests=self.requests)
        self._server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    # The first Deployment's state, as the single-Deployment tests read it.
    @property
    def primary(self) -> FakeDeployment:
        return self.deployments[self.deployment]

    @property
    def replicas(self) -> int:
        return self.primary.replicas

    @property
    def deleted(self) -> list[str]:
        return self.primary.deleted

    @property
    def replica_history(self) -> list[int]:
        return self.primary.replica_history

    @property
    def conflicts_to_inject(self) -> int:
        return self.primary.conflicts_to_inject

    @conflicts_to_inject.setter
    def conflicts_to_inject(self, value: int) -> None:
        self.primary.conflicts_to_inject = value

    def __enter__(self) -> KubeApiStandIn:
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline:
                raise TimeoutError("stand-in API server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        self._thread.join(10)

    # -- the ReplicaSet controller ---------------------------------------------------------------

    def live_pods(self, deployment: str | None = None) -> list[FakePod]:
        labels = self.deployments[deployment or self.deployment].labels
        return [pod for pod in self.pods.values() if pod.deleted_at is None and pod.labels == labels]

    def _set_replicas(self, deployment: FakeDeployment, replicas: int, delay: bool = True) -> None:
        deployment.replicas = replicas
        deployment.replica_history.append(replicas)
        live = self.live_pods(deployment.name)
        for _ in range(replicas - len(live)):
            name = f"{deployment.name}-7d9f8b-{next(deployment.names):05d}"
            if delay and self.pod_creation_delay_s > 0:
                threading.Timer(self.pod_creation_delay_s, self._create, (name, deployment.labels)).start()
            else:
                self._create(name, deployment.labels)
        # Who goes: not ready first, then the lowest deletion cost, then the newest.
        ranked = sorted(live, key=lambda p: (self._ready(p), p.deletion_cost(), -p.created))
        for pod in ranked[: max(0, len(live) - replicas)]:
            pod.deleted_at = time.time()
            deployment.deleted.append(pod.name)
            if self.kubelet is not None:
                threading.Thread(target=self.kubelet.stop, args=(pod.name,), daemon=True).start()

    def _ready(self, pod: FakePod) -> bool:
        return self.kubelet.ready(pod.name) if self.kubelet is not None else pod.ready

    def _create(self, name: str, labels: dict[str, str]) -> None:
        with self._lock:
            self.pods[name] = FakePod(name, dict(labels), time.time())
            if self.kubelet is not None:
                self.kubelet.start(name)

    # -- endpoints -------------------------------------------------------------------------------

    def _scale_json(self, deployment: FakeDeployment) -> dict:
        return {
            "kind": "Scale", "apiVersion": "autoscaling/v1",
            "metadata": {"name": deployment.name, "namespace": self.namespace, "uid": f"uid-{deployment.name}",
                         "resourceVersion": str(deployment.resource_version), "creationTimestamp": _timestamp(0)},
            "spec": {"replicas": deployment.replicas},
            "status": {"replicas": len(self.live_pods(deployment.name)), "selector": _selector(deployment.labels)},
        }

    def _deployment_of(self, request: Request) -> FakeDeployment | None:
        return self.deployments.get(request.path_params["deployment"])

    async def _get_scale(self, request: Request) -> JSONResponse:
        with self._lock:
            deployment = self._deployment_of(request)
            if deployment is None:
                return _not_found_deployment(request)
            return JSONResponse(self._scale_json(deployment))

    async def _patch_scale(self, request: Request) -> JSONResponse:
        if request.headers.get("content-type") not in PATCH_TYPES:
            return _status(415, "UnsupportedMediaType", f"the body of the request was in an unknown format - "
                                                        f"accepted media types include: {', '.join(PATCH_TYPES)}")
        patch = json.loads(await request.body())
        with self._lock:
            deployment = self._deployment_of(request)
            if deployment is None:
                return _not_found_deployment(request)
            wanted_version = patch.get("metadata", {}).get("resourceVersion")
            if deployment.conflicts_to_inject > 0:
                deployment.conflicts_to_inject -= 1
                deployment.resource_version += 1  # another writer got there first
            if wanted_version is not None and wanted_version != str(deployment.resource_version):
                return _status(409, "Conflict", 'Operation cannot be fulfilled on deployments.apps '
                                                f'"{deployment.name}": the object has been modified')
            replicas = patch.get("spec", {}).get("replicas")
            if not isinstance(replicas, int) or replicas < 0:
                return _status(422, "Invalid", "spec.replicas: must be a non-negative integer")
            deployment.resource_version += 1
            self._set_replicas(deployment, replicas)
            return JSONResponse(self._scale_json(deployment))

    async def _list_pods(self, request: Request) -> JSONResponse:
        wanted = _parse_selector(request.query_params.get("labelSelector", ""))
        with self._lock:
            items = [pod.to_json(self.namespace) for pod in self.pods.values()
                     if all(pod.labels.get(k) == v for k, v in wanted.items())]
        return JSONResponse({"kind": "PodList", "apiVersion": "v1",
                             "metadata": {"resourceVersion": str(self.primary.resource_version)}, "items": items})

    async def _patch_pod(self, request: Request) -> JSONResponse:
        if request.headers.get("content-type") not in PATCH_TYPES:
            return _status(415, "UnsupportedMediaType", "unknown patch format")
        name = request.path_params["name"]
        patch = json.loads(await request.body())
        with self._lock:
            pod = self.pods.get(name)
            if pod is None:
                return _status(404, "NotFound", f'pods "{name}" not found')
            for key, value in patch.get("metadata", {}).get("annotations", {}).items():
                if value is None:
                    pod.annotations.pop(key, None)
                else:
                    pod.annotations[key] = value
            return JSONResponse(pod.to_json(self.namespace))

    def remove_pod(self, name: str) -> None:
        """The pod is gone from the API (e.g. its node failed and it was force-deleted)."""
        with self._lock:
            del self.pods[name]


@dataclass
class Kubelet:
    """What runs a pod: start it, stop it (preStop, then SIGTERM), ask its readiness probe."""

    start: Callable[[str], None]
    stop: Callable[[str], None]
    ready: Callable[[str], bool]


class _Recorder:
    def __init__(self, app, requests: list) -> None:
        self.app, self.requests = app, requests

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            headers = dict(scope["headers"])
            self.requests.append((scope["method"], scope["path"], headers.get(b"content-type", b"").decode()))
        await self.app(scope, receive, send)


def _status(code: int, reason: str, message: str) -> JSONResponse:
    body = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
            "reason": reason, "code": code}
    return JSONResponse(body, status_code=code)


def _not_found_deployment(request: Request) -> JSONResponse:
    return _status(404, "NotFound", f'deployments.apps "{request.path_params["deployment"]}" not found')


def _selector(labels: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


def _parse_selector(selector: str) -> dict[str, str]:
    return dict(part.split("=", 1) for part in selector.split(",") if part)


def _timestamp(seconds: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))
