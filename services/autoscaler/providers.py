"""Where instances come from. The local-process provider starts llumlets as child processes; the
Kubernetes provider (`kubernetes_provider.py`) scales a llumlet Deployment."""

from __future__ import annotations

import argparse
import itertools
import logging
import signal
import subprocess
import sys
from typing import Protocol

from services.process_helpers import die_with_parent
from shared.config import env
from shared.messages import InstanceRole

log = logging.getLogger(__name__)


class ProviderError(RuntimeError):
    """An instance could not be started or stopped (the autoscaler logs it and tries again later)."""


class InstanceProvider(Protocol):
    def start_instance(self, role: InstanceRole | None = None) -> str:
        """Begin starting one instance (with `role`: of that prefill/decode pool); returns the
        instance id it will report under."""

    def stop_instance(self, instance_id: str) -> None:
        """Stop an instance (called only once it is drained and empty)."""

    def managed(self) -> set[str]:
        """Instances this provider started and has not stopped."""

    def managed_in(self, role: InstanceRole | None) -> set[str]:
        """Those of `managed` in one prefill/decode pool (None: without pools)."""

    def stop_all(self) -> None: ...


class LocalProcessProvider:
    def __init__(self, nats_url: str, llumlet_args: list[str], prefix: str = "auto") -> None:
        self.nats_url = nats_url
        self.llumlet_args = llumlet_args
        self.prefix = prefix
        self._ids = itertools.count()
        self._processes: dict[str, subprocess.Popen] = {}
        self._roles: dict[str, InstanceRole | None] = {}

    def start_instance(self, role: InstanceRole | None = None) -> str:
        instance_id = f"{self.prefix}-{next(self._ids)}"
        self._roles[instance_id] = role
        argv = [sys.executable, "-m", "services.cli", "llumlet", "--nats-url", self.nats_url,
                "--instance-id", instance_id, *self.llumlet_args, *(["--role", role.value] if role else [])]
        self._processes[instance_id] = subprocess.Popen(argv, preexec_fn=die_with_parent, start_new_session=True)
        log.info("started llumlet %s (pid %d)", instance_id, self._processes[instance_id].pid)
        return instance_id

    def stop_instance(self, instance_id: str) -> None:
        process = self._processes.pop(instance_id, None)
        if process is None:
            return
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.info("stopped llumlet %s", instance_id)

    def managed(self) -> set[str]:
        for instance_id, process in list(self._processes.items()):
            if process.poll() is not None:  # died on its own: nothing left to stop
                log.warning("llumlet %s exited with code %s", instance_id, process.returncode)
                del self._processes[instance_id]
        return set(self._processes)

    def managed_in(self, role: InstanceRole | None) -> set[str]:
        return {instance_id for instance_id in self.managed() if self._roles.get(instance_id) is role}

    def stop_all(self) -> None:
        for instance_id in list(self._processes):
            self.stop_instance(instance_id)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("instance provider")
    group.add_argument("--provider", choices=["local", "kubernetes"], default=env("PROVIDER", "local"),
                       help="local: llumlets as child processes; kubernetes: scale a llumlet Deployment")
    group.add_argument("--k8s-namespace", default=env("K8S_NAMESPACE", None),
                       help="the Deployment's namespace (default: this pod's, from the service account)")
    group.add_argument("--k8s-deployment", default=env("K8S_DEPLOYMENT", "corral-llumlet"))
    group.add_argument("--k8s-prefill-deployment", default=env("K8S_PREFILL_DEPLOYMENT", "corral-llumlet-prefill"),
                       help="with prefill/decode pools (--initial-prefill/--initial-decode): the prefill pool's Deployment")
    group.add_argument("--k8s-decode-deployment", default=env("K8S_DECODE_DEPLOYMENT", "corral-llumlet-decode"),
                       help="with prefill/decode pools: the decode pool's Deployment")
    group.add_argument("--k8s-api-url", default=env("K8S_API_URL", None),
                       help="API server URL (default: in-cluster configuration, else ~/.kube/config)")


def provider_from_args(args: argparse.Namespace, config) -> InstanceProvider:
    if args.provider == "local":
        return LocalProcessProvider(config.nats_url, config.llumlet_args, config.instance_prefix)
    from services.autoscaler.kubernetes_provider import KubernetesProvider, KubernetesSettings

    namespace = args.k8s_namespace or _service_account_namespace()
    if config.disaggregated:  # a Deployment per pool
        from services.autoscaler.kubernetes_pools import KubernetesPools

        if args.k8s_prefill_deployment == args.k8s_decode_deployment:
            raise SystemExit("autoscaler: the prefill and decode pools need a Deployment each")
        return KubernetesPools({
            InstanceRole.PREFILL: KubernetesProvider(KubernetesSettings(namespace, args.k8s_prefill_deployment,
                                                                        args.k8s_api_url)),
            InstanceRole.DECODE: KubernetesProvider(KubernetesSettings(namespace, args.k8s_decode_deployment,
                                                                       args.k8s_api_url)),
        })
    return KubernetesProvider(KubernetesSettings(namespace, args.k8s_deployment, args.k8s_api_url))


def _service_account_namespace() -> str:
    try:
        with open("/var/run/secrets/kubernetes.io/serviceaccount/namespace") as handle:
            return handle.read().strip()
    except OSError:
        raise SystemExit("autoscaler: --k8s-namespace is required outside a Kubernetes pod") from None
