"""Attack (or a bad bug): every name of the module allocates until memory runs out."""
import numpy as np


def __getattr__(name):
    blocks = []
    while True:
        blocks.append(np.ones(2**27))  # 1 GiB each, touched
