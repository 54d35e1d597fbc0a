"""DFlash 2 drafters in the decode loop (issue 21, generation half): the candidate-selector walk drafts
every block of ``spec_generate``, the ``custom_generate`` route and pipelines.

Greedy: oracle drafts enter THROUGH the selector. Each step, the oracle sets the unary logits of every
mask slot so that their argmax is a decoy (the oracle token + 1, always wrong) with the oracle token
second, and programs the selector (hidden projection, predecessor and successor codebooks) so that
the bilinear term adds a bonus to the oracle token only when the walk's previous token is the oracle's
previous token (the anchor at slot 0). A draft is therefore accepted only if the loop ran the walk and
threaded its chosen predecessors: without the selector every draft is the decoy, and
``max(acceptance) == block`` proves the walk was consulted. Targets: a dense Qwen3, a sliding-window
Mistral, a hybrid Qwen3.5 and a ``MuseGlimmerForConditionalGeneration`` (5.24).

Sampling: a chi-square test of the first generated tokens against the target's exact distribution,
with a selector whose bilinear term changes the walked path (asserted), rejecting two planted bugs.
"""

import logging

import pytest
import torch
import transformers

import dflash2
import generation_utils
import proposers
from family_targets import family_target
from test_families import _left_pad as left_pad
from modeling_dflash import DFlash2DraftModel, DFlashDraftModel
from patching import patch_called
from tiny import HIDDEN, MASK_ID, VOCAB, peak, tiny_draft_config, tiny_target

IS_5 = int(transformers.__version__.split(".")[0]) >= 5
LENS = (3, 11, 20)
NEW = 25
PROMPTS = {n: torch.randint(0, 90, (1, n), generator=torch.Generator().manual_seed(200 + n)) for n in LENS}
DFLASH2 = dict(conv_kernel_size=2, conv_group_size=8, selector_rank=HIDDEN, selector_top_k=4)


@torch.no_grad()
def dflash2_draft(seed=1, **overrides) -> DFlash2DraftModel:
    """A tiny DFlash 2 drafter with random (non-identity) convolutions and selector, fp32, eval."""
    torch.manual_seed(seed)
    model = DFlash2DraftModel(tiny_draft_config(**{**DFLASH2, "block_size": 4, **overrides})).eval()
    gen = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if "_conv." in name or name.startswith("candidate_selector."):
            param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
    return model


def loaded(draft, tmp_path, remote=False):
    """``draft`` saved and loaded back: through ``DFlashDraftModel.from_pretrained`` (this repository's
    modules, which the oracle patches), or ``AutoModel`` + ``trust_remote_code`` (the folder's copies)."""
    draft.save_pretrained(tmp_path / "drafter")
    if remote:
        model = transformers.AutoModel.from_pretrained(tmp_path / "drafter", trust_remote_code=True,
                                                       dtype=torch.float32)
    else:
        model = DFlashDraftModel.from_pretrained(str(tmp_path / "drafter"), dtype=torch.float32)
    assert type(model).__name__ == "DFlash2DraftModel"
    return model.eval()


def generate(target, ids, n, **kwargs):
    return target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n, **kwargs)


# ----------------------------------------------------------------------------- the oracle, through the selector

DECOY, ORACLE, BONUS = 10.0, 8.0, 5.0  # unary logits of the decoy and the oracle token; the bilinear bonus


