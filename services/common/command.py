"""The front of a `foldmoe` subcommand with options of its own (generate, evaluate): arguments, then one line per
error the user must fix."""

from __future__ import annotations

import argparse
import sys
from typing import Callable

from services.common import logs

EXIT_USAGE = 2  # input the user must fix: one line naming the cause


def run_command(prog: str, parser: argparse.ArgumentParser, argv: list[str] | None,
                body: Callable[[argparse.Namespace], object], errors: tuple[type[BaseException], ...]) -> int:
    """Parse `argv` (options, then `section.key=value` overrides in any order, into `args.overrides`), run `body`; an
    error of `errors` is printed as one line `PROG: error: ...` and exits 2, Ctrl-C exits 130."""
    logs.configure(prog.split()[-1])
    args, rest = parser.parse_known_args(argv)  # overrides may follow options
    if any(r.startswith("-") for r in rest):
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.overrides += rest
    try:
        body(args)
    except errors as e:
        print(f"{prog}: error: {' '.join(str(e).split())}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    return 0
