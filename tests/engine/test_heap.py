"""A long-running process freezes what it built at startup out of the cyclic garbage
collector's reach, after collecting what startup left as garbage."""

from __future__ import annotations

import gc
import weakref

from tandem.engine.heap import freeze_startup_heap


class Node:
    pass


def test_startup_garbage_is_collected_and_the_rest_frozen():
    cycle = Node()
    cycle.me = cycle  # garbage only the cyclic collector can free
    dead = weakref.ref(cycle)
    del cycle
    kept = Node()
    try:
        frozen = freeze_startup_heap("test")
        assert dead() is None, "startup garbage was frozen instead of collected"
        assert frozen == gc.get_freeze_count() > 0
        assert not any(o is kept for o in gc.get_objects()), "a live object is still collected"
    finally:
        gc.unfreeze()  # the rest of the suite runs in this process
