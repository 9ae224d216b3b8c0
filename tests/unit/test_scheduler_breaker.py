"""The gateway's circuit breaker in front of the global scheduler (a frozen scheduler costs one
timeout, then requests bypass it and one probe at a time asks again)."""

from services.gateway.scheduler_breaker import SchedulerBreaker


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_closed_breaker_always_asks():
    breaker = SchedulerBreaker(clock=Clock())
    assert all(breaker.may_ask() for _ in range(5))
    assert breaker.closed


def test_one_timeout_opens_it_and_requests_bypass_until_the_probe():
    clock = Clock()
    breaker = SchedulerBreaker(open_s=1.0, clock=clock)
    breaker.failed()
    assert not breaker.closed
    assert not any(breaker.may_ask() for _ in range(10))
    clock.now = 1.0
    assert breaker.may_ask()  # the probe
    assert not breaker.may_ask()  # only one at a time
    breaker.answered()
    assert breaker.closed and breaker.may_ask()


def test_a_failed_probe_doubles_the_open_time_up_to_the_cap():
    clock = Clock()
    breaker = SchedulerBreaker(open_s=1.0, max_open_s=3.0, clock=clock)
    breaker.failed()
    waits = []
    for _ in range(4):
        start = clock.now
        while not breaker.may_ask():
            clock.now += 0.25
        waits.append(clock.now - start)
        breaker.failed()
    assert waits == [1.0, 2.0, 3.0, 3.0]
    clock.now += 3.0
    assert breaker.may_ask()
    breaker.answered()  # an answer resets the back-off
    breaker.failed()
    clock.now += 1.0
    assert breaker.may_ask()


def test_an_abandoned_probe_lets_the_next_request_probe():
    clock = Clock()
    breaker = SchedulerBreaker(open_s=1.0, clock=clock)
    breaker.failed()
    clock.now = 1.5
    assert breaker.may_ask()
    breaker.abandoned()
    assert breaker.may_ask()