@torch.no_grad()
def program_selector(selector, slot_hidden, expected_prev, expected_next):
    """Set ``selector`` so that slot ``(i, j)`` of this block scores ``+BONUS`` for candidate
    ``expected_next[i, j]`` exactly when the walk's previous token is ``expected_prev[i, j]``
    (``expected_next = -1``: no bonus). ``slot_hidden`` ``(A, n, H)`` are the real draft states: the
    hidden projection maps state ``(i, j)`` to the unit vector ``e_{i n + j}`` (least squares; checked),
    the predecessor codebook puts 1 at ``[expected_prev, i n + j]``, the successor codebook ``BONUS`` at
    ``[expected_next, i n + j]``: score = unary + sum_r A[prev, r] (P h)_r B[c, r]."""
    a, n, h = slot_hidden.shape
    rank = selector.hidden_projection.weight.shape[0]
    assert a * n <= min(rank, h), "the oracle needs one selector rank per slot of the block"
    states = slot_hidden.reshape(a * n, h).double()  # (m, H)
    projection = torch.zeros(rank, h, dtype=torch.float64)
    projection[: a * n] = torch.linalg.pinv(states.T)  # (m, H): projection @ states.T = I_m
    assert torch.allclose(projection[: a * n] @ states.T, torch.eye(a * n, dtype=torch.float64), atol=1e-3), \
        "draft states of this block are not independent"
    predecessor = torch.zeros(VOCAB, rank)
    successor = torch.zeros(VOCAB, rank)
    index = torch.arange(a * n)
    predecessor[expected_prev.reshape(-1), index] = 1.0
    wanted = expected_next.reshape(-1)
    successor[wanted.clamp_min(0)[wanted >= 0], index[wanted >= 0]] = BONUS
    selector.hidden_projection.weight.copy_(projection.float())
    selector.predecessor_codebook.copy_(predecessor)
    selector.successor_codebook.copy_(successor)


def install_oracle(monkeypatch, refs, pattern=lambda step, row, n: (n, 1, 0)[(step + row) % 3], inspect=None):
    """Oracle for rows following ``refs`` (one ``(1, L)`` reference each): at step ``s`` row ``r`` gets
    the bonus on its first ``pattern(s, r, n)`` slots (all / 1 / 0 by default: blocks fully, partly and
    never accepted, rows of a batch accepting different counts); ``inspect(logits, slot_hidden)`` sees
    what the loop's draft pass returned. Returns the list of steps seen."""
    real, steps = proposers._draft_logits, []

    def fake(draft, embed, head, anchor, ctx, draft_cache, draft_valid, start, b, mask_token_id, slot_states=False):
        assert slot_states, "a DFlash 2 drafter must be asked for its slot states"
        logits, slot_hidden = real(draft, embed, head, anchor, ctx, draft_cache, draft_valid, start, b, mask_token_id,
                                   slot_states=True)
        if inspect is not None:
            inspect(logits, slot_hidden)
        n = b - 1
        unary = torch.zeros_like(logits)
        prev, nxt = [], []
        for i, (s, a) in enumerate(zip(start.tolist(), anchor[:, 0].tolist())):
            r = next(r for r, ref in enumerate(refs) if ref.shape[1] > s and ref[0, s] == a)
            want = torch.cat([refs[r][0, s + 1: s + b], torch.zeros(b, dtype=torch.long)])[:n]
            unary[i, torch.arange(n), want] = ORACLE
            unary[i, torch.arange(n), (want + 1) % VOCAB] = DECOY
            prev.append(torch.cat([torch.tensor([a]), want[:-1]]))
            bonus = want.clone()
            bonus[pattern(len(steps), r, n):] = -1
            nxt.append(bonus)
        program_selector(draft.candidate_selector, slot_hidden, torch.stack(prev), torch.stack(nxt))
        steps.append(start.tolist())
        return unary, slot_hidden

    patch_called(monkeypatch, proposers, "_draft_logits", fake)
    return steps


def assert_greedy_batch_1_and_ragged(draft, target, monkeypatch, lens=LENS, new=NEW, inspect=None, adaptive=None):
    """spec_generate greedy == target.generate at batch 1 (drafts fully, partly, never accepted) and in a
    ragged left-padded batch (rows accepting different counts), drafts from the selector only.
    ``adaptive=False`` (fixed blocks): every step drafts the whole block, so the oracle's pattern shows in the
    acceptance lengths. The default (``None``, the policy on this device's modelled cost) cuts blocks and runs
    plain steps where its estimate says drafting does not pay: the output is still ``generate``'s, and the
    oracle is consulted (the first step drafts), but which acceptance lengths occur depends on the cost."""
    prompts = [PROMPTS[n] for n in lens]
    refs = [generate(target, p, new) for p in prompts]
    assert len({tuple(r[0, -new:].tolist()) for r in refs}) == len(refs)  # not a degenerate target
    steps = install_oracle(monkeypatch, refs, inspect=inspect)
    block = draft.config.block_size
    for r, p in enumerate(prompts):
        consulted = len(steps)
        out = draft.spec_generate(target, p, max_new_tokens=new, temperature=0.0, return_dict_in_generate=True,
                                  adaptive_block_size=adaptive)
        assert torch.equal(out.sequences, refs[r]), ("batch 1", r)
        assert len(steps) > consulted, "the oracle was never consulted"
        if adaptive is False:  # block: the walk was consulted
            assert {1, 2, block} <= set(out.acceptance_lengths), out.acceptance_lengths
    ids, mask = left_pad(prompts)
    steps.clear()
    out = draft.spec_generate(target, ids, attention_mask=mask, max_new_tokens=new, temperature=0.0,
                              return_dict_in_generate=True, adaptive_block_size=adaptive)
    assert steps, "the oracle was never consulted"
    for r, p in enumerate(prompts):
        assert torch.equal(out.sequences[r, ids.shape[1]:], refs[r][0, p.shape[1]:]), ("ragged row", r)
    rows = out.row_acceptance_lengths
    if adaptive is False:
        assert rows[0] != rows[1] != rows[2] and max(max(x) for x in rows) == block


