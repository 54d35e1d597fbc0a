"""Calls as users really make them (issue 22): a stateful grammar processor written like xgrammar's
transformers processor, per-row ``prefix_allowed_tokens_fn`` rules in a batch, a stopping criterion
returning a plain ``bool``, ``synced_gpus`` / ``use_model_defaults``, ``adaptive_block_size`` with the
static cache, a batch without eos whose rows stop at different points, ``cache_implementation`` values,
and a target with another vocabulary on every route.

Each test was run against the code before issue 22 and failed there (the planted-bug notes say how).
"""

import inspect
import logging
import pathlib
import threading

import pytest
import torch
import transformers
from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteria

import generation_utils
from test_generate_parity import DRAFT, PROMPTS, TARGET, _left_pad, oracle  # noqa: F401 (fixture)
from tiny import VOCAB, tiny_draft, tiny_target

IS_5 = int(transformers.__version__.split(".")[0]) >= 5


# ----------------------------------------------------------------------------- a stateful grammar processor


class ToyMatcher:
    """A grammar over the tiny vocabulary, per row: no two consecutive tokens in the same residue class
    ``(t + row) % 3``. ``accept_token`` returns False for a forbidden token, like xgrammar's matcher."""

    def __init__(self, row):
        self.row, self.state = row, None

    def allowed(self):
        return [t for t in range(VOCAB) if self.state is None or (t + self.row) % 3 != self.state]

    def accept_token(self, token):
        if self.state is not None and (token + self.row) % 3 == self.state:
            return False
        self.state = (token + self.row) % 3
        return True

    def is_terminated(self):
        return False


class GrammarProcessor(LogitsProcessor):
    """xgrammar's transformers ``LogitsProcessor`` call pattern (``xgrammar/contrib/hf.py``): the first call
    creates one matcher per row and fixes the batch size; every later call advances row ``i``'s matcher by
    ``input_ids[i, -1]`` (an illegal token fails, as xgrammar's ``assert accept_token``), then masks each
    row's scores to the tokens its matcher allows. It also raises when called out of order (a prefix
    length other than the previous one + 1), which xgrammar would not notice but would mis-track."""

    def __init__(self):
        self.matchers, self.prefilled, self.length, self.calls = [], False, None, 0

    def __call__(self, input_ids, scores):
        self.calls += 1
        if not self.matchers:
            self.batch_size = input_ids.shape[0]
            self.matchers = [ToyMatcher(i) for i in range(self.batch_size)]
        if input_ids.shape[0] != self.batch_size:
            raise RuntimeError(f"batch of {input_ids.shape[0]} rows, the processor was built for {self.batch_size}")
        if not self.prefilled:
            self.prefilled = True
        else:
            if input_ids.shape[1] != self.length + 1:
                raise RuntimeError(f"called out of order: length {input_ids.shape[1]} after {self.length}")
            for i, matcher in enumerate(self.matchers):
                if not matcher.is_terminated() and not matcher.accept_token(int(input_ids[i, -1])):
                    raise AssertionError(f"row {i}: token {int(input_ids[i, -1])} breaks the grammar")
        self.length = input_ids.shape[1]
        mask = torch.full_like(scores, float("-inf"))
        for i, matcher in enumerate(self.matchers):
            mask[i, matcher.allowed()] = 0
        return scores + mask


def _follows_grammar(row_tokens, row):
    return all((a + row) % 3 != (b + row) % 3 for a, b in zip(row_tokens, row_tokens[1:]))


def _ragged_script(step, row):
    """Drafts right for a row-dependent number of slots: rows of a batch accept different counts."""
    return (1, 3, 0, 2)[(step + row) % 4]


