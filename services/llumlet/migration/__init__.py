"""Live migration of running requests with their KV cache (Llumnix §4.2–4.3): the source-side
coordinator, the destination-side handshake and leases, block fusion and the TCP data plane."""
