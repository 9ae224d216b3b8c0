"""Waiting queues behind one small interface, and the matching preemption victim choice.

Policies: "fcfs" (arrival order; preempted requests go back to the front), "priority" (lower
value first, then arrival), "sjf" (least total work first: prompt + expected output).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

from shared.engine_model.request import SimRequest

QUEUE_POLICIES = ("fcfs", "priority", "sjf")


class RequestQueue(Protocol):
    def add(self, request: SimRequest) -> None: ...

    def add_front(self, request: SimRequest) -> None:
        """Requeue a preempted request ahead of those that would otherwise tie with it."""

    def peek(self) -> SimRequest: ...

    def pop(self) -> SimRequest: ...

    def remove(self, request: SimRequest) -> None: ...

    def __len__(self) -> int: ...

    def __bool__(self) -> bool: ...

    def __iter__(self) -> Iterator[SimRequest]:
        """In scheduling order."""


class FCFSQueue:
    def __init__(self) -> None:
        self._queue: deque[SimRequest] = deque()

    def add(self, request: SimRequest) -> None:
        self._queue.append(request)

    def add_front(self, request: SimRequest) -> None:
        self._queue.appendleft(request)

    def peek(self) -> SimRequest:
        return self._queue[0]

    def pop(self) -> SimRequest:
        return self._queue.popleft()

    def remove(self, request: SimRequest) -> None:
        self._queue.remove(request)

    def __len__(self) -> int:
        return len(self._queue)

    def __bool__(self) -> bool:
        return bool(self._queue)

    def __iter__(self) -> Iterator[SimRequest]:
        return iter(self._queue)


class HeapQueue:
    """A heap on `key(request)`, ties broken by insertion order.

    `front_key`: where a preempted request re-enters (None: by `key`, like any other). The
    priority queue puts it ahead of every request of its level, the latest victim first, as
    FCFS's `appendleft` does. By arrival time instead, the order differed from FCFS's once
    migration ran: a migrated-in request joins the batch last with its old arrival time, so
    it is the first victim, and re-queued by that time it went ahead of the newer local
    victims (a short request that had just sampled its first token), which then waited until
    its long sequence fit again. On S-L at 8 req/s (v1, seed 0) a 3-token request waited 97 s
    so, and Corral's mean decode latency was 94 ms against Llumnix-base's 53 ms with the same
    requests (benchmarks/decode_tail.py); with this order the two run the same.
    vLLM's own priority queue re-queues by arrival time: the vLLM engine keeps that order."""

    def __init__(self, key: Callable[[SimRequest], tuple],
                 front_key: Callable[[SimRequest], tuple] | None = None) -> None:
        self._key = key
        self._front_key = front_key
        self._heap: list[tuple[tuple, int, SimRequest]] = []
        self._seq = itertools.count()

    def add(self, request: SimRequest) -> None:
        heapq.heappush(self._heap, (self._key(request), next(self._seq), request))

    def add_front(self, request: SimRequest) -> None:
        if self._front_key is None:
            self.add(request)
            return
        # A negative sequence: among re-queued requests of one level, the latest comes first.
        heapq.heappush(self._heap, (self._front_key(request), -next(self._seq), request))

    def peek(self) -> SimRequest:
        return self._heap[0][2]

    def pop(self) -> SimRequest:
        return heapq.heappop(self._heap)[2]

    def remove(self, request: SimRequest) -> None:
        index = next(i for i, entry in enumerate(self._heap) if entry[2] is request)
        last = self._heap.pop()
        if index < len(self._heap):
            self._heap[index] = last
            heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)

    def __iter__(self) -> Iterator[SimRequest]:
        return (entry[2] for entry in sorted(self._heap, key=lambda e: (e[0], e[1])))


def priority_key(request: SimRequest) -> tuple:
    return (request.priority, request.arrival_time)


def priority_front_key(request: SimRequest) -> tuple:
    """A preempted request: ahead of every waiting request of its priority level."""
    return (request.priority, -math.inf)


def sjf_key(request: SimRequest) -> tuple:
    return (request.prompt_len + request.expected_output_len, request.arrival_time)


def create_request_queue(policy: str) -> RequestQueue:
    if policy == "fcfs":
        return FCFSQueue()
    if policy == "priority":
        return HeapQueue(priority_key, priority_front_key)
    if policy == "sjf":
        return HeapQueue(sjf_key)
    raise ValueError(f"unknown queue policy {policy!r}; expected one of {QUEUE_POLICIES}")


def select_victim(policy: str, running: Sequence[SimRequest]) -> SimRequest:
    """The running request to preempt: the least important one under the queue's order.

    FCFS takes the last in running order (vLLM: `running.pop()`). Priority takes, among the
    least important level, the last in running order too: with one level it preempts exactly
    what FCFS does. (vLLM's priority scheduler breaks the tie by arrival time instead; here that
    made Corral at 0 % high priority preempt other requests than Llumnix-base with the same
    requests: a migrated-in request joins the batch last but keeps its older arrival time, so
    the newest local arrival, often a long prompt mid-prefill, was preempted in its place.)
    SJF takes the maximum of its key.
    """
    assert running, "no running request to preempt"
    if policy == "fcfs":
        return running[-1]
    if policy == "priority":
        least = max(r.priority for r in running)
        return next(r for r in reversed(running) if r.priority == least)
    return max(running, key=sjf_key)
