"""`pdm run compare --week 3 --day 1` on an honest engine and on one with a planted preemption bug.

The full set of planted bugs, on every week-3 day, is `pdm run python -m maint.check_compare`; here
the honest run and the bug the issue names (the oldest running sequence preempted instead of the
newest), on day 3.1.
"""

from maint import check_compare


def test_compare_reports_no_difference_for_an_honest_engine_and_one_for_a_preemption_bug():
    swapped_victim = next(m for m in check_compare.MUTATIONS if "oldest running sequence" in m.name)
    assert check_compare.check(days=(1,), mutations=[swapped_victim]) == []