@pytest.mark.parametrize("batch", [False, True], ids=["batch_1", "ragged"])
@pytest.mark.parametrize("script", [[5], _ragged_script], ids=["full", "partly"])
def test_stateful_grammar_processor_greedy_equals_generate(oracle, batch, script):
    """Planted bugs caught: without copies (the code before issue 22) the processor is advanced by drafted
    slots and raises 'called out of order' at the first draft; replaying one slot too few on the original
    ('count - 1' in ``replay``) raises it too; without ``lockstep`` the ragged rows, which accept different
    counts, are scored at one row's length (wrong tokens or 'called out of order')."""
    ids, mask = _left_pad(PROMPTS if batch else PROMPTS[:1])
    ref = TARGET.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=20, pad_token_id=0,
                          logits_processor=LogitsProcessorList([GrammarProcessor()]))
    oracle(mask, ref, script)
    proc = GrammarProcessor()
    out = DRAFT.spec_generate(TARGET, ids, attention_mask=mask, max_new_tokens=20, temperature=0.0, pad_token_id=0,
                              logits_processor=LogitsProcessorList([proc]))
    assert torch.equal(out, ref)
    for r in range(ids.shape[0]):
        assert _follows_grammar(out[r, ids.shape[1]:].tolist(), r)


def test_stateful_grammar_processor_sampled_follows_the_grammar():
    """Sampling: every draw passes through the copies and the replayed original without an illegal token,
    and the output obeys each row's grammar."""
    ids, mask = _left_pad(PROMPTS)
    for seed in range(3):
        out = DRAFT.spec_generate(TARGET, ids, attention_mask=mask, max_new_tokens=16, do_sample=True, pad_token_id=0,
                                  logits_processor=LogitsProcessorList([GrammarProcessor()]),
                                  generator=torch.Generator().manual_seed(seed))
        for r in range(ids.shape[0]):
            assert _follows_grammar(out[r, ids.shape[1]:].tolist(), r), (seed, r)


def test_the_original_processor_sees_committed_tokens_once_in_order(oracle):
    """The caller's instance ends where generate's does (one call per committed token but the last)."""
    ids = PROMPTS[0]
    ref = TARGET.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=20)
    oracle(torch.ones_like(ids), ref, [1, 3, 0, 2])
    class Recording(GrammarProcessor):
        def __call__(self, input_ids, scores):
            self.seen = getattr(self, "seen", []) + [input_ids.shape[1]]  # copies keep their own list
            return super().__call__(input_ids, scores)

    proc = Recording()
    DRAFT.spec_generate(TARGET, ids, max_new_tokens=20, temperature=0.0, logits_processor=LogitsProcessorList([proc]))
    assert proc.seen == list(range(ids.shape[1], ids.shape[1] + len(proc.seen))) and len(proc.seen) > 10


def test_a_processor_that_cannot_be_copied_is_refused_before_any_forward():
    class Locked(LogitsProcessor):
        def __init__(self):
            self.lock = threading.Lock()

        def __call__(self, input_ids, scores):
            return scores

    calls = []
    handle = TARGET.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        with pytest.raises(ValueError, match="Locked.*stateless=True"):
            DRAFT.spec_generate(TARGET, PROMPTS[0], max_new_tokens=4, logits_processor=LogitsProcessorList([Locked()]))
    finally:
        handle.remove()
    assert calls == []


# ----------------------------------------------------------------------------- per-row prefix_allowed_tokens_fn


def test_per_row_prefix_allowed_tokens_fn_in_a_ragged_batch(oracle):
    """Row ``b`` may only continue with tokens ``t % 3 == b``, and its rule has nothing to offer after a
    token outside its class (documented ``batch_id`` use). Planted bug caught: ``_process_at`` filling the
    other rows with one row's prefix (the code before issue 22) raises 'constraint is unsatisfiable'; so
    does scoring rows that accepted different counts at one length (``lockstep`` removed)."""
    ids, mask = _left_pad(PROMPTS)
    width = ids.shape[1]

    def rule(batch_id, sent):
        if len(sent) > width and int(sent[-1]) % 3 != batch_id:
            return []
        return [t for t in range(VOCAB) if t % 3 == batch_id]

    ref = TARGET.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=15, pad_token_id=0,
                          prefix_allowed_tokens_fn=rule)
    oracle(mask, ref, _ragged_script)
    out = DRAFT.spec_generate(TARGET, ids, attention_mask=mask, max_new_tokens=15, temperature=0.0, pad_token_id=0,
                              prefix_allowed_tokens_fn=rule)
    assert torch.equal(out, ref)


