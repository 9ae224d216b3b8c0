"""`loadgen simulate`: a discrete-event cluster simulator in virtual time.

It runs the shared policies (`shared.policy`) over load reports and the simulated engine's own
local scheduler and latency model (`services.llumlet.engines.sim`), so the policies compared
here are the ones the services run.
"""
