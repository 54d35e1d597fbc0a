import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # tests/tiny.py, tests/reference.py
import patching  # noqa: E402  (tests/patching.py)

# the verify-length policy's device constants (verify_cost.speed_file) go to a folder of this run, not to ~; the
# policy itself runs as users run it (no cost is pinned for the suite: tests that need one pass verify_cost)
os.environ.setdefault("DFLASH_HF_CACHE", os.path.join(__import__("tempfile").mkdtemp(prefix="dflash_hf_costs_")))
os.environ.pop("DFLASH_VERIFY_COST", None)  # a cost pinned in the caller's shell would hide the default's faults
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