# ----------------------------------------------------------------------------- stopping criteria


class AtLength(StoppingCriteria):
    """The tutorial pattern: a plain Python bool."""

    def __init__(self, length, kind="bool"):
        self.length, self.kind = length, kind

    def __call__(self, input_ids, scores, **kwargs):
        done = input_ids.shape[1] >= self.length
        if self.kind == "tensor":
            return torch.full((input_ids.shape[0],), done, dtype=torch.bool)
        return done


@pytest.mark.parametrize("kind", ["bool", "tensor"])
def test_stopping_criteria_returning_a_bool_like_generate(kind):
    """Planted bug caught: ``c(prefix, None).any()`` (the code before issue 22): AttributeError on a bool."""
    ids = PROMPTS[0]
    ref = TARGET.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=20,
                          stopping_criteria=[AtLength(ids.shape[1] + 7, kind)])
    out = DRAFT.spec_generate(TARGET, ids, max_new_tokens=20, temperature=0.0,
                              stopping_criteria=[AtLength(ids.shape[1] + 7, kind)])
    assert torch.equal(out, ref) and out.shape[1] == ids.shape[1] + 7


class LastTokenIs(StoppingCriteria):
    def __init__(self, token):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


def test_without_eos_a_stopped_row_keeps_generating_like_generate(oracle):
    """No eos criterion: generate keeps generating a stopped row until every row has stopped; with one, the
    row is padded. Planted bug caught: padding the stopped row (the code before issue 22)."""
    ids, mask = _left_pad(PROMPTS[:2])
    full = TARGET.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=30, pad_token_id=0)
    new = full[:, ids.shape[1]:]
    token = int(new[0, 3])  # stops row 0 early; row 1 later or at the budget
    assert token not in new[1, :3].tolist()
    for eos in (None, 95):
        kw = dict(max_new_tokens=30, pad_token_id=0, stopping_criteria=[LastTokenIs(token)], eos_token_id=eos)
        ref = TARGET.generate(ids, attention_mask=mask, do_sample=False, **kw)
        oracle(mask, full, [1, 3, 0, 2])
        out = DRAFT.spec_generate(TARGET, ids, attention_mask=mask, temperature=0.0, **kw)
        assert torch.equal(out, ref), (eos, out[:, ids.shape[1]:].tolist(), ref[:, ids.shape[1]:].tolist())
    assert (out[0, ids.shape[1] + 4:] == 0).all()  # with eos set, the stopped row is padded


# ----------------------------------------------------------------------------- generate's own options


def test_synced_gpus_and_use_model_defaults():
    """Planted bug caught: the code before issue 22 raises TypeError for both."""
    ids = PROMPTS[1]
    base = DRAFT.spec_generate(TARGET, ids, max_new_tokens=8, temperature=0.0)
    for value in (None, False):
        assert torch.equal(DRAFT.spec_generate(TARGET, ids, max_new_tokens=8, temperature=0.0, synced_gpus=value), base)
    with pytest.raises(NotImplementedError, match="synced_gpus=True"):
        DRAFT.spec_generate(TARGET, ids, max_new_tokens=8, synced_gpus=True)
    if "use_model_defaults" in inspect.signature(TARGET.generate).parameters:  # transformers 4.57
        for value in (None, True, False):
            ref = TARGET.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                                  use_model_defaults=value)
            out = DRAFT.spec_generate(TARGET, ids, max_new_tokens=8, temperature=0.0, use_model_defaults=value)
            assert torch.equal(out, ref)
    else:
        with pytest.raises(TypeError, match="use_model_defaults"):
            DRAFT.spec_generate(TARGET, ids, max_new_tokens=8, use_model_defaults=True)


