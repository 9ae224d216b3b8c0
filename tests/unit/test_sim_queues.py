from __future__ import annotations

import pytest

from shared.engine_model.queues import create_request_queue, select_victim
from shared.engine_model.request import SimRequest


def req(rid: str, arrival: float, priority: int = 0, prompt: int = 10, output: int = 10) -> SimRequest:
    return SimRequest(rid, prompt_len=prompt, max_tokens=output, priority=priority, arrival_time=arrival)


def ids(queue) -> list[str]:
    return [r.request_id for r in queue]


def test_fcfs_keeps_arrival_order_and_preempted_go_first() -> None:
    queue = create_request_queue("fcfs")
    for i in range(3):
        queue.add(req(f"r{i}", i))
    queue.add_front(req("preempted", 9))
    assert ids(queue) == ["preempted", "r0", "r1", "r2"]
    assert queue.peek().request_id == "preempted"
    assert queue.pop().request_id == "preempted" and len(queue) == 3


def test_priority_orders_by_priority_then_arrival() -> None:
    queue = create_request_queue("priority")
    queue.add(req("late-normal", 3, priority=0))
    queue.add(req("early-normal", 1, priority=0))
    queue.add(req("high", 5, priority=-1))
    assert ids(queue) == ["high", "early-normal", "late-normal"]
    assert [queue.pop().request_id for _ in range(3)] == ["high", "early-normal", "late-normal"]
    assert not queue


def test_priority_preempted_request_precedes_later_arrivals_of_its_level() -> None:
    queue = create_request_queue("priority")
    queue.add(req("newer", 5))
    queue.add_front(req("preempted-old", 1))
    assert queue.peek().request_id == "preempted-old"


def test_priority_requeues_a_victim_ahead_of_its_level_as_fcfs_does() -> None:
    # As FCFS's appendleft within a level: the latest victim first, even ahead of older waiting
    # requests (a victim that waits behind older ones by its arrival time is starved by them),
    # and never ahead of a more important request.
    queue = create_request_queue("priority")
    queue.add(req("old-waiting", 0))
    queue.add(req("high", 8, priority=-1))
    queue.add_front(req("victim-1", 5))
    queue.add_front(req("victim-2", 3))
    queue.add(req("new", 9))
    assert ids(queue) == ["high", "victim-2", "victim-1", "old-waiting", "new"]
    assert [queue.pop().request_id for _ in range(5)] == ["high", "victim-2", "victim-1", "old-waiting", "new"]


def test_priority_with_one_level_requeues_as_fcfs() -> None:
    fcfs, priority = create_request_queue("fcfs"), create_request_queue("priority")
    for queue in (fcfs, priority):
        for i in range(3):
            queue.add(req(f"r{i}", i))
        queue.add_front(req("victim-a", 7))
        queue.add_front(req("victim-b", 1))
    assert ids(priority) == ids(fcfs) == ["victim-b", "victim-a", "r0", "r1", "r2"]


def test_sjf_orders_by_total_work() -> None:
    queue = create_request_queue("sjf")
    queue.add(req("long", 0, prompt=500, output=500))
    queue.add(req("short", 2, prompt=10, output=20))
    queue.add(req("mid", 1, prompt=100, output=100))
    tie = SimRequest("short-by-target", prompt_len=10, max_tokens=500, target_output_len=5, arrival_time=3)
    queue.add(tie)
    assert ids(queue) == ["short-by-target", "short", "mid", "long"]


@pytest.mark.parametrize("policy", ["fcfs", "priority", "sjf"])
def test_remove_keeps_the_rest_in_order(policy: str) -> None:
    queue = create_request_queue(policy)
    requests = [req(f"r{i}", i, prompt=10 + i) for i in range(6)]
    for r in requests:
        queue.add(r)
    queue.remove(requests[2])
    queue.remove(requests[0])
    assert ids(queue) == ["r1", "r3", "r4", "r5"]
    assert [queue.pop().request_id for _ in range(4)] == ["r1", "r3", "r4", "r5"]


def test_unknown_policy_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown queue policy"):
        create_request_queue("lifo")


def test_victim_choice_per_policy() -> None:
    running = [req("a", 0, priority=-1), req("b", 2, priority=0, prompt=5), req("c", 1, priority=0, prompt=900)]
    assert select_victim("fcfs", running).request_id == "c"  # last in running order
    # The least important level, and in it the last in running order (as FCFS), not the latest
    # arrival: with one level Corral's priority queue preempts what Llumnix-base's FCFS does.
    assert select_victim("priority", running).request_id == "c"
    assert select_victim("priority", running[:2]).request_id == "b"
    assert select_victim("sjf", running).request_id == "c"  # the most work
