"""A copy of the repository's code in a scratch folder (the grader's trusted directory, `check-days`' workspaces,
`check_compare`'s honest copies, the tooling tests): the folders named, pyproject.toml, and models/ linked."""

from __future__ import annotations

import shutil
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
# Caches a run leaves behind, and the labs' saved figures: never part of what a copy runs.
IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache", "results")


def copy_repository(dest: Path, folders) -> Path:
    """`folders` of the repository (e.g. "tests", "course") and pyproject.toml copied under `dest`, models/ linked
    (the embedded model is 30 MB)."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in folders:
        shutil.copytree(REPO_ROOT / name, dest / name, ignore=IGNORE)
    shutil.copyfile(REPO_ROOT / "pyproject.toml", dest / "pyproject.toml")
    if (REPO_ROOT / "models").exists():
        (dest / "models").symlink_to((REPO_ROOT / "models").resolve(), target_is_directory=True)
    return dest
