"""Draft trees (``spec_generate(tree_budget=N)``, ``draft_trees.py``): greedy output equal to
``target.generate`` on several families, at batch 1 and in ragged batches, with oracle drafts that put
the target's token at sibling rank 1, 2 or 3 at a chosen depth (the tree commits the whole block where
the chain stops at that depth); DFlash 2 trees from the selector's pairwise scores; the sampled output's
joint distribution against the target's exact one (chi-square), with two planted bugs it must reject;
refusals by name.

Planted bugs each test was shown to catch are listed in its docstring.
"""

import itertools

import pytest
import torch
import transformers

import draft_trees
import generation_utils
import proposers
from family_targets import family_target
from patching import patch_called
from test_families import _left_pad
from test_dflash2_generate import dflash2_draft
from tiny import VOCAB, tiny_draft, tiny_target

IS_5 = int(transformers.__version__.split(".")[0]) >= 5
BLOCK = 8
STEPS = 3
NEW = 1 + (BLOCK) * STEPS  # the prefill token, then STEPS full blocks when every tree is fully accepted
LENS = (3, 11, 20)
PROMPTS = {n: torch.randint(0, 90, (1, n), generator=torch.Generator().manual_seed(300 + n)) for n in LENS}
REAL_DRAFT_LOGITS = proposers._draft_logits  # the oracles below call the real pass (it fills the draft cache)


def _generate(target, ids, n, **kw):
    return target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n, **kw)


def plan(step, row):
    """(depth, rank) of the oracle's one ranked slot at ``step`` for ``row``: the target's token sits at
    sibling rank 1, 2, 3 (or 0) at depths 1..3; every other slot holds it at rank 0 with probability ~1."""
    return 1 + (step + row) % 3, (step + 2 * row + 1) % 4


def oracle_logits(want, depth, rank):
    """``(n, V)`` slot logits: slot ``depth - 1`` ranks ``rank`` decoys just above the wanted token (near
    ties: the tree must hold ``rank + 1`` siblings there), every other slot the wanted token at 30."""
    n = want.shape[0]
    logits = torch.zeros(n, VOCAB)
    logits[torch.arange(n), want] = 30.0
    if depth <= n:
        j = depth - 1
        logits[j, want[j]] = 10.0
        for i in range(rank):
            logits[j, (want[j] + 1 + i) % VOCAB] = 10.0 + 0.001 * (rank - i)
    return logits


def install_oracle(monkeypatch, refs, selector=False):
    """Oracle draft logits for rows following ``refs`` (``(1, L)`` each; row ``i`` of every step follows
    ``refs[i]``: batch 1 with one ref, or a ragged batch whose rows all run to the end); returns the list
    of steps seen (each: the ``(depth, rank)`` plan of every row). With ``selector`` the DFlash 2 pass
    also returns the real slot states (the test zeroes the selector's codebooks: its scores are the unary
    logits)."""
    steps = []

    def fake(draft, embed, head, anchor, ctx, draft_cache, draft_valid, start, b, mask_token_id, **kw):
        out = REAL_DRAFT_LOGITS(draft, embed, head, anchor, ctx, draft_cache, draft_valid, start, b, mask_token_id, **kw)
        assert anchor.shape[0] == len(refs)
        rows, plans = [], []
        for r, (s, a) in enumerate(zip(start.tolist(), anchor[:, 0].tolist())):
            assert refs[r][0, s] == a, "the row left its reference: the output is not the target's"
            want = torch.cat([refs[r][0, s + 1: s + b], torch.zeros(b, dtype=torch.long)])[: b - 1]
            plans.append(plan(len(steps), r))
            rows.append(oracle_logits(want, *plans[-1]))
        steps.append(plans)
        logits = torch.stack(rows)
        return (logits, out[1]) if selector else logits

    patch_called(monkeypatch, proposers, "_draft_logits", fake)
    return steps


