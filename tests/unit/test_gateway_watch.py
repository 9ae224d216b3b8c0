"""A llumlet's view of the gateways: one heard and then silent is gone (its requests are
aborted); one never heard is never judged; silence while the llumlet itself is away is no death;
one whose beats came late lately (starved, not killed) is given longer, up to a cap."""

from services.llumlet.gateway_watch import MAX_SILENCE_S, MIN_SILENCE_S, GatewayWatch


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_silent_gateway_is_gone_once_and_a_beating_one_never():
    clock = Clock()
    watch = GatewayWatch(clock)
    watch.heard("g1", 0.25)
    watch.heard("g2", 0.25)
    for _ in range(6):  # 1.5 s: not yet
        clock.now += 0.25
        watch.heard("g2", 0.25)
        assert watch.gone() == []
    clock.now += 0.1
    watch.heard("g2", 0.25)
    assert watch.gone() == ["g1"]
    assert watch.gone() == []  # reported once
    watch.heard("g1", 0.25)  # back: judged again from now
    clock.now += MIN_SILENCE_S + 0.01
    assert watch.gone() == ["g1", "g2"]


def test_silence_counts_in_missed_beats_of_the_gateways_own_interval():
    clock = Clock()
    watch = GatewayWatch(clock)
    watch.heard("slow", 2.0)
    clock.now = 7.9
    assert watch.gone() == []
    clock.now = 8.1
    assert watch.gone() == ["slow"]


def test_silence_while_we_were_away_from_nats_does_not_count():
    clock = Clock()
    watch = GatewayWatch(clock)
    watch.heard("g", 0.25)
    clock.now = 30.0
    watch.pause()  # reconnected just now
    clock.now += MIN_SILENCE_S - 0.1
    assert watch.gone() == []
    clock.now += 0.2
    assert watch.gone() == ["g"]


def test_a_gateway_that_was_slow_lately_is_given_longer_and_a_slow_spell_fades():
    clock = Clock()
    watch = GatewayWatch(clock)

    def starve() -> None:  # its beats 1.2 s apart, every one of them late
        for _ in range(3):
            watch.heard("g", 0.25)
            clock.now += 1.2
        watch.heard("g", 0.25)

    starve()
    clock.now += 2.3  # past the 1.5 s a gateway with punctual beats gets: still not gone
    assert watch.gone() == []
    clock.now += 0.15  # twice its worst gap
    assert watch.gone() == ["g"]
    starve()
    for _ in range(240):  # then punctual for a minute: the slow spell is forgotten
        clock.now += 0.25
        watch.heard("g", 0.25)
    clock.now += MIN_SILENCE_S + 0.05
    assert watch.gone() == ["g"]


def test_however_slow_its_beats_a_gateway_silent_for_the_cap_is_gone():
    clock = Clock()
    watch = GatewayWatch(clock)
    for _ in range(4):  # (past its first beats, which may be start-up's)
        watch.heard("g", 0.25)
        clock.now += 9.0
    watch.heard("g", 0.25)
    clock.now += MAX_SILENCE_S - 0.01  # (twice its gaps would be 18 s)
    assert watch.gone() == []
    clock.now += 0.02
    assert watch.gone() == ["g"]
