"""Who proposes: one proposer per drafter kind behind one call, one proposal type for the verifier.

Like transformers' ``generation/candidate_generator.py`` (every assistant kind a ``CandidateGenerator``
with ``get_candidates``, the loop never asking which kind it has), each drafter kind here drafts a
block through the same call, ``proposer.propose(rows, b) -> Proposal``, and one verify function
(``speculative_sampling._Sampling.verify``) consumes it. The choice is one proxy object per drafter kind,
made once per call by [`proposer_for`]:

* [`BlockProposer`], DFlash 1 (``DFlashDraftModel``): one draft pass over ``[anchor, MASK x (b-1)]``,
  then each slot's token chosen from its own logits under generate's processors (notes section 1);
* [`SelectorProposer`], DFlash 2 (``DFlash2DraftModel``): the same pass, then the candidate selector's
  walk over each slot's top-k (``dflash2.selector_walk``; z-lab ``DFlash2DraftModel.propose``).

A [`Proposal`] describes a chain or a tree (``draft_trees.py``): every node's token, parent and depth, the
positions, the draft's probability of each node's own token (greedy calls included), the q rows when
sampling, and a per-node acceptance estimate for drafters that predict one (DSpark's confidence head).
Source: issue "Seams for what comes next".
"""

from dataclasses import dataclass
from typing import Optional

import torch
from transformers import LogitsProcessorList

try:
    from .decode_step import crop_cache
    from .dflash2 import selector_walk
    from .dspark import confidence_logits, confident_length
    from .draft_trees import TreeBatch, block_trees, selector_trees, tree_batch
    from .speculative_sampling import _WARPERS, prefix_free
    from .target_families import FAMILY as _families
except ImportError:  # imported from the repository root instead of as a Hub remote-code package
    from decode_step import crop_cache
    from dflash2 import selector_walk
    from dspark import confidence_logits, confident_length
    from draft_trees import TreeBatch, block_trees, selector_trees, tree_batch
    from speculative_sampling import _WARPERS, prefix_free
    from target_families import FAMILY as _families


AUTO_TREE_BUDGET = 32  # tree_budget="auto": trees are built to this many nodes, then cut by the policy


@dataclass
class Proposal:
    """What a proposer drafts for one verify step of ``A`` rows: ``n`` nodes below each row's anchor.

    Attributes:
        tokens: ``(A, n)`` long, each node's token, in node order (a chain: slot order).
        positions: ``(A, n + 1)`` long, the true positions of the anchor and of every node
            (``start + depth``): the verify forward's positions.
        token_probs: ``(A, n)`` fp32, the draft's probability of each node's own token: the q it was drawn
            from, or under greedy the softmax of the scores it was chosen from (DFlash 2: of its slot's
            draft logits after the processors that do not read the prefix).
        q: ``(A, n, V)`` fp32, the distribution each node was drawn from (sampling), else None (greedy).
        tree: a ``draft_trees.TreeBatch`` (each row's tree: node tokens, depths, ancestor visibility),
            or None for a chain (node ``j``'s parent is node ``j - 1``).
        acceptance: ``(A, n)`` fp32, the drafter's own estimate that each node is accepted given its parent
            was (DSpark's confidence head), or None where the drafter has none.
        lengths: ``(A,)`` long, a chain's proposed length per row when rows differ (DSpark's confidence cut in
            a batch): row ``r``'s nodes from ``lengths[r]`` on are verified but never accepted (its bonus
            token is drawn at ``lengths[r]``); None: every row proposes all ``n``.
        confidence: ``(A, n)`` fp32, what the verify-length policy may read of each slot to cut the chain
            (``verify_policy.py``): under random draws the largest probability of the slot's distribution
            (never the drawn token's own probability: reading it would make the cut depend on the draw and bias
            the output, notes section 11), otherwise the chosen token's own probability; None: ``token_probs``.
        walk: whether slot ``k``'s distribution (and confidence) was computed from this step's random draws
            before it (DFlash 2's selector walk, DSpark's Markov walk, DFlash 1 under a processor that reads the
            prefix, each under sampling with ``sample_draft``): then the cut at slot ``k`` may read slots ``<= k``
            only, never a later one (a stopping rule). False: every slot's confidence is known before any draw.
    """

    tokens: torch.Tensor
    positions: torch.Tensor
    token_probs: torch.Tensor
    q: Optional[torch.Tensor] = None
    tree: Optional[TreeBatch] = None
    acceptance: Optional[torch.Tensor] = None
    lengths: Optional[torch.Tensor] = None
    confidence: Optional[torch.Tensor] = None
    walk: bool = False

    def cut(self, n: int) -> "Proposal":
        """The chain's first ``n`` nodes (``n`` at most its length); ``lengths`` capped at ``n``."""
        if n >= self.tokens.shape[1]:
            return self
        part = (lambda t: None if t is None else t[:, :n])
        return Proposal(self.tokens[:, :n], self.positions[:, :n + 1], self.token_probs[:, :n], part(self.q),
                        None, part(self.acceptance), None if self.lengths is None else self.lengths.clamp_max(n),
                        part(self.confidence), self.walk)

    @classmethod
    def anchor_only(cls, anchor: torch.Tensor, positions: torch.Tensor) -> "Proposal":
        """No drafted node (a block of 1: a plain target step); ``anchor`` ``(A, 1)``, positions ``(A, 1)``."""
        return cls(anchor[:, :0], positions, positions.new_zeros(positions.shape[0], 0, dtype=torch.float32))