def assert_tree_beats_chain(draft, target, monkeypatch, prompts, budget=32, selector=False, **inputs):
    """Greedy with trees == generate, batch 1 and ragged; each tree step commits the whole block while the
    chain on the same first step commits only up to the ranked depth (both counts asserted)."""
    refs = [_generate(target, p, NEW, **inputs) for p in prompts]
    for r, p in enumerate(prompts):
        steps = install_oracle(monkeypatch, refs[r: r + 1], selector)
        chain = draft.spec_generate(target, p, max_new_tokens=NEW, temperature=0.0, block_size=BLOCK,
                                    return_dict_in_generate=True, **inputs)
        depth, rank = steps[0][0]
        assert chain.acceptance_lengths[0] == (depth if rank else BLOCK), (steps[0], chain.acceptance_lengths)
        steps.clear()
        tree = draft.spec_generate(target, p, max_new_tokens=NEW, temperature=0.0, block_size=BLOCK,
                                   tree_budget=budget, return_dict_in_generate=True, **inputs)
        assert torch.equal(tree.sequences, refs[r]) and torch.equal(chain.sequences, refs[r]), ("batch 1", r)
        assert tree.acceptance_lengths == [BLOCK] * STEPS, (steps, tree.acceptance_lengths)
        assert any(rank for (_, rank), in steps), "no step ranked the target's token below the top"
    ids, mask = _left_pad(prompts)
    steps = install_oracle(monkeypatch, refs, selector)
    out = draft.spec_generate(target, ids, attention_mask=mask, max_new_tokens=NEW, temperature=0.0,
                              block_size=BLOCK, tree_budget=budget, return_dict_in_generate=True)
    assert steps, "the oracle was never consulted"
    for r, p in enumerate(prompts):
        assert torch.equal(out.sequences[r, ids.shape[1]:], refs[r][0, p.shape[1]:]), ("ragged row", r)
    return out


def test_dense_qwen3_tree_equals_generate_and_commits_more_than_the_chain(monkeypatch):
    """Planted bugs caught: siblings visible to each other in the tree mask (``visible[:, :, 0:] = True`` for
    every node); ``position = start + node index``; ``compact_cache`` keeping the first ``W`` tree slots
    instead of the path's."""
    target = tiny_target(peaked=True)
    out = assert_tree_beats_chain(tiny_draft(block_size=BLOCK), target, monkeypatch, [PROMPTS[n] for n in LENS])
    assert out.row_draft_lengths[0][0] == BLOCK - 1  # a tree's drafted length is its depth


def test_llama_tree_equals_generate(monkeypatch):
    assert_tree_beats_chain(tiny_draft(block_size=BLOCK), tiny_target("llama", peaked=True), monkeypatch,
                            [PROMPTS[n] for n in LENS])


@pytest.mark.parametrize("name", ["mistral", "gemma3"])
def test_sliding_window_tree_past_the_window_in_a_ragged_batch(name, monkeypatch):
    """Window 6, 25 new tokens: every row passes the window; windows counted in true positions (depth).
    Planted bug caught: ``window_masks`` counting a tree key's window by its node index."""
    target = family_target(name)
    if target is None:
        pytest.skip(f"{name} is not in this transformers version")
    assert_tree_beats_chain(tiny_draft(block_size=BLOCK), target, monkeypatch, [PROMPTS[n] for n in LENS])


def test_qwen3_moe_tree_equals_generate(monkeypatch):
    cfg = transformers.Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=40, intermediate_size=72, moe_intermediate_size=24,
                                      num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=10,
                                      num_experts=4, num_experts_per_tok=2, max_position_embeddings=512,
                                      eos_token_id=None, bos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    from tiny import peak
    target = peak(transformers.Qwen3MoeForCausalLM(cfg)).eval()
    target.generation_config.eos_token_id = target.generation_config.pad_token_id = None
    assert_tree_beats_chain(tiny_draft(block_size=BLOCK), target, monkeypatch, [PROMPTS[n] for n in LENS[:2]])


