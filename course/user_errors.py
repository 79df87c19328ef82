"""User errors in commands: one line on stderr and an exit status, never a traceback (tracebacks are for bugs)."""

import argparse
import functools
import sys

from course.selector import Task


def user_error(prog: str, message: str) -> int:
    """Print `prog: error: message` on one line; return the exit status for a user error (2)."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    return 2


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (argparse prints the usage too; --help has it)."""

    def error(self, message: str):
        raise SystemExit(user_error(self.prog, f"{message} (see --help)"))


def command(main):
    """Decorator for an entry point's `main`: a NotImplementedError that escapes (an unfinished task, only possible
    with --strict) ends in one line naming the task, its chapter and its test command, and exit status 1."""

    @functools.wraps(main)
    def wrapped(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except NotImplementedError as error:
            while isinstance(error.__context__, NotImplementedError):
                error = error.__context__  # clean-up code that is unwritten too: report what failed first
            task = Task.parse(str(error))
            line = f"not implemented yet: {error}"
            if task is not None:
                line += (f". Read {task.chapter}, then run `pdm run test --week {task.week} --day {task.day}`. "
                         f"(Without --strict, a command takes unwritten tasks from the reference.)")
            print(line, file=sys.stderr, flush=True)
            raise SystemExit(1) from None

    return wrapped
