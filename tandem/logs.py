"""How every tandem process logs: one line per event on stderr, INFO unless
TANDEM_LOGGING_LEVEL says otherwise (as VLLM_LOGGING_LEVEL does for vLLM). The level applies
to tandem's own loggers; libraries stay at WARNING, so DEBUG shows tandem's detail only."""

from __future__ import annotations

import logging
import os

QUIET = (
    "httpx",
    # torch's extension builder warns "No CUDA runtime is found" on every CPU-only import
    "torch.utils.cpp_extension",
)


def setup_logging(tag: str = "") -> None:
    """Configure the root logger once per process; `tag` names the process in each line."""
    name = os.environ.get("TANDEM_LOGGING_LEVEL", "INFO").upper()
    level = logging.getLevelName(name)
    if not isinstance(level, int):
        raise ValueError(f"TANDEM_LOGGING_LEVEL: {name!r} is not a logging level")
    prefix = f"{tag} " if tag else ""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {prefix}%(levelname)s %(message)s")
    logging.getLogger("tandem").setLevel(level)
    for noisy in QUIET:
        logging.getLogger(noisy).setLevel(logging.WARNING if noisy == "httpx" else logging.ERROR)
