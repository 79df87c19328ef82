"""Attack: every test is reported as passed, whatever happened."""
import course.pytest_events as events

events._outcome = lambda reports: ("passed", "")
