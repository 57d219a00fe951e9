"""The ``loom`` command line. Each command family lives in its own module and registers here."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

# Each entry: module path -> name of its ``register(subparsers)`` function. A registered command
# sets ``func`` on its parser; ``main`` calls it with the parsed arguments and exits with its result.
_COMMAND_MODULES: list[str] = [
    "loom.cmd_generate",
    "loom.cmd_bench",  # bench, loadtest and soak: launchers of loadtest/ in a source checkout
    "loom.cmd_admin",
    "loom.cmd_serve",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="loom", description="Loom: multi-tenant LLM inference.")
    sub = parser.add_subparsers(dest="command", required=True)
    import importlib

    for module_name in _COMMAND_MODULES:
        module = importlib.import_module(module_name)
        register: Callable[[argparse._SubParsersAction[argparse.ArgumentParser]], None] = module.register
        register(sub)
    return parser


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    from loom import cmd_bench

    if argv and argv[0] in cmd_bench.LAUNCHED:  # the benchmarks parse their own arguments
        sys.exit(cmd_bench.launch(argv[0], argv[1:]))
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code = args.func(args)
    except KeyboardInterrupt:
        code = 130
    sys.exit(code or 0)


if __name__ == "__main__":
    main()
