"""User errors in commands: one line on stderr and exit status 2, never a traceback (tracebacks are for bugs)."""

import argparse
import sys


def user_error(prog: str, message: str) -> int:
    """Print `prog: error: message` on one line; return the exit status for a user error (2)."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    return 2


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (argparse prints the usage too; --help has it)."""

    def error(self, message: str):
        raise SystemExit(user_error(self.prog, f"{message} (see --help)"))
