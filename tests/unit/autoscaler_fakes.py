"""An instance provider and a bus that record what an autoscaler asks of them (no processes, no NATS)."""

from __future__ import annotations

from shared.messages import Ack, InstanceRole, encode


class FakeProvider:
    def __init__(self) -> None:
        self.started: list[tuple[str, InstanceRole | None]] = []
        self.stopped: list[str] = []

    def start_instance(self, role=None) -> str:
        instance_id = f"auto-{len(self.started)}"
        self.started.append((instance_id, role))
        return instance_id

    def stop_instance(self, instance_id: str) -> None:
        self.stopped.append(instance_id)

    def managed(self) -> set[str]:
        return {iid for iid, _ in self.started} - set(self.stopped)

    def managed_in(self, role) -> set[str]:
        return {iid for iid, r in self.started if r is role} - set(self.stopped)

    def stop_all(self) -> None: ...


class FakeBus:
    def __init__(self) -> None:
        self.published: list[str] = []
        self.requests: list[str] = []
        self.request_payloads: list[bytes] = []

    async def publish(self, subject: str, data: bytes) -> None:
        self.published.append(subject)

    async def request(self, subject: str, data: bytes, timeout: float, headers: dict | None = None):
        self.requests.append(subject)
        self.request_payloads.append(data)
        return type("Reply", (), {"data": encode(Ack(ok=True))})()
