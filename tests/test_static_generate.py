"""The static-cache loop (``cache_implementation="static"``): exact against the dynamic loop, eager and
compiled (``fullgraph=True``, eager backend), with a fixed number of graphs however acceptance varies."""

import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModel, CompileConfig

import generation_utils
import proposers
import static_generate
from patching import patch_called
from tiny import VOCAB, tiny_draft, tiny_target

REPO = Path(__file__).resolve().parents[1]
TARGETS = {kind: tiny_target(kind, peaked=True) for kind in ("qwen3", "llama")}
PROMPT = torch.randint(0, 96, (1, 11), generator=torch.Generator().manual_seed(11))
SCRIPT = [0, 3, 1, 5, 2, 5, 4, 0]  # drafts right per step: acceptance lengths 1, 4, 2, 6, 3, 6, 5, 1
_REFS = {}


def reference(kind, n=80):
    if kind not in _REFS:
        target = TARGETS[kind]
        _REFS[kind] = target.generate(PROMPT, attention_mask=torch.ones_like(PROMPT), do_sample=False,
                                      max_new_tokens=80)
    return _REFS[kind][:, : PROMPT.shape[1] + n]


def _oracle(want_from, start, b):
    """One-hot logits ``(1, b - 1, V)`` right for the scripted number of slots after ``start``."""
    want = want_from[0, start + 1 : start + b].clone()
    right = SCRIPT[_oracle.calls % len(SCRIPT)]
    _oracle.calls += 1
    want[right:] = (want[right:] + 1) % VOCAB
    return torch.nn.functional.one_hot(want, VOCAB).float()[None] * 30


@pytest.fixture
def scripted(monkeypatch):
    """Both loops draft with the oracle; the real draft logits of every call are kept for comparison."""
    real, state = {"dynamic": [], "static": []}, {}
    dyn, sta = proposers._draft_logits, static_generate._draft_logits

    def fake_dynamic(draft, embed, head, anchor, ctx, cache, valid, start, b, mask_token_id):
        real["dynamic"].append(dyn(draft, embed, head, anchor, ctx, cache, valid, start, b, mask_token_id))
        return _oracle(state["ref"], int(start[0]), b)

    def fake_static(fn, draft, embed, head, anchor, features, n_ctx, cache, b, mask_token_id):
        real["static"].append(sta(fn, draft, embed, head, anchor, features, n_ctx, cache, b, mask_token_id).clone())
        return _oracle(state["ref"], int(cache.length), b)  # cache.length == the anchor's position now

    monkeypatch.setattr(proposers, "_draft_logits", fake_dynamic)
    monkeypatch.setattr(static_generate, "_draft_logits", fake_static)

    def run(kind, block_size, max_new_tokens, **kwargs):
        state["ref"] = reference(kind)
        _oracle.calls = 0
        out = generation_utils.spec_generate(tiny_draft(block_size=8), TARGETS[kind], PROMPT,
                                             max_new_tokens=max_new_tokens, temperature=0.0, block_size=block_size,
                                             return_dict_in_generate=True, **kwargs)
        assert _oracle.calls > 0, "the oracle never ran: patched where the loops do not look it up"
        return out

    run.real = real
    return run


class GraphCounter:
    """A ``torch.compile`` backend that runs graphs eagerly and counts them per compiled function
    (told apart by their inputs: the draft forward's graph reads the draft's weights)."""

    def __init__(self):
        self.graphs = {"draft": 0, "verify": 0}

    def __call__(self, gm, example_inputs):
        names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        self.graphs["draft" if any(name.lower().startswith("l_draft_") for name in names) else "verify"] += 1
        return gm.forward


