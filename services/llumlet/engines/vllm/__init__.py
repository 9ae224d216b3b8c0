"""The real engine: vLLM v1 in process, driven one step at a time on its own thread.

`engine.py` is the llumlet's side (event loop), `driver.py` the engine thread's, `state.py` what
they share; `startup.py` builds vLLM's engine, `params.py` translates requests, `probe.py` and
`connector.py` are the only paths into vLLM's internals; `migration.py` holds the migration verbs.
(Importing this package does not import vLLM: `connector.py` and `startup.py` do, on the engine
thread.)
"""