def test_adaptive_block_size_with_the_static_cache_adapts(caplog, monkeypatch):
    """Planted bug caught: the static loop ran with fixed blocks and said nothing (before issue 22)."""
    monkeypatch.setattr(generation_utils, "static_decode", lambda *a, **k: pytest.fail("static loop used"))
    target, ids = tiny_target(peaked=True), PROMPTS[1]
    with caplog.at_level(logging.INFO):
        out = DRAFT.spec_generate(target, ids, max_new_tokens=20, temperature=0.0, cache_implementation="static",
                                  adaptive_block_size=True, return_dict_in_generate=True)
    assert [r for r in caplog.records if "adaptive_block_size" in r.getMessage()]
    drafted = out.row_draft_lengths[0]
    assert min(drafted) < DRAFT.config.block_size - 1  # blocks shrank after short acceptances
    ref = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=20)
    assert torch.equal(out.sequences, ref)


# ----------------------------------------------------------------------------- cache_implementation


def _logs(caplog, text):
    return [r for r in caplog.records if text in r.getMessage()]


def test_cache_implementation_from_a_config_runs_the_dynamic_loop_with_one_log(caplog, monkeypatch):
    monkeypatch.setattr(generation_utils, "static_decode", lambda *a, **k: pytest.fail("static loop used"))
    target, ids = tiny_target(peaked=True), PROMPTS[1]
    ref = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=9)
    for value in ("hybrid", "sliding_window", "offloaded", "quantized"):
        target.generation_config.cache_implementation = value
        caplog.clear()
        with caplog.at_level(logging.INFO):
            assert torch.equal(DRAFT.spec_generate(target, ids, max_new_tokens=9, temperature=0.0), ref), value
        assert len(_logs(caplog, f"cache_implementation={value!r}")) == 1, value


def test_cache_implementation_in_the_call(caplog, monkeypatch):
    """Passed in the call: static aliases follow the static loop's rules, offloaded runs dynamic with a log,
    quantized is refused by name."""
    import static_generate

    calls = []
    real = static_generate.static_decode
    monkeypatch.setattr(generation_utils, "static_decode", lambda *a, **k: calls.append(1) or real(*a, **k))
    target, ids = tiny_target(peaked=True), PROMPTS[1]
    ref = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=9)
    for value in ("hybrid", "hybrid_chunked", "sliding_window"):  # full-attention target: the static loop
        out = DRAFT.spec_generate(target, ids, max_new_tokens=9, temperature=0.0, cache_implementation=value)
        assert torch.equal(out, ref) and len(calls) == 1, value
        calls.clear()
    sliding = tiny_target(peaked=True, layer_types=["full_attention", "sliding_attention", "full_attention"],
                          sliding_window=4, use_sliding_window=True)
    with caplog.at_level(logging.INFO):
        DRAFT.spec_generate(sliding, ids, max_new_tokens=9, temperature=0.0, cache_implementation="hybrid")
        DRAFT.spec_generate(target, ids, max_new_tokens=9, temperature=0.0, cache_implementation="offloaded")
    assert calls == [] and len(_logs(caplog, "cache_implementation='hybrid'")) == 1
    assert len(_logs(caplog, "cache_implementation='offloaded'")) == 1
    with pytest.raises(NotImplementedError, match="quantized"):
        DRAFT.spec_generate(target, ids, max_new_tokens=9, cache_implementation="quantized")


# ----------------------------------------------------------------------------- vocabulary


def _other_vocab_target():
    return tiny_target(peaked=True, vocab_size=VOCAB + 4)


def test_a_target_with_another_vocabulary_is_refused_before_any_forward():
    """Planted bug caught: no vocabulary check (before issue 22): the call ran."""
    target, calls = _other_vocab_target(), []
    handle = target.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        with pytest.raises(ValueError, match=f"{VOCAB} tokens.*{VOCAB + 4} rows"):
            DRAFT.spec_generate(target, PROMPTS[0], max_new_tokens=4)
    finally:
        handle.remove()
    assert calls == []


