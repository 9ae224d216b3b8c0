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


class KubeApiStandIn:
    """One namespace, one Deployment (its scale subresource) and its pods."""

    def __init__(self, namespace: str = "corral", deployment: str = "corral-llumlet", replicas: int = 2,
                 pod_creation_delay_s: float = 0.0, kubelet: Kubelet | None = None) -> None:
        self.namespace, self.deployment = namespace, deployment
        self.labels = {"app.kubernetes.io/name": "corral-llumlet"}
        self.replicas = 0
        self.resource_version = 1
        self.pod_creation_delay_s = pod_creation_delay_s
        self.kubelet = kubelet
        self.pods: dict[str, FakePod] = {}
        self.deleted: list[str] = []  # pod names, in the order the controller deleted them
        self.replica_history: list[int] = []
        self.requests: list[tuple[str, str, str]] = []  # (method, path, content type)
        self.conflicts_to_inject = 0  # answer this many scale patches with 409 as if another writer won
        self._names = itertools.count()
        self._lock = threading.RLock()
        self._set_replicas(replicas, delay=False)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        prefix = f"/apis/apps/v1/namespaces/{namespace}/deployments/{deployment}/scale"
        app = Starlette(routes=[
            Route(prefix, self._get_scale, methods=["GET"]),
            Route(prefix, self._patch_scale, methods=["PATCH"]),
            Route(f"/api/v1/namespaces/{namespace}/pods", self._list_pods, methods=["GET"]),
            Route(f"/api/v1/namespaces/{namespace}/pods/{{name}}", self._patch_pod, methods=["PATCH"]),
        ])
        app.add_middleware(_Recorder, requests=self.requests)
        self._server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self._thread = threading.Thread(target=self._server.run, daemon=True)

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

    def live_pods(self) -> list[FakePod]:
        return [pod for pod in self.pods.values() if pod.deleted_at is None]

    def _set_replicas(self, replicas: int, delay: bool = True) -> None:
        self.replicas = replicas
        self.replica_history.append(replicas)
        live = self.live_pods()
        for _ in range(replicas - len(live)):
            name = f"{self.deployment}-7d9f8b-{next(self._names):05d}"
            if delay and self.pod_creation_delay_s > 0:
                threading.Timer(self.pod_creation_delay_s, self._create, (name,)).start()
            else:
                self._create(name)
        # Who goes: not ready first, then the lowest deletion cost, then the newest.
        ranked = sorted(live, key=lambda p: (self._ready(p), p.deletion_cost(), -p.created))
        for pod in ranked[: max(0, len(live) - replicas)]:
            pod.deleted_at = time.time()
            self.deleted.append(pod.name)
            if self.kubelet is not None:
                threading.Thread(target=self.kubelet.stop, args=(pod.name,), daemon=True).start()

    def _ready(self, pod: FakePod) -> bool:
        return self.kubelet.ready(pod.name) if self.kubelet is not None else pod.ready

    def _create(self, name: str) -> None:
        with self._lock:
            self.pods[name] = FakePod(name, dict(self.labels), time.time())
            if self.kubelet is not None:
                self.kubelet.start(name)

    # -- endpoints -------------------------------------------------------------------------------

    def _scale_json(self) -> dict:
        return {
            "kind": "Scale", "apiVersion": "autoscaling/v1",
            "metadata": {"name": self.deployment, "namespace": self.namespace, "uid": "uid-deploy",
                         "resourceVersion": str(self.resource_version), "creationTimestamp": _timestamp(0)},
            "spec": {"replicas": self.replicas},
            "status": {"replicas": len(self.live_pods()), "selector": _selector(self.labels)},
        }

    async def _get_scale(self, request: Request) -> JSONResponse:
        with self._lock:
            return JSONResponse(self._scale_json())

    async def _patch_scale(self, request: Request) -> JSONResponse:
        if request.headers.get("content-type") not in PATCH_TYPES:
            return _status(415, "UnsupportedMediaType", f"the body of the request was in an unknown format - "
                                                        f"accepted media types include: {', '.join(PATCH_TYPES)}")
        patch = json.loads(await request.body())
        with self._lock:
            wanted_version = patch.get("metadata", {}).get("resourceVersion")
            if self.conflicts_to_inject > 0:
                self.conflicts_to_inject -= 1
                self.resource_version += 1  # another writer got there first
            if wanted_version is not None and wanted_version != str(self.resource_version):
                return _status(409, "Conflict", 'Operation cannot be fulfilled on deployments.apps '
                                                f'"{self.deployment}": the object has been modified')
            replicas = patch.get("spec", {}).get("replicas")
            if not isinstance(replicas, int) or replicas < 0:
                return _status(422, "Invalid", "spec.replicas: must be a non-negative integer")
            self.resource_version += 1
            self._set_replicas(replicas)
            return JSONResponse(self._scale_json())

    async def _list_pods(self, request: Request) -> JSONResponse:
        wanted = _parse_selector(request.query_params.get("labelSelector", ""))
        with self._lock:
            items = [pod.to_json(self.namespace) for pod in self.pods.values()
                     if all(pod.labels.get(k) == v for k, v in wanted.items())]
        return JSONResponse({"kind": "PodList", "apiVersion": "v1",
                             "metadata": {"resourceVersion": str(self.resource_version)}, "items": items})

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


def _selector(labels: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


def _parse_selector(selector: str) -> dict[str, str]:
    return dict(part.split("=", 1) for part in selector.split(",") if part)


def _timestamp(seconds: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))
