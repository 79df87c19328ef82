"""Attack: an extra module, not in the course, that patches the reporting plugin when imported."""
import sys

for module in list(sys.modules.values()):
    if getattr(module, "__name__", "").endswith("pytest_events"):
        module._outcome = lambda reports: ("passed", "")