@pytest.mark.skipif(not IS_5, reason="transformers' native DFlash loop (speculation_type='dflash') arrived in 5.x")
def test_a_target_with_another_vocabulary_is_refused_on_the_native_route():
    """The native generator calls the drafter with the target's embeddings; the drafter's forward names
    both sizes. Planted bug caught: no check in the native forward (the call ran)."""
    target = _other_vocab_target()
    with pytest.raises(ValueError, match=f"{VOCAB} tokens.*{VOCAB + 4} rows"):
        target.generate(PROMPTS[0], attention_mask=torch.ones_like(PROMPTS[0]), assistant_model=DRAFT,
                        speculation_type="dflash", max_new_tokens=8, do_sample=False)


@pytest.mark.skipif(not IS_5, reason="transformers' native DFlash loop (speculation_type='dflash') arrived in 5.x")
@pytest.mark.parametrize("overrides, message", [
    (dict(target_layer_ids=[0, 5], num_target_layers=None), r"target_layer_ids \[0, 5\] reach beyond the target's 3"),
    (dict(hidden_size=48, head_dim=12), "draft fc expects 96 input features but the target gives 2 layers x hidden 40"),
    (dict(num_target_layers=4), "trained for a 4-layer target, this target has 3"),
])
def test_a_drafter_of_another_shape_is_named_on_the_native_route_before_the_target_runs(overrides, message):
    """The native route gives the other routes' message (check_pairing) when transformers builds its DFlash
    generator, before any forward. Without the check: a raw IndexError from transformers' generator (layers
    beyond the target), a matmul shape error (hidden size), a 4-layer drafter run on a 3-layer target."""
    target, calls = tiny_target(), []
    handle = target.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        with pytest.raises(ValueError, match=message):
            target.generate(PROMPTS[0], attention_mask=torch.ones_like(PROMPTS[0]), speculation_type="dflash",
                            assistant_model=tiny_draft(**overrides), max_new_tokens=8, do_sample=False)
    finally:
        handle.remove()
    assert calls == []


def test_a_target_with_another_vocabulary_is_refused_by_the_converter():
    from convert.convert_checkpoint import _check_generation
    from convert.errors import CommandError

    with pytest.raises(CommandError, match=f"{VOCAB} tokens.*{VOCAB + 4} rows"):
        _check_generation(DRAFT, tiny_draft(block_size=6), _other_vocab_target(), 0)


# ----------------------------------------------------------------------------- demo.py in bf16


def test_demo_reports_bf16_differences_and_exits_0(capsys):
    """Planted bug caught: the demo before issue 22 has no such report (FAIL, exit 1, no detail)."""
    import demo

    ref = torch.tensor([[1, 2, 3, 4, 5, 6]])
    out = torch.tensor([[1, 2, 3, 4, 9, 6]])
    differences = [("p0", demo.first_difference(ref, out, 2))]
    assert differences[0][1] == (2, 5, 9)
    assert demo.report_differences(differences, "bfloat16", str) == 0
    text = capsys.readouterr().out
    assert "p0" in text and "new token 2" in text and "bfloat16" in text and "round differently" in text
    assert demo.report_differences(differences, "float32", str) == 1
    assert "FAIL" in capsys.readouterr().out
    assert demo.report_differences([], "float32", str) == 0


# ----------------------------------------------------------------------------- subclasses of transformers' processors


class MyTopK(transformers.TopKLogitsWarper):
    """A caller's subclass of a prefix-free warper (issue 34, item 7): it inherits ``__call__``."""


class MySuppress(transformers.SuppressTokensLogitsProcessor):
    """A caller's subclass that overrides ``__call__`` (and could read the prefix)."""

    def __call__(self, input_ids, scores):
        return super().__call__(input_ids, scores)


class MyTemperature(transformers.TemperatureLogitsWarper):
    pass


