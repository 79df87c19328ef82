"""The book cannot drift from the code: checked in pure Python, without mdbook.

Each test runs one check of maint/book_check.py on this repo and lists every problem it finds as
"<file>:<line>: <what is wrong>". The checks themselves are tested on small synthetic books, where
each kind of drift is introduced on purpose, in tests/test_tooling.py.
"""

from pathlib import Path

import pytest

from maint import book_check

REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("check", list(book_check.CHECKS))
def test_book_is_in_step_with_the_code(check):
    problems = book_check.CHECKS[check](REPO_ROOT)
    assert not problems, f"{len(problems)} problem(s) with the book ({check}):\n  " + "\n  ".join(problems)
