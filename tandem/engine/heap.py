"""Take what a long-running process built at startup out of the cyclic garbage collector's
reach, as vLLM's engine does: a loaded model, its tokenizer and the libraries they import
are ~300,000 objects that live as long as the process, and a full collection walks every
one of them: ~200 ms on the default model, every running request waiting. The in-process
engine loop met two in 75 s of load; the served processes none in 100 s runs either way
(`benchmarks/gc_pauses.py`), Python running a full collection only once a quarter of the old
generation is new. Frozen objects are still freed by reference counting; only cycles among
them wait for the process to end."""

from __future__ import annotations

import gc
import logging
import mmap

log = logging.getLogger("tandem")


def freeze_startup_heap(what: str) -> int:
    """Collect what startup left as garbage, then freeze everything alive; -> objects frozen."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.debug("%s: %d objects built at startup frozen out of the garbage collector", what, frozen)
    return frozen


def resident_bytes() -> int:
    """This process's resident memory (Linux's /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * mmap.PAGESIZE
    except OSError:
        return 0


def collect_all() -> None:
    """A full collection that reaches the startup heap too (thawed, collected, frozen
    again): what a sleeping engine drops may hold cycles among frozen objects."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()
