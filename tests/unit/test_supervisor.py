"""`corral up`'s supervisor: a metrics port per process, progress while starting, and a child that
dies named with its last lines."""

from __future__ import annotations

from services.supervisor import Child, Cluster, GatewayState, plan_children, reachable_url, wait_ready


def flag(child: Child) -> str:
    return child.argv[child.argv.index("--metrics-port") + 1]


def test_every_process_gets_a_metrics_port_of_its_own():
    children = plan_children("nats://x:4222", 3, ["--port", "8000"], [], [], None, None, "http://127.0.0.1:8000", 9100)
    by_name = {child.name: child for child in children}
    assert [c.name for c in children] == ["gateway", "llumlet-0", "llumlet-1", "llumlet-2", "scheduler"]
    ports = [flag(by_name[name]) for name in ("scheduler", "llumlet-0", "llumlet-1", "llumlet-2")]
    assert ports == ["9100", "9101", "9102", "9103"]
    assert by_name["llumlet-2"].metrics_url == "http://127.0.0.1:9103/metrics"
    assert by_name["gateway"].metrics_url == "http://127.0.0.1:8000/metrics"  # on its HTTP port


def test_metrics_off_is_said_to_every_child():
    """Given explicitly, so a CORRAL_METRICS_PORT they inherit cannot make them share one port."""
    children = plan_children("nats://x:4222", 2, [], [], [], None, None, "http://127.0.0.1:8000", 0)
    assert [flag(c) for c in children if c.name != "gateway"] == ["0", "0", "0"]
    assert [c.metrics_url for c in children if c.name != "gateway"] == [None, None, None]


def test_the_gateway_is_reached_where_it_listens():
    assert reachable_url("0.0.0.0", 8000) == "http://127.0.0.1:8000"
    assert reachable_url("::", 8000) == "http://[::1]:8000"
    assert reachable_url("10.1.2.3", 8000) == "http://10.1.2.3:8000"


def test_progress_is_said_and_ready_only_with_every_instance(capsys):
    states = iter([GatewayState(False), GatewayState(True, False), GatewayState(True, True, 0),
                   GatewayState(True, True, 1), GatewayState(True, True, 2)])
    assert wait_ready("http://127.0.0.1:8000", 2, 30, Cluster(), probe=lambda url: next(states)) is None
    said = capsys.readouterr().out.splitlines()
    assert said == ["corral up: gateway answering on http://127.0.0.1:8000", "corral up: gateway connected to NATS",
                    "corral up: instances reporting: 0/2", "corral up: instances reporting: 1/2",
                    "corral up: instances reporting: 2/2"]


def test_not_ready_in_time_says_what_is_missing():
    why = wait_ready("http://127.0.0.1:8000", 2, 0.5, Cluster(), probe=lambda url: GatewayState(True, True, 1))
    assert why == "not ready after 0 s: 1/2 instances reporting"
    why = wait_ready("http://127.0.0.1:8000", 1, 0.3, Cluster(), probe=lambda url: GatewayState(False))
    assert why.endswith("the gateway never answered")


def test_a_child_that_dies_while_starting_is_named_with_its_last_lines(capfd):
    child = Child("llumlet-0", ["llumlet", "--engine", "no-such-engine"])
    child.start()
    child.process.wait(60)
    why = wait_ready("http://127.0.0.1:8000", 1, 60, Cluster([child]), probe=lambda url: GatewayState(False))
    assert why.startswith("llumlet-0 exited with code 2; its last lines:")
    assert "invalid choice: 'no-such-engine'" in why
    assert "invalid choice" in capfd.readouterr().err  # forwarded as it came, too
