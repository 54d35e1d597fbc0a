"""Targets prepared the way the transformers docs say: ``model.forward = torch.compile(model.forward, ...)``.

The taps then come from the forward's own hidden states (``target_taps.run_target``), never from hooks
inside the compiled region: with ``fullgraph=True`` the call runs, without it dynamo cuts no graph.
And a cold static compile (a target that never asked for hidden states, in a fresh process) runs.
Backend "eager" everywhere: dynamo traces, nothing is code-generated. Kept cheap (issue 23's CI
budget): a 1-layer target (tracing time grows with depth), 4 new tokens (3 verify steps), static
shapes (``dynamic=False``: symbolic tracing costs twice the time here, and the taps do not depend on it).

Planted bugs (each fails here): taps by hooks on a compiled target (``compiled_forward`` returning
False): the fullgraph call raises, the other counts graph breaks; no warm-up of transformers'
output capture (``warm_output_capture`` a no-op): 5.x fails "Unsupported context manager" in the
fullgraph call and in the fresh-process static call, and the no-fullgraph test counts the graph break
(checked again after the size cut: 1 layer, 4 tokens, ``dynamic=False``).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import target_taps
from tiny import tiny_draft, tiny_target

REPO = Path(__file__).resolve().parents[1]
PROMPT = torch.randint(0, 90, (1, 9), generator=torch.Generator().manual_seed(9))
NEW = 4  # the prefill's token, then 3 verify steps of block 4 (the random draft is accepted for 1 token)


def _draft():
    return tiny_draft(block_size=4, target_layer_ids=[0], num_target_layers=1)


def _compiled_target(fullgraph):
    """A 1-layer peaked target, its generate, then its forward compiled."""
    torch._dynamo.reset()  # dynamo caches per code object: a graph of an earlier test would be reused
    target = tiny_target("qwen3", peaked=True, layers=1)
    ref = target.generate(PROMPT, attention_mask=torch.ones_like(PROMPT), do_sample=False, max_new_tokens=NEW)
    target.forward = torch.compile(target.forward, fullgraph=fullgraph, backend="eager", dynamic=False)
    return target, ref


def test_fullgraph_compiled_target_runs_and_equals_generate():
    target, ref = _compiled_target(fullgraph=True)
    out = _draft().spec_generate(target, PROMPT, max_new_tokens=NEW, temperature=0.0, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    assert len(out.acceptance_lengths) >= 2  # the compiled forward verified more than one block
    assert target_taps.compiled_forward(target)


def test_no_graph_break_inside_a_compiled_target_forward():
    from torch._dynamo.utils import counters

    target, ref = _compiled_target(fullgraph=False)
    counters.clear()
    out = _draft().spec_generate(target, PROMPT, max_new_tokens=NEW, temperature=0.0)
    assert torch.equal(out, ref)
    assert counters["stats"]["unique_graphs"] >= 1  # the forward really was compiled
    assert dict(counters["graph_break"]) == {}


COLD = """
import sys, torch
sys.path[:0] = [{repo!r}, {tests!r}]
torch.set_num_threads(1)
from transformers import CompileConfig
from tiny import tiny_draft, tiny_target
target, prompt = tiny_target("qwen3", peaked=True, layers=1), torch.tensor([[5, 17, 3, 60, 8, 41, 2]])
out = tiny_draft(block_size=4, target_layer_ids=[0], num_target_layers=1).spec_generate(target, prompt, max_new_tokens=4,
    temperature=0.0, cache_implementation="static", compile_config=CompileConfig(backend="eager", fullgraph=True, dynamic=False))
ref = target.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=4)
assert torch.equal(out, ref), (out, ref)
print("COLD-OK")
"""


def test_cold_static_compile_in_a_fresh_process():
    """The target never ran a forward with ``output_hidden_states`` before the compiled verify."""
    code = COLD.format(repo=str(REPO), tests=str(REPO / "tests"))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert "COLD-OK" in done.stdout, done.stderr[-3000:]