@pytest.mark.parametrize("kind, compiled", [("qwen3", False), ("llama", False), ("qwen3", True)])
def test_static_equals_dynamic_under_varying_acceptance(kind, compiled, scripted):
    """Same tokens, same acceptance lengths and the same real draft logits at every step as the dynamic
    loop (whose budget is larger, so it never shortens a block in the compared range)."""
    counter = GraphCounter()
    kwargs = {}
    if compiled:
        torch._dynamo.reset()
        kwargs["compile_config"] = CompileConfig(backend=counter, fullgraph=True, dynamic=False)  # churn = new graphs
    new, b = 40, 6
    static = scripted(kind, b, new, cache_implementation="static", **kwargs)
    dynamic = scripted(kind, b, new + 2 * b, adaptive_block_size=False)  # the static loop verifies whole blocks
    assert torch.equal(static.sequences, reference(kind, new))
    assert torch.equal(static.sequences, dynamic.sequences[:, : PROMPT.shape[1] + new])
    steps = len(static.acceptance_lengths)
    assert static.acceptance_lengths[:-1] == dynamic.acceptance_lengths[: steps - 1]
    assert static.acceptance_lengths[-1] <= dynamic.acceptance_lengths[steps - 1]  # the last one is cut by the budget
    assert len(set(static.acceptance_lengths)) >= 4 and steps >= 6
    for got, want in zip(scripted.real["static"], scripted.real["dynamic"]):  # the draft context is right
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    if compiled:  # one graph per function is expected; a second would be a recompile, a third is churn
        assert 1 <= counter.graphs["draft"] <= 2 and 1 <= counter.graphs["verify"] <= 2, counter.graphs


@pytest.mark.parametrize("block_size", [1, 2, 8])
def test_static_random_draft_equals_generate_and_stops_like_it(block_size):
    """Real (random) draft: exact at every block size (1 drafts nothing), and the output ends right
    after the first stop token, as ``generate`` does."""
    target, draft = TARGETS["llama"], tiny_draft(block_size=8)
    full = reference("llama", 33)
    out = draft.spec_generate(target, PROMPT, max_new_tokens=33, temperature=0.0, block_size=block_size,
                              cache_implementation="static")
    assert torch.equal(out, full)
    stop = int(full[0, PROMPT.shape[1] + 7])
    cut = next(i for i in range(PROMPT.shape[1], full.shape[1]) if full[0, i] == stop)
    out = draft.spec_generate(target, PROMPT, max_new_tokens=33, temperature=0.0, stop_token_ids=[stop],
                              block_size=block_size, cache_implementation="static")
    assert torch.equal(out, full[:, : cut + 1])


def test_static_sampling_draws_what_the_dynamic_loop_draws():
    """Same generator seed, same block size: the same random draws in the same order, so the same tokens."""
    target, draft = TARGETS["llama"], tiny_draft(block_size=4)

    def run(n, **kwargs):
        g = torch.Generator().manual_seed(5)
        return draft.spec_generate(target, PROMPT, max_new_tokens=n, temperature=0.8, top_k=20, generator=g,
                                   **kwargs)

    static = run(30, cache_implementation="static")
    assert torch.equal(static, run(30 + 8)[:, : static.shape[1]])


def test_generation_config_selects_the_static_loop(monkeypatch, caplog):
    """Also with the verify-length policy on by default (``adaptive_block_size`` not passed): the static loop
    runs its fixed blocks without a word (asked for explicitly, the policy logs: the test below)."""
    target, draft = tiny_target(peaked=True), tiny_draft()
    calls = []
    real = static_generate.static_decode
    patch_called(monkeypatch, generation_utils, "static_decode", lambda *a, **k: calls.append(k) or real(*a, **k))
    target.generation_config.cache_implementation = "static"
    with caplog.at_level(logging.INFO):
        out = draft.spec_generate(target, PROMPT, max_new_tokens=9, temperature=0.0)
    assert len(calls) == 1 and calls[0]["compile_config"] is None
    assert "falls back" not in caplog.text and "adaptive_block_size" not in caplog.text
    target.generation_config.cache_implementation = None
    assert torch.equal(out, draft.spec_generate(target, PROMPT, max_new_tokens=9, temperature=0.0)) and len(calls) == 1


