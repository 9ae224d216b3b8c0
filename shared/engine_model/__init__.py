"""The local-scheduler model: what one engine instance does with its requests and KV blocks.

vLLM's queues, paged blocks, chunked prefill and recompute preemption, the step-time model, the
request views load reports are built from, and the report builder itself. The simulated llumlet
(`services/llumlet/engines/sim/`) and the discrete-event simulator (`loadgen/simulator/`) both run
this one copy, so the simulator models the rules the services run.
"""
