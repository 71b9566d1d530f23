"""Loading a prefix's KV from a KV tier (host memory, disk, a shared Redis): the question the
scheduler asks and the ledger entry it plans.

The scheduler asks a `KVLoadSource` one side-effect-free question when it admits a request,
after matching the radix cache: how many of the next tokens' KV can be loaded instead of
computed. If some can, it allocates their blocks unpublished and the request waits, LOADING_KV,
holding a seat but no step budget, while the load runs off the step loop; `finish_load` then
runs it from after what arrived (all of it, part, or nothing: the rest is computed).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from tandem.core.request import Request


class KVLoadSource(Protocol):
    def num_loadable(self, request: Request, start: int, end: int) -> int:
        """Tokens of [start, end) (both multiples of the block size) whose KV a tier holds,
        counted from start, in whole blocks; 0 when loading them is not worth it."""
        ...


@dataclass(slots=True)
class KVLoad:
    request_id: str
    start: int  # the first position loaded (a block boundary)
    block_ids: list[int]  # the request's blocks to fill, in order
    hashes: list[bytes]  # their names in the tiers (core/block_hash.py)
