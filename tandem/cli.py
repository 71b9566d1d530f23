"""`tandem serve | generate | bench | profile | proxy | router | sim`: each subcommand lives in its package and is imported
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
    "profile": "tandem.engine.profile_cli",
    "proxy": "tandem.disagg.proxy_cli",
    "router": "tandem.router.cli",
    "sim": "tandem.sim.cli",
    "keys": "tandem.disagg.keys_cli",
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    wanted = argv[0] if argv and argv[0] in SUBCOMMANDS else None
    parser, modules = build_parser(wanted)
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # the sub-command's usage, not the top level's
        _innermost(parser, argv).error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        return modules[args.command].run(args) or 0
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def build_parser(only: str | None = None) -> tuple[argparse.ArgumentParser, dict]:
    """The whole command line, and each subcommand's module; with `only`, the other
    subcommands are names without flags (their modules are not imported)."""
    from tandem import __version__

    parser = argparse.ArgumentParser(prog="tandem", description="LLM inference serving")
    parser.add_argument("--version", action="version", version=f"tandem {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    modules = {}
    for name, path in SUBCOMMANDS.items():
        if only is None or name == only:
            modules[name] = importlib.import_module(path)
            modules[name].add_parser(sub)
        else:
            sub.add_parser(name)
    _show_defaults(parser)
    return parser, modules


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices
    return {}


def _show_defaults(parser: argparse.ArgumentParser) -> None:
    """Every flag's help ends with its default, unless it says the default in words."""
    for action in parser._actions:
        if not action.option_strings or action.default is argparse.SUPPRESS:
            continue
        if action.help is argparse.SUPPRESS or "(default" in (action.help or ""):
            continue
        action.help = f"{action.help or ''} (default: %(default)s)".strip()
    for child in _subcommands(parser).values():
        _show_defaults(child)


def _innermost(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.ArgumentParser:
    for token in argv:
        parser = _subcommands(parser).get(token, parser)
    return parser


if __name__ == "__main__":
    sys.exit(main())
