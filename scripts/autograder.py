"""Write a Gradescope autograder: `pdm run make-autograder DIR`, then upload a zip of DIR's contents.

DIR gets Gradescope's `setup.sh` and `run_autograder` (the shell files in scripts/autograder/) and, in DIR/course,
the course they grade with: the tests, the tooling, the reference, the embedded model and a skeleton written afresh
from the reference, so whatever is in this checkout's src/tiny_llm (a student's work) never goes in.
book/src/grading.md ("For instructors") says how to use it.
"""

import argparse
import shutil
import sys
from pathlib import Path

from course.scratch import IGNORE
from course.user_errors import OneLineParser, user_error
from maint.make_skeleton import generate

PROG = "pdm run make-autograder"
REPO_ROOT = Path(__file__).resolve().parent.parent
SHELL_FILES = REPO_ROOT / "scripts" / "autograder"
PARTS = ("pyproject.toml", "pdm.lock", "README.md", "course", "maint", "scripts", "tests", "src", "src_ref",
         "models/qwen2-tiny-random")


def build_parser() -> OneLineParser:
    parser = OneLineParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dest", metavar="DIR", help="an empty or new folder to write the autograder to")
    return parser


def make_autograder(dest: Path) -> None:
    if dest.exists() and any(dest.iterdir()):
        raise SystemExit(user_error(PROG, f"{dest}: the folder is not empty"))
    course = dest / "course"
    course.mkdir(parents=True)
    for name in PARTS:
        source = REPO_ROOT / name
        if source.is_dir():
            shutil.copytree(source, course / name, ignore=IGNORE, symlinks=True)
        elif source.exists():
            shutil.copyfile(source, course / name)
    for name, text in generate(REPO_ROOT / "src_ref" / "tiny_llm_ref").items():
        (course / "src" / "tiny_llm" / name).write_text(text)
    for script in ("setup.sh", "run_autograder"):
        shutil.copyfile(SHELL_FILES / script, dest / script)
        (dest / script).chmod(0o755)  # Gradescope runs them as programs
    print(f"wrote a Gradescope autograder to {dest}: upload a zip of its contents "
          f"(cd {dest} && zip -r ../autograder.zip .)")


def main(argv: list[str] | None = None) -> int:
    make_autograder(Path(build_parser().parse_args(argv).dest).resolve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
