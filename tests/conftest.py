import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))  # tests/tiny.py, tests/reference.py
torch.set_num_threads(1)  # tiny models: threads only add overhead on the 2-core CI machine
