"""`tandem proxy --prefill URL [URL...] --decode URL [URL...]`: the router in PD mode (the same
front end as `tandem router --prefill ... --decode ...`; see disagg/proxy.py)."""

from __future__ import annotations

import argparse


def add_parser(sub) -> None:
    from tandem.router.cli import add_common, add_pd

    p = sub.add_parser("proxy", help="front prefill and decode instances (the router's PD mode)")
    add_common(p)
    add_pd(p, required=True)


def run(args: argparse.Namespace) -> int:
    from tandem.router.cli import run as run_router

    return run_router(args)