def test_dflash2_tree_equals_generate(monkeypatch):
    """A DFlash 2 drafter's tree (selector scores = unary: codebooks zeroed) follows the same oracle."""
    draft = dflash2_draft(block_size=BLOCK)
    with torch.no_grad():
        draft.candidate_selector.successor_codebook.zero_()
    assert_tree_beats_chain(draft, tiny_target(peaked=True), monkeypatch, [PROMPTS[n] for n in LENS[:2]],
                            selector=True)


def test_vision_language_target_with_an_image_tree_equals_generate(monkeypatch):
    """Qwen3-VL with an image: node positions are text positions + the row's M-RoPE delta."""
    from test_multimodal import _image, qwen3_vl, qwen_inputs
    target = qwen3_vl()
    inputs = qwen_inputs(target, [[5, 6, *_image(), 7, 8, 9]], 1)
    ids = inputs.pop("input_ids")
    inputs.pop("attention_mask")
    ref = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW, **inputs)
    steps = install_oracle(monkeypatch, [ref])
    out = tiny_draft(block_size=BLOCK).spec_generate(target, ids, max_new_tokens=NEW, temperature=0.0,
                                                     block_size=BLOCK, tree_budget=32, return_dict_in_generate=True,
                                                     **inputs)
    assert steps and torch.equal(out.sequences, ref)
    assert out.acceptance_lengths == [BLOCK] * STEPS


def test_selector_tree_ranks_children_by_the_pair_score_given_their_parent():
    """The tree's rank-0 path is the selector's greedy walk (pairwise scores, not the marginals), and a
    node's children follow ``transition_scores`` given that node's candidate.
    Planted bug caught: children ranked by the unary logits alone."""
    from dflash2 import selector_walk, transition_scores
    draft = dflash2_draft(block_size=BLOCK)
    sel = draft.candidate_selector
    gen = torch.Generator().manual_seed(3)
    hidden, logits = torch.randn(2, BLOCK - 1, 40, generator=gen), torch.randn(2, BLOCK - 1, VOCAB, generator=gen) * 3
    anchor = torch.tensor([4, 9])
    with torch.no_grad():
        trees = draft_trees.selector_trees(sel, hidden, logits, anchor, budget=40)
        walk = selector_walk(sel, hidden, logits, anchor)
        unary, cands = sel.candidates(logits)
        table = transition_scores(sel, unary, cands, sel.hidden_projection(hidden))
    for r, tree in enumerate(trees):
        node, path = 0, []
        while tree.children[node]:
            node = min(tree.children[node].values())  # the first child taken is the best one
            path.append(tree.tokens[node])
        assert path == walk.tokens[r].tolist()
        first = min(tree.children[0].values())
        kids = sorted(tree.children[first].values())
        index = cands[r, 0].tolist().index(tree.tokens[first])
        best = [cands[r, 1, c].item() for c in table[r, 0, index].argsort(descending=True)]
        assert [tree.tokens[k] for k in kids] == best[: len(kids)]


def test_best_first_is_ddtrees_heap():
    """The tree holds the ``budget`` best paths by summed log-prob, closed under parents."""
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(1, 5, 11, generator=gen) * 2
    tree = draft_trees.block_trees(logits, budget=20)[0]
    lp = torch.log_softmax(logits[0], -1)
    scores = {}
    for node in range(1, tree.size + 1):
        parent = tree.parents[node]
        scores[node] = scores.get(parent, 0.0) + lp[tree.depths[node] - 1, tree.tokens[node]].item()
    worst_in = min(scores.values())
    # every path not in the tree whose parent is in it scores no better than the worst node taken
    for node in [0, *scores]:
        if tree.depths[node] == 5:
            continue
        taken = set(tree.children[node])
        for tok in range(11):
            if tok not in taken:
                assert scores.get(node, 0.0) + lp[tree.depths[node], tok].item() <= worst_in + 1e-6
    assert tree.size == 20


# ----------------------------------------------------------------------------- sampling


TOP_K, PENALTY, N_NEW, ROWS, CALLS = 2, 3.0, 4, 600, 5


