import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # tests/tiny.py, tests/reference.py
import patching  # noqa: E402  (tests/patching.py)

# the verify-length policy's device constants (verify_cost.speed_file) go to a folder of this run, never to the
# user's; the policy itself runs as users run it (no cost is pinned for the suite: tests that need one pass
# verify_cost). The folder starts with the constants measured once on the 2-core CI machine, read through the
# package's own file path, so that whether a tiny model's call drafts does not depend on the load of the moment
# (a measurement under load made a block of 4 never pay and a DFlash 2 walk never run); the measurement itself is
# tested in tests/test_verify_cost.py on folders of its own.
os.environ["DFLASH_HF_CACHE"] = __import__("tempfile").mkdtemp(prefix="dflash_hf_costs_")
os.environ.pop("DFLASH_VERIFY_COST", None)  # a cost pinned in the caller's shell would hide the default's faults
torch.set_num_threads(1)  # tiny models: threads only add overhead on the 2-core CI machine
CI_MACHINE_SPEED = {"op_s": 1.2e-5, "byte_s": 3.5e-11, "flop_s": 1.7e-11, "attn_flop_s": 4.1e-11}


def _seed_device_speed():
    import json
    import time

    import verify_cost

    entry = {**CI_MACHINE_SPEED, "measured_at": time.time(), "load": None, "cores": os.cpu_count(), "seconds": 0.0}
    with open(verify_cost.speed_file(), "w") as f:
        json.dump({verify_cost.speed_key(torch.device("cpu"), torch.float32): entry}, f)


_seed_device_speed()


@pytest.fixture(autouse=True)
def _test_doubles_must_run():
    """Fail a test whose ``patching.patch_called`` double never ran (patched where the loop does not look)."""
    patching.INSTALLED.clear()
    yield
    idle = patching.never_called()
    patching.INSTALLED.clear()
    if idle:
        pytest.fail(f"test double(s) never called: {idle}; patch the name where the decode loop looks it up")
