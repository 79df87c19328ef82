"""Attack (or a bad bug): softmax allocates until memory runs out."""
import numpy as np


def softmax(x, axis):
    blocks = []
    while True:
        blocks.append(np.ones(2**27))  # 1 GiB each, touched