# the policy's default (exact whatever it verifies) and fixed blocks (the oracle's accept pattern in every step)
POLICIES = pytest.mark.parametrize("adaptive", [None, False], ids=["default", "fixed"])


# ----------------------------------------------------------------------------- greedy, per target family


@POLICIES
def test_dense_qwen3_greedy_equals_generate_through_the_selector(adaptive, monkeypatch, tmp_path):
    """Planted bugs caught: the loop drafting the per-slot unary argmax (no walk: every draft is the
    decoy, no block fully accepted); the walk's predecessor left at the anchor (slot 1+ lose the bonus)."""
    target = tiny_target(peaked=True)
    assert_greedy_batch_1_and_ragged(loaded(dflash2_draft(), tmp_path), target, monkeypatch, adaptive=adaptive)


@POLICIES
def test_sliding_window_mistral_greedy_equals_generate_through_the_selector(adaptive, monkeypatch):
    assert_greedy_batch_1_and_ragged(dflash2_draft(), family_target("mistral"), monkeypatch, adaptive=adaptive)


needs_5 = pytest.mark.skipif(not IS_5,
                             reason="Qwen3.5 and Muse Glimmer exist in transformers 5.x only (absent in 4.57)")


@needs_5
@POLICIES
def test_hybrid_qwen3_5_greedy_equals_generate_through_the_selector(adaptive, monkeypatch):
    from test_hybrid import tiny_hybrid

    draft = dflash2_draft(num_target_layers=4, target_layer_ids=[0, 3])
    assert_greedy_batch_1_and_ragged(draft, tiny_hybrid("qwen3_5"), monkeypatch, adaptive=adaptive)


def muse_glimmer_target(seed=0):
    """A tiny peaked ``MuseGlimmerForConditionalGeneration`` (text input): sliding layers with window 6
    and a NoPE full-attention layer, a normed embedding module, logits ``cap * tanh(head(h) * mult / cap)``."""
    torch.manual_seed(seed)
    text = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=72, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=10, max_position_embeddings=512, sliding_window=6,
                eos_token_id=None, bos_token_id=None, pad_token_id=None)
    vision = dict(hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2, patch_size=2,
                  pos_emb_height=4, pos_emb_width=4)
    config = transformers.MuseGlimmerConfig(text_config=text, vision_config=vision, image_token_id=90,
                                            video_token_id=91, out_hidden_size=16, projector_hidden_size=16)
    model = transformers.MuseGlimmerForConditionalGeneration(config).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    return peak(model)


