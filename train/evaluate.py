"""Evaluation during training: held-out loss and per-slot accuracy on fixed blocks, and the acceptance
length measured by the real decoding loop (``spec_generate``), as the DFlash paper reports it.

Definitions (greedy decoding, one verify step = one target forward after the prefill):

* tau = ``sum_rows (new_tokens - 1) / sum_rows verify_steps``: the prefill's first token is not counted,
  every other new token came out of a verify step (accepted draft tokens + the bonus token).
* per-slot acceptance ``k`` (1 <= k < block_size) = verify steps that accepted at least ``k`` draft tokens /
  verify steps that drafted slot ``k`` (a step near the token budget drafts fewer slots).

These are the definitions of ``DFlashGenerateOutput.tau`` / ``slot_acceptance()``, pooled over prompts.
"""
from __future__ import annotations

from typing import Optional

import torch

from train._paths import spec_generate
from train.blocks import drafter_loss, pack_batch


def acceptance_stats(draft, target, prompt_ids: list[torch.Tensor], max_new_tokens: int,
                     block_size: Optional[int] = None, stop_token_ids=None) -> dict:
    """Greedy ``spec_generate`` over ``prompt_ids`` (each ``(1, L)`` LongTensor on the target's device).

    Returns ``{"tau": float, "acceptance_slot": [B - 1 floats], "new_tokens": int, "verify_steps": int}``
    with the module docstring's definitions (tau 0.0 and an empty list when no verify step ran).
    """
    was_training = draft.training
    draft.eval()
    new, steps, drafted, accepted = 0, 0, [], []
    try:
        for ids in prompt_ids:
            out = spec_generate(draft, target, ids, max_new_tokens=max_new_tokens, temperature=0.0,
                                block_size=block_size, stop_token_ids=stop_token_ids, return_dict_in_generate=True,
                                low_acceptance_warning=None)  # this measures acceptance itself, early drafters included
            for n_new, row in zip(out.num_new_tokens, out.row_acceptance_lengths):
                new += max(int(n_new) - 1, 0)
                steps += len(row)
            drafted += [d for row in out.row_draft_lengths for d in row]
            accepted += [a for row in out.row_accepted_drafts for a in row]
    finally:
        draft.train(was_training)
    slot = []
    for k in range(1, max(drafted, default=0) + 1):  # the result object's slot_acceptance, pooled over prompts
        n = sum(d >= k for d in drafted)
        slot.append(sum(a >= k for a, d in zip(accepted, drafted) if d >= k) / n if n else 0.0)
    return {"tau": new / steps if steps else 0.0, "acceptance_slot": slot, "new_tokens": new, "verify_steps": steps}


def mean_acceptance(draft, target, prompt_ids: list[torch.Tensor], max_new_tokens: int,
                    block_size: Optional[int] = None, stop_token_ids=None) -> float:
    """tau of :func:`acceptance_stats` alone."""
    return acceptance_stats(draft, target, prompt_ids, max_new_tokens, block_size, stop_token_ids)["tau"]


@torch.no_grad()
def eval_loss(draft, target, rows, config, weights, batch_size: int = 4, device="cpu") -> tuple[float, list]:
    """Weighted block loss and per-slot top-1 accuracy over fixed rows ``(ids (T,), feats (T, F), anchors (n,))``.

    The loss is pooled over all labelled tokens (``sum w*ce / sum w``); accuracy per slot ``0..B-1`` (slot 0
    has no label: 0). No gradient; the draft's train/eval mode is restored.
    """
    was_training = draft.training
    draft.eval()
    tot, wsum = 0.0, 0.0
    correct = torch.zeros(len(weights))
    count = torch.zeros(len(weights))
    for i in range(0, len(rows), batch_size):
        batch = pack_batch(rows[i:i + batch_size], config, len(weights)).to(device)
        loss, st = drafter_loss(draft, target, batch, weights, reduction="sum")
        tot += float(loss)
        wsum += float(st["weight"])
        correct += st["correct"]
        count += st["count"]
    draft.train(was_training)
    return tot / max(wsum, 1e-12), (correct / count.clamp_min(1)).tolist()


@torch.no_grad()
def eval_selector(draft, target, rows, config, weights, batch_size: int = 4, device="cpu") -> dict:
    """A DFlash 2 drafter's selector on fixed rows (as :func:`eval_loss`): ``heldout_selector_loss`` (the
    slot-weighted selector cross-entropy of ``train.selector.dflash2_loss``, over ``sum w``),
    ``heldout_topk_recall`` (share of labelled slots whose gold token is among the unary top-k) and
    ``heldout_selector_acc`` (share whose teacher-forced selector top-1 is gold). No gradient; the draft's
    train/eval mode is restored."""
    from train.selector import dflash2_loss

    was_training = draft.training
    draft.eval()
    selector, wsum, covered, correct, count = 0.0, 0.0, 0.0, 0.0, 0.0
    for i in range(0, len(rows), batch_size):
        batch = pack_batch(rows[i:i + batch_size], config, len(weights)).to(device)
        _, st = dflash2_loss(draft, target, batch, weights, reduction="sum")
        selector += float(st["selector"])
        wsum += float(st["weight"])
        covered += float(st["covered"].sum())
        correct += float(st["selector_correct"].sum())
        count += float(st["count"].sum())
    draft.train(was_training)
    return {"heldout_selector_loss": selector / max(wsum, 1e-12), "heldout_topk_recall": covered / max(count, 1),
            "heldout_selector_acc": correct / max(count, 1)}
