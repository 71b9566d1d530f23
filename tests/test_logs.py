"""setup_logging: what every tandem process prints, and TANDEM_LOGGING_LEVEL."""

import os
import subprocess
import sys

SCRIPT = """
import logging
from tandem.logs import setup_logging
setup_logging("core")
logging.getLogger("tandem.x").debug("tandem detail")
logging.getLogger("tandem.x").info("tandem event")
logging.getLogger("somelib").debug("library detail")
logging.getLogger("torch.utils.cpp_extension").warning("No CUDA runtime is found")
"""


def _run(level: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TANDEM_LOGGING_LEVEL"}
    if level:
        env["TANDEM_LOGGING_LEVEL"] = level
    return subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=60
    )


def test_info_by_default_with_the_process_tag_and_without_torchs_cuda_warning():
    err = _run(None).stderr
    assert " core INFO tandem event" in err
    assert "tandem detail" not in err and "No CUDA" not in err


def test_debug_level_shows_tandems_detail_but_not_the_libraries():
    err = _run("debug").stderr
    assert " core DEBUG tandem detail" in err and "tandem event" in err
    assert "library detail" not in err


def test_an_unknown_level_is_refused_naming_the_variable():
    run = _run("chatty")
    assert run.returncode != 0 and "TANDEM_LOGGING_LEVEL: 'CHATTY'" in run.stderr