def _processed(target, seq):
    logits = target(torch.tensor([seq])).logits[0, -1:].float()
    procs = transformers.LogitsProcessorList([transformers.RepetitionPenaltyLogitsProcessor(PENALTY),
                                              transformers.TopKLogitsWarper(TOP_K)])
    return torch.softmax(procs(torch.tensor([seq]), logits)[0], -1)


@torch.no_grad()
def _exact_joint(target, prompt):
    """Every reachable ``N_NEW``-token continuation with its exact probability, and per depth the set of
    tokens the target can draw there (what the oracle drafter proposes)."""
    joint, reach = {(): 1.0}, [set() for _ in range(N_NEW)]
    for d in range(N_NEW):
        nxt = {}
        for seq, p in joint.items():
            probs = _processed(target, prompt + list(seq))
            for tok in probs.nonzero()[:, 0].tolist():
                nxt[seq + (tok,)] = p * probs[tok].item()
                reach[d].add(tok)
        joint = nxt
    return joint, reach


def _wrong_prefix_walk(sampling, tree, logits, rows, walks):
    """Planted bug: every node's processors see the anchor's prefix, not the node's own path."""
    a = logits.shape[0]
    nxt, procs = [None] * a, sampling._step_procs()
    for r in range(a):
        while True:
            node = walks[r][-1]
            scores = sampling.node_scores(procs, rows, torch.tensor([r]), torch.zeros(1, 0, dtype=torch.long),
                                          logits[r: r + 1, node])
            token = sampling._pick(scores, True).item()
            child = tree.host[r].children[node].get(token)
            if child is None:
                nxt[r] = token
                break
            walks[r].append(child)
    return draft_trees._path_tensor(walks, logits.device), nxt, None


def _q_ratio_walk(sampling, tree, logits, rows, walks):
    """Planted bug: a rejection test with the draft's q (uniform over the node's top-k children) on the
    children in rank order, residual ``norm(max(p - q, 0))`` after each rejection (biased: hipfire PR #483)."""
    a = logits.shape[0]
    nxt, procs = [None] * a, sampling._step_procs()
    for r in range(a):
        while True:
            node = walks[r][-1]
            ext = torch.tensor([[tree.host[r].tokens[j] for j in walks[r][1:]]], dtype=torch.long).view(1, -1)
            p = torch.softmax(sampling.node_scores(procs, rows, torch.tensor([r]), ext, logits[r: r + 1, node])[0], -1)
            kids = tree.host[r].children[node]
            moved = False
            for tok, child in kids.items():
                q = torch.zeros_like(p)
                q[list(kids)] = 1.0 / len(kids)
                if torch.rand(1, generator=sampling.generator).item() < min(1.0, p[tok].item() / q[tok].item()):
                    walks[r].append(child)
                    moved = True
                    break
                p = (p - q).clamp_min(0)
                p = p / p.sum() if p.sum() > 0 else q
            if not moved:
                nxt[r] = torch.multinomial(p, 1, generator=sampling.generator).item()
                break
    return draft_trees._path_tensor(walks, logits.device), nxt, None


