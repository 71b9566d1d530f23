"""A kernel build can never hang a start: real processes building a tiny extension, stopped,
killed, raced and timed out. The compiler is wrapped (CXX) to be slow on demand, count its
compiles and record its pid, so each case is deterministic without a 40 s real build."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tandem.model.kernels.build_lock import Owner

pytestmark = [
    pytest.mark.skipif(
        sys.platform != "linux" or subprocess.run(["which", "c++"], capture_output=True).returncode,
        reason="needs Linux and a C++ compiler",
    ),
    pytest.mark.slow,  # real builds, started, killed and raced: 90 s on 2 cores
]

TINY = """#include <pybind11/pybind11.h>
int answer() { return 42; }
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("answer", &answer); }
"""
NAME = "tiny_kernel_0123456789ab"  # a build tag's shape: the stem and 12 hex digits

START = textwrap.dedent("""
    import logging, sys, torch
    from pathlib import Path
    from tandem.model.kernels.kernel_cache import load_or_build
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
    timeout = float(sys.argv[3])
    m = load_or_build(sys.argv[2], Path(sys.argv[1]), ["-O0"], [], lambda: timeout, "the tiny kernel")
    print("ANSWER", m.answer() if m is not None else "fallback", flush=True)
""")


@pytest.fixture
def box(tmp_path):
    """A private extensions directory, the tiny source, and a compiler wrapper that logs each
    compile (and its pid) to compiles.txt and sleeps $SLOW_COMPILE seconds first."""
    (tmp_path / "tiny.cpp").write_text(TINY)
    cxx = tmp_path / "cxx"
    cxx.write_text(
        textwrap.dedent(f"""\
        #!/bin/sh
        case " $* " in *" -c "*)
          echo $$ >> {tmp_path}/compiles.txt
          [ -n "$SLOW_COMPILE" ] && sleep "$SLOW_COMPILE" ;;
        esac
        exec c++ "$@"
    """)
    )
    cxx.chmod(0o755)
    return tmp_path


def start(
    box: Path, timeout: float = 120, slow: float = 0, source: str = "tiny.cpp", name: str = NAME
) -> subprocess.Popen:
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(box / "ext"), CXX=str(box / "cxx"))
    if slow:
        env["SLOW_COMPILE"] = str(slow)
    return subprocess.Popen(
        [sys.executable, "-c", START, str(box / source), name, str(timeout)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )


def finish(proc: subprocess.Popen, within: float = 120) -> str:
    out, _ = proc.communicate(timeout=within)
    return out


def cache(box: Path) -> Path:
    return box / "ext" / f"py{sys.version_info.major}{sys.version_info.minor}_cpu"


def compiles(box: Path) -> list[int]:
    path = box / "compiles.txt"
    return [int(x) for x in path.read_text().split()] if path.exists() else []


def wait_until(condition, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting for the condition"
        time.sleep(0.05)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (killed, not reaped by its orphaned parent yet) is gone for our purpose
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"


def test_a_start_builds_once_and_later_starts_load_the_cached_module(box):
    out = finish(start(box))
    assert "ANSWER 42" in out and "compiled the tiny kernel in" in out
    assert (cache(box) / NAME / f"{NAME}.so").exists()
    assert not list(cache(box).glob(f".{NAME}.build-*"))  # the temporary build is gone
    out = finish(start(box))
    assert "ANSWER 42" in out and "compiling" not in out
    assert len(compiles(box)) == 1


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT])
def test_a_start_stopped_mid_build_leaves_nothing_that_blocks_the_next(box, sig):
    first = start(box, slow=120)
    wait_until(lambda: compiles(box))  # the compiler is running
    first.send_signal(sig)
    first.wait(timeout=30)
    assert not (cache(box) / NAME).exists()  # nothing half-built in the module's place
    # the compiler the killed start left is killed with it, not left to finish
    wait_until(lambda: not alive(compiles(box)[0]), seconds=10)
    t0 = time.monotonic()
    out = finish(start(box, timeout=60))
    assert "ANSWER 42" in out, out
    assert "waiting for" not in out  # nothing to wait for: the owner is gone
    if sig == signal.SIGKILL:  # its lock still names it: taken over, and said so
        assert f"from pid {first.pid}" in out and "(gone)" in out
    assert time.monotonic() - t0 < 60
    assert not list(cache(box).glob(f".{NAME}.build-*"))


def test_a_lock_file_torch_left_in_the_module_directory_does_not_block(box):
    (cache(box) / NAME).mkdir(parents=True)
    (cache(box) / NAME / "lock").write_text("")  # torch's baton from an interrupted build
    out = finish(start(box, timeout=60))
    assert "ANSWER 42" in out and "left without its module" in out
    assert not (cache(box) / NAME / "lock").exists()


def test_a_lock_recorded_by_a_dead_pid_is_taken_over(box):
    dead = subprocess.Popen(["true"])
    dead.wait()
    lock = cache(box) / f"{NAME}.lock"
    lock.parent.mkdir(parents=True)
    lock.write_text(json.dumps(dict(pid=dead.pid, host="here", started=time.time() - 999)))
    out = finish(start(box, timeout=60))
    assert "ANSWER 42" in out and f"from pid {dead.pid} on here (gone)" in out


def test_two_starts_racing_build_once(box):
    first = start(box, slow=3)
    wait_until(lambda: compiles(box))
    second = start(box, timeout=120)
    outs = [finish(first), finish(second)]
    assert all("ANSWER 42" in out for out in outs), outs
    assert len(compiles(box)) == 1
    assert f"waiting for the tiny kernel: held by pid {first.pid}" in outs[1]


def test_a_live_builder_is_waited_for_only_up_to_the_timeout(box):
    builder = start(box, slow=120)
    wait_until(lambda: compiles(box))
    try:
        t0 = time.monotonic()
        out = finish(start(box, timeout=3), within=60)
        assert "ANSWER fallback" in out
        assert f"gave up waiting for the tiny kernel after 3 s: held by pid {builder.pid}" in out
        assert time.monotonic() - t0 < 30  # 3 s of waiting and a Python start
    finally:
        builder.kill()
        builder.wait()


def test_a_build_past_the_timeout_is_killed_and_the_start_goes_on(box):
    out = finish(start(box, timeout=3, slow=120), within=60)
    assert "ANSWER fallback" in out and "took longer than 3 s (--kernel-build-timeout)" in out
    wait_until(lambda: not alive(compiles(box)[0]), seconds=10)  # the compiler is gone
    out = finish(start(box, timeout=60))  # and the next start builds as usual
    assert "ANSWER 42" in out


def test_a_compile_error_falls_back_and_says_why(box):
    (box / "broken.cpp").write_text('#error "this kernel does not compile"\n')
    out = finish(start(box, source="broken.cpp", name="broken_0123456789ab"))
    assert "ANSWER fallback" in out and "this kernel does not compile" in out


def test_the_lock_names_its_owner_while_held(box, tmp_path):
    from tandem.model.kernels.build_lock import BuildLock, read_owner

    lock = BuildLock(tmp_path / "x.lock", timeout=1)
    with lock as held:
        assert held
        owner = read_owner(tmp_path / "x.lock")
        assert owner.pid == os.getpid() and owner.host == Owner.me().host
        assert abs(owner.started - time.time()) < 60
    assert read_owner(tmp_path / "x.lock") is None  # released: it names nobody


@pytest.mark.slow
def test_generate_starts_and_answers_when_the_kernel_builds_run_out_of_time(box, llama_path):
    """`tandem generate` on an empty kernel cache with a compiler slower than the timeout:
    the builds (all at once) are stopped at the bound and it answers on the torch path."""
    env = dict(
        os.environ, TORCH_EXTENSIONS_DIR=str(box / "ext"), CXX=str(box / "cxx"), SLOW_COMPILE="120"
    )
    t0 = time.monotonic()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "tandem.cli",
            "generate",
            "--model",
            str(llama_path),
            "--max-tokens",
            "4",
            "--ignore-eos",
            "--kernel-build-timeout",
            "3",
            "The quick",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "took longer than 3 s (--kernel-build-timeout)" in done.stderr
    assert done.stdout.strip()
    assert time.monotonic() - t0 < 120
    wait_until(lambda: not any(alive(pid) for pid in compiles(box)), seconds=10)
