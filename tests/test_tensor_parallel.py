"""Tensor-parallel targets: a tiny Llama target loaded with ``tp_plan="auto"`` under 2 CPU ranks (gloo,
``torchrun``), the drafter replicated on each rank (``tests/tp_worker.py``). Every rank's greedy
``spec_generate`` (chain and trees, batch 1 and a ragged batch) equals that sharded target's own
``generate``, and a seeded sampled call gives the same tokens on every rank.

Planted bug caught: the draft's block embedding reading the sharded table as a plain tensor (5.x:
"aten.embedding.default got mixed torch.Tensor and DTensor").
"""

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tiny import peak, tiny_draft, tiny_target

TESTS = Path(__file__).resolve().parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Run the two ranks once for the whole file; returns their reports."""
    if not torch.distributed.is_available():
        pytest.skip("this torch build has no torch.distributed")
    root = tmp_path_factory.mktemp("tp")
    target = tiny_target("llama", seed=3)
    peak(target)
    target.save_pretrained(root / "target")
    tiny_draft(target_layer_ids=[0, 2]).save_pretrained(root / "drafter")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(_free_port()),
           str(TESTS / "tp_worker.py"), str(root / "target"), str(root / "drafter"), str(root)]
    proc = subprocess.run(cmd, cwd=TESTS.parent, capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(TESTS.parent)})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads((root / f"rank{k}.json").read_text()) for k in (0, 1)]


def test_the_target_is_really_sharded(ranks):
    assert all(r["sharded"] for r in ranks)


@pytest.mark.parametrize("call", ["batch1", "ragged"])
def test_every_rank_equals_the_sharded_targets_generate(ranks, call):
    for r in ranks:
        assert r[call]["spec"] == r[call]["generate"], call
        assert r[call]["tree"] == r[call]["generate"], call
    assert ranks[0][call] == ranks[1][call]


def test_seeded_sampling_gives_the_same_tokens_on_every_rank(ranks):
    assert ranks[0]["sampled"] == ranks[1]["sampled"]


def test_ranks_with_different_device_constants_choose_the_same_widths(ranks):
    """tp_worker hands rank 0 GPU-like and rank 1 compute-bound device constants: alone, their cost models would
    choose other widths (a collective-shape mismatch on a real sharded verify); rank 0's cost is shared.
    Planted bug caught: ``verify_cost.call_cost`` not calling ``shared_cost`` (the ranks' widths differ, or
    the run hangs on mismatched collectives)."""
    for key in ("sampled_widths",):
        assert ranks[0][key] == ranks[1][key]
    for call in ("batch1", "ragged"):
        assert ranks[0][call]["widths"] == ranks[1][call]["widths"], call
