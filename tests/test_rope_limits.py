"""Position-dependent RoPE (``dynamic`` NTK, Phi-3 ``longrope``) just below its switch: every verify
forward stays at or below the last position ``generate`` computes for each row, in ragged batches and
on the static path, so no forward runs with the switched frequencies (which a forward reaching the
switch applies to ALL its positions and rows, committed tokens included).

The target is a peaked Llama with dynamic NTK (factor 4) switching at 40; prompts and budgets put
generate's last position at exactly 39. Oracle drafts make one row run ahead of the other.
Planted bugs (each fails here): blocks sized from the slowest row only (``verify_budget`` returning
``budget - min(host_new)``: the fast row's block reaches 42); no static fallback (``static_rope_reason``
returning None: the last full block reaches 46); ``check_rope`` given the padded width (a call whose
rows stay below the switch refused).
"""

import contextlib
import logging

import pytest
import torch

import generation_utils
import proposers
import static_generate
import target_families
from patching import patch_called
from tiny import VOCAB, tiny_draft, tiny_target

SWITCH = 40
LONG, SHORT = (torch.randint(0, 90, (1, n), generator=torch.Generator().manual_seed(n)) for n in (11, 6))
NEW = SWITCH + 1 - LONG.shape[1]  # generate's last position: 11 + 30 - 2 = 39 = SWITCH - 1


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama", peaked=True, max_position_embeddings=SWITCH,
                       rope_scaling={"rope_type": "dynamic", "factor": 4.0})


def _generate(target, ids, new=NEW):
    return target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new)


@contextlib.contextmanager
def _positions_seen(target):
    """Yields a list that gets every target forward's ``position_ids`` ``(A, n)`` inside the block."""
    seen = []

    def hook(module, args, kwargs):
        if kwargs.get("position_ids") is not None:
            seen.append(kwargs["position_ids"].clone())

    handle = target.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield seen
    finally:
        handle.remove()


def _oracle(monkeypatch, refs, right):
    """Draft logits right on ``right[r]`` slots for the row that follows ``refs[r]`` (None: every slot)."""
    real = proposers._draft_logits

    def fake(draft, embed, head, anchor, ctx, draft_cache, draft_valid, start, b, mask_token_id):
        real(draft, embed, head, anchor, ctx, draft_cache, draft_valid, start, b, mask_token_id)
        out = []
        for s, a in zip(start.tolist(), anchor[:, 0].tolist()):
            r = next(r for r, ref in enumerate(refs) if ref.shape[1] > s and ref[0, s] == a)
            want = torch.cat([refs[r][0, s + 1: s + b], torch.zeros(b, dtype=torch.long)])[: b - 1].clone()
            n = b - 1 if right[r] is None else right[r]
            want[n:] = (want[n:] + 1) % VOCAB
            out.append(torch.nn.functional.one_hot(want, VOCAB).float() * 30)
        return torch.stack(out)

    patch_called(monkeypatch, proposers, "_draft_logits", fake)


def _left_padded(prompts, width=None):
    width = width or max(p.shape[1] for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, p in enumerate(prompts):
        ids[r, width - p.shape[1]:], mask[r, width - p.shape[1]:] = p[0], 1
    return ids, mask


def test_the_premise_a_forward_past_the_switch_changes_the_tokens(target):
    """Positions 0..39 computed in one forward with position 40 added: every logit moves."""
    ids = _generate(target, LONG)
    with torch.no_grad():
        below = target(ids[:, :SWITCH]).logits
        past = target(ids[:, : SWITCH + 1]).logits[:, :SWITCH]
    assert not torch.equal(below.argmax(-1), past.argmax(-1))


def test_ragged_batch_row_ahead_stays_below_its_last_position(target, monkeypatch):
    """Row 0 accepts every draft, row 1 none: row 0 runs ahead, and a block sized from row 1 alone
    would carry row 0 past 39 (to 42), switching the frequencies of both rows' forward."""
    refs = [_generate(target, LONG), _generate(target, SHORT)]
    _oracle(monkeypatch, refs, right=[None, 0])
    ids, mask = _left_padded([LONG, SHORT])
    with _positions_seen(target) as seen:
        out = tiny_draft(block_size=8).spec_generate(target, ids, attention_mask=mask, max_new_tokens=NEW,
                                                     temperature=0.0, return_dict_in_generate=True)
    last = (mask.sum(1) + NEW - 2).tolist()  # generate's last position per row: [39, 34]
    assert len(seen) > 4
    for positions in seen:  # prefill + every verify; row 0 (ahead) leaves the batch first
        rows = last if positions.shape[0] == 2 else last[1:]
        assert all(int(p.max()) <= limit for p, limit in zip(positions, rows)), (positions, rows)
    for r, ref in enumerate(refs):
        n = ref.shape[1] - (LONG, SHORT)[r].shape[1]
        assert out.sequences[r, ids.shape[1]: ids.shape[1] + n].tolist() == ref[0, -n:].tolist(), r
    assert out.row_acceptance_lengths[0] != out.row_acceptance_lengths[1]


def test_static_path_whose_full_blocks_would_pass_the_switch_runs_the_dynamic_loop(target, caplog):
    """The static loop verifies a full block at its last step (anchor at 39: block to 46); it falls
    back to the dynamic loop, with one info log naming the switch, and equals generate."""
    ref = _generate(target, LONG)
    with _positions_seen(target) as seen, caplog.at_level(logging.INFO):
        out = tiny_draft(block_size=8).spec_generate(target, LONG, max_new_tokens=NEW, temperature=0.0,
                                                     cache_implementation="static")
    assert torch.equal(out, ref)
    assert max(int(p.max()) for p in seen) <= SWITCH - 1
    assert "RoPE switch at position 40" in caplog.text
    assert target_families.static_rope_reason(target, LONG.shape[1], NEW - 8, 8) is None  # far from it: static


def test_padding_does_not_count_toward_the_limit(target):
    """Both rows padded (width 13, longest row 11): generate's last position is 39, so the call runs
    and equals generate row by row; one token more is refused before any forward, naming position 40."""
    ids, mask = _left_padded([LONG, SHORT], width=13)
    out = tiny_draft(block_size=4).spec_generate(target, ids, attention_mask=mask, max_new_tokens=NEW,
                                                 temperature=0.0)
    for r, p in enumerate((LONG, SHORT)):
        assert out[r, 13:].tolist() == _generate(target, p)[0, p.shape[1]:].tolist(), r
    calls = []
    handle = target.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        with pytest.raises(NotImplementedError, match=r"'dynamic' .* position 40 .* reach position 40"):
            tiny_draft(block_size=4).spec_generate(target, ids, attention_mask=mask, max_new_tokens=NEW + 1,
                                                   temperature=0.0)
    finally:
        handle.remove()
    assert calls == []