def _subclassed(kind):
    if kind == "top_k":
        return [MyTopK(1)]
    if kind == "suppress":
        return [MySuppress([int(t) for t in range(0, VOCAB, 3)])]
    return [MyTemperature(0.5), MyTopK(1)]


@pytest.mark.parametrize("kind", ["top_k", "suppress", "temperature"])
@pytest.mark.parametrize("do_sample", [False, True], ids=["greedy", "sampled"])
def test_subclasses_of_prefix_free_processors_run_like_generate(oracle, kind, do_sample):
    """A subclass of a prefix-free transformers processor is the caller's processor (copied per step, prefix
    built). With a top-1 warper or greedy the output is deterministic, so it equals generate's in a ragged batch
    (with suppression and sampling: the suppressed tokens never appear). Planted bug caught: deciding prefix-free
    by ``isinstance`` alone (the code before issue 34) raises 'NoneType' object has no attribute 'prompt_len'."""
    ids, mask = _left_pad(PROMPTS)
    procs = _subclassed(kind)
    sample = dict(do_sample=True, top_k=None, temperature=1.0) if do_sample else dict(do_sample=False)
    ref = TARGET.generate(ids, attention_mask=mask, max_new_tokens=12, pad_token_id=0,
                          logits_processor=LogitsProcessorList(procs), **sample)
    if not (do_sample and kind == "suppress"):
        oracle(mask, ref, [3, 1, 5])
    out = DRAFT.spec_generate(TARGET, ids, attention_mask=mask, max_new_tokens=12, pad_token_id=0,
                              logits_processor=LogitsProcessorList(_subclassed(kind)),
                              generator=torch.Generator().manual_seed(0), **sample)
    if do_sample and kind == "suppress":
        assert not any(t % 3 == 0 for t in out[:, ids.shape[1]:].flatten().tolist())
    else:
        assert torch.equal(out, ref)


# ----------------------------------------------------------------------------- issue 34: eos-less batch ends


class LastTokenIn(StoppingCriteria):
    """Fires on a row whose last token is one of ``tokens`` (per row, as generate asks it)."""

    def __init__(self, tokens):
        self.tokens = torch.tensor(tokens)

    def __call__(self, input_ids, scores, **kwargs):
        return torch.isin(input_ids[:, -1], self.tokens)


def _stop_tokens(new, at):
    """Tokens making row ``r`` of ``new`` (generate's eos-less output) stop first at its ``at[r]``-th new token."""
    tokens = [int(new[r, n - 1]) for r, n in enumerate(at)]
    for r, n in enumerate(at):
        assert not set(new[r, : n - 1].tolist()) & set(tokens), "precondition: the rows stop where planned"
    return tokens


def test_without_eos_a_row_stopped_by_its_prefill_token_keeps_generating(oracle):
    """Issue 34 item 1: eos unset, a criterion firing on row 0's 1st and row 1's 3rd token: generate gives 3
    tokens per row. With eos set, the row stopped by its prefill token is padded, as before. Planted bug
    caught: the prefill's commit without ``keep_generating`` (the code before): row 0 got 1 token + padding
    and row 1 ran to ``max_new_tokens`` (16)."""
    ids, mask = _left_pad(PROMPTS[:2])
    full = TARGET.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=16, pad_token_id=0)
    stops = _stop_tokens(full[:, ids.shape[1]:], [1, 3])
    for eos in (None, 95):
        kw = dict(max_new_tokens=16, pad_token_id=0, stopping_criteria=[LastTokenIn(stops)], eos_token_id=eos)
        ref = TARGET.generate(ids, attention_mask=mask, do_sample=False, **kw)
        oracle(mask, full, [5])  # every draft right: rows commit past the batch end in one step
        out = DRAFT.spec_generate(TARGET, ids, attention_mask=mask, temperature=0.0, **kw)
        assert torch.equal(out, ref), (eos, out[:, ids.shape[1]:].tolist(), ref[:, ids.shape[1]:].tolist())
        assert ref.shape[1] == ids.shape[1] + 3


