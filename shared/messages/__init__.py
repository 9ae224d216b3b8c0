"""Wire messages between Corral services: typed, MessagePack-encoded, validated on decode.

Every message that crosses NATS is defined here and nowhere else. `encode`/`decode` are the only
way in and out: a malformed payload raises `WireError` at the edge instead of an AttributeError
deep inside a handler.

One module per part of the protocol: `wire` (the base: errors, bounded types, encode and
decode), `streams` (requests and their tokens), `load` (load reports, dispatch, KV-cache
events) and `migration` (orders, hand-offs, the handshake). Import from `shared.messages`.
"""

from shared.messages.wire import *  # noqa: F401,F403
from shared.messages.streams import *  # noqa: F401,F403
from shared.messages.load import *  # noqa: F401,F403
from shared.messages.migration import *  # noqa: F401,F403
