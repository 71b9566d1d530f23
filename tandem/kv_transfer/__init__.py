"""Moving KV out of an instance's pool and back, below the engine: the link between prefill
and decode instances (wire.py, connector.py, curve.py) and the tiers behind the radix cache
(host memory, a local disk, a shared Redis: tiers.py, entry.py, offload.py)."""
