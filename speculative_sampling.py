"""How tokens are chosen in one verify step: generate's logits processors applied per block slot with
that slot's own prefix (on the target's logits, and for the drafter's proposer, ``proposers.py``), and
the acceptance rule (greedy prefix match, or speculative sampling: Leviathan et al. 2023, Algorithm 1).
The counterpart of transformers' ``generation/logits_process.py`` for a DFlash block.
"""

from dataclasses import dataclass
from typing import Optional

import torch
from transformers import LogitsProcessorList
from transformers.generation import logits_process as _lp

try:
    from .draft_trees import Verdict, verify_tree
    from .user_processors import is_user_processor, lockstep, process_rows, replay, step_copies
except ImportError:  # imported from the repository root instead of as a Hub remote-code package
    from draft_trees import Verdict, verify_tree
    from user_processors import is_user_processor, lockstep, process_rows, replay, step_copies


# Processors that act on each row's scores alone, whatever came before: applied in one batched call.
# Any other processor (repetition penalty, n-gram, lengths, bad words, a user's) sees each prefix.
_PREFIX_FREE = tuple(getattr(_lp, name) for name in (
    "TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper", "MinPLogitsWarper", "TypicalLogitsWarper",
    "EpsilonLogitsWarper", "EtaLogitsWarper", "TopHLogitsWarper", "SuppressTokensLogitsProcessor",
    "LogitNormalization", "InfNanRemoveLogitsProcessor",
) if hasattr(_lp, name))


def prefix_free(processor) -> bool:
    """Whether ``processor`` acts on each row's scores alone: an instance of a ``_PREFIX_FREE`` class that is
    transformers' own. A caller's subclass (``class MyTopK(TopKLogitsWarper)``) may read ``input_ids`` or keep
    state, so it is the caller's processor (``user_processors.is_user_processor``): it sees each prefix and is
    isolated by copies. One rule for both questions: before it, such a subclass counted as prefix-free here and
    as the caller's there, and the loop built no history for the caller's path (AttributeError at the first step).
    """
    return isinstance(processor, _PREFIX_FREE) and not is_user_processor(processor)


# Warpers reshape the target's distribution only when a DFlash 2 drafter walks its candidates (the walk
# draws from softmax(score / T) over its top-k, as z-lab ``dflash_generate`` does); processors act on both.
_WARPERS = tuple(getattr(_lp, name) for name in (
    "TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper", "MinPLogitsWarper", "TypicalLogitsWarper",
    "EpsilonLogitsWarper", "EtaLogitsWarper", "TopHLogitsWarper",
) if hasattr(_lp, name))


class _History:
    """Each row's tokens so far (padded prompt + committed new tokens), for processors and stopping
    criteria that read the sequence. ``tokens`` ``(B0, width)`` int64 over the original rows."""

    def __init__(self, input_ids, budget, block_size, pad: int = 0):
        bsz, width = input_ids.shape
        self.prompt_len, self.pad = width, pad
        self.tokens = input_ids.new_full((bsz, width + budget + block_size), pad)  # a finished row reads pad
        self.tokens[:, :width] = input_ids

    def write(self, row: int, start: int, tokens: list):
        self.tokens[row, start: start + len(tokens)] = torch.tensor(tokens, dtype=torch.long)

    def pad_from(self, row: int, start: int):
        """Row ``row`` ended before ``start``: pad from there on, as generate pads a finished row."""
        self.tokens[row, start:] = self.pad


def _process_at(procs, history, ids, lengths, ext, scores):
    """Apply ``procs`` to ``scores`` ``(A, V)``, row ``i`` seeing its own prefix: its first ``lengths[i]``
    history tokens followed by ``ext[i]`` ``(A, j)`` (anchor-side drafts). Returns ``(A, V)`` fp32.

    This is the call generate makes when it chooses the token after that prefix (and what transformers'
    ``DFlashTokenCandidateGenerator.get_candidates`` does slot by slot). Rows of equal prefix length go in
    one call, laid out at their original batch index in a full ``(B0, L)`` batch (other rows hold a copy),
    because some processors are per batch row (``prefix_allowed_tokens_fn(batch_id, ...)``, the 5.x
    repetition penalty's per-row prompt padding).
    """
    out = torch.empty(scores.shape, dtype=torch.float32, device=scores.device)
    bsz0 = history.tokens.shape[0]
    for length in sorted(set(lengths.tolist())):
        sel = (lengths == length).nonzero()[:, 0]
        prefix = torch.cat([history.tokens[ids[sel], :length], ext[sel]], dim=1)  # (g, length + j)
        rows = ids[sel]
        full_ids = prefix[:1].expand(bsz0, -1).clone()
        full_ids[rows] = prefix
        full_scores = scores[sel[:1]].float().expand(bsz0, -1).clone()
        full_scores[rows] = scores[sel].float()
        out[sel] = procs(full_ids, full_scores)[rows]
    return out


