"""A build lock that names its owner and can never outlive it.

torch's extension builder guards a build directory with a bare `lock` file and waits on it
with no limit; a build stopped by Ctrl-C or kill -9 left that file behind, and every later
start waited forever at 0% CPU. This lock is an flock(2) on a file that records its owner
(pid, host, start time): the kernel drops an flock when its holder dies, however it dies, so
a dead owner's lock is simply taken; a live owner is waited for up to a bound, with a log
line every few seconds saying who holds it and for how long.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Owner:
    pid: int
    host: str
    started: float  # time.time() when the lock was taken

    @classmethod
    def me(cls) -> Owner:
        return cls(os.getpid(), socket.gethostname(), time.time())


class BuildLock:
    """`with BuildLock(path, timeout) as held:` held is False when `timeout` seconds passed
    while a live process held the lock (the caller then does without what it guards)."""

    def __init__(
        self,
        path: Path,
        timeout: float,
        what: str = "a kernel build",
        poll: float = 0.1,
        report_every: float = 5.0,
    ) -> None:
        self.path = Path(path)
        self.timeout = timeout
        self.what = what
        self.poll = poll
        self.report_every = report_every
        self._fd: int | None = None

    def acquire(self) -> bool:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        start = time.monotonic()
        next_report = start + min(1.0, self.report_every)
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                now = time.monotonic()
                if now - start >= self.timeout:
                    os.close(fd)
                    log.warning(
                        "gave up waiting for %s after %.0f s: %s",
                        self.what,
                        now - start,
                        self._describe_owner(),
                    )
                    return False
                if now >= next_report:
                    log.info(
                        "waiting for %s: %s (giving up in %.0f s)",
                        self.what,
                        self._describe_owner(),
                        self.timeout - (now - start),
                    )
                    next_report = now + self.report_every
                time.sleep(self.poll)
        previous = read_owner(self.path)
        if previous is not None and previous.pid != os.getpid():
            log.info(
                "took over the lock of %s from pid %d on %s (gone)",
                self.what,
                previous.pid,
                previous.host,
            )
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(asdict(Owner.me())).encode(), 0)
        self._fd = fd
        return True

    def release(self) -> None:
        if self._fd is not None:
            os.ftruncate(self._fd, 0)  # the file stays: unlinking it would race a waiter
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

    def _describe_owner(self) -> str:
        owner = read_owner(self.path)
        if owner is None:
            return "held by a process that has not written its name yet"
        return (
            f"held by pid {owner.pid} on {owner.host} for "
            f"{max(0.0, time.time() - owner.started):.0f} s"
        )


def read_owner(path: Path) -> Owner | None:
    """The owner a lock file records, or None (empty, released, or not ours)."""
    try:
        data = json.loads(Path(path).read_text() or "null")
        return Owner(int(data["pid"]), str(data["host"]), float(data["started"]))
    except (OSError, ValueError, TypeError, KeyError):
        return None
