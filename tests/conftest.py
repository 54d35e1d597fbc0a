import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # tests/tiny.py, tests/reference.py
import patching  # noqa: E402  (tests/patching.py)

# the verify-length policy's measured tables (verify_policy.cost_file) go to a folder of this run, not to ~
os.environ.setdefault("DFLASH_HF_CACHE", os.path.join(__import__("tempfile").mkdtemp(prefix="dflash_hf_costs_")))
# the policy is the default: pin a cost under which every position is free, so it verifies the whole block each step
# (the drafting paths stay exercised) and no test pays a table's measurement; tests of the policy pass their own
# verify_cost, and those of the measured table delete the variable (verify_policy.env_cost)
os.environ.setdefault("DFLASH_VERIFY_COST", '{"widths": [1, 2], "verify": [1.0, 1.0]}')
torch.set_num_threads(1)  # tiny models: threads only add overhead on the 2-core CI machine


@pytest.fixture(autouse=True)
def _test_doubles_must_run():
    """Fail a test whose ``patching.patch_called`` double never ran (patched where the loop does not look)."""
    patching.INSTALLED.clear()
    yield
    idle = patching.never_called()
    patching.INSTALLED.clear()
    if idle:
        pytest.fail(f"test double(s) never called: {idle}; patch the name where the decode loop looks it up")
