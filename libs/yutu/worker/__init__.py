"""The worker core shared by the mixed, prefill and decode roles.

The engine thread (``engine_loop``), the KV cache in a registered transfer-engine region
(``kv_region``), moving KV blocks between workers and the store (``kv_io``), holding a prefill's
blocks until its decode has pulled them (``holds``), and writing new full blocks behind the
requests into the store (``write_behind``). The role decides which of these run.
"""