@pytest.mark.parametrize("case", ["batch", "sliding", "padding", "adaptive"])
def test_unsupported_calls_fall_back_to_the_dynamic_loop_with_one_info_log(case, caplog, monkeypatch):
    monkeypatch.setattr(generation_utils, "static_decode", lambda *a, **k: pytest.fail("static loop used"))
    draft, ids, mask, extra = tiny_draft(), PROMPT, None, {}
    target = TARGETS["qwen3"]
    if case == "batch":
        ids = PROMPT.repeat(2, 1)
    elif case == "sliding":
        target = tiny_target(peaked=True, layer_types=["full_attention", "sliding_attention", "full_attention"],
                             sliding_window=4, use_sliding_window=True)
    elif case == "padding":
        mask = torch.ones_like(PROMPT)
        mask[0, 0] = 0
    else:  # the verify-length policy asked for by name: the dynamic loop runs it
        extra = {"adaptive_block_size": True}
    with caplog.at_level(logging.INFO):
        out = draft.spec_generate(target, ids, attention_mask=mask, max_new_tokens=7, temperature=0.0,
                                  cache_implementation="static", **extra)
    logs = [r for r in caplog.records if "falls back to the dynamic loop" in r.getMessage()]
    assert len(logs) == 1 and logs[0].levelno == logging.INFO
    assert torch.equal(out, draft.spec_generate(target, ids, attention_mask=mask, max_new_tokens=7, temperature=0.0))


@pytest.mark.parametrize("kwargs, match", [
    ({"cache_implementation": "paged"}, "cache_implementation='paged'"),  # offloaded: test_user_calls.py
    ({"cache_implementation": "static", "compile_config": {"fullgraph": True}}, "must be a transformers CompileConfig"),
])
def test_bad_static_arguments_are_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        tiny_draft().spec_generate(TARGETS["qwen3"], PROMPT, max_new_tokens=3, **kwargs)


def test_saved_draft_runs_the_static_loop_from_its_own_remote_code(tmp_path):
    target, draft = TARGETS["qwen3"], tiny_draft()
    draft.save_pretrained(tmp_path / "draft")
    assert (tmp_path / "draft" / "static_generate.py").read_bytes() == (REPO / "static_generate.py").read_bytes()
    loaded = AutoModel.from_pretrained(str(tmp_path / "draft"), trust_remote_code=True).eval()
    out = loaded.spec_generate(target, PROMPT, max_new_tokens=12, temperature=0.0, cache_implementation="static",
                               return_dict_in_generate=True)
    assert torch.equal(out.sequences, reference("qwen3", 12)) and out.num_target_forwards > 1