def slot_confidence(sampling, q: Optional[torch.Tensor], token_probs: torch.Tensor) -> torch.Tensor:
    """``Proposal.confidence`` ``(A, n)`` fp32: under random draws (``do_sample`` and ``sample_draft``) the largest
    probability of each slot's distribution ``q`` ``(A, n, V)``, a function of the distribution alone, never of the
    token drawn from it; otherwise (greedy, argmax drafts: nothing random to bias) ``token_probs``."""
    if q is not None and sampling.do_sample and sampling.sample_draft:
        return q.max(dim=-1).values.float()
    return token_probs


def _random_walk(sampling) -> bool:
    """Whether a walking proposer's slots depend on this step's random draws (``Proposal.walk``)."""
    return bool(sampling.do_sample and sampling.sample_draft)


def _own_probs(scores: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``(A, n)`` fp32 ``softmax(scores)[token]`` of each slot, without the ``(A, n, V)`` softmax."""
    own = scores.gather(-1, tokens[..., None])[..., 0]
    return (own.float() - torch.logsumexp(scores.float(), dim=-1)).exp()


def _draft_logits(draft, embed, head, anchor, ctx, draft_cache, draft_valid, start, b, mask_token_id,
                  slot_states=False, draft_window=None):
    """One draft pass over ``[anchor, MASK x (b-1)]`` at positions ``start..start+b-1`` per row.

    Args:
        anchor: ``(B, 1)`` last committed token of each row; ``start`` ``(B,)`` its position.
        ctx: ``decode_step._Context`` with the features ``(B, C, F)`` of positions before the anchor that are
            not yet in ``draft_cache``, their positions ``(B, C)`` and validity ``(B, C)``.
        draft_valid: ``(B, cache_len)`` validity of the cached slots, or None when all are valid.
        draft_window: ``spec_generate``'s, handed to the draft's forward (None: the whole context).

    Returns draft logits ``(B, b-1, V)`` for slots 1..b-1; with ``slot_states`` (a DFlash 2 drafter, whose
    candidate selector also reads the slots' states) ``(logits, slot_hidden (B, b-1, H))``
    (``DFlash2DraftModel.selector_inputs``). ``draft_cache`` keeps context K/V only.
    """
    bsz = anchor.shape[0]
    noise = torch.cat([anchor, anchor.new_full((bsz, b - 1), mask_token_id)], dim=1)
    block_pos = start[:, None] + torch.arange(b, device=anchor.device)
    key_valid = None
    if draft_valid is not None or ctx.valid is not None:  # only with holes (ctx.valid is None without)
        cached = draft_valid if draft_valid is not None else ctx.valid.new_ones(bsz, draft_cache.get_seq_length())
        ctx_valid = ctx.valid if ctx.valid is not None else cached.new_ones(ctx.positions.shape)
        key_valid = torch.cat([cached, ctx_valid, cached.new_ones(bsz, b)], dim=1)
    kept = draft_cache.get_seq_length() + ctx.features.shape[1]
    noise_embedding = _families.draft_block_embedding(draft.config, embed, noise)
    hidden = draft(position_ids=torch.cat([ctx.positions, block_pos], dim=1), noise_embedding=noise_embedding,
                   target_hidden=ctx.features, past_key_values=draft_cache, use_cache=True, attention_mask=key_valid,
                   **({} if draft_window is None else {"draft_window": draft_window}))
    crop_cache(draft_cache, kept)  # block K/V are thrown away
    if slot_states:
        slot_hidden, logits = draft.selector_inputs(hidden, head)
        return logits, slot_hidden
    return _families.draft_logits(draft.config, head, hidden[:, 1:])


class BlockProposer:
    """DFlash 1: one draft pass fills the block; each slot's token is chosen from its own logits.

    Args:
        draft: the drafter as the loop calls it (``cache_reuse.Resume.draft``); facts: the call's
            ``target_facts.TargetFacts`` (embedding and head); draft_cache: the draft's context cache;
        sampling: the call's ``speculative_sampling._Sampling``; mask_token_id; draft_window: see ``spec_generate``;
        tree_budget: ``spec_generate``'s (None: a chain; N: a tree of at most N drafted nodes, ``draft_trees.py``).
    """

    slot_states = False  # the draft pass returns the slots' logits only
    static_loop = True  # the fixed-shape loop (static_generate.py) drafts this kind too

    @staticmethod
    def verify_width(config) -> int:
        """The trained verify block (anchor + drafts) of a drafter of this kind: ``block_size`` (slot 0 is the anchor)."""
        return config.block_size

    def __init__(self, draft, facts, draft_cache, sampling, mask_token_id: int, draft_window=None, tree_budget=None):
        self.draft, self.facts, self.draft_cache, self.sampling = draft, facts, draft_cache, sampling
        self.mask_token_id, self.window = mask_token_id, {} if draft_window is None else {"draft_window": draft_window}
        self.auto_trees = tree_budget == "auto"
        self.tree_budget = AUTO_TREE_BUDGET if self.auto_trees else tree_budget
        self.size_trees = lambda trees: trees  # tree_budget="auto": the policy's cut (verify_policy.VerifyPolicy)

    def draft_pass(self, rows, b: int):
        """The block's draft pass (``_draft_logits``, looked up at call time so tests can replace it)."""
        walk = {"slot_states": True} if self.slot_states else {}  # DFlash 1 calls stay as they were
        return _draft_logits(self.draft, self.facts.embed, self.facts.head, rows.anchor, rows.context(), self.draft_cache,
                             rows.draft_valid, rows.start, b, self.mask_token_id, **walk, **self.window)

    def propose(self, rows, b: int, positions: torch.Tensor) -> Proposal:
        """Draft ``b - 1`` tokens after each row's anchor; ``positions`` ``(A, b)`` those of the block."""
        drafted = self.draft_pass(rows, b)
        rows.context_drafted(self.draft_cache.get_seq_length())
        device = positions.device
        if self.tree_budget is not None:
            trees = self.size_trees(self.trees(*drafted if self.slot_states else (drafted,), rows=rows))
            tree = tree_batch(trees, device)
            tokens = tree.tokens
            return Proposal(tokens, rows.start[:, None] + tree.depths, tree.token_probs, tree=tree)
        tokens, q, probs = self.choose(*drafted if self.slot_states else (drafted,), rows=rows)
        walk = _random_walk(self.sampling) and (self.slot_states or self.sampling.needs_prefix)
        return Proposal(tokens if tokens.device == device else tokens.to(device), positions, probs, q,
                        confidence=slot_confidence(self.sampling, q, probs), walk=walk)

    def trees(self, draft_logits: torch.Tensor, rows) -> list:
        """DDTree's best-first trees over the slots' raw draft log-probs (``draft_trees.block_trees``)."""
        return block_trees(draft_logits, self.tree_budget)

    def choose(self, draft_logits: torch.Tensor, rows):
        """``(tokens (A, n), q (A, n, V) or None, token_probs (A, n))``: [`choose_tokens`]."""
        return choose_tokens(self.sampling, draft_logits, rows)


def choose_tokens(s, draft_logits: torch.Tensor, rows):
    """DFlash 1's choice: ``(tokens (A, n), q (A, n, V) fp32 or None, token_probs (A, n) fp32)`` from the
    slots' draft logits ``(A, n, V)`` under the call's processors (``s``, a ``_Sampling``): the argmax, or
    under sampling a draw from q (``sample_draft``) or q's argmax with a one-hot q (both exact).

    Without prefix-dependent processors one batched call processes the block; otherwise slot ``j`` is
    processed with the row's prefix and the drafts chosen before it (``_Sampling._at``). Shared by the
    dynamic loop's [`BlockProposer`] and the static loop."""
    if not s.needs_prefix:
        if not s.do_sample:
            scores = s.processed(draft_logits) if len(s.procs) else draft_logits
            tokens = scores.argmax(dim=-1)
            return tokens, None, _own_probs(scores, tokens)
        q = s.probs(draft_logits)
        if not s.sample_draft:
            tokens = q.argmax(dim=-1)
            return tokens, torch.nn.functional.one_hot(tokens, q.shape[-1]).to(q.dtype), _gather(q, tokens)
        tokens = torch.multinomial(q.flatten(0, 1), 1, generator=s.generator).view(q.shape[:2])
        return tokens, q, _gather(q, tokens)
    a, n, _ = draft_logits.shape  # slot by slot: slot j is processed given the drafts chosen before it
    tokens = draft_logits.new_zeros(a, n, dtype=torch.long)
    qs = []
    procs = s._step_procs()
    for j in range(n):
        scores = s._at(procs, rows, tokens[:, :j], draft_logits[:, j])
        tokens[:, j] = s._pick(scores, s.do_sample and s.sample_draft)
        qs.append(torch.softmax(scores, dim=-1))
    q = torch.stack(qs, dim=1)
    probs = _gather(q, tokens)
    if not s.do_sample:
        return tokens, None, probs
    return tokens, (q if s.sample_draft else torch.nn.functional.one_hot(tokens, q.shape[-1]).to(q.dtype)), probs


def _gather(q: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return q.gather(-1, tokens[..., None])[..., 0].float()


class SelectorProposer(BlockProposer):
    """DFlash 2: the same draft pass, then the candidate selector's walk (``dflash2.selector_walk``).

    Processors (``procs`` less the warpers) act on each slot's full-vocabulary draft logits before its
    top-k, with the row's prefix and the tokens the walk chose before that slot (the caller's own
    processors through this step's draft-side copies, ``user_processors.py``); the warpers act on the
    target only. The walk samples (``do_sample`` and ``sample_draft``) from ``softmax(score / T)`` over
    the slot's k candidates given the sampled predecessor, ``T`` generate's temperature, and that is the
    q of the rejection test; otherwise it takes the argmax (q one-hot). Without processors the walk is
    z-lab's ``DFlash2DraftModel.propose`` exactly (issue 21).
    """

    slot_states = True  # the selector reads the slots' states too
    static_loop = False  # the walk is dynamic-only

    def choose(self, draft_logits: torch.Tensor, slot_hidden: torch.Tensor, rows):
        s = self.sampling
        procs = LogitsProcessorList(p for p in s._step_procs() if not isinstance(p, _WARPERS))  # user ones: copies
        logits, process = draft_logits.to(slot_hidden.device), None
        if not all(prefix_free(p) for p in procs):

            def process(slot, drafted, scores):  # (A, V) scores of `slot`, `drafted` (A, slot) walked so far
                return s._at(procs, rows, drafted, scores)
        elif len(procs):
            logits = s.processed(logits, procs)
        walked = selector_walk(self.draft.candidate_selector, slot_hidden, logits, rows.anchor.to(slot_hidden.device),
                               do_sample=s.do_sample and s.sample_draft, temperature=s.temperature,
                               generator=s.generator, process=process)
        tokens = walked.tokens.to(draft_logits.device)
        if s.do_sample:
            q = walked.q.to(draft_logits.device)
            return tokens, q, _gather(q, tokens)
        return tokens, None, _own_probs(logits, walked.tokens).to(draft_logits.device)

    def trees(self, draft_logits: torch.Tensor, slot_hidden: torch.Tensor, rows) -> list:
        """Trees from the selector's pairwise scores (``draft_trees.selector_trees``), over the slots' draft
        logits after the processors that do not read the prefix (warpers excluded, as in the walk)."""
        procs = LogitsProcessorList(p for p in self.sampling.procs if not isinstance(p, _WARPERS) and prefix_free(p))
        logits = draft_logits.to(slot_hidden.device)
        if len(procs):
            logits = self.sampling.processed(logits, procs)
        return selector_trees(self.draft.candidate_selector, slot_hidden, logits, rows.anchor, self.tree_budget)


class DSparkProposer(SelectorProposer):
    """DSpark (``DSparkDraftModel``, ``dspark.py``): a verify block of ``b`` positions is drafted by one pass
    over ``b - 1`` slots ``[anchor, MASK x (b - 2)]`` with the drafter's own ``embed_tokens`` / ``lm_head``,
    slot k giving the token at ``start + k + 1`` (so the trained ``block_size`` drafts ``block_size`` tokens
    and verifies ``block_size + 1``: [`verify_width`]), then the Markov walk from the anchor
    (``dspark.markov_walk``; DeepSpec ``VanillaMarkov.sample_block_tokens``). Each slot's corrected logits,
    given the token chosen before it, go through generate's processors and warpers (``_Sampling.probs``):
    that q is the rejection test's; a processor that reads the prefix sees the row's prefix and the slots
    walked before (as the verify does). ``tree_budget`` is refused by name.
    """

    static_loop = False

    @staticmethod
    def verify_width(config) -> int:
        return config.block_size + 1

    def __init__(self, draft, facts, draft_cache, sampling, mask_token_id: int, draft_window=None, tree_budget=None,
                 confidence_threshold: float = 0.0):
        self.threshold = confidence_threshold
        if tree_budget is not None:
            raise ValueError(f"tree_budget={tree_budget} is not implemented for a DSpark drafter (trees from its "
                             "Markov-corrected scores are a follow-up); use tree_budget=None")
        super().__init__(draft, facts, draft_cache, sampling, mask_token_id, draft_window, None)

    def draft_pass(self, rows, b: int):
        """``(logits (A, b - 1, V), hidden (A, b - 1, H))`` of the ``b - 1`` drafted slots."""
        return _draft_logits(self.draft, self.draft.embed_tokens, None, rows.anchor, rows.context(), self.draft_cache,
                             rows.draft_valid, rows.start, b - 1, self.mask_token_id, slot_states=True, **self.window)

    def propose(self, rows, b: int, positions: torch.Tensor) -> Proposal:
        """The Markov walk's chain of ``b - 1`` drafts, with the confidence head's per-slot estimates
        (``Proposal.acceptance``) and, with ``confidence_threshold``, each row cut at its first slot under it
        (DeepSpec ``build_dspark_proposal``; a batch verifies up to its longest row's cut, ``Proposal.lengths``)."""
        logits, hidden = self.draft_pass(rows, b)
        rows.context_drafted(self.draft_cache.get_seq_length())
        tokens, q, probs = self.choose(logits, hidden, rows)
        prev = torch.cat([rows.anchor, tokens[:, :-1]], dim=1)
        head = self.draft.confidence_head
        conf = confidence_logits(head, self.draft.markov_head, self.draft.config.confidence_head_with_markov, hidden, prev)
        full = Proposal(tokens, positions, probs, q, acceptance=None if conf is None else conf.sigmoid(),
                        confidence=slot_confidence(self.sampling, q, probs), walk=_random_walk(self.sampling))
        if not self.threshold:
            return full
        lengths = confident_length(conf, self.threshold)  # (A,) each row's cut
        n = int(lengths.max())
        if n == 0:
            return Proposal.anchor_only(rows.anchor, positions[:, :1])
        cut = full.cut(n)
        if int(lengths.min()) < n:  # rows cut at different slots: the shorter ones stop at their own cut
            cut.lengths = lengths
        return cut

    def choose(self, draft_logits: torch.Tensor, slot_hidden: torch.Tensor, rows):
        """The Markov walk: slot k's logits ``(A, V)`` plus the Markov row of the token chosen at slot k - 1 (the
        anchor for slot 0), through generate's processors and warpers (prefix readers after the row's prefix
        and slots 0..k-1), then a draw from that q (or its argmax). Returns tokens ``(A, n)``, q ``(A, n, V)``
        (None when greedy) and each token's own probability ``(A, n)``."""
        s, markov = self.sampling, self.draft.markov_head
        procs = s._step_procs()  # the caller's processors: this step's copies
        prefix = s.needs_prefix
        prev, tokens, qs, probs = rows.anchor[:, 0], [], [], []
        for k in range(draft_logits.shape[1]):
            row = draft_logits[:, k] if markov is None else draft_logits[:, k] + markov.bias(prev)
            if prefix:
                walked = torch.stack(tokens, 1) if tokens else rows.anchor[:, :0]
                scores = s._at(procs, rows, walked, row.float())
            else:
                scores = s.processed(row[:, None], procs)[:, 0]
            if s.do_sample:
                q = torch.softmax(scores, dim=-1)
                prev = (torch.multinomial(q, 1, generator=s.generator)[:, 0] if s.sample_draft else q.argmax(-1))
                qs.append(q if s.sample_draft else torch.nn.functional.one_hot(prev, q.shape[-1]).to(q.dtype))
                probs.append(_gather(q, prev))
            else:
                prev = scores.argmax(-1)
                probs.append(_own_probs(scores, prev))
            tokens.append(prev)
        return torch.stack(tokens, 1), (torch.stack(qs, 1) if s.do_sample else None), torch.stack(probs, 1)


def check_confidence_threshold(draft, threshold, batch: int) -> None:
    """Refuse, naming ``confidence_threshold``, a threshold outside ``[0, 1]``, one for a drafter without a
    confidence head (anything but a DSpark drafter with ``enable_confidence_head``). ``batch``: unused (every
    batch size runs: each row is cut at its own slot)."""
    if not threshold:
        return
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0 <= threshold <= 1:
        raise ValueError(f"confidence_threshold={threshold!r} must be a number in [0, 1]")
    if getattr(draft, "confidence_head", None) is None:
        raise ValueError(f"confidence_threshold={threshold} needs a DSpark drafter with a confidence head; "
                         f"{type(draft).__name__} has none")


def proposer_for(draft):
    """The proposer class of ``draft``'s kind: [`DSparkProposer`] for a drafter with its own ``lm_head`` (DSpark),
    [`SelectorProposer`] for a drafter with a candidate selector (DFlash 2), else [`BlockProposer`]. The one
    place the drafter kind is asked, once per call."""
    if getattr(getattr(draft, "config", None), "is_dspark", False):
        return DSparkProposer
    return SelectorProposer if getattr(draft, "candidate_selector", None) is not None else BlockProposer


__all__ = ["AUTO_TREE_BUDGET", "BlockProposer", "DSparkProposer", "Proposal", "SelectorProposer", "check_confidence_threshold",
           "choose_tokens", "proposer_for", "slot_confidence"]
