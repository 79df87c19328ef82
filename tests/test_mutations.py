"""maint/mutations.py's planted bugs still apply to the reference: a stale patch is a maintainer check that stopped
checking without a sound (grading the mutations is a maintainer's run, not CI's; planting them is cheap)."""

import shutil

from maint import mutations


def test_every_planted_bug_still_applies_once(tmp_path):
    honest = tmp_path / "honest"
    mutations.honest_submission(honest)
    stale = {}
    for mutation in mutations.MUTATIONS:
        submission = tmp_path / mutation.name
        shutil.copytree(honest, submission)
        if found := mutations.plant(submission, mutation):
            stale[mutation.name] = found
    assert stale == {}, "rewrite these patches against the reference's code (pdm run python -m maint.mutations --list)"


def test_every_day_has_planted_bugs():
    hurt = {key for mutation in mutations.MUTATIONS for key in mutation.day_keys}
    assert hurt == {(day.week, day.day) for day in mutations.DAYS}
