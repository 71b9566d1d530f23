"""GrammarCompiler: compiles requests' grammars on worker threads, never on the step loop.

The tokenizer's vocabulary is prepared for the backends once, on a worker thread: at start
in a server (`prepare()`, so it is ready as soon as its model is), at the first structured
request offline. Compiled grammars are cached by (backend,
kind, canonical spec): the schema an agent sends on every call compiles once. A compile
past `timeout` seconds fails its request, while the compile itself runs on, for nothing
can stop a native compile midway; other requests' compiles go on beside it on the other
worker threads.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from tandem.structured.params import StructuredOutputsParams

log = logging.getLogger("tandem")
# Compiled grammars kept, the least recently used going first: at most this many, and at
# most this many bytes (an xgrammar grammar for a 49,152-token vocabulary is 25 KB to 1 MB).
CACHE_SIZE = 1024
CACHE_BYTES = 256 * 2**20


@dataclass
class CompiledGrammar:
    backend: object  # the backend that compiled it, which makes its matchers
    grammar: object
    seconds: float  # how long the compile took

    @property
    def nbytes(self) -> int:
        size = getattr(self.grammar, "memory_size_bytes", None)  # xgrammar's
        return size if size is not None else len(str(self.grammar))  # llguidance's: its text


class GrammarCompiler:
    def __init__(
        self,
        tokenizer_loader,  # () -> a transformers tokenizer; called once, on a worker thread
        vocab_size: int,
        stop_token_ids: list[int],
        backend: str = "auto",
        timeout: float = 5.0,
        threads: int = 2,
    ) -> None:
        self.vocab_size, self.stop_token_ids = vocab_size, list(stop_token_ids)
        self.configured, self.timeout = backend, timeout
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="grammar")
        self._lock = threading.Lock()  # the cache
        self._backend_lock = threading.Lock()
        self._backends: dict[str, object] = {}
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._sizes: dict[tuple, int] = {}  # bytes of each compiled grammar in the cache
        self._cached_bytes = 0
        self._loader, self._tokenizer = tokenizer_loader, None

    def prepare(self) -> Future:
        """Prepare the tokenizer's vocabulary for the backends on a worker thread (once): a
        server does it at start, so its first structured request does not wait for it; the
        offline engine, at its first structured request."""
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = self.pool.submit(self._prepare, self._loader)
            return self._tokenizer

    def prepared(self) -> bool:
        """The vocabulary is ready (a compile's deadline runs from then, not before)."""
        return self._tokenizer is not None and self._tokenizer.done()

    def _prepare(self, tokenizer_loader):
        t0 = time.perf_counter()
        _import_libraries()  # here, not at build: a server is ready ~2 s sooner
        tokenizer = tokenizer_loader()
        names = ["xgrammar", "guidance"] if self.configured == "auto" else [self.configured]
        for name in names:
            self._backend(name, tokenizer)
        log.debug("structured output: %s ready in %.2f s", names, time.perf_counter() - t0)
        return tokenizer

    def _backend(self, name: str, tokenizer=None):
        from tandem.structured.backends import BACKEND_CLASSES

        if tokenizer is None:
            tokenizer = self.prepare().result()  # never under the lock: _prepare takes it
        with self._backend_lock:
            backend = self._backends.get(name)
            if backend is None:
                backend = BACKEND_CLASSES[name](tokenizer, self.vocab_size, self.stop_token_ids)
                self._backends[name] = backend
            return backend

    def submit(self, so: StructuredOutputsParams) -> Future:
        """The compiled grammar of `so`, as a future (done at once on a cache hit). Raises
        ValueError at once for what needs no compile to refuse (a keyword the configured
        backend would drop)."""
        name = so.backend(self.configured)
        key = (name, *so.spec())
        self.prepare()  # queued before any compile, which waits for it on another thread
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            future = self.pool.submit(self._compile, name, so)
            self._cache[key] = future
            self._evict()
        future.add_done_callback(lambda f: self._account(key, f))
        return future

    def _account(self, key: tuple, future: Future) -> None:
        if future.cancelled():  # closed before it ran
            return
        size = future.result().nbytes if future.exception() is None else 0
        with self._lock:
            if self._cache.get(key) is future:
                self._sizes[key] = size
                self._cached_bytes += size
                self._evict()

    def _evict(self) -> None:
        """Drop the least recently used past the count or the bytes (under the lock)."""
        while len(self._cache) > 1 and (
            len(self._cache) > CACHE_SIZE or self._cached_bytes > CACHE_BYTES
        ):
            key, _ = self._cache.popitem(last=False)
            self._cached_bytes -= self._sizes.pop(key, 0)

    def _compile(self, name: str, so: StructuredOutputsParams) -> CompiledGrammar:
        backend = self._backend(name)
        t0 = time.perf_counter()
        try:
            grammar = backend.compile(so)
        except Exception as e:
            text = str(e).strip()
            # xgrammar prefixes its errors with "[hh:mm:ss] /source/file.cc:NN: "
            message = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", text.splitlines()[0]) if text else ""
            message = message or type(e).__name__
            if not message.startswith(f"{so.source}:"):
                message = f"{so.source}: the {so.kind} does not compile ({name}): {message}"
            raise ValueError(message[:500]) from None
        return CompiledGrammar(backend, grammar, time.perf_counter() - t0)

    def compile(self, so: StructuredOutputsParams) -> CompiledGrammar:
        """Compile now (waiting at most `timeout`, once the vocabulary is prepared):
        ValueError naming the field if it fails."""
        self.prepare().result()
        future = self.submit(so)
        try:
            return future.result(timeout=self.timeout)
        except TimeoutError:
            raise ValueError(timeout_message(so, self.timeout)) from None

    def matcher(self, so: StructuredOutputsParams):
        """A fresh matcher of a grammar already compiled (the engine admits a request only
        then)."""
        compiled = self.submit(so).result()
        return compiled.backend.matcher(compiled.grammar)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def _import_libraries() -> None:
    """Import the grammar libraries and the transformers names they use, all on one thread
    and before the tokenizer loads: transformers resolves its names lazily, and two threads
    doing that at once can fail ("cannot import name 'PreTrainedTokenizerBase'"). The engine
    thread meanwhile never touches transformers (the tokenizer lives in the server)."""
    import llguidance.hf  # noqa: F401
    import llguidance.torch  # noqa: F401
    import xgrammar  # noqa: F401
    from transformers import AutoTokenizer, PreTrainedTokenizerBase  # noqa: F401


def timeout_message(so: StructuredOutputsParams, timeout: float) -> str:
    return (
        f"{so.source}: the {so.kind} did not compile within {timeout:g} s "
        "(--structured-outputs-compile-timeout)"
    )