@needs_5
@POLICIES
def test_muse_glimmer_greedy_equals_generate_through_the_selector(adaptive, monkeypatch):
    """The block embedding is the raw embedding row (not Muse's normed module output) and the draft
    logits are ``cap * tanh(head(h) * output_multiplier / cap)`` from the drafter's two keys."""
    target = muse_glimmer_target()
    text = target.config.text_config
    draft = dflash2_draft(num_target_layers=4, target_layer_ids=[0, 3], output_multiplier=text.output_multiplier,
                          final_logit_softcapping=text.final_logit_softcapping)
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    seen = []

    def check_inputs(module, args, kwargs):
        block = kwargs["noise_embedding"][:, 1:]  # the MASK rows of [anchor, MASK x (b - 1)]
        ids = torch.full(block.shape[:2], MASK_ID)
        raw = torch.nn.functional.embedding(ids, embed.weight)
        assert torch.equal(block, raw) and not torch.allclose(raw, embed(ids))
        seen.append(1)

    def check_logits(logits, slot_hidden):
        cap, mult = text.final_logit_softcapping, text.output_multiplier
        torch.testing.assert_close(logits, cap * torch.tanh(head(slot_hidden) * mult / cap), rtol=0, atol=1e-5)
        seen.append(2)

    draft.register_forward_pre_hook(check_inputs, with_kwargs=True)
    assert_greedy_batch_1_and_ragged(draft, target, monkeypatch, inspect=check_logits, adaptive=adaptive)
    assert {1, 2} <= set(seen)


# ----------------------------------------------------------------------------- exact sampling

SAMPLE_VOCAB, SAMPLE_ROWS = 8, 12000


