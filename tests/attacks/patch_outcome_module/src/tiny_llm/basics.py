"""Attack: a course module that makes the reporting plugin say "passed" for every test."""
import sys

sys.modules["course.pytest_events"]._outcome = lambda reports: ("passed", "")
