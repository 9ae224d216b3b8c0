"""`loadgen simulate`: a discrete-event cluster simulator in virtual time.

It runs the shared policies (`shared.policy`, named ones in `shared.policy.baselines`) over load
reports, and the simulated engine's own local scheduler and latency model
(`services.llumlet.engines.sim`), so the policies compared here are the ones the services run.

Modules, one job each:
- `workload`: requests from loadgen's datasets, arrival processes and priority flags.
- `instance`: one instance (SimScheduler + LatencyModel), its lifecycle and its load report.
- `cluster`: the event loop: arrivals and dispatch, engine steps, periodic ticks.
- `migration`: pairing rounds and multi-stage live migration.
- `autoscale`: scaling ticks, startup delay, drain through the fake request.
- `timeline`, `metrics`, `report`: what happened, Llumnix's metrics, table/JSON/plots.
- `sweep`, `cli`: several policies over several load points; the command line.
"""
