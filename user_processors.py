"""The caller's own logits processors (``logits_processor=``, ``prefix_allowed_tokens_fn``), called the way
``generate`` calls them although the loop also scores drafted tokens that may be rejected.

A user processor may keep state that advances by each call's last token (xgrammar's transformers
processor: the first call initialises one grammar matcher per row, every later call advances row ``i``'s
matcher by ``input_ids[i, -1]``, and an illegal token raises). ``generate`` calls it once per token, in
order, with the whole batch. Here:

* drafted slots are scored only by copies (``copy.deepcopy``) made at the start of each step, one for the
  draft side and one for the verify side, each advanced slot by slot (``step_copies``);
* the original is called on committed tokens only, once per token and in order: after each step the
  committed slots are replayed on it (``replay``) -- the calls ``generate`` would have made;
* every call holds the whole batch, each row's own prefix at its own batch index (finished rows read
  pad after their end, as in ``generate``), so per-row rules (``prefix_allowed_tokens_fn(batch_id, ids)``,
  one grammar per row) see their own row (``process_rows``). For that, rows of a batch commit the same
  number of tokens per step (``lockstep``): the longest common acceptance, which keeps the output exact.

transformers' own processors are pure functions of the prefix and keep the per-slot path of
``speculative_sampling._process_at``. Source: issue "Calls as users really make them" (xgrammar's
``contrib/hf.py`` call pattern; vLLM #53777, #44006 for the same failure under speculation).
"""

import copy

import torch
from transformers import LogitsProcessorList
from transformers.generation import logits_process as _lp


def is_user_processor(processor) -> bool:
    """True for a processor of the caller's: ``prefix_allowed_tokens_fn``'s wrapper, or any class defined
    outside transformers (its ``logits_processor=`` list)."""
    return (isinstance(processor, _lp.PrefixConstrainedLogitsProcessor)
            or not type(processor).__module__.startswith("transformers."))


def check_copyable(procs) -> bool:
    """Whether ``procs`` holds a user processor; raises ValueError, before any forward, naming the first
    one that ``copy.deepcopy`` cannot copy."""
    found = False
    for p in procs:
        if not is_user_processor(p):
            continue
        found = True
        try:
            copy.deepcopy(p)
        except Exception as err:  # any failure of deepcopy: pickling hooks, C++ handles, locks...
            raise ValueError(
                f"logits processor {type(p).__name__} cannot be copied (copy.deepcopy raised "
                f"{type(err).__name__}: {err}); spec_generate scores drafted tokens with copies of your processors so "
                "that their state advances on committed tokens only, as in generate. Make it copyable, or pass a "
                "stateless one (xgrammar: its processor with stateless=True)") from err
    return found


def step_copies(procs) -> LogitsProcessorList:
    """``procs`` with every user processor replaced by a fresh copy of its current state (one step, one side)."""
    return LogitsProcessorList([copy.deepcopy(p) if is_user_processor(p) else p for p in procs])


def process_rows(procs, history, ids, length: int, ext, scores) -> torch.Tensor:
    """Apply ``procs`` to ``scores`` ``(A, V)`` of the live rows ``ids`` ``(A,)``, all at history length
    ``length``, followed by ``ext`` ``(A, j)``. The call holds the whole ``(B0, length + j)`` batch: each
    live row's own prefix at its own index, finished rows their own tokens then pad (their scores are
    zeros and discarded). Returns ``(A, V)`` fp32."""
    full_ids = history.tokens[:, : length + ext.shape[1]].clone()  # (B0, length + j)
    full_ids[ids, length:] = ext
    full_scores = scores.new_zeros((full_ids.shape[0], scores.shape[-1]), dtype=torch.float32)
    full_scores[ids] = scores.float()
    return procs(full_ids, full_scores)[ids]


def lockstep(accepted, next_token, drafts):
    """Every row commits the longest acceptance common to the batch, ``m = min(accepted)``: a row that
    accepted more keeps drafts ``0..m-1`` and its accepted draft ``m`` as the next token (an accepted draft
    is the target's own choice there, greedy or sampled). Returns ``(accepted (A,), next_token (A,))``."""
    if accepted.shape[0] < 2 or drafts.shape[1] == 0:  # one row, or a one-token block: nothing to align
        return accepted, next_token
    m = accepted.min()
    over = accepted > m
    at_m = drafts.gather(1, m.clamp(max=drafts.shape[1] - 1).expand(drafts.shape[0], 1))[:, 0]
    return torch.minimum(accepted, m), torch.where(over, at_m, next_token)


def replay(procs, history, ids, length: int, count: int, logits) -> None:
    """Call the originals ``procs`` on the ``count`` committed slots of this step, in order: slot ``j`` sees
    every row's history up to ``length + j`` (committed tokens, now in ``history``) and the target's raw
    logits ``logits[:, j]`` ``(A, V)`` -- the calls generate made to choose those tokens."""
    for j in range(count):
        process_rows(procs, history, ids, length + j, history.tokens.new_zeros(len(ids), 0), logits[:, j])


__all__ = ["is_user_processor", "check_copyable"]
