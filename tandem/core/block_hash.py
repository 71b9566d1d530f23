"""Block hashes: a name for the KV of each full block of a request that holds across
processes, restarts and instances, for the KV tiers behind the radix cache.

The radix tree keys a block by its tokens under its parent, which only means something
inside one tree. A tier shared by a restarted or another instance needs a name that says
everything the KV depends on: block i's hash covers the hash of block i - 1 (so the whole
prefix), the block's own tokens, and a seed naming the model, its dtypes and the block size.
Two requests share a hash exactly when they would share the radix node.

blake2b with a 16-byte digest: about a microsecond a block, and collisions are out of reach.
"""

from __future__ import annotations

import hashlib
import struct

from tandem.core.request import Request


def model_seed(*parts: object) -> bytes:
    """The root of every chain: whatever makes the KV of the same tokens differ (model,
    weights, dtypes, block size)."""
    return hashlib.blake2b(repr(parts).encode(), digest_size=16).digest()


def chain_hash(parent: bytes, tokens: list[int]) -> bytes:
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(struct.pack(f"<{len(tokens)}q", *tokens))
    return h.digest()


class BlockHasher:
    def __init__(self, seed: bytes, block_size: int) -> None:
        self.seed, self.block_size = seed, block_size
        # LoRA adapters by id -> the root of their chains: the model's seed and the adapter's
        # own digest (of its weights), so an adapter's KV has one name in every instance
        # that loads it, under whatever id, and never another adapter's or the base model's.
        self._adapters: dict[int, bytes] = {}
        self.versions: dict[int, str] = {}  # weight epoch -> version (set_weights)

    def add_adapter(self, lora_id: int, digest: bytes) -> None:
        self._adapters[lora_id] = model_seed(self.seed, digest)

    def remove_adapter(self, lora_id: int) -> None:
        self._adapters.pop(lora_id, None)

    def covers(self, lora_id: int) -> bool:
        """Whether requests of this adapter (0: the base model) have names."""
        return not lora_id or lora_id in self._adapters

    def hashes(self, request: Request, num_blocks: int) -> list[bytes]:
        """The hashes of the request's first num_blocks full blocks, extending (and kept
        on) `request.block_hashes`."""
        out, bs = request.block_hashes, self.block_size
        if len(out) >= num_blocks:
            return out[:num_blocks]
        tokens = request.all_token_ids
        parent = out[-1] if out else self._root(request)
        for i in range(len(out), min(num_blocks, len(tokens) // bs)):
            parent = chain_hash(parent, tokens[i * bs : (i + 1) * bs])
            out.append(parent)
        return out[:num_blocks]

    def _root(self, request: Request) -> bytes:
        """The chain's root: the model's (or the adapter's) seed, and the salt where the
        request has one, so a tenant's blocks have names of their own in a shared tier too."""
        root = self._adapters.get(request.lora_id, self.seed)
        if request.weight_epoch:  # pushed weights (RL): named by their version and epoch
            version = self.versions.get(request.weight_epoch, "")
            root = model_seed(root, "weights", request.weight_epoch, version)
        return root if request.cache_salt is None else model_seed(root, request.cache_salt)

    def set_weights(self, epoch: int, version: str) -> None:
        """The weights of `epoch` are version `version`: their blocks' names root in both (two
        instances that took the same updates name the same KV alike in a shared tier; an
        update that keeps the version string still renames every block)."""
        self.versions[epoch] = version
