"""`corral up` starts a child that died again, backing off while it keeps dying."""

from __future__ import annotations

import threading
import time

from services import supervisor
from services.supervisor import Child, Cluster, watch


def test_a_dead_child_is_started_again_with_backoff(monkeypatch):
    monkeypatch.setattr(supervisor, "RESTART_FIRST_S", 0.2)
    child = Child("crashing", ["no-such-command"])  # services.cli exits at once (usage error)
    cluster = Cluster(children=[child])
    child.start()
    starts: list[int] = []
    original = child.start

    def counted() -> None:
        original()
        starts.append(child.process.pid)

    child.start = counted
    stop = threading.Event()
    watcher = threading.Thread(target=watch, args=(cluster, stop.is_set))
    watcher.start()
    time.sleep(3.0)
    stop.set()
    watcher.join()
    if child.process.poll() is None:
        child.process.kill()
        child.process.wait()
    # Waits of 0.2, 0.4, 0.8, 1.6 s (plus each start's own second or so): restarted, but backing off.
    assert 1 <= len(starts) <= 3, starts
    assert len(set(starts)) == len(starts)