def test_gpu_check_dry_runs_on_cpu():
    """bench/gpu_check.sh at the tiny shape on CPU: every section prints its JSON line, and every figure
    printed is positive and finite (a figure left out is null with a reason in ``refused``). Planted bug
    caught: plain decode per token from single-shot timings (printed negative on a loaded machine)."""
    env = {**os.environ, "GPU_CHECK_DRY_RUN": "1", "OMP_NUM_THREADS": "1", "PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(REPO / "bench" / "gpu_check.sh")], cwd=REPO, capture_output=True, text=True,
                          timeout=240, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    import json
    import math

    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    kinds = {line["check"] for line in lines}
    assert {"versions", "exactness", "compile", "speed", "syncs", "done"} <= kinds, kinds
    assert all(line.get("ok", True) for line in lines if line["check"] == "exactness")
    for line in lines:
        refused = line.get("refused", {})
        for key, value in line.items():
            if isinstance(value, float):
                assert math.isfinite(value) and value > 0, (key, line)
            elif isinstance(value, int) and not isinstance(value, bool):
                assert value >= 0, (key, line)
            elif value is None and key not in ("first_divergence", "logit_margin"):
                assert isinstance(refused.get(key), str) and refused[key], (key, line)
    plain = next(line for line in lines if line.get("path") == "plain_target_decode")
    assert plain["s_per_token"] is not None and plain["prefill_s"] < plain["decode_s"], plain
    assert all(line["c"] is not None for line in lines if line["check"] == "speed" and "c" in line)


def test_gpu_check_refuses_a_non_positive_derived_figure(capsys):
    """A per-token time that is the difference of two timings is refused, naming both, when the longer
    run was not longer; ``emit`` never prints a non-positive figure. Planted bug caught: without the
    positivity check in ``per_unit_difference`` / ``emit`` the negative figure is printed."""
    import json

    from bench import gpu_check

    value, why = gpu_check.per_unit_difference(0.10, 0.12, 11, "s_per_token")
    assert value is None and "0.1 s - 0.12 s" in why
    assert gpu_check.per_unit_difference(0.32, 0.10, 11, "s_per_token") == (pytest.approx(0.02), None)
    assert gpu_check.ratio(1.0, None, "c")[0] is None and gpu_check.ratio(1.0, 2.0, "c") == (0.5, None)
    gpu_check.emit(check="speed", s_per_token=-0.001, c=float("inf"), tau=2.0)
    line = json.loads(capsys.readouterr().out)
    assert line["s_per_token"] is None and line["c"] is None and line["tau"] == 2.0
    assert "-0.001" in line["refused"]["s_per_token"] and "inf" in line["refused"]["c"]
    with pytest.raises(ValueError, match="without a reason"):
        gpu_check.emit(check="speed", c=None)

def test_compiled_static_loop_does_not_recompile_across_calls_and_prompt_lengths():
    """``CompileConfig(backend="eager")``: the first call compiles the draft and verify graphs; later calls
    with other prompt lengths (shorter, so inside the first call's cache capacity) compile nothing more,
    and every output equals the dynamic loop. Planted bug caught: fresh caches at every call (the capacity
    then follows the prompt length: 240 + 16 + 6 needs 512 slots, 11 + 16 + 6 needs 256) -> two more graphs."""
    from torch._dynamo.utils import counters

    target, draft = TARGETS["qwen3"], tiny_draft(block_size=6)
    torch._dynamo.reset()
    counters.clear()
    config = CompileConfig(backend="eager", fullgraph=True, dynamic=False)
    graphs = []
    for n in (240, 11, 60):
        prompt = torch.randint(0, 96, (1, n), generator=torch.Generator().manual_seed(n))
        out = draft.spec_generate(target, prompt, max_new_tokens=16, temperature=0.0, block_size=6,
                                  cache_implementation="static", compile_config=config)
        assert torch.equal(out, draft.spec_generate(target, prompt, max_new_tokens=16, temperature=0.0, block_size=6))
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[0] >= 2 and graphs == graphs[:1] * len(graphs), graphs


def test_static_caches_are_per_target_and_thread_and_emptied_at_each_call(monkeypatch):
    """Two threads never share caches; a thread's next call gets its own caches back, emptied (zeros,
    counters at 0) before any forward. Planted bugs caught: one cache per target for all threads (same
    objects across threads), no ``reset`` (a kept buffer holds the last call's keys)."""
    import threading

    target, draft = TARGETS["llama"], tiny_draft(block_size=6)
    seen, real = [], static_generate._static_steps

    def watch(*args):
        target_cache, draft_cache = args[-2:]
        keys = [k for k in draft_cache.keys if k is not None]
        seen.append((threading.get_ident(), id(target_cache), id(draft_cache), int(draft_cache.length),
                     all(not bool(k.any()) for k in keys), len(keys)))
        return real(*args)

    monkeypatch.setattr(static_generate, "_static_steps", watch)

    # One thread after the other (so that each call's caches are seen alone; concurrent calls: the test below),
    # both alive until both are done so that their idents cannot be reused.
    first_done, second_done, outputs = threading.Event(), threading.Event(), []

    def run(wait, done):
        try:
            assert wait is None or wait.wait(120)
            for _ in range(2):
                outputs.append(draft.spec_generate(target, PROMPT, max_new_tokens=12, temperature=0.0,
                                                   cache_implementation="static"))
        finally:
            done.set()
            second_done.wait(120)

    threads = [threading.Thread(target=run, args=(None, first_done)),
               threading.Thread(target=run, args=(first_done, second_done))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(240)
    assert len(seen) == 4 and len(outputs) == 4
    assert all(torch.equal(out, reference("llama", 12)) for out in outputs)
    by_thread = {}
    for ident, t_id, d_id, length, zeros, allocated in seen:
        by_thread.setdefault(ident, []).append((t_id, d_id, allocated))
        assert length == 0 and zeros
    first, second = by_thread.values()
    assert first[0][:2] == first[1][:2] and second[0][:2] == second[1][:2]  # reused within a thread
    assert not {first[0][0], first[0][1]} & {second[0][0], second[0][1]}  # never shared between threads
    assert first[1][2] > 0 and second[1][2] > 0  # the second call found allocated buffers (then emptied)


def test_concurrent_static_calls_on_one_target_each_equal_generate():
    """Two threads, two static-loop calls each, at the same time on one target: every output equals
    ``generate``. The bug (transformers 4.x): a forward asking for hidden states replaces the decoder
    layers' ``forward`` on the shared model for its duration, so the other thread's forwards meanwhile
    filled its tuple or lost their own (IndexError, or states of the other prompt's length).
    ``target_taps.forward_lock`` serialises our forwards per target; planted bug seen failing on 4.57 (lock
    made a no-op: IndexError / size mismatch in ``_verify_forward``). On 5.x it passes either way."""
    import sys
    import threading

    target, draft = TARGETS["llama"], tiny_draft(block_size=6)
    outputs, errors = [], []

    def run():
        try:
            for _ in range(2):
                outputs.append(draft.spec_generate(target, PROMPT, max_new_tokens=12, temperature=0.0,
                                                   cache_implementation="static"))
        except Exception as exc:  # reported below with the thread's error
            errors.append(repr(exc))

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # interleave the threads inside forwards
    try:
        threads = [threading.Thread(target=run) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(240)
    finally:
        sys.setswitchinterval(interval)
    assert not errors, errors
    assert len(outputs) == 4 and all(torch.equal(out, reference("llama", 12)) for out in outputs)


def test_static_call_on_cpu_logs_one_warning_with_the_measured_figures(caplog):
    """The note carries the README's measured figures; a call that falls back (batch 2) says nothing of it."""
    draft = tiny_draft()
    with caplog.at_level(logging.WARNING):
        draft.spec_generate(TARGETS["qwen3"], PROMPT, max_new_tokens=5, temperature=0.0, cache_implementation="static")
    notes = [r for r in caplog.records if "not faster than spec_generate's dynamic loop" in r.getMessage()]
    assert len(notes) == 1 and notes[0].levelno == logging.WARNING
    readme = (REPO / "docs" / "speed.md").read_text()
    for figure in re.findall(r"\d\.\d\dx", notes[0].getMessage()):
        assert figure in readme, f"{figure} of the CPU note is not in docs/speed.md"
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        draft.spec_generate(TARGETS["qwen3"], PROMPT.repeat(2, 1), max_new_tokens=5, temperature=0.0,
                            cache_implementation="static")
    assert "not faster" not in caplog.text


def test_drafters_of_other_attention_shapes_one_after_another_on_one_target_each_equal_generate(monkeypatch):
    """Issue 34, item 6: the static caches kept per (target, thread) are rebuilt for a drafter whose
    context K/V differ (other ``num_key_value_heads``, other ``head_dim``, another dtype), and reused by
    the next call of the same drafter. Planted bug caught: caches keyed by the draft's layer count only
    (before issue 34) -> ``index_copy_(): Source/destination tensor must have same slice shapes`` on the
    second drafter."""
    target, seen, real = TARGETS["qwen3"], [], static_generate._static_steps

    def watch(*args):
        seen.append(args[-1])  # the object itself: an id of a freed cache can be reused
        return real(*args)

    monkeypatch.setattr(static_generate, "_static_steps", watch)
    ref = reference("qwen3", 4)
    base = tiny_draft(block_size=4)
    others = [tiny_draft(block_size=4, num_key_value_heads=4), tiny_draft(block_size=4, head_dim=8),
              tiny_draft(block_size=4).double()]
    calls = [base, others[0], base, others[1], base, others[2], others[2]]  # each change alone after `base`
    for draft in calls:
        out = draft.spec_generate(target, PROMPT, max_new_tokens=4, temperature=0.0, cache_implementation="static")
        assert torch.equal(out, ref), draft.config
    assert len({id(c) for c in seen[:6]}) == 6 and seen[6] is seen[5]  # new caches per change, then reused