def speculative_verify(draft_tokens, draft_probs, target_probs, generator=None, lengths=None):
    """Speculative sampling acceptance (Leviathan et al. 2023, Algorithm 1; Chen et al. 2023).

    Draft token ``x_j`` is accepted with probability ``min(1, p_j(x_j) / q_j(x_j))``, in order, until
    the first rejection; there the next token is drawn from ``norm(max(p_j - q_j, 0))``; if all are
    accepted, the bonus token is drawn from ``p_{n}``. The committed tokens are then distributed
    exactly as the target's own samples. A one-hot ``q`` (greedy draft) is a valid special case.

    Args:
        draft_tokens: ``(B, n)`` LongTensor, drawn from ``draft_probs``.
        draft_probs: ``(B, n, V)`` float, the draft's processed distributions q.
        target_probs: ``(B, n + 1, V)`` float, the target's processed distributions p after each
            block slot (slot j predicts the token after it; the last one gives the bonus token).
        generator: ``torch.Generator`` for the uniforms and the residual draw.
        lengths: ``(B,)`` long or None: row ``r`` proposes only its first ``lengths[r]`` drafts (the rest are
            verified positions it never accepts; reaching ``lengths[r]`` draws the bonus token from
            ``p_{lengths[r]}``, as a chain of that length would).

    Returns:
        ``(accepted (B,), next_token (B,))``: accepted draft count in ``[0, n]`` and the token that
        follows them (residual sample or bonus).
    """
    bsz, n = draft_tokens.shape
    if n == 0:  # a plain step (nothing drafted): the target's own sample, as generate draws it
        return (torch.zeros(bsz, dtype=torch.long, device=draft_tokens.device),
                torch.multinomial(target_probs[:, 0], 1, generator=generator)[:, 0])
    rows = torch.arange(bsz, device=draft_tokens.device)
    p_x = target_probs[:, :n].gather(-1, draft_tokens[..., None])[..., 0]
    q_x = draft_probs.gather(-1, draft_tokens[..., None])[..., 0]
    u = torch.rand(bsz, n, generator=generator, device=draft_tokens.device)
    ok = u * q_x < p_x  # u < p/q, with q(x) > 0 because x was drawn from q
    accepted = ok.long().cumprod(dim=1).sum(dim=1)
    p_next = target_probs[rows, accepted]
    q_next = torch.cat([draft_probs, target_probs.new_zeros(bsz, 1, target_probs.shape[-1])], dim=1)[rows, accepted]
    if lengths is not None:  # a row's end of proposal: its bonus token comes from p there
        ended = accepted >= lengths
        accepted = torch.minimum(accepted, lengths)
        p_next = torch.where(ended[:, None], target_probs[rows, accepted], p_next)
        q_next = torch.where(ended[:, None], torch.zeros_like(q_next), q_next)
    residual = (p_next - q_next).clamp_min(0)
    total = residual.sum(-1, keepdim=True)
    residual = torch.where(total > 0, residual / total.clamp_min(1e-30), p_next)  # p == q: never rejected
    return accepted, torch.multinomial(residual, 1, generator=generator)[:, 0]


