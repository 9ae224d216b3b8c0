"""The test clusters' port picker (`tests/support/cluster.py`): a port a service is started on is
not one the kernel may hand to any process's next `bind(0)` or outgoing connection meanwhile."""

from __future__ import annotations

import socket

from tests.support.cluster import _ephemeral_range, free_port


def test_a_free_port_is_bindable_and_below_the_kernels_ephemeral_range():
    low, high = _ephemeral_range()
    assert 0 < low <= high <= 65535
    ports = {free_port() for _ in range(20)}
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))
    if low > 11024:  # (a machine whose ephemeral range starts low gets the kernel's pick)
        assert all(low - 10000 <= port < low for port in ports), ports
