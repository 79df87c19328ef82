"""Attack: the reporting plugin's next "start" event blocks forever, so the grader waits forever."""
import time

import course.pytest_events as events

_emit = events._emit


def _blocking(event):
    while event.get("event") == "start":
        try:
            time.sleep(1)
        except BaseException:  # the per-test time limit too
            pass
    _emit(event)


events._emit = _blocking
