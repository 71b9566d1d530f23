"""Counters a server reports on /metrics, read before and after a run so the summary can say
what the server did with the run's requests (speculative decoding's acceptance). Servers
without them (or without /metrics) just leave those lines out."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

SPEC_COUNTERS = (
    "spec_decode_num_drafts",
    "spec_decode_num_draft_tokens",
    "spec_decode_num_accepted_tokens",
)


async def read_spec_counters(base_url: str, headers: dict) -> dict[str, float] | None:
    """The spec_decode_* totals under tandem's or vLLM's prefix; None: none reported."""
    try:
        async with httpx.AsyncClient(timeout=10) as client:
            r = await client.get(f"{base_url}/metrics", headers=headers)
        r.raise_for_status()
        families = list(text_string_to_metric_families(r.text))
    except (httpx.HTTPError, ValueError):
        return None
    totals: dict[str, float] = {}
    for family in families:
        name = family.name.split(":", 1)[-1]
        if name in SPEC_COUNTERS:
            totals[name] = sum(s.value for s in family.samples if s.name.endswith("_total"))
    return totals or None


def spec_summary(before: dict | None, after: dict | None) -> dict:
    """The run's drafts and acceptance, from the counters around it (empty: no drafts)."""
    if not after:
        return {}
    delta = {k: after.get(k, 0.0) - (before or {}).get(k, 0.0) for k in SPEC_COUNTERS}
    drafted, accepted = (
        delta["spec_decode_num_draft_tokens"],
        delta["spec_decode_num_accepted_tokens"],
    )
    if drafted <= 0:
        return {}
    return {
        "spec_decode_num_draft_tokens": int(drafted),
        "spec_decode_num_accepted_tokens": int(accepted),
        "spec_decode_acceptance_rate": accepted / drafted,
        # tokens per verified draft: the accepted ones plus the one the target adds
        "spec_decode_mean_acceptance_length": 1
        + accepted / max(1.0, delta["spec_decode_num_drafts"]),
    }
