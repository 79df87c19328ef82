"""Read the book: build it with mdBook (installed by `pdm install`) and serve it on this machine, offline.

    pdm run book                      # build, serve at http://127.0.0.1:3000 and rebuild on every change
    pdm run book --port 3001 --open   # another port; open it in your browser
    pdm run book --build book-out     # only build, into book-out/ (open book-out/index.html)

Formulas become MathML while the book is built (course/book_math.py), so nothing is fetched from the
network when you read it. A build fails on any warning mdBook prints, and then checks every link and
image of the built pages (maint/book_check.py's built_book_problems).
"""

import argparse
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

from course.user_errors import OneLineParser, user_error

REPO_ROOT = Path(__file__).resolve().parent.parent
BOOK = REPO_ROOT / "book"


def build_parser() -> OneLineParser:
    parser = OneLineParser(prog="pdm run book", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--build", metavar="DIR", type=Path,
                        help="build into DIR and stop (no server); fails on a warning or a broken link")
    parser.add_argument("--port", type=int, default=3000, help="port of the local server (default 3000)")
    parser.add_argument("--open", action="store_true", help="open the book in your web browser")
    return parser


def mdbook() -> str | None:
    """The mdbook of this environment (the `book` dependency group), next to this Python."""
    beside_python = Path(sys.executable).parent / "mdbook"
    return str(beside_python) if beside_python.exists() else shutil.which("mdbook")


def mdbook_env() -> dict:
    """mdBook runs the formula preprocessor as `python ...`: this environment's Python must come first."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def build(executable: str, out: Path) -> int:
    """Build into `out`; a warning or error from mdBook, or a broken link or image, fails the build."""
    from maint.book_check import built_book_problems

    run = subprocess.run([executable, "build", str(BOOK), "--dest-dir", str(out)], env=mdbook_env(),
                         capture_output=True, text=True)
    log = (run.stdout + run.stderr).strip()
    warnings = [line for line in log.splitlines() if re.match(r"\s*(WARN|ERROR)\b", line)]
    if run.returncode != 0 or warnings:
        print(log, file=sys.stderr)
        print(f"pdm run book: the build failed ({len(warnings)} warning(s)/error(s) above; "
              f"mdbook exit status {run.returncode})", file=sys.stderr)
        return 1
    problems = built_book_problems(out)
    if problems:
        print("\n".join(problems), file=sys.stderr)
        print(f"pdm run book: {len(problems)} broken link(s) or image(s) in the built book", file=sys.stderr)
        return 1
    print(f"built the book into {out}/ (open {out / 'index.html'})")
    return 0


def port_is_free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    executable = mdbook()
    if executable is None:
        return user_error(parser.prog, "mdbook is not installed: run `pdm install` (it installs the book "
                                       "group, mdBook from the Python package index)")
    if args.build is not None:
        out = args.build.resolve()
        if out == REPO_ROOT or out in (BOOK, BOOK / "src") or BOOK / "src" in out.parents:
            return user_error(parser.prog, f"--build {args.build}: pick a folder outside book/ and book/src "
                                           f"(mdBook empties it first)")
        if out.exists() and not out.is_dir():
            return user_error(parser.prog, f"--build {args.build}: is a file, not a folder")
        return build(executable, out)
    if not 1 <= args.port <= 65535:
        return user_error(parser.prog, f"--port {args.port}: must be 1 to 65535")
    if not port_is_free(args.port):
        return user_error(parser.prog, f"port {args.port} is in use: pick another with --port")
    command = [executable, "serve", str(BOOK), "--hostname", "127.0.0.1", "--port", str(args.port)]
    print(f"serving the book at http://127.0.0.1:{args.port} (Ctrl-C stops)")
    try:
        return subprocess.run(command + (["--open"] if args.open else []), env=mdbook_env()).returncode
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