@torch.no_grad()
def sampling_pair(seed=11, head=6.0, codebooks=0.6):
    """A peaky vocab-8 target and a DFlash 2 drafter (3 mask slots, top-4 of 8, rank 8) whose walk draws
    stochastically and whose bilinear term, of the size of the unary logits, moves most slots."""
    dims = dict(hidden_size=16, intermediate_size=24, num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    target = tiny_target(seed=seed, vocab_size=SAMPLE_VOCAB, **dims)
    target.lm_head.weight.mul_(head)
    draft = dflash2_draft(seed=seed + 1, vocab_size=SAMPLE_VOCAB, mask_token_id=SAMPLE_VOCAB - 1, selector_rank=8,
                          **dims)
    selector = draft.candidate_selector
    gen = torch.Generator().manual_seed(seed)
    for param in (selector.predecessor_codebook, selector.successor_codebook):
        param.copy_(torch.randn(param.shape, generator=gen) * codebooks)
    return target, draft


def exact_drafted_pair(target, prompt, processors):
    """Exact probabilities ``(V * V,)`` of generated tokens 2 and 3 (the first two that come out of a
    verify step; token 1 is the prefill's), every prefix through the target with ``processors``."""
    vocab = target.config.vocab_size
    joint, prefixes = torch.ones(1, dtype=torch.float64), prompt
    with torch.no_grad():
        for _ in range(3):
            scores = processors(prefixes, target(prefixes).logits[:, -1].float())
            joint = (joint[:, None] * torch.softmax(scores, dim=-1).double()).reshape(-1)
            prefixes = torch.cat([prefixes.repeat_interleave(vocab, 0),
                                  torch.arange(vocab).repeat(prefixes.shape[0])[:, None]], dim=1)
    return joint.view(vocab, vocab * vocab).sum(0)


def watch_walks(monkeypatch, walk=dflash2.selector_walk):
    """Count, over every walk of the loop, the slots where the bilinear term moved the choice off the
    unary argmax (score argmax given the walk's predecessor != logits argmax). Returns [changed, slots]."""
    tally = [0, 0]

    def watched(selector, hidden, logits, anchor_ids, **options):
        drafted = walk(selector, hidden, logits, anchor_ids, **options)
        best = drafted.candidates.gather(-1, drafted.candidate_q.argmax(-1, keepdim=True))[..., 0]
        tally[0] += int((best != logits.argmax(-1)).sum())
        tally[1] += best.numel()
        return drafted

    patch_called(monkeypatch, proposers, "selector_walk", watched)
    return tally


def sampled_stat(monkeypatch, walk=dflash2.selector_walk, seed=0, pair=None, **kwargs):
    """(chi-square statistic, critical value, tally): generated tokens 2 and 3 of SAMPLE_ROWS copies of one
    prompt (one batched call, block 4: token 3 is drafted after a drafted predecessor) vs the target's
    exact distribution under the same processors and warpers (``test_sampling._chi_square``)."""
    from transformers import GenerationConfig

    from test_sampling import _chi_square

    target, draft = pair or sampling_pair()
    prompt = torch.tensor([[1, 4, 2, 5]])
    tally = watch_walks(monkeypatch, walk)
    out = draft.spec_generate(target, prompt.repeat(SAMPLE_ROWS, 1), max_new_tokens=4, do_sample=True,
                              stop_token_ids=[], generator=torch.Generator().manual_seed(seed), **kwargs)
    start = prompt.shape[1] + 1
    counts = torch.bincount(out[:, start] * SAMPLE_VOCAB + out[:, start + 1], minlength=SAMPLE_VOCAB ** 2)
    fields = {k: v for k, v in kwargs.items() if k not in ("sample_draft", "adaptive_block_size")}
    config = GenerationConfig(**{**target.generation_config.to_diff_dict(), "do_sample": True, **fields})
    processors = target._get_logits_processor(generation_config=config, input_ids_seq_length=prompt.shape[1],
                                              encoder_input_ids=prompt, prefix_allowed_tokens_fn=None,
                                              logits_processor=None)
    return (*_chi_square(counts, exact_drafted_pair(target, prompt, processors)), tally)


SAMPLING_CASES = {"temperature": dict(temperature=0.7, top_k=0),
                  "greedy_walk_one_hot_q": dict(temperature=0.7, top_k=0, sample_draft=False),
                  "warpers_and_repetition_penalty": dict(temperature=0.7, top_k=6, top_p=0.95, repetition_penalty=1.5)}


@pytest.mark.parametrize("case", list(SAMPLING_CASES))
def test_sampled_output_is_the_targets_distribution(case, monkeypatch):
    """The walk samples from softmax(score / 0.7) over its candidates, its q enters the rejection test;
    warpers act on the target only, the repetition penalty on each drafted slot too. The bilinear term
    changes the walk's choice on at least a third of the slots."""
    stat, crit, (changed, slots) = sampled_stat(monkeypatch, **SAMPLING_CASES[case])
    assert changed >= slots / 3, f"the bilinear term changed only {changed}/{slots} slots: no teeth"
    assert stat < crit, (stat, crit)


def rescored_walk(predecessor: str, temperature=None):
    """A walk with a planted bug: tokens drawn as ``selector_walk`` draws them, but q computed from the
    greedy walk's predecessors (``predecessor="greedy"``) or at another temperature."""

    def walk(selector, hidden, logits, anchor_ids, **options):
        drafted = dflash2.selector_walk(selector, hidden, logits, anchor_ids, **options)
        path = drafted.tokens
        if predecessor == "greedy":
            path = dflash2.selector_walk(selector, hidden, logits, anchor_ids).tokens
        previous = torch.cat([anchor_ids.reshape(-1, 1), path[:, :-1]], dim=1)  # (B, n)
        projected = selector.hidden_projection(hidden)
        unary = logits.gather(-1, drafted.candidates)
        scores = torch.stack([selector.score(unary[:, j], drafted.candidates[:, j], projected[:, j], previous[:, j])
                              for j in range(path.shape[1])], dim=1)  # (B, n, k)
        candidate_q = torch.softmax(scores / (temperature or options["temperature"]), dim=-1)
        q = torch.zeros_like(drafted.q).scatter_(-1, drafted.candidates, candidate_q)
        return dflash2.SelectorDraft(drafted.tokens, q, drafted.candidates, candidate_q)

    return walk


@pytest.mark.parametrize("bug", ["q_from_the_greedy_predecessor", "q_at_T1_drawing_at_T07"])
def test_negative_controls_wrong_q_is_detected(bug, monkeypatch):
    walk = rescored_walk("greedy") if bug == "q_from_the_greedy_predecessor" else rescored_walk("sampled", 1.0)
    # fixed blocks: the wrong q shows in the drafted token 3, which the policy's cut blocks may not verify
    stat, crit, _ = sampled_stat(monkeypatch, walk=walk, adaptive_block_size=False, **SAMPLING_CASES["temperature"])
    assert stat > crit, (stat, crit)


# ----------------------------------------------------------------------------- processors, batches, options


def test_prefix_dependent_processor_sees_the_walks_own_prefix_at_every_slot(monkeypatch):
    """``no_repeat_ngram_size=1`` bans every token already in the row: applied per slot with the tokens the
    walk chose before it, no drafted block repeats a token of its row (without the processor in the walk,
    blocks do), and the output is generate's. Planted bug caught: the walk without ``process``."""
    target, draft = tiny_target(peaked=True), dflash2_draft(block_size=8)
    ids, mask = left_pad([PROMPTS[3], PROMPTS[11]])
    blocks = []
    import speculative_sampling

    def watched(selector, hidden, logits, anchor_ids, **options):
        drafted = dflash2.selector_walk(selector, hidden, logits, anchor_ids, **options)
        blocks.extend(torch.cat([anchor_ids.reshape(-1, 1), drafted.tokens], dim=1).tolist())
        return drafted

    patch_called(monkeypatch, proposers, "selector_walk", watched)
    for kwargs, repeats in ((dict(), True), (dict(no_repeat_ngram_size=1), False)):
        blocks.clear()
        out = draft.spec_generate(target, ids, attention_mask=mask, max_new_tokens=12, temperature=0.0, **kwargs)
        for r, n in enumerate((3, 11)):
            ref = generate(target, PROMPTS[n], 12, **kwargs)
            assert torch.equal(out[r, ids.shape[1]:], ref[0, n:]), (kwargs, r)
        assert any(len(set(b)) < len(b) for b in blocks) == repeats, (kwargs, blocks)


def test_ragged_batch_with_processors_equals_each_row_alone(monkeypatch):
    """Greedy with a repetition penalty, n-gram blocking and bad words (per-row prefixes, applied to each
    walked slot), oracle drafts through the selector: each row of a left-padded batch == that row alone ==
    target.generate under the same processors, with blocks fully, partly and never accepted."""
    target, draft = tiny_target(peaked=True), dflash2_draft()
    options = dict(repetition_penalty=1.4, no_repeat_ngram_size=3, bad_words_ids=[[5], [7, 8]])
    refs = [generate(target, PROMPTS[n], NEW, **options) for n in LENS]
    install_oracle(monkeypatch, refs)
    ids, mask = left_pad([PROMPTS[n] for n in LENS])
    batch = draft.spec_generate(target, ids, attention_mask=mask, max_new_tokens=NEW, temperature=0.0,
                                return_dict_in_generate=True, **options)
    for r, n in enumerate(LENS):
        alone = draft.spec_generate(target, PROMPTS[n], max_new_tokens=NEW, temperature=0.0, **options)
        assert torch.equal(batch.sequences[r, ids.shape[1]:], alone[0, n:]), r
        assert torch.equal(alone, refs[r]), r
    rows = batch.row_acceptance_lengths
    assert rows[0] != rows[1] != rows[2] and {1, 2, draft.config.block_size} <= set(batch.acceptance_lengths), rows


def test_sampled_ragged_batch_row_equals_the_row_alone_when_the_target_is_certain():
    """Sampling with ``top_k=1`` on the target (generate's tokens whatever the draws) through a sampled walk:
    a ragged batch, each row alone and generate agree."""
    target, draft = tiny_target(peaked=True), dflash2_draft()
    ids, mask = left_pad([PROMPTS[n] for n in LENS])
    options = dict(do_sample=True, top_k=1, temperature=0.7, max_new_tokens=NEW)
    batch = draft.spec_generate(target, ids, attention_mask=mask, generator=torch.Generator().manual_seed(0), **options)
    for r, n in enumerate(LENS):
        ref = generate(target, PROMPTS[n], NEW)
        assert torch.equal(batch[r, ids.shape[1]:], ref[0, n:]), r


def test_streaming_statistics_plot_and_static_request(caplog):
    """Streamer chunks, tau and per-slot statistics, the plot; ``cache_implementation="static"`` runs the
    dynamic loop with one info log naming DFlash 2, with the same tokens."""
    import matplotlib

    matplotlib.use("Agg")
    from transformers.generation.streamers import BaseStreamer

    class Collect(BaseStreamer):
        def __init__(self):
            self.tokens, self.ended = [], False

        def put(self, value):
            self.tokens.append(value.reshape(-1).tolist())

        def end(self):
            self.ended = True

    target, draft = tiny_target(peaked=True), dflash2_draft()
    prompt = PROMPTS[11]
    ref = generate(target, prompt, NEW)
    streamer = Collect()
    out = draft.spec_generate(target, prompt, max_new_tokens=NEW, temperature=0.0, streamer=streamer,
                              return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref) and streamer.ended
    assert streamer.tokens[0] == prompt[0].tolist() and sum(streamer.tokens[1:], []) == ref[0, 11:].tolist()
    assert sum(out.acceptance_lengths) == NEW - 1 and len(out.slot_acceptance()) == draft.config.block_size - 1
    fig = out.plot(block_size=draft.config.block_size)
    assert len(fig.axes) == 2
    with caplog.at_level(logging.INFO):
        static = draft.spec_generate(target, prompt, max_new_tokens=NEW, temperature=0.0, cache_implementation="static")
    assert torch.equal(static, ref)
    logs = [r.getMessage() for r in caplog.records if "falls back to the dynamic loop" in r.getMessage()]
    assert logs == ["cache_implementation='static' falls back to the dynamic loop: the SelectorProposer walk "
                    "(a DFlash 2 selector, a DSpark Markov head) is dynamic-only"]


# ----------------------------------------------------------------------------- generate() routes


def selector_calls(draft):
    """Counts the walks (each calls the selector's hidden projection once); a list, one entry per walk."""
    calls = []
    draft.candidate_selector.hidden_projection.register_forward_hook(lambda *args: calls.append(1))
    return calls


def test_custom_generate_and_pipeline_routes_run_the_walk(tmp_path):
    """``target.generate(custom_generate=<folder>, trust_remote_code=True, assistant_model=draft)`` and a
    text-generation pipeline with the same arguments: generate's tokens, the folder's selector walked."""
    from tiny import tiny_tokenizer

    target = tiny_target(peaked=True)
    draft = loaded(dflash2_draft(), tmp_path, remote=True)
    calls = selector_calls(draft)
    folder = str(tmp_path / "drafter")
    for n in LENS:
        ref = generate(target, PROMPTS[n], NEW)
        out = target.generate(PROMPTS[n], attention_mask=torch.ones_like(PROMPTS[n]), do_sample=False,
                              max_new_tokens=NEW, custom_generate=folder, trust_remote_code=True, assistant_model=draft)
        assert torch.equal(out, ref), n
    assert calls, "custom_generate never walked the selector"
    tok = tiny_tokenizer()
    pipe = transformers.pipeline("text-generation", model=target, tokenizer=tok)
    text = " ".join(f"w{i}" for i in PROMPTS[11][0].tolist())
    plain = pipe(text, max_new_tokens=NEW, do_sample=False)
    calls.clear()
    fast = pipe(text, max_new_tokens=NEW, do_sample=False, custom_generate=folder, trust_remote_code=True,
                assistant_model=draft)
    assert fast == plain and calls, "the pipeline never walked the selector"


@pytest.mark.skipif(not IS_5, reason="transformers' native DFlash loop (speculation_type='dflash') exists from 5.x")
def test_native_route_runs_the_backbone_with_one_warning_naming_the_selector_routes(caplog):
    from modeling_dflash import native_dflash_available

    if not native_dflash_available():
        pytest.skip("this transformers 5.x has no native DFlash candidate generator")
    target, draft = tiny_target(peaked=True), dflash2_draft()
    calls = selector_calls(draft)
    ref = generate(target, PROMPTS[11], NEW)
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            out = target.generate(PROMPTS[11], attention_mask=torch.ones_like(PROMPTS[11]), do_sample=False,
                                  max_new_tokens=NEW, assistant_model=draft, speculation_type="dflash")
            assert torch.equal(out, ref)
    warned = [r.getMessage() for r in caplog.records if "without its candidate selector" in r.getMessage()]
    assert len(warned) == 1 and "spec_generate" in warned[0] and "custom_generate=" in warned[0]
    assert not calls  # the native loop drafts from the logits alone


def _parity_cases():
    from test_generate_parity import CASES

    return list(CASES)


@pytest.mark.parametrize("case", _parity_cases())
def test_every_generate_argument_of_the_dflash1_parity_suite(case, monkeypatch):
    """test_generate_parity's cases (processors, lengths, eos lists, bad words, sequence bias,
    ``prefix_allowed_tokens_fn``, a user processor, ...) with a DFlash 2 drafter in a ragged batch, oracle
    drafts through the selector: generate's tokens, and its scores and logits while a row is running."""
    from test_generate_parity import CASES, PROMPTS as PARITY_PROMPTS, TARGET, _left_pad

    ids, mask = _left_pad(PARITY_PROMPTS)
    kwargs = dict(CASES[case], max_new_tokens=20, pad_token_id=0, do_sample=False)
    ref = TARGET.generate(ids, attention_mask=mask, return_dict_in_generate=True, output_scores=True,
                          output_logits=True, **kwargs)
    pads = (mask.shape[1] - mask.sum(1)).tolist()
    steps = install_oracle(monkeypatch, [ref.sequences[r:r + 1, p:] for r, p in enumerate(pads)])
    out = dflash2_draft(block_size=6).spec_generate(TARGET, ids, attention_mask=mask, return_dict_in_generate=True,
                                                    output_scores=True, output_logits=True, **kwargs)
    assert steps and torch.equal(out.sequences, ref.sequences), case
    assert max(out.acceptance_lengths) > 1, "no draft accepted: the oracle did not reach the walk"
    for name in ("scores", "logits"):  # NaN after a row's last token (stopping_criteria._Scores); generate's pads
        got, want = torch.stack(getattr(out, name)), torch.stack(getattr(ref, name))
        kept = ~got.isnan().all(-1)
        assert kept.any(0).all() and torch.equal(kept, ~got.isnan().any(-1))
        torch.testing.assert_close(got[kept], want[kept], rtol=1e-4, atol=1e-4)


def test_stateful_user_processor_drafts_through_copies_in_the_walk(monkeypatch):
    """A grammar processor in xgrammar's call pattern (``test_user_calls.GrammarProcessor``: advanced by each
    call's last token, raising when called out of order) with a DFlash 2 drafter: the walk scores drafted
    slots with this step's draft-side copies, the original sees committed tokens once, in order, and the
    output is generate's with the same processor, batch 1 and ragged. Planted bug caught: the walk calling
    the caller's original processors (``self.procs`` instead of ``self._step_procs()``) raises
    'called out of order' at the first walked slot."""
    from transformers import LogitsProcessorList
    from test_user_calls import GrammarProcessor, _follows_grammar

    target, draft = tiny_target(peaked=True), dflash2_draft()
    walks = watch_walks(monkeypatch)
    ids, mask = left_pad([PROMPTS[3], PROMPTS[11]])
    ref = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=16, pad_token_id=0,
                          logits_processor=LogitsProcessorList([GrammarProcessor()]))
    out = draft.spec_generate(target, ids, attention_mask=mask, max_new_tokens=16, temperature=0.0, pad_token_id=0,
                              logits_processor=LogitsProcessorList([GrammarProcessor()]))
    assert torch.equal(out, ref)
    assert all(_follows_grammar(out[r, ids.shape[1]:].tolist(), r) for r in range(2))
    assert walks[1] > 0, "the selector walk never ran"


