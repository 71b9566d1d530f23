"""`tandem keys generate FOLDER [--name NAME]`: a CURVE key pair for the KV link (curve.py)."""

from __future__ import annotations

import argparse


def add_parser(sub) -> None:
    p = sub.add_parser("keys", help="make key pairs for the authenticated KV link (CurveZMQ)")
    actions = p.add_subparsers(dest="action", required=True)
    gen = actions.add_parser("generate", help="write NAME.key (public) and NAME.key_secret")
    gen.add_argument("folder", help="where to write them (created if missing)")
    gen.add_argument("--name", default="kv", help="the files' base name")


def run(args: argparse.Namespace) -> int:
    from tandem.kv_transfer.curve import generate

    public, secret = generate(args.folder, args.name)
    print(f"public key: {public} (give it to the peers)")
    print(f"secret key: {secret} (keep it on this instance only, mode 600)")
    return 0
