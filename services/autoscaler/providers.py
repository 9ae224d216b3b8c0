"""Where instances come from. The local-process provider starts llumlets as child processes;
the interface admits others (docker compose, Kubernetes) that start them elsewhere."""

from __future__ import annotations

import itertools
import logging
import signal
import subprocess
import sys
from typing import Protocol

from services.supervisor import die_with_parent

log = logging.getLogger(__name__)


class InstanceProvider(Protocol):
    def start_instance(self) -> str:
        """Begin starting one instance; returns the instance id it will report under."""

    def stop_instance(self, instance_id: str) -> None:
        """Stop an instance (called only once it is drained and empty)."""

    def managed(self) -> set[str]:
        """Instances this provider started and has not stopped."""

    def stop_all(self) -> None: ...


class LocalProcessProvider:
    def __init__(self, nats_url: str, llumlet_args: list[str], prefix: str = "auto") -> None:
        self.nats_url = nats_url
        self.llumlet_args = llumlet_args
        self.prefix = prefix
        self._ids = itertools.count()
        self._processes: dict[str, subprocess.Popen] = {}

    def start_instance(self) -> str:
        instance_id = f"{self.prefix}-{next(self._ids)}"
        argv = [sys.executable, "-m", "services.cli", "llumlet", "--nats-url", self.nats_url,
                "--instance-id", instance_id, *self.llumlet_args]
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

    def stop_all(self) -> None:
        for instance_id in list(self._processes):
            self.stop_instance(instance_id)