@dataclass
class _Sampling:
    """How tokens are chosen from logits: generate's processors, then argmax (greedy) or a sample.

    ``procs`` is generate's own ``LogitsProcessorList`` (warpers included when sampling). When every
    processor is prefix-free (``prefix_free``), one batched call processes a whole block (the fast
    path, as cheap as before); otherwise each slot is processed with its own prefix (``_process_at``).
    The drafter's proposer (``proposers.py``) chooses the drafts with these helpers; ``verify`` judges
    every proposal, whatever drafted it.
    """

    procs: LogitsProcessorList
    do_sample: bool
    generator: Optional[torch.Generator]
    sample_draft: bool = True
    history: Optional[_History] = None  # set when some processor reads the prefix

    want_scores: bool = False  # output_scores / output_logits: return processed scores from verify
    user: bool = False  # some processor is the caller's: copies per step, whole-batch calls, lockstep rows

    def _lengths(self, rows) -> torch.Tensor:
        return rows.n_new + self.history.prompt_len  # (A,) history length, anchor included

    def _at(self, procs, rows, ext, scores) -> torch.Tensor:
        """``(A, V)`` processed scores of one slot, each row after its prefix + ``ext`` ``(A, j)``."""
        if self.user:  # rows in lockstep: one history length; the whole batch in every call
            return process_rows(procs, self.history, rows.ids, self.history.prompt_len + rows.host_new[0], ext, scores)
        return _process_at(procs, self.history, rows.ids, self._lengths(rows), ext, scores)

    def _step_procs(self):
        """This step's processors for one side (draft or verify): the caller's ones as fresh copies."""
        return step_copies(self.procs) if self.user else self.procs

    def advance(self, rows, counts: list, target_logits, finished: list) -> None:
        """After a step's commit: replay its committed slots on the caller's original processors (each
        advances once per committed token, in order, as in generate). ``counts``: anchor + accepted drafts
        per row (equal in lockstep); nothing to do once every row is finished."""
        if self.user and not all(finished):
            replay(self.procs, self.history, rows.ids, self.history.prompt_len + rows.host_new[0], counts[0],
                   target_logits)

    @property
    def needs_prefix(self) -> bool:
        return not all(prefix_free(p) for p in self.procs)

    def processed(self, logits: torch.Tensor, procs: Optional[LogitsProcessorList] = None) -> torch.Tensor:
        """Prefix-free path: ``(B, n, V)`` logits -> processed fp32 scores, one batched call of ``procs``
        (default ``self.procs``; a proposer passes this step's copies or a subset)."""
        procs = self.procs if procs is None else procs
        b, n, v = logits.shape
        flat = logits.reshape(b * n, v).float()
        if len(procs):
            flat = procs(flat.new_zeros(b * n, 1, dtype=torch.long), flat)
        return flat.view(b, n, v)

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """``(B, n, V)`` logits -> processed probabilities, fp32 (prefix-free path)."""
        return torch.softmax(self.processed(logits), dim=-1)

    def _pick(self, scores: torch.Tensor, sample: bool) -> torch.LongTensor:
        """``(N, V)`` processed scores -> ``(N,)`` tokens: a sample or the argmax."""
        if sample:
            return torch.multinomial(torch.softmax(scores, dim=-1), 1, generator=self.generator)[:, 0]
        return scores.argmax(dim=-1)

    def first(self, logits: torch.Tensor, input_ids: torch.Tensor):
        """The prefill token ``(B,)`` and its processed scores ``(B, V)`` from the last prompt logits ``(B, V)``;
        processors see the whole prompt batch, exactly as in generate's first step."""
        scores = self.procs(input_ids, logits.float()) if len(self.procs) else logits.float()
        return self._pick(scores, self.do_sample), scores

    @property
    def temperature(self) -> float:
        """Generate's temperature: the product of the ``TemperatureLogitsWarper`` values in ``procs`` (1.0 without)."""
        value = 1.0
        for p in self.procs:
            if isinstance(p, _lp.TemperatureLogitsWarper):
                value *= float(p.temperature)
        return value

    def target_scores(self, drafts: torch.Tensor, target_logits: torch.Tensor, rows) -> torch.Tensor:
        """Processed target scores ``(A, n + 1, V)``: slot j sees the row's prefix + the first j drafts."""
        if not self.needs_prefix:
            return self.processed(target_logits)
        procs = self._step_procs()
        return torch.stack([self._at(procs, rows, drafts[:, :j], target_logits[:, j])
                            for j in range(target_logits.shape[1])], dim=1)

    def verify(self, proposal, target_logits, rows) -> Verdict:
        """The ``draft_trees.Verdict`` of ``proposal`` (``proposers.Proposal``) against the target's logits
        ``(A, n + 1, V)`` at the anchor and each node. A chain: its tokens ``(A, n)`` and q through
        ``speculative_verify`` (greedy: the longest prefix equal to the target's argmax); a tree:
        ``draft_trees.verify_tree`` (follow the target's own choice at each node).

        ``scores`` are the processed target scores (None on the greedy path without processors). With the
        caller's processors, rows commit in lockstep (``user_processors.lockstep``; never with a tree)."""
        if proposal.tree is not None:
            return verify_tree(self, proposal.tree, target_logits, rows)
        drafts, q = proposal.tokens, proposal.q
        accepted, next_token, scores = self._verify(drafts, q, target_logits, rows, proposal.lengths)
        if self.user:
            accepted, next_token = lockstep(accepted, next_token, drafts)
        drafted = None if proposal.lengths is None else proposal.lengths.tolist()
        return Verdict(accepted, next_token, scores, drafts, target_logits, drafted=drafted)

    def node_scores(self, procs, rows, sel: torch.Tensor, ext: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """``(g, V)`` fp32 processed scores at one tree node of each selected row ``sel`` ``(g,)``, whose path
        below the anchor is ``ext`` ``(g, depth)``: the processors see the row's prefix, then that path."""
        if not self.needs_prefix:
            return self.processed(scores[:, None])[:, 0]
        return _process_at(procs, self.history, rows.ids[sel], self._lengths(rows)[sel], ext, scores)

    def _verify(self, drafts, q, target_logits, rows, lengths=None):
        if not self.do_sample:  # greedy: keep drafts equal to the target's (processed) argmax
            scores = self.target_scores(drafts, target_logits, rows) if len(self.procs) else None
            choice = (target_logits if scores is None else scores).argmax(dim=-1)  # (A, n + 1)
            accepted = (drafts == choice[:, :-1]).cumprod(dim=1).sum(dim=1)  # bool cumprod: int64
            if lengths is not None:
                accepted = torch.minimum(accepted, lengths)
            if scores is None and self.want_scores:
                scores = target_logits.float()
            return accepted, choice.gather(1, accepted[:, None])[:, 0], scores
        if self.needs_prefix:
            scores = self.target_scores(drafts, target_logits, rows)
            p = torch.softmax(scores, dim=-1)
        else:
            p = self.probs(target_logits)
            scores = self.processed(target_logits) if self.want_scores else None
        cut = {} if lengths is None else {"lengths": lengths}
        accepted, nxt = speculative_verify(drafts, p[:, :0] if q is None else q, p, self.generator, **cut)
        return accepted, nxt, scores


__all__ = ["speculative_verify"]
