"""`flush_in_order`: back only once the server holds what was sent before it. nats-py's own
`flush` writes its PING ahead of a SUB still queued for the client's flusher task, so its PONG
proves nothing about that SUB (a KV subscriber missed a llumlet's first events this way, 1 run
in ~40 on a loaded machine); the bytes on the wire show it without any race."""

from __future__ import annotations

import nats

from shared.nats_client import flush_in_order


async def _wire_after_subscribe_and(flush, nats_url: str) -> bytes:
    nc = await nats.connect(nats_url)
    sent: list[bytes] = []
    transport = nc._transport
    write, writelines = transport.write, transport.writelines
    transport.write = lambda data: (sent.append(bytes(data)), write(data))[1]
    transport.writelines = lambda parts: (sent.extend(bytes(p) for p in parts), writelines(parts))[1]
    try:
        await nc.subscribe("flush.order.probe", cb=_ignore)
        await flush(nc)
        return b"".join(sent)
    finally:
        transport.write, transport.writelines = write, writelines
        await nc.close()


async def _ignore(msg) -> None:
    pass


async def test_nats_py_flush_can_answer_before_a_queued_subscription_is_sent(nats_url):
    wire = await _wire_after_subscribe_and(lambda nc: nc.flush(), nats_url)
    assert wire.index(b"PING") < wire.index(b"SUB flush.order.probe")  # (why flush_in_order exists)


async def test_flush_in_order_pings_after_the_subscription(nats_url):
    wire = await _wire_after_subscribe_and(flush_in_order, nats_url)
    assert wire.index(b"SUB flush.order.probe") < wire.rindex(b"PING")
