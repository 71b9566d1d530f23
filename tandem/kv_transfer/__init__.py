"""Moving KV out of the pool and back: the tiers behind the radix cache (host memory, a
local disk, a shared Redis) and the connector the engine loads and stores through."""