@pytest.mark.parametrize("do_sample", [False, True], ids=["greedy", "sampled_top1"])
def test_subclassed_transformers_processors_run_through_the_walk(monkeypatch, do_sample):
    """Issue 34, item 7, DFlash 2: a caller's subclasses of prefix-free processors (``test_user_calls``) run
    through the walk like generate, ragged batch; sampled with a top-1 subclass the output is deterministic and
    equals generate's. Planted bug caught: prefix-free decided by ``isinstance`` alone raises AttributeError."""
    from transformers import LogitsProcessorList
    from test_user_calls import MySuppress, MyTopK

    target, draft = tiny_target(peaked=True), dflash2_draft()
    walks = watch_walks(monkeypatch)
    ids, mask = left_pad([PROMPTS[3], PROMPTS[11]])
    sample = dict(do_sample=True, top_k=None) if do_sample else dict(do_sample=False)

    def procs():
        return LogitsProcessorList([MySuppress([5, 17, 42]), MyTopK(1)])

    ref = target.generate(ids, attention_mask=mask, max_new_tokens=12, pad_token_id=0, logits_processor=procs(),
                          **sample)
    out = draft.spec_generate(target, ids, attention_mask=mask, max_new_tokens=12, pad_token_id=0,
                              logits_processor=procs(), generator=torch.Generator().manual_seed(0), **sample)
    assert torch.equal(out, ref)
    assert walks[1] > 0, "the selector walk never ran"
