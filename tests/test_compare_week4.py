"""`pdm run compare --week 4 --day 1` on an honest speculative engine and on one with a planted bug.

The full set of planted bugs, on days 4.1 and 4.2, is `pdm run python -m maint.check_compare --week 4`;
here the honest run and one bug (no token of the target's own after a fully accepted draft), on day 4.1.
"""

from maint import check_compare


def test_compare_week4_reports_no_difference_for_an_honest_engine_and_one_for_a_missing_bonus_token():
    no_bonus = next(m for m in check_compare.MUTATIONS if m.week == 4 and "target's own" in m.name)
    assert check_compare.check(days=(1,), mutations=[no_bonus], week=4) == []