@pytest.mark.parametrize("bug", [None, "node_processed_with_the_anchors_prefix", "q_ratio_on_top_k_children"])
def test_sampled_tree_output_has_the_targets_distribution(bug, monkeypatch):
    """Chi-square of the joint of 4 new tokens (3 drawn in the tree, at depths 0..2) against the exact
    processed distribution (repetition penalty 3: each node's own path changes its distribution); the
    two planted bugs must be rejected by the same test."""
    target = tiny_target(peaked=True, seed=4)
    prompt = [3, 17, 42, 8, 61]
    joint, reach = _exact_joint(target, prompt)
    if bug == "node_processed_with_the_anchors_prefix":
        patch_called(monkeypatch, draft_trees, "_walk_by_depth", _wrong_prefix_walk)
    elif bug == "q_ratio_on_top_k_children":
        patch_called(monkeypatch, draft_trees, "_walk_by_depth", _q_ratio_walk)
    consulted = []

    def fake(draft, embed, head, anchor, ctx, draft_cache, draft_valid, start, b, mask_token_id, **kw):
        consulted.append(1)
        logits = torch.zeros(anchor.shape[0], b - 1, VOCAB)
        for j in range(b - 1):
            logits[:, j, sorted(reach[j + 1]) if j + 1 < N_NEW else []] = 10.0
        return logits

    patch_called(monkeypatch, proposers, "_draft_logits", fake)
    draft = tiny_draft(block_size=4)
    counts = {}
    gen = torch.Generator().manual_seed(0)
    ids = torch.tensor([prompt] * ROWS)
    for _ in range(CALLS):
        out = draft.spec_generate(target, ids, max_new_tokens=N_NEW, do_sample=True, temperature=1.0, top_k=TOP_K,
                                  repetition_penalty=PENALTY, tree_budget=40, generator=gen,
                                  return_dict_in_generate=True)
        for row in out.sequences[:, len(prompt):].tolist():
            counts[tuple(row)] = counts.get(tuple(row), 0) + 1
        assert max(out.acceptance_lengths) >= 3  # the walk went two nodes deep
    assert consulted
    n = ROWS * CALLS
    impossible = set(counts) - set(joint)  # continuations the target cannot produce
    cells = sorted(joint, key=joint.get, reverse=True)
    big = [c for c in cells if joint[c] * n >= 5]
    stat = sum((counts.get(c, 0) - n * joint[c]) ** 2 / (n * joint[c]) for c in big)
    rest = sum(joint[c] for c in cells if c not in big)
    if rest * n >= 5:
        rest_count = sum(counts.get(c, 0) for c in cells if c not in big)
        stat += (rest_count - n * rest) ** 2 / (n * rest)
    df = len(big) - (0 if rest * n >= 5 else 1)
    crit = _chi2_crit(df)
    if bug is None:
        assert not impossible and stat < crit, (impossible, stat, crit, df)
    else:
        assert impossible or stat > crit, (stat, crit, df)


def _chi2_crit(df, p=1e-3):
    """Upper ``p`` quantile of chi-square with ``df`` degrees of freedom (Wilson-Hilferty)."""
    z = 3.090232  # standard normal quantile at 1 - 1e-3
    return df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3


# ----------------------------------------------------------------------------- refusals and routes


def test_refusals_name_tree_budget():
    draft, target = tiny_draft(), tiny_target()
    ids = torch.tensor([[1, 2, 3]])
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="tree_budget"):
            draft.spec_generate(target, ids, tree_budget=bad)
    with pytest.raises(ValueError, match="tree_budget.*adaptive"):
        draft.spec_generate(target, ids, tree_budget=4, adaptive_block_size=True)

    class Mine(transformers.LogitsProcessor):
        def __call__(self, input_ids, scores):
            return scores

    with pytest.raises(ValueError, match="tree_budget.*Mine"):
        draft.spec_generate(target, ids, tree_budget=4, logits_processor=transformers.LogitsProcessorList([Mine()]))


@pytest.mark.skipif(not hasattr(transformers, "Qwen3_5ForCausalLM"),
                    reason="hybrid targets run from transformers 5.x on (4.57 refuses them whatever the tree)")
def test_hybrid_target_refused_with_trees():
    from test_hybrid import hybrid_draft, tiny_hybrid
    target, calls = tiny_hybrid("qwen3_5"), []
    target.register_forward_hook(lambda *a: calls.append(1))
    with pytest.raises(ValueError, match="tree_budget=4 .*hybrid linear-attention"):
        hybrid_draft().spec_generate(target, torch.tensor([[1, 2, 3]]), tree_budget=4)
    assert not calls  # refused before any forward


def test_static_cache_runs_the_dynamic_tree_loop(caplog):
    draft, target = tiny_draft(), tiny_target(peaked=True)
    ids = PROMPTS[11]
    ref = _generate(target, ids, 12)
    with caplog.at_level("INFO"):
        out = draft.spec_generate(target, ids, max_new_tokens=12, temperature=0.0, tree_budget=6,
                                  cache_implementation="static")
    assert torch.equal(out, ref)
    assert any("tree" in r.getMessage() for r in caplog.records)


