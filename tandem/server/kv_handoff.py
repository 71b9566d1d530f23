"""The HTTP side of a prefill/decode handoff, as `tandem proxy` drives it (disagg/proxy.py):

1. decode instance: the client's body + kv_transfer_params {"do_remote_prefill": true}.
   It reserves blocks for every sequence and answers at once with the reservation in the
   x-tandem-kv-transfer header (address, and per sequence its id, the first position it
   lacks, the prompt's length and digest); the body (tokens) follows as it decodes.
2. prefill instance: the same body + {"do_remote_decode": true, **that header}. It computes
   the prompts, streams the KV the decode side lacks layer by layer, then the first token,
   and answers with a one-token completion.
3. the decode instance commits each sequence once its KV is in and decodes on.
"""

from __future__ import annotations

import hashlib
import json
from array import array

from tandem.engine.messages import KVTransferParams
from tandem.server.errors import bad_request, unavailable
from tandem.server.protocol import KVTransferField

HEADER = "x-tandem-kv-transfer"


def prompt_digest(token_ids: list[int]) -> str:
    return hashlib.blake2b(array("q", token_ids).tobytes(), digest_size=8).hexdigest()


def check_role(kv: KVTransferField | None, role: str, switching: bool = False) -> None:
    """A handoff stage this instance may serve in `role`; one that switches roles turns away
    the other role's requests as busy (503: the router tries another instance)."""
    if kv is None:
        return
    if kv.do_remote_prefill and kv.do_remote_decode:
        raise bad_request(
            "kv_transfer_params: do_remote_prefill and do_remote_decode exclude each other",
            "kv_transfer_params",
        )
    wanted = "decode" if kv.do_remote_prefill else "prefill" if kv.do_remote_decode else None
    if wanted is not None and role != wanted and switching:
        raise unavailable(f"this instance now serves the {role} role", retry_after=1)
    if wanted is not None and role != wanted:
        raise bad_request(
            f"kv_transfer_params: this is a {role!r} instance; "
            f"{'do_remote_prefill' if wanted == 'decode' else 'do_remote_decode'} needs one "
            f"started with --role {wanted}",
            "kv_transfer_params",
        )


def destinations(kv: KVTransferField, prompt_ids: list[list[int]], n: int):
    """Per prompt, the KVTransferParams of its n sequences (a prefill instance's request)."""
    if not kv.address or kv.requests is None:
        raise bad_request(
            "kv_transfer_params: do_remote_decode needs the decode side's address and requests",
            "kv_transfer_params",
        )
    if len(kv.requests) != len(prompt_ids) * n:
        raise bad_request(
            f"kv_transfer_params: {len(kv.requests)} requests for {len(prompt_ids) * n} sequences",
            "kv_transfer_params",
        )
    out = []
    for i, ids in enumerate(prompt_ids):
        mine = kv.requests[i * n : (i + 1) * n]
        for r in mine:
            if r.num_tokens != len(ids) or r.digest != prompt_digest(ids):
                raise bad_request(
                    "kv_transfer_params: the decode side reserved for a different prompt "
                    f"({r.num_tokens} tokens) than this instance tokenized ({len(ids)})",
                    "kv_transfer_params",
                )
            if not 0 <= r.start < len(ids):
                raise bad_request(
                    f"kv_transfer_params: start {r.start} outside the prompt of {len(ids)}",
                    "kv_transfer_params",
                )
        out.append([KVTransferParams(kv.address, r.id, r.start) for r in mine])
    return out


async def reservation(address: str, prompt_ids: list[list[int]], streams) -> dict[str, str]:
    """The decode side's answer: wait for the core's reservations; the response header."""
    requests = []
    for ids, stream in zip(prompt_ids, streams):
        for child_id, held in await stream.reserved():
            if held < 0:
                raise unavailable(
                    "kv: no room to reserve KV for the prompt here now (batch or blocks full)",
                    retry_after=1,
                )
            requests.append(
                {
                    "id": child_id,
                    "start": held,
                    "num_tokens": len(ids),
                    "digest": prompt_digest(ids),
                }
            )
    return {HEADER: json.dumps({"address": address, "requests": requests})}
