"""Draft trees: several candidates per depth, verified in one target forward, exactly.

A block drafter's per-slot distributions hold more than their argmax path. A tree of at most
``tree_budget`` nodes below the anchor is built from them, the target verifies every node in ONE
forward (each node attends to the committed context and to its own ancestors only, at position
``start + depth``), and a walk from the anchor follows the child whose token the target itself chose
at each node. The walk commits exactly the tokens the target would have produced, so the output is
the target's own (greedy) or has exactly its distribution (sampling).

Which tree each drafter kind gets:

* DFlash 1 (``DFlashDraftModel``): DDTree's best-first tree (Ringel & Romano, arXiv 2604.12989,
  ``liranringel/ddtree`` ``build_ddtree_tree``): every node's score is the sum of the draft's log-probs
  of the tokens on its path (the drafter's per-slot marginals, raw logits, before any logits processor;
  processors change which tree is built, so acceptance, never the output); a heap pops the best node,
  then offers its next sibling and its first child, until ``tree_budget`` nodes are taken. Children of
  every node at depth ``d`` are the top-k tokens of slot ``d``.
* DFlash 2 (``DFlash2DraftModel``): the same heap over the candidate selector's pairwise scores
  (SGLang PR #36196): a node's children are the next slot's top-k candidates ranked by their score
  given THAT node's token (``dflash2.transition_scores``: unary + bilinear), scored by the cumulative
  ``log_softmax`` of those scores over the k candidates. The marginals alone follow the argmax path
  (rmagur1203/vllm-ddtree ``docs/DDTREE-FINDINGS-EN.md``: a sibling's next depth is right 22% of the time).

Acceptance (``verify_tree``): greedy follows the child equal to the target's argmax at each node
(after generate's processors, with the node's own path as the prefix). Sampling is sample-and-match:
at each node the walk visits, one draw from the target's processed distribution at that node; the
walk moves to the child holding the drawn token, and the first draw without such a child is the next
anchor. Every committed token is then a draw from the target given its own prefix, so the output has
exactly the target's distribution; for children fixed by top-k this rule is exact and optimal (a
q-ratio test on top-k children is biased: hipfire PR #483). ``sample_draft`` has no effect on trees.
Draws happen only at visited nodes (DDTree draws at every node: equally exact, costlier).

After the walk the target cache keeps exactly the accepted path, in order (``compact_cache``), and the
draft context gets the target's features of the accepted nodes at their true positions
(``decode_step.compact_cache``).
Source: issue 36 ("Tree verification").
"""

import heapq
import math
from typing import NamedTuple, Optional

import torch

try:
    from .dflash2 import transition_scores
except ImportError:  # imported from the repository root instead of as a Hub remote-code package
    from dflash2 import transition_scores


class HostTree(NamedTuple):
    """One row's tree on the host. Node 0 is the anchor; nodes ``1..n`` are drafted, parents before children.

    ``tokens``, ``parents``, ``depths``, ``log_probs``: lists of length ``n + 1`` (entry 0: the anchor, token
    None, parent -1, depth 0, log-prob 0); ``log_probs[j]``: the drafter's log-prob of node ``j``'s token
    given its parent. ``children``: for every node, ``{token: child node}``.
    """

    tokens: list
    parents: list
    depths: list
    children: list
    log_probs: list

    @property
    def size(self) -> int:
        """Drafted nodes (the anchor not counted)."""
        return len(self.tokens) - 1

    @property
    def depth(self) -> int:
        """Deepest drafted node's depth (0 for a tree of the anchor alone)."""
        return max(self.depths)


class _Children(NamedTuple):
    """A node's candidate children, best first: their log-probs, tokens and keys (what ``expand`` reads)."""

    log_probs: list
    tokens: list
    keys: list


def best_first(root: _Children, expand, budget: int, depth_limit: int) -> HostTree:
    """The ``budget`` best nodes by path score, closed under parents and earlier siblings (DDTree's heap).

    Args:
        root: the anchor's children, sorted best first.
        expand: ``expand(depth, key) -> _Children`` of a node at ``depth`` (1-based) with ``key``
            (called once per node that may have children, i.e. above ``depth_limit``).
        budget: drafted nodes at most (>= 1); depth_limit: deepest depth (the block's drafted slots).

    A popped node offers its next sibling (same parent, next rank) and its own best child; ties break
    by (parent, rank), so the tree is a deterministic function of the scores.
    """
    tree = HostTree([None], [-1], [0], [{}], [0.0])
    offers, score = [root], [0.0]  # offers[node]: its children; score[node]: its path log-prob
    heap = [(-root.log_probs[0], 0, 0)] if root.tokens and depth_limit > 0 else []
    while heap and tree.size < budget:
        neg, parent, rank = heapq.heappop(heap)
        siblings = offers[parent]
        node, depth = len(tree.tokens), tree.depths[parent] + 1
        token = siblings.tokens[rank]
        tree.tokens.append(token)
        tree.parents.append(parent)
        tree.depths.append(depth)
        tree.children.append({})
        tree.log_probs.append(siblings.log_probs[rank])
        tree.children[parent].setdefault(token, node)
        score.append(-neg)
        if rank + 1 < len(siblings.tokens):
            heapq.heappush(heap, (-(score[parent] + siblings.log_probs[rank + 1]), parent, rank + 1))
        mine = expand(depth, siblings.keys[rank]) if depth < depth_limit else None
        offers.append(mine)
        if mine is not None and mine.tokens:
            heapq.heappush(heap, (-(score[node] + mine.log_probs[0]), node, 0))
    return tree


