"""Where built kernels live, and the one way a kernel gets there: locked, bounded, atomic.

A module named `name` (its build tag inside) is `<root>/<name>/<name>.so`, root being torch's
extensions directory (TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions/pyXY_cpu), so
builds made before this module are found. When it is not there, one process builds it:
- under a BuildLock named for it (the owner's pid, host and start time; taken from a dead
  owner at once, waited for from a live one up to the timeout, saying so);
- in a child process with the remaining time as its limit (a hung compiler is killed, a
  build cannot be interrupted halfway from inside torch), into a private temporary
  directory that is renamed into place only once the module is complete, so a half-built
  module is never loaded and a killed build leaves nothing later starts trip on;
- a directory left in the module's place without the module (torch's own `lock` from an
  interrupted build before this module) is cleared first.
Any failure returns None with the reason logged: callers run the torch path.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from tandem.model.kernels.build_lock import BuildLock

log = logging.getLogger(__name__)


def cache_root() -> Path:
    """torch's extensions directory, as torch.utils.cpp_extension names it for the CPU."""
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    return Path(root) / f"py{sys.version_info.major}{sys.version_info.minor}_cpu"


def load_or_build(
    name: str,
    source: Path,
    cflags: list[str],
    ldflags: list[str],
    seconds_left: Callable[[], float],
    what: str,
):
    """The module `name` built from `source`, or None (reason logged). `seconds_left()` (asked
    once, when a build is needed) bounds the wait for another builder plus the build."""
    final = cache_root() / name
    so = final / f"{name}.so"
    if so.exists():
        return _import(name, so)
    timeout = seconds_left()
    if timeout <= 0:
        log.warning(
            "%s: the time for kernel builds (--kernel-build-timeout) is spent; "
            "using the torch path",
            what,
        )
        return None
    deadline = time.monotonic() + timeout
    with BuildLock(cache_root() / f"{name}.lock", timeout, what) as held:
        if not held:
            log.warning("%s: another process is still building it; using the torch path", what)
            return None
        if so.exists():  # built by the process we waited for
            return _import(name, so)
        for stale in cache_root().glob(f".{name}.build-*"):  # from builds killed before
            shutil.rmtree(stale, ignore_errors=True)
        log.info("compiling %s (once; later starts load it)", what)
        t0 = time.monotonic()
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.build-", dir=cache_root()))
        try:
            error = _build(name, source, cflags, ldflags, tmp, deadline - time.monotonic())
            if error:
                log.warning("%s unavailable (%s); using the torch path", what, error)
                return None
            if final.exists():  # no module inside (checked above): torch's leftover lock
                log.info("removing %s, a build directory left without its module", final)
                shutil.rmtree(final)
            tmp.chmod(0o755)  # mkdtemp's 0700 would hide the cache from other users
            os.rename(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        log.info("compiled %s in %.0f s (cached for later starts)", what, time.monotonic() - t0)
        return _import(name, so)


def _build(
    name: str, source: Path, cflags: list[str], ldflags: list[str], into: Path, seconds: float
) -> str | None:
    """Build in a child process killed (with the compiler) past `seconds`; an error or None."""
    if seconds <= 0:
        return "no time left to build"
    spec = dict(
        name=name,
        sources=[str(source)],
        extra_cflags=cflags,
        extra_ldflags=ldflags,
        build_directory=str(into),
        parent=os.getpid(),
    )
    env = dict(os.environ)  # ninja from the virtualenv too, when it is not activated
    env["PATH"] = os.pathsep.join([sysconfig.get_path("scripts"), env.get("PATH", "")])
    child = subprocess.Popen(
        [sys.executable, "-m", "tandem.model.kernels.kernel_cache", json.dumps(spec)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env=env,
        preexec_fn=_die_with_parent,
    )
    try:
        output, _ = child.communicate(timeout=seconds)
    except subprocess.TimeoutExpired:
        _stop_build(child)
        return f"the build took longer than {seconds:.0f} s (--kernel-build-timeout)"
    except BaseException:  # Ctrl-C, SIGTERM: the compiler goes too
        _stop_build(child)
        raise
    if child.returncode != 0:
        text = output.decode(errors="replace").strip().splitlines()
        log.debug("kernel build output:\n%s", "\n".join(text))
        compiler = [line.strip() for line in text if " error: " in line or "fatal error" in line]
        return (compiler or text[-1:] or [f"exit code {child.returncode}"])[0][:300]
    return None


def _stop_build(child: subprocess.Popen) -> None:
    _kill_tree(child.pid)
    child.wait()


def _kill_tree(pid: int) -> None:
    """SIGKILL `pid` and its descendants: ninja runs each compiler in a process group of its
    own, so killing the build's group would leave the compiler running."""
    for victim in [*_descendants(pid), pid]:
        try:
            os.kill(victim, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # exited while we looked
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def _die_with_parent() -> None:
    """In the build child: SIGTERM when the starting process dies, kill -9 included; _main
    answers it by killing itself and everything it started, the compiler with it."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:  # not Linux: the build only outlives a killed start
        pass


def _import(name: str, so: Path):
    spec = importlib.util.spec_from_file_location(name, so)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _main(spec_json: str) -> None:
    signal.signal(signal.SIGTERM, lambda *_: _kill_tree(os.getpid()))
    spec = json.loads(spec_json)
    if os.getppid() != spec.pop("parent"):  # the start died before the line above
        return
    from torch.utils.cpp_extension import load

    load(**spec, verbose=False)


if __name__ == "__main__":
    _main(sys.argv[1])