def test_tree_budget_through_custom_generate_and_pipelines():
    """The shipped pair: ``target.generate(custom_generate=<drafter folder>, tree_budget=...)`` and a
    text-generation pipeline run trees (a budget of 1 drafts depth 1, the chain 15; a budget of 0 is
    refused, so the argument reached spec_generate) and give generate's own output."""
    from test_entry_points import PAIR, prompts
    draft, target, tok = _load_pair(PAIR)  # the shipped pair, loaded as users load it
    enc = tok(prompts(1)[0], return_tensors="pt", add_special_tokens=False)
    route = dict(custom_generate=str(PAIR / "drafter"), trust_remote_code=True, assistant_model=draft)
    ref = target.generate(**enc, max_new_tokens=24, do_sample=False)
    out = target.generate(**enc, max_new_tokens=24, do_sample=False, tree_budget=1, return_dict_in_generate=True,
                          **route)
    assert torch.equal(out.sequences, ref)
    assert {d for row in out.row_draft_lengths for d in row[:-1]} == {1}
    with pytest.raises(ValueError, match="tree_budget"):
        target.generate(**enc, max_new_tokens=4, do_sample=False, tree_budget=0, **route)
    pipe = transformers.pipeline("text-generation", model=target, tokenizer=tok)
    text = prompts(2)[1]
    assert pipe(text, max_new_tokens=24, do_sample=False, tree_budget=6, **route) == \
        pipe(text, max_new_tokens=24, do_sample=False)


def _load_pair(pair_dir):
    draft = transformers.AutoModel.from_pretrained(pair_dir / "drafter", trust_remote_code=True,
                                                   dtype=torch.float32).eval()
    target = transformers.AutoModelForCausalLM.from_pretrained(pair_dir / "target", dtype=torch.float32).eval()
    return draft, target, transformers.AutoTokenizer.from_pretrained(pair_dir / "target")


def test_prefix_processors_and_scores_with_trees(monkeypatch):
    """Greedy under a repetition penalty (each node processed with its own path: the depth-by-depth walk)
    equals generate, and ``output_scores`` are generate's processed scores of every committed token."""
    target = tiny_target(peaked=True)
    prompt = PROMPTS[11]
    ref = target.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=NEW,
                          repetition_penalty=1.5, output_scores=True, return_dict_in_generate=True)
    steps = install_oracle(monkeypatch, [ref.sequences])
    out = tiny_draft(block_size=BLOCK).spec_generate(target, prompt, max_new_tokens=NEW, temperature=0.0,
                                                     block_size=BLOCK, tree_budget=32, repetition_penalty=1.5,
                                                     output_scores=True, return_dict_in_generate=True)
    assert steps and torch.equal(out.sequences, ref.sequences)
    assert max(out.acceptance_lengths) == BLOCK
    assert len(out.scores) == NEW
    for mine, theirs in zip(out.scores, ref.scores):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)


def test_sampled_walk_with_top_k_1_is_greedy_in_a_ragged_batch(monkeypatch):
    """Sampling with ``top_k=1`` draws the target's argmax at every visited node: the sampled walk (no
    prefix processors) must reproduce greedy generate in a ragged batch, with trees accepted deep."""
    target = tiny_target(peaked=True)
    prompts = [PROMPTS[n] for n in LENS]
    refs = [_generate(target, p, NEW) for p in prompts]
    ids, mask = _left_pad(prompts)
    steps = install_oracle(monkeypatch, refs)
    out = tiny_draft(block_size=BLOCK).spec_generate(target, ids, attention_mask=mask, max_new_tokens=NEW,
                                                     do_sample=True, top_k=1, block_size=BLOCK, tree_budget=32,
                                                     generator=torch.Generator().manual_seed(0),
                                                     return_dict_in_generate=True)
    assert steps
    for r, p in enumerate(prompts):
        assert torch.equal(out.sequences[r, ids.shape[1]:], refs[r][0, p.shape[1]:]), r
    assert max(max(x) for x in out.row_acceptance_lengths) == BLOCK