def block_trees(draft_logits: torch.Tensor, budget: int) -> list:
    """DFlash 1 trees, one per row: ``draft_logits`` ``(A, m, V)`` of the ``m`` drafted slots -> ``A`` [`HostTree`].

    Slot ``d - 1``'s top-``min(budget, V)`` tokens and their log-probs (fp32 ``log_softmax`` of the raw
    logits) are the children of every node at depth ``d - 1``; one transfer to the host, then
    [`best_first`] per row (DDTree ``build_ddtree_tree``)."""
    a, m, v = draft_logits.shape
    logits = draft_logits.float()
    top, ids = torch.topk(logits, k=min(budget, v), dim=-1)
    log_probs = (top - torch.logsumexp(logits, dim=-1, keepdim=True)).tolist()  # (A, m, k) on the host
    ids = ids.tolist()
    trees = []
    for row_lp, row_ids in zip(log_probs, ids):
        slots = [_Children(lp, tok, [None] * len(tok)) for lp, tok in zip(row_lp, row_ids)]
        trees.append(best_first(slots[0], lambda depth, key, s=slots: s[depth], budget, m))
    return trees


def selector_trees(selector, slot_hidden: torch.Tensor, logits: torch.Tensor, anchor: torch.Tensor,
                   budget: int) -> list:
    """DFlash 2 trees from the candidate selector's pairwise scores, one [`HostTree`] per row.

    Args:
        selector: the drafter's ``candidate_selector``; slot_hidden: ``(A, m, H)`` the slots' draft states;
        logits: ``(A, m, V)`` the slots' draft logits (after the processors that do not read the prefix);
        anchor: ``(A,)`` or ``(A, 1)`` the anchors (slot 0's predecessor); budget: drafted nodes at most.

    A node holding candidate ``p`` of slot ``d - 1`` has as children slot ``d``'s candidates ranked by
    ``transition_scores[d - 1, p]`` (the anchor's children: slot 0's scores given the anchor), each scored
    by the ``log_softmax`` of those k scores: z-lab's walk picks the argmax of the same scores, so the
    tree's best path is the chain's draft. Source: SGLang PR #36196 (beam over the selector's top-k lattice).
    """
    anchor = anchor.reshape(-1).to(slot_hidden.device)
    projected = selector.hidden_projection(slot_hidden)  # (A, m, r)
    unary, candidates = selector.candidates(logits.to(slot_hidden.device))  # (A, m, k) each
    first = selector.score(unary[:, 0], candidates[:, 0], projected[:, 0], anchor)  # (A, k)
    table = transition_scores(selector, unary, candidates, projected)  # (A, m - 1, k, k)
    first_lp, first_order = torch.log_softmax(first.float(), dim=-1).sort(dim=-1, descending=True)
    table_lp, table_order = torch.log_softmax(table.float(), dim=-1).sort(dim=-1, descending=True)
    host = [t.tolist() for t in (first_lp, first_order, table_lp, table_order, candidates)]
    trees = []
    for f_lp, f_order, t_lp, t_order, cands in zip(*host):
        def expand(depth, key, t_lp=t_lp, t_order=t_order, cands=cands):  # key: candidate index at slot depth - 1
            order = t_order[depth - 1][key]
            return _Children(t_lp[depth - 1][key], [cands[depth][c] for c in order], order)

        root = _Children(f_lp, [cands[0][c] for c in f_order], f_order)
        trees.append(best_first(root, expand, budget, len(cands)))
    return trees


