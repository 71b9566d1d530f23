"""Take what a long-running process built at startup out of the cyclic garbage collector's
reach, as vLLM's engine does: a loaded model, its tokenizer and the libraries they import
are ~300,000 objects that live as long as the process, and a full collection walks every
one of them. In the engine core that was a ~200 ms stall of every running request about
once every 40 s of load (`benchmarks/gc_pauses.py`). Frozen objects are still freed by
reference counting; only cycles among them wait for the process to end."""

from __future__ import annotations

import gc
import logging

log = logging.getLogger("tandem")


def freeze_startup_heap(what: str) -> int:
    """Collect what startup left as garbage, then freeze everything alive; -> objects frozen."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("%s: %d objects built at startup frozen out of the garbage collector", what, frozen)
    return frozen