@pytest.mark.parametrize("cache_implementation", [None, "static"])
def test_without_eos_stop_strings_at_a_rows_prefill_token_like_generate(oracle, cache_implementation):
    """Issue 34 item 1 with ``stop_strings`` (the shipped pair's byte-level tokenizer, read from the
    repository: ids < 97 are one character each, so a stop string fires at its token only) and both loop
    requests (a batch with stop strings runs the dynamic loop under ``cache_implementation='static'`` too).
    Planted bug caught: as above, row 0 padded after 1 token and row 1 run to 16 tokens."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(pathlib.Path(__file__).resolve().parents[1] / "pair" / "target")
    ids, mask = _left_pad(PROMPTS[:2])
    full = TARGET.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=16, pad_token_id=0)
    strings = [tok.convert_tokens_to_string(tok.convert_ids_to_tokens([t]))
               for t in _stop_tokens(full[:, ids.shape[1]:], [1, 3])]
    kw = dict(max_new_tokens=16, pad_token_id=0, stop_strings=strings, tokenizer=tok)
    ref = TARGET.generate(ids, attention_mask=mask, do_sample=False, **kw)
    oracle(mask, full, [2])
    out = DRAFT.spec_generate(TARGET, ids, attention_mask=mask, temperature=0.0,
                              cache_implementation=cache_implementation, **kw)
    assert torch.equal(out, ref), (out[:, ids.shape[1]:].tolist(), ref[:, ids.shape[1]:].tolist())
    assert ref.shape[1] == ids.shape[1] + 3


def test_without_eos_scores_and_statistics_are_cut_at_the_batch_end(oracle):
    """Issue 34 item 5: rows that committed past the batch end (row 0 all drafts right, several steps past it;
    row 1 one draft right per step) keep scores and logits of the kept tokens only, equal to generate's, and
    statistics that count them only (``sum(row_acceptance_lengths[r]) == num_new_tokens[r] - 1``). Planted
    bug caught: only the chunks trimmed (the code before): ``RuntimeError: The expanded size of the tensor``
    after the generation (and, with the scores trimmed alone, ``sum([6, 6, 3]) != 7 - 1`` for row 0)."""
    ids, mask = _left_pad(PROMPTS[:2])
    full = TARGET.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=16, pad_token_id=0)
    stops = _stop_tokens(full[:, ids.shape[1]:], [2, 7])
    kw = dict(max_new_tokens=16, pad_token_id=0, stopping_criteria=[LastTokenIn(stops)], output_scores=True,
              output_logits=True, return_dict_in_generate=True)
    ref = TARGET.generate(ids, attention_mask=mask, do_sample=False, **kw)
    oracle(mask, full, lambda step, row: 5 if row == 0 else 1)
    out = DRAFT.spec_generate(TARGET, ids, attention_mask=mask, temperature=0.0, output_timings=True, **kw)
    assert torch.equal(out.sequences, ref.sequences) and out.sequences.shape[1] == ids.shape[1] + 7
    assert len(out.scores) == len(ref.scores) == len(out.logits) == 7
    for mine, theirs in ((out.scores, ref.scores), (out.logits, ref.logits)):
        for a, b in zip(mine, theirs):
            torch.testing.assert_close(a, b.float(), rtol=1e-4, atol=1e-4)
    assert out.num_new_tokens == [7, 7]
    for r in range(2):
        lengths, drafted, accepted = (out.row_acceptance_lengths[r], out.row_draft_lengths[r],
                                      out.row_accepted_drafts[r])
        assert sum(lengths) == out.num_new_tokens[r] - 1 and len(lengths) == len(drafted) == len(accepted)
        assert all(a <= min(d, n) for a, d, n in zip(accepted, drafted, lengths))
    assert out.row_acceptance_lengths[0] == [6] and out.row_accepted_drafts[0] == [5]  # later steps dropped
    assert out.acceptance_lengths == [a for row in out.row_acceptance_lengths for a in row]
    assert out.timings["new_tokens"] == 14