class TreeBatch(NamedTuple):
    """The rows' trees as tensors, padded to one node count ``n`` (the widest row's).

    ``tokens`` ``(A, n)`` long (node ``j + 1``'s token at column ``j``); ``token_probs`` ``(A, n)`` fp32, the
    drafter's probability of each node's token given its parent (0 for padding); ``depths`` ``(A, n + 1)`` long
    (column 0: the anchor, depth 0); ``visible`` ``(A, n + 1, n + 1)`` bool, ``visible[a, i, j]``: node
    ``j`` is node ``i`` or one of its ancestors (a padded node sees the anchor and itself, and no node
    sees it); ``host``: the [`HostTree`] list.
    """

    tokens: torch.Tensor
    token_probs: torch.Tensor
    depths: torch.Tensor
    visible: torch.Tensor
    host: list


def tree_batch(trees: list, device) -> TreeBatch:
    """[`TreeBatch`] of ``trees`` on ``device``: built as host lists, then one tensor each (a per-node tensor
    write costs more than the whole list build at these sizes)."""
    n = max(t.size for t in trees)
    tokens, log_probs, depths, visible = [], [], [], []
    for tree in trees:
        size = tree.size
        tokens.append(tree.tokens[1:] + [0] * (n - size))
        log_probs.append(tree.log_probs[1:] + [float("-inf")] * (n - size))
        depths.append(tree.depths + [1] * (n - size))
        rows = [[True] + [False] * n]
        for node in range(1, n + 1):
            row = rows[tree.parents[node]][:] if node <= size else [True] + [False] * n
            row[node] = True
            rows.append(row)
        visible.append(rows)
    as_tensor = lambda x, dtype: torch.tensor(x, dtype=dtype).to(device)  # noqa: E731
    return TreeBatch(as_tensor(tokens, torch.long).view(len(trees), n),
                     as_tensor(log_probs, torch.float32).view(len(trees), n).exp(), as_tensor(depths, torch.long),
                     as_tensor(visible, torch.bool), trees)


def first_nodes(tree: HostTree, n: int) -> HostTree:
    """``tree``'s first ``n`` drafted nodes (with the anchor): a best-first tree's nodes come in
    non-increasing path score, parents first, so this is the best-first tree of budget ``n``."""
    if tree.size <= n:
        return tree
    keep = n + 1
    return HostTree(tree.tokens[:keep], tree.parents[:keep], tree.depths[:keep],
                    [{t: c for t, c in kids.items() if c < keep} for kids in tree.children[:keep]], tree.log_probs[:keep])


def path_probs(tree: HostTree) -> list:
    """Per drafted node, the product of the drafter's probabilities along its path (node order)."""
    score = [0.0]
    for node in range(1, tree.size + 1):
        score.append(score[tree.parents[node]] + tree.log_probs[node])
    return [math.exp(x) for x in score[1:]]


class Verdict(NamedTuple):
    """What a verify step decided, chain or tree, for the commit and the roll-back.

    ``accepted`` ``(A,)`` long: drafted tokens accepted per row; ``next_token`` ``(A,)``: the token after them
    (bonus or correction); ``scores``: ``(A, W, V)`` fp32 processed target scores of the committed slots, or
    None; ``drafts`` ``(A, m)`` long: the accepted path's tokens first (a chain: its drafts); ``path``: ``(A, W)``
    long node index of each committed slot (0: the anchor; padded with 0), None for a chain;
    ``drafted``: per-row host list of drafted depth (a tree's depth), None for a chain (its block);
    ``logits``: ``(A, W, V)`` the target's raw logits of the committed slots (what ``output_logits`` records).
    """

    accepted: torch.Tensor
    next_token: torch.Tensor
    scores: Optional[torch.Tensor]
    drafts: torch.Tensor
    logits: torch.Tensor
    path: Optional[torch.Tensor] = None
    drafted: Optional[list] = None


def verify_tree(sampling, tree: TreeBatch, logits: torch.Tensor, rows) -> Verdict:
    """Walk every row's tree against the target's logits ``(A, n + 1, V)`` at its nodes.

    Greedy without prefix-dependent processors: one batched argmax of every node, one transfer, then the
    host walk. Otherwise the walk runs depth by depth, the target's scores at each row's current node
    processed with that node's own path as the prefix (``sampling.node_scores``), then its argmax or one
    draw (``sampling.generator``); one transfer per depth. See the module docstring for why this is exact.
    """
    a = logits.shape[0]
    walks = [[0] for _ in range(a)]
    nxt = [None] * a
    kept_scores = None
    if not sampling.do_sample and not sampling.needs_prefix:
        scores = sampling.processed(logits) if len(sampling.procs) else None
        choice = (logits if scores is None else scores).argmax(dim=-1).tolist()  # (A, n + 1) on the host
        for r, host in enumerate(tree.host):
            while (child := host.children[walks[r][-1]].get(choice[r][walks[r][-1]])) is not None:
                walks[r].append(child)
            nxt[r] = choice[r][walks[r][-1]]
        if scores is None and sampling.want_scores:
            scores = logits.float()
        path = _path_tensor(walks, logits.device)
        kept_scores = None if scores is None else _gather_nodes(scores, path)
    else:
        path, nxt, kept_scores = _walk_by_depth(sampling, tree, logits, rows, walks)
    accepted = [len(w) - 1 for w in walks]
    width = max(len(w) for w in walks)
    drafts = [[tree.host[r].tokens[j] for j in w[1:]] + [0] * (width - len(w)) for r, w in enumerate(walks)]
    device = logits.device
    return Verdict(torch.tensor(accepted, device=device), torch.tensor(nxt, device=device), kept_scores,
                   torch.tensor(drafts, dtype=torch.long, device=device).view(a, width - 1),
                   _gather_nodes(logits, path) if sampling.want_scores else logits, path,
                   [t.depth for t in tree.host])


