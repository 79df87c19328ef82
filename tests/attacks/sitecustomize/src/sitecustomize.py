"""Attack: Python runs this at start-up when src/ is on the path: every process ends at once."""
import os

os._exit(0)
