"""`tandem serve | generate | bench`: each subcommand lives in its package and is imported
only when used, so `tandem --help` stays fast."""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> module with add_parser(subparsers) and run(args)
SUBCOMMANDS = {
    "generate": "tandem.engine.generate_cli",
    "serve": "tandem.server.cli",
    "bench": "tandem.bench.cli",
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="tandem", description="LLM inference serving")
    sub = parser.add_subparsers(dest="command", required=True)
    wanted = argv[0] if argv and argv[0] in SUBCOMMANDS else None
    modules = {}
    for name, path in SUBCOMMANDS.items():
        if wanted is None or name == wanted:
            modules[name] = importlib.import_module(path)
            modules[name].add_parser(sub)
        else:
            sub.add_parser(name)
    args = parser.parse_args(argv)
    try:
        return modules[args.command].run(args) or 0
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