def _walk_by_depth(sampling, tree: TreeBatch, logits, rows, walks):
    """The walk one depth at a time for every row still walking: ``(path (A, W), next tokens, scores)``."""
    a, device = logits.shape[0], logits.device
    nxt, per_row = [None] * a, [[] for _ in range(a)]
    walking, depth = list(range(a)), 0
    procs = sampling._step_procs()
    while walking:
        sel = torch.tensor(walking, device=device)
        nodes = torch.tensor([walks[r][-1] for r in walking], device=device)
        ext = torch.tensor([[tree.host[r].tokens[j] for j in walks[r][1:]] for r in walking],
                           dtype=torch.long, device=device).view(len(walking), depth)  # (g, depth): each node's path
        scores = sampling.node_scores(procs, rows, sel, ext, logits[sel, nodes])  # (g, V) fp32
        picks = sampling._pick(scores, sampling.do_sample).tolist()
        still = []
        for i, (r, token) in enumerate(zip(walking, picks)):
            per_row[r].append(scores[i])
            child = tree.host[r].children[walks[r][-1]].get(token)
            if child is None:
                nxt[r] = token
            else:
                walks[r].append(child)
                still.append(r)
        walking, depth = still, depth + 1
    path = _path_tensor(walks, device)
    kept = None
    if sampling.want_scores:
        width = path.shape[1]
        kept = torch.stack([torch.stack(s + [s[-1]] * (width - len(s))) for s in per_row])  # (A, W, V)
    return path, nxt, kept


def _path_tensor(walks: list, device) -> torch.Tensor:
    width = max(len(w) for w in walks)
    return torch.tensor([w + [0] * (width - len(w)) for w in walks], dtype=torch.long, device=device)


def _gather_nodes(values: torch.Tensor, path: torch.Tensor) -> torch.Tensor:
    """``values`` ``(A, n + 1, ...)`` at the nodes ``path`` ``(A, W)`` -> ``(A, W, ...)``."""
    index = path.view(*path.shape, *([1] * (values.dim() - 2))).expand(*path.shape, *values.shape[2:])
    return values.gather(1, index.to(values.device))


def check_tree(tree_budget, *, adaptive: bool, facts) -> None:
    """Refuse, before any forward, a ``tree_budget`` that is not an integer >= 1 or a call a tree cannot run
    exactly: ``adaptive_block_size=True`` with an integer budget (``"auto"`` is the policy's own size), a
    hybrid linear-attention target (its recurrent state runs along one path, not a tree), a flash-attention
    target (a tree needs an explicit 4-D mask). ``facts``: the call's ``target_facts.TargetFacts``.

    Raises:
        ValueError: naming ``tree_budget`` and the reason.
    """
    if tree_budget is None:
        return
    if tree_budget != "auto" and (isinstance(tree_budget, bool) or not isinstance(tree_budget, int) or tree_budget < 1):
        raise ValueError(f"tree_budget={tree_budget!r} must be None (a chain), an integer >= 1 (drafted nodes per "
                         "step) or 'auto' (sized each step by the verify-length policy)")
    reasons = ((adaptive and tree_budget != "auto", "adaptive_block_size=True sizes chains; a tree's size is its "
                "budget (drop one of them, or pass tree_budget='auto')"),
               (facts.linear_layers, "a hybrid linear-attention target keeps one recurrent state per row, which "
                                     "runs along one path and cannot verify a tree; use the chain (tree_budget=None)"),
               (facts.flash, "a flash-attention target takes no 4-D tree mask; load it with attn_implementation="
                             "'sdpa' or 'eager'"))
    for bad, why in reasons:
        if bad:
            raise ValueError(f"tree_budget={tree_budget} cannot run exactly here: {why}")


__all__ = ["HostTree", "TreeBatch", "Verdict", "best_first", "block_trees", "check_tree", "first_nodes", "path_probs",
           "selector_trees", "tree_batch", "verify_tree"]
