"""One block's KV as a tier stores it: a header with its metadata, then the bytes.

    magic "TKV1" | crc32 of the payload (u32) | payload bytes (u64) | block hash (16 bytes)
    | layout length (u16) | layout (ascii: dtype and shape, as the runner names them) | payload

Everything needed to trust an entry is inside it (one key per block, so no second key can
disagree with it): an entry for another hash, another layout (model, dtype, block size), or
whose bytes are short or changed is rejected by `unpack`, and the caller counts a miss.
"""

from __future__ import annotations

import struct
import zlib

MAGIC = b"TKV1"
_HEAD = struct.Struct("<4sIQ16sH")


def pack(block_hash: bytes, layout: str, payload) -> bytes:
    """The entry for payload (a bytes-like of the block's KV)."""
    view = memoryview(payload).cast("B")
    name = layout.encode()
    head = _HEAD.pack(MAGIC, zlib.crc32(view), view.nbytes, block_hash, len(name))
    return b"".join((head, name, view))


def unpack(block_hash: bytes, layout: str, entry) -> memoryview | None:
    """The payload of a sound entry for this hash and layout; None for anything else."""
    if entry is None:
        return None
    view = memoryview(entry).cast("B")
    if view.nbytes < _HEAD.size:
        return None
    magic, crc, size, stored_hash, name_len = _HEAD.unpack_from(view)
    start = _HEAD.size + name_len
    if magic != MAGIC or stored_hash != block_hash or view.nbytes != start + size:
        return None
    if bytes(view[_HEAD.size : start]) != layout.encode():
        return None
    payload = view[start:]
    return payload if zlib.crc32(payload) == crc else None
