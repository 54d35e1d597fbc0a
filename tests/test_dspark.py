"""DSpark drafters (issue 38): DeepSpec's published layout loads strictly, the Markov walk and the confidence
cut follow the formulas written here (independent of dspark.py), and what is not implemented is refused.

The layout: deepseek-ai/DeepSpec ``deepspec/modeling/dspark/qwen3/config.py`` (``build_draft_config``: the
target's Qwen3Config plus top-level keys) and ``modeling.py`` / ``markov_head.py`` / ``common.py`` (tensor
names), shrunk to vocab 97, hidden 40, 3 layers.
"""

import json
import sys

import pytest
import torch
from safetensors.torch import save_file

from configuration_dflash import DFlashConfig
from modeling_dflash import DFlashDraftModel, DSparkDraftModel

pytestmark = pytest.mark.quick  # the first-check subset (README "Run the tests")

V, H, R, LAYERS, BLOCK, MASK = 97, 40, 8, 3, 7, 96


def _config(rank=R, confidence=True, architecture="Qwen3DSparkModel"):
    """A DeepSpec config.json, by hand: a Qwen3 target config plus DeepSpec's top-level keys."""
    config = dict(architectures=[architecture], model_type="qwen3", vocab_size=V, hidden_size=H, intermediate_size=72,
                  num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2, head_dim=10,
                  hidden_act="silu", max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=1000000.0,
                  attention_bias=False, attention_dropout=0.0, tie_word_embeddings=False, use_sliding_window=False,
                  sliding_window=None, layer_types=["full_attention"] * LAYERS, torch_dtype="float32",
                  num_target_layers=4, block_size=BLOCK, mask_token_id=MASK, target_layer_ids=[0, 2],
                  num_anchors=512, markov_rank=rank, enable_confidence_head=confidence)
    if rank:
        config["markov_head_type"] = "vanilla"
    if confidence:
        config["confidence_head_with_markov"] = bool(rank)
    return config


def _tensors(rank=R, confidence=True, seed=0):
    """DeepSpec's tensor names and shapes, written out (not read from our class)."""
    g = torch.Generator().manual_seed(seed)
    shapes = {"fc.weight": (H, 2 * H), "hidden_norm.weight": (H,), "norm.weight": (H,),
              "embed_tokens.weight": (V, H), "lm_head.weight": (V, H)}
    for i in range(LAYERS):
        p = f"layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (40, H), p + "self_attn.k_proj.weight": (20, H),
                       p + "self_attn.v_proj.weight": (20, H), p + "self_attn.o_proj.weight": (H, 40),
                       p + "self_attn.q_norm.weight": (10,), p + "self_attn.k_norm.weight": (10,),
                       p + "mlp.gate_proj.weight": (72, H), p + "mlp.up_proj.weight": (72, H),
                       p + "mlp.down_proj.weight": (H, 72), p + "input_layernorm.weight": (H,),
                       p + "post_attention_layernorm.weight": (H,)})
    if rank:
        shapes.update({"markov_head.markov_w1.weight": (V, rank), "markov_head.markov_w2.weight": (V, rank)})
    if confidence:
        shapes.update({"confidence_head.proj.weight": (1, H + rank), "confidence_head.proj.bias": (1,)})
    return {k: torch.randn(s, generator=g) * 0.5 for k, s in shapes.items()}


def _folder(path, config=None, tensors=None):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config or _config()))
    save_file(tensors if tensors is not None else _tensors(), str(path / "model.safetensors"))
    return str(path)


def test_published_layout_loads_strictly_as_dspark(tmp_path):
    tensors = _tensors()
    model = DFlashDraftModel.from_pretrained(_folder(tmp_path / "d", tensors=tensors))
    assert type(model) is DSparkDraftModel
    state = model.state_dict()
    assert set(state) == set(tensors)
    assert all(torch.equal(state[k], v) for k, v in tensors.items())
    assert (model.block_size, model.mask_token_id, model.target_layer_ids) == (BLOCK, MASK, [0, 2])


def test_deepspec_dflash_baseline_is_the_same_class_without_heads(tmp_path):
    folder = _folder(tmp_path / "d", _config(rank=0, confidence=False), _tensors(rank=0, confidence=False))
    model = DFlashDraftModel.from_pretrained(folder)
    assert type(model) is DSparkDraftModel and model.markov_head is None and model.confidence_head is None
    assert model.lm_head.weight.shape == (V, H)  # its own head, not the target's


@pytest.mark.parametrize("change, named", [
    (lambda t: t.pop("markov_head.markov_w2.weight"), "markov_head.markov_w2.weight"),
    (lambda t: t.pop("lm_head.weight"), "lm_head.weight"),
    (lambda t: t.update({"markov_head.gate_proj.weight": torch.zeros(R, H + R)}), "markov_head.gate_proj.weight"),
])
def test_missing_or_unexpected_tensors_are_named(tmp_path, change, named):
    tensors = _tensors()
    change(tensors)
    with pytest.raises(ValueError, match=rf"does not match.*{named}"):
        DFlashDraftModel.from_pretrained(_folder(tmp_path / "d", tensors=tensors))


def test_misshapen_tensor_is_named(tmp_path):
    tensors = _tensors()
    tensors["confidence_head.proj.weight"] = torch.zeros(1, H)  # a head built without the Markov row
    folder = _folder(tmp_path / "d", tensors=tensors)
    with pytest.raises((ValueError, RuntimeError)):  # transformers' own refusal (5.x names it in its load report)
        DFlashDraftModel.from_pretrained(folder)
    with pytest.raises(ValueError, match=r"mismatched_keys.*confidence_head.proj.weight"):
        DFlashDraftModel.from_pretrained(folder, ignore_mismatched_sizes=True)


def test_save_pretrained_keeps_deepspec_keys_and_adds_auto_map(tmp_path):
    model = DFlashDraftModel.from_pretrained(_folder(tmp_path / "d"))
    model.save_pretrained(tmp_path / "out")
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert saved["architectures"] == ["Qwen3DSparkModel"]
    for key, value in _config().items():
        if key in ("num_anchors", "markov_rank", "markov_head_type", "enable_confidence_head",
                   "confidence_head_with_markov", "block_size", "mask_token_id", "target_layer_ids"):
            assert saved[key] == value, key
    assert saved["auto_map"]["AutoModel"] == "modeling_dflash.DSparkDraftModel"
    assert "dflash_config" not in saved
    again = DFlashDraftModel.from_pretrained(str(tmp_path / "out"))
    assert type(again) is DSparkDraftModel
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), model.state_dict().values()))


def test_gemma4_dspark_and_unimplemented_heads_are_refused_by_name(tmp_path):
    folder = _folder(tmp_path / "g", _config(architecture="Gemma4DSparkModel"))
    with pytest.raises(ValueError, match=r"'Gemma4DSparkModel'.*not implemented"):
        DFlashDraftModel.from_pretrained(folder)
    with pytest.raises(ValueError, match=r"markov_head_type='gated' is not implemented"):
        DFlashConfig(**dict(_config(), markov_head_type="gated"))
    with pytest.raises(ValueError, match="DSparkDraftModel"):
        DFlashDraftModel(DFlashConfig(**_config()))


def _model(tmp_path, **kw):
    return DFlashDraftModel.from_pretrained(_folder(tmp_path / "d", _config(**kw), _tensors(**kw))).eval()


@torch.no_grad()
def test_markov_walk_and_confidence_equal_the_formula(tmp_path):
    """Slot k: ``lm_head h_k + W2 W1[x_{k-1}]`` with ``x_{-1}`` the anchor and ``x_{k-1}`` the token drawn
    at slot k - 1 (greedy here); confidence ``proj([h_k, W1[x_{k-1}]])``. Every slot is drafted."""
    model = _model(tmp_path)
    with torch.no_grad():
        model.markov_head.markov_w2.weight.mul_(6.0)  # large enough to change tokens
    torch.manual_seed(1)
    hidden = torch.randn(2, BLOCK, H)
    anchor = torch.tensor([5, 60])
    draft = model.propose(hidden, anchor)
    w1, w2 = model.markov_head.markov_w1.weight, model.markov_head.markov_w2.weight
    head, proj = model.lm_head.weight, model.confidence_head.proj
    changed = 0
    for row in range(2):
        prev = int(anchor[row])
        for k in range(BLOCK):
            base = hidden[row, k] @ head.T
            logits = base + w2 @ w1[prev]
            conf = proj.weight[0] @ torch.cat([hidden[row, k], w1[prev]]) + proj.bias[0]
            assert torch.allclose(draft.logits[row, k], logits, atol=1e-5)
            assert torch.allclose(draft.confidence[row, k], conf, atol=1e-5)
            assert int(draft.tokens[row, k]) == int(logits.argmax())
            changed += int(logits.argmax() != base.argmax())
            prev = int(logits.argmax())
    assert draft.tokens.shape == (2, BLOCK)
    assert changed >= 3  # the correction matters in this test


@torch.no_grad()
def test_sampled_walk_conditions_each_slot_on_the_drawn_token(tmp_path):
    model = _model(tmp_path)
    hidden = torch.randn(1, BLOCK, H)
    draft = model.propose(hidden, torch.tensor([3]), do_sample=True, temperature=0.7,
                          generator=torch.Generator().manual_seed(0))
    w1, w2, head = model.markov_head.markov_w1.weight, model.markov_head.markov_w2.weight, model.lm_head.weight
    prev = torch.cat([torch.tensor([3]), draft.tokens[0, :-1]])
    want = hidden[0] @ head.T + w1[prev] @ w2.T
    assert torch.allclose(draft.logits[0], want, atol=1e-5)


@torch.no_grad()
def test_baseline_walk_is_plain_argmax_of_its_own_head(tmp_path):
    model = _model(tmp_path, rank=0, confidence=False)
    hidden = torch.randn(1, BLOCK, H)
    draft = model.propose(hidden, torch.tensor([3]))
    assert torch.equal(draft.tokens[0], (hidden[0] @ model.lm_head.weight.T).argmax(-1))
    assert draft.confidence is None


def test_confident_length_is_the_first_slot_under_the_threshold():
    from dspark import confident_length

    logits = torch.logit(torch.tensor([[0.9, 0.8, 0.4, 0.9, 0.1, 0.9, 0.9],
                                       [0.9, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9],
                                       [0.2, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9]]))
    for t in (0.0, 0.3, 0.5, 0.85, 0.95):
        want = []
        for row in torch.sigmoid(logits).tolist():
            below = [k for k, p in enumerate(row) if p < t] if t > 0 else []
            want.append(below[0] if below else len(row))
        assert confident_length(logits, t).tolist() == want, t


@torch.no_grad()
def _oracle_draft(tmp_path, target, prompt, n, **gen):
    """A DSpark drafter whose drafts come only from its Markov head: ``lm_head`` zero, rank V, ``W1 = I`` and
    ``W2[next, prev] = 50`` for the bigrams of the target's own greedy continuation (first occurrence wins;
    ``gen``: generate's processors, applied to that continuation too)."""
    greedy = target.generate(prompt, max_new_tokens=n, do_sample=False, **gen)[0].tolist()
    tensors = _tensors(rank=V, confidence=False)
    tensors["lm_head.weight"].zero_()
    tensors["markov_head.markov_w1.weight"] = torch.eye(V)
    w2 = torch.zeros(V, V)
    seen = set()
    for prev, nxt in zip(greedy[prompt.shape[1] - 1:], greedy[prompt.shape[1]:]):
        if prev not in seen:
            seen.add(prev)
            w2[nxt, prev] = 50.0
    tensors["markov_head.markov_w2.weight"] = w2
    folder = _folder(tmp_path / "oracle", _config(rank=V, confidence=False), tensors)
    return DFlashDraftModel.from_pretrained(folder).eval(), greedy


def test_greedy_equals_generate_with_drafts_from_the_markov_head(tmp_path):
    from tiny import tiny_target

    target = tiny_target(layers=4)
    prompt = torch.tensor([[3, 14, 15, 92, 65]])
    draft, greedy = _oracle_draft(tmp_path, target, prompt, 24)
    out = draft.spec_generate(target, prompt, max_new_tokens=24, do_sample=False, return_dict_in_generate=True)
    assert out.sequences[0].tolist() == greedy
    assert max(out.row_draft_lengths[0]) == BLOCK  # a block of 7 slots drafts 7 tokens (verifies 8)
    assert sum(out.row_accepted_drafts[0]) >= 8  # the oracle was consulted, and accepted past slot 0
    assert max(out.acceptance_lengths) > 2


def test_processors_that_read_the_prefix_apply_to_the_markov_walk_as_in_generate(tmp_path):
    """repetition_penalty and no_repeat_ngram_size read every committed token: with DSpark drafts (the oracle
    of the processed continuation) the output is generate's with the same processors, drafts accepted.
    Planted: the processors left out of the verify (the unprocessed continuation differs, asserted)."""
    from tiny import tiny_target

    target = tiny_target(layers=4)
    prompt = torch.tensor([[3, 14, 15, 92, 65]])
    gen = dict(repetition_penalty=1.5, no_repeat_ngram_size=2)
    draft, expected = _oracle_draft(tmp_path, target, prompt, 24, **gen)
    assert expected != target.generate(prompt, max_new_tokens=24, do_sample=False)[0].tolist()
    out = draft.spec_generate(target, prompt, max_new_tokens=24, do_sample=False, return_dict_in_generate=True, **gen)
    assert out.sequences[0].tolist() == expected
    assert sum(out.row_accepted_drafts[0]) >= 8


class _NextAfterLast:
    """A caller's processor that reads the prefix: only ``last token + 1`` stays (all else -inf)."""

    def __call__(self, input_ids, scores):
        keep = (input_ids[:, -1:] + 1) % scores.shape[-1]
        return torch.full_like(scores, float("-inf")).scatter(1, keep, scores.gather(1, keep))


@pytest.mark.parametrize("do_sample", [False, True])
def test_a_prefix_reading_processor_sees_the_slots_walked_before(tmp_path, do_sample):
    """Every slot of the walk is processed after the row's prefix and the slots walked before it, as the verify
    processes them: the drafts are then exactly the target's processed tokens, every block accepted whole.
    Planted bug caught: slots processed without the prefix (the drafts follow the raw Markov walk)."""
    from transformers import LogitsProcessorList

    from tiny import tiny_target

    target = tiny_target(layers=4)
    prompt = torch.tensor([[3, 14, 15, 92, 65]])
    draft, _ = _oracle_draft(tmp_path, target, prompt, 24)
    procs = LogitsProcessorList([_NextAfterLast()])
    out = draft.spec_generate(target, prompt, max_new_tokens=17, do_sample=do_sample, logits_processor=procs,
                              generator=torch.Generator().manual_seed(0), return_dict_in_generate=True)
    assert out.sequences[0, 5:].tolist() == [(65 + k) % V for k in range(1, 18)]
    assert out.row_acceptance_lengths[0][:2] == [BLOCK + 1, BLOCK + 1]  # 1 + 2 x 8 = 17 tokens


def test_tree_budget_is_refused_by_name_with_dspark(tmp_path):
    from tiny import tiny_target

    draft = _model(tmp_path)
    with pytest.raises(ValueError, match="tree_budget=4 is not implemented for a DSpark drafter"):
        draft.spec_generate(tiny_target(layers=4), torch.tensor([[3, 4, 5]]), max_new_tokens=4, tree_budget=4)


@pytest.mark.parametrize("threshold, p_slot0, p_rest, length", [(0.0, 0.1, 0.1, BLOCK), (0.5, 0.9, 0.9, BLOCK),
                                                                  (0.5, 0.1, 0.9, 0), (0.5, 0.9, 0.1, 1)])
def test_confidence_threshold_cuts_each_block_at_the_first_slot_under_it(tmp_path, threshold, p_slot0, p_rest, length):
    """The head's logit is ``proj([h_k, W1[x_{k-1}]])``: zero on ``h``, and on the Markov row (``W1 = I``) the
    logit of ``p_slot0`` for the anchor's token and of ``p_rest`` for every other token, so the proposed
    length is (DeepSpec ``_confident_prefix_length``): ``BLOCK`` when nothing is under the threshold, 0 when slot
    0 is, 1 when only later slots are (the oracle's drafts never repeat the anchor in this prompt's walk)."""
    from tiny import tiny_target

    target = tiny_target(layers=4)
    prompt = torch.tensor([[3, 14, 15, 92, 65]])
    draft, greedy = _oracle_draft(tmp_path, target, prompt, 1)  # the first anchor only: its bigram drafts slot 0
    anchor = greedy[-1]
    config = _config(rank=V, confidence=True)
    tensors = dict(draft.state_dict())
    weight = torch.zeros(1, H + V)
    weight[0, H:] = torch.logit(torch.tensor(p_rest))
    weight[0, H + anchor] = torch.logit(torch.tensor(p_slot0))
    tensors.update({"confidence_head.proj.weight": weight, "confidence_head.proj.bias": torch.zeros(1)})
    draft = DFlashDraftModel.from_pretrained(_folder(tmp_path / "c", config, tensors)).eval()
    out = draft.spec_generate(target, prompt, max_new_tokens=1 + BLOCK + 1, do_sample=False,
                              return_dict_in_generate=True, confidence_threshold=threshold)
    assert out.sequences[0].tolist() == target.generate(prompt, max_new_tokens=1 + BLOCK + 1, do_sample=False)[0].tolist()
    assert out.row_draft_lengths[0][0] == length


def test_confidence_threshold_is_refused_by_name_without_a_head(tmp_path):
    from tiny import tiny_target

    draft = _model(tmp_path, rank=0, confidence=False)
    with pytest.raises(ValueError, match="confidence_threshold=0.5 needs a DSpark drafter with a confidence head"):
        draft.spec_generate(tiny_target(layers=4), torch.tensor([[3, 4, 5]]), max_new_tokens=4, confidence_threshold=0.5)


def test_ragged_batch_equals_each_row_alone(tmp_path):
    from tiny import tiny_target

    target = tiny_target(layers=4)
    draft, _ = _oracle_draft(tmp_path, target, torch.tensor([[3, 14, 15, 92, 65]]), 12)
    ids = torch.tensor([[0, 0, 3, 14, 15], [3, 14, 15, 92, 65]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    out = draft.spec_generate(target, ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                              return_dict_in_generate=True)
    for i in range(2):
        alone = target.generate(ids[i:i + 1, 5 - int(mask[i].sum()):], max_new_tokens=12, do_sample=False)
        assert out.sequences[i, -12:].tolist() == alone[0, -12:].tolist(), i
    assert sum(out.row_accepted_drafts[1]) >= 4  # row 1's oracle drafts walk from row 1's own anchor


def test_confidence_threshold_cuts_each_row_of_a_ragged_batch_at_its_own_slot(tmp_path):
    """Row 1's anchor has confidence 0.1 (cut at slot 0: no drafted position), every other token 0.9 (row 0
    keeps its block): one verify forward, each row's proposed length its own (``Proposal.lengths``), each row
    equal to ``generate`` alone. Planted bug caught: the batch cut at its shortest row (``lengths.min()``)."""
    from tiny import tiny_target

    target = tiny_target(layers=4)
    a, b = torch.tensor([[3, 14, 15, 92, 65]]), torch.tensor([[0, 0, 7, 21, 40]])
    draft, greedy = _oracle_draft(tmp_path, target, a, 12)
    anchor_b = target.generate(b[:, 2:], max_new_tokens=1, do_sample=False)[0, -1].item()
    assert anchor_b != greedy[a.shape[1]]
    weight = torch.full((1, H + V), float(torch.logit(torch.tensor(0.9))))
    weight[0, :H] = 0
    weight[0, H + anchor_b] = torch.logit(torch.tensor(0.1))
    tensors = dict(draft.state_dict())
    tensors.update({"confidence_head.proj.weight": weight, "confidence_head.proj.bias": torch.zeros(1)})
    draft = DFlashDraftModel.from_pretrained(_folder(tmp_path / "c", _config(rank=V, confidence=True), tensors)).eval()
    ids, mask = torch.cat([a, b]), torch.tensor([[1] * 5, [0, 0, 1, 1, 1]])
    out = draft.spec_generate(target, ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                              return_dict_in_generate=True, confidence_threshold=0.5)
    assert out.row_draft_lengths[1][0] == 0 and out.row_draft_lengths[0][0] > 0, out.row_draft_lengths
    for i, prompt in enumerate((a, b[:, 2:])):
        alone = target.generate(prompt, max_new_tokens=12, do_sample=False)
        assert out.sequences[i, -12:].tolist() == alone[0, -12:].tolist(), i


# ----------------------------------------------------------------------------- sampling is the target's distribution

TOP_K, N_NEW, ROWS, CALLS = 2, 4, 600, 5


def _processed_probs(target, seq):
    logits = target(torch.tensor([seq])).logits[0, -1:].float()
    return torch.softmax(transformers_top_k(TOP_K)(torch.tensor([seq]), logits)[0], -1)


def transformers_top_k(k):
    from transformers import TopKLogitsWarper
    return TopKLogitsWarper(k)


@torch.no_grad()
def _exact_joint(target, prompt):
    joint = {(): 1.0}
    for _ in range(N_NEW):
        nxt = {}
        for seq, p in joint.items():
            probs = _processed_probs(target, prompt + list(seq))
            for tok in probs.nonzero()[:, 0].tolist():
                nxt[seq + (tok,)] = p * probs[tok].item()
        joint = nxt
    return joint


def _chi2_crit(df, z=3.090232):  # upper 1e-3 quantile (Wilson-Hilferty)
    return df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3


def _markov_sampler(tmp_path, target, prompt):
    """A DSpark drafter whose Markov head boosts, after each reachable token, the target's top-2 next tokens
    after the prompt plus that token (its own lm_head random): the correction moves the drafts toward the
    target, so drafts are accepted, and it changes the drawn token on many slots."""
    tensors = _tensors(rank=V, confidence=False, seed=3)
    tensors["markov_head.markov_w1.weight"] = torch.eye(V)
    w2 = torch.zeros(V, V)
    with torch.no_grad():
        for prev in range(V):
            top = _processed_probs(target, prompt + [prev]).topk(TOP_K).indices
            w2[top, prev] = 4.0
    tensors["markov_head.markov_w2.weight"] = w2
    folder = _folder(tmp_path / "sampler", _config(rank=V, confidence=False), tensors)
    return DFlashDraftModel.from_pretrained(folder).eval()


@pytest.mark.parametrize("bug,cost", [(None, None), (None, "cut"), ("q_before_the_markov_correction", None)])
def test_sampled_output_is_the_targets_distribution(tmp_path, monkeypatch, bug, cost):
    """Chi-square of the joint of 4 new tokens (3 of them drafted by the Markov walk) against the exact
    top-k 2 distribution of the target; a q taken before the Markov correction must be rejected. The
    correction changes the argmax token on at least a third of the drafted slots (asserted). ``cost="cut"``:
    a verify cost under which the policy's cut of the walk varies with the slots' confidences (a walk: slot k
    decided from slots <= k, ``verify_policy.VerifyPolicy._width``); the widths are asserted to vary."""
    import proposers
    from patching import patch_called
    from tiny import tiny_target

    target = tiny_target(layers=4, peaked=True, seed=6)
    prompt = [3, 14, 15, 92, 65]
    joint = _exact_joint(target, prompt)
    draft = _markov_sampler(tmp_path, target, prompt)
    real, changed = proposers.DSparkProposer.choose, []

    def choose(self, draft_logits, slot_hidden, rows):
        tokens, q, probs = real(self, draft_logits, slot_hidden, rows)
        prev = torch.cat([rows.anchor, tokens[:, :-1]], dim=1)
        corrected = draft_logits + self.draft.markov_head.bias(prev.flatten()).view(draft_logits.shape)
        changed.append((corrected.argmax(-1) != draft_logits.argmax(-1)).float().mean().item())
        if bug:
            q = self.sampling.probs(draft_logits)  # the q of the uncorrected logits: biased
        return tokens, q, probs

    patch_called(monkeypatch, proposers.DSparkProposer, "choose", choose)
    counts, gen = {}, torch.Generator().manual_seed(0)
    accepted, widths = 0, set()
    extra = {} if cost is None else {"verify_cost": {"widths": [1, 2, 4], "verify": [1.0, 1.2, 1.5]}}
    if cost is not None:  # the first step cut too (not observed whole), learning off: the cut decides each step
        from test_policy_rules import _decisive_policy
        _decisive_policy(monkeypatch)
    for _ in range(CALLS):
        out = draft.spec_generate(target, torch.tensor([prompt] * ROWS), max_new_tokens=N_NEW, do_sample=True,
                                  temperature=1.0, top_k=TOP_K, generator=gen, return_dict_in_generate=True, **extra)
        accepted += sum(sum(r) for r in out.row_accepted_drafts)
        widths |= {d for r in out.row_draft_lengths for d in r if d}
        for row in out.sequences[:, len(prompt):].tolist():
            counts[tuple(row)] = counts.get(tuple(row), 0) + 1
    assert sum(changed) / len(changed) >= 1 / 3, changed
    assert accepted >= ROWS * CALLS // 2  # the walk's drafts were accepted, so its q mattered
    assert cost is None or len(widths) > 1, widths
    n = ROWS * CALLS
    impossible = set(counts) - set(joint)
    big = [c for c in joint if joint[c] * n >= 5]
    rest = 1 - sum(joint[c] for c in big)
    stat = sum((counts.get(c, 0) - n * joint[c]) ** 2 / (n * joint[c]) for c in big)
    df = len(big) - 1
    if rest * n >= 5:
        rest_count = n - sum(counts.get(c, 0) for c in big)
        stat, df = stat + (rest_count - n * rest) ** 2 / (n * rest), df + 1
    if bug is None:
        assert not impossible and stat < _chi2_crit(df), (impossible, stat, df)
    else:
        assert impossible or stat > _chi2_crit(df), (stat, df)


def test_dspark_through_automodel_custom_generate_cache_window_and_streamer(tmp_path):
    """The routes a user takes, with the Markov-oracle drafter (drafts accepted past slot 0): a folder saved
    by ``save_pretrained`` loads through ``AutoModel`` + ``trust_remote_code``; ``target.generate(
    custom_generate=<folder>)``, a passed cache continued in a second call, ``draft_window`` and a streamer
    all give the target's greedy tokens."""
    import transformers
    from transformers import DynamicCache
    from transformers.generation.streamers import BaseStreamer
    from tiny import tiny_target

    target = tiny_target(layers=4)
    prompt = torch.tensor([[3, 14, 15, 92, 65]])
    oracle, greedy = _oracle_draft(tmp_path, target, prompt, 30)
    oracle.save_pretrained(tmp_path / "saved")
    draft = transformers.AutoModel.from_pretrained(tmp_path / "saved", trust_remote_code=True).eval()
    assert type(draft).__name__ == "DSparkDraftModel" and type(draft).__module__ != "modeling_dflash"
    ref = torch.tensor([greedy[:prompt.shape[1] + 24]])
    out = draft.spec_generate(target, prompt, max_new_tokens=24, temperature=0.0, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref) and sum(out.row_accepted_drafts[0]) >= 8
    via = target.generate(prompt, max_new_tokens=24, do_sample=False, custom_generate=str(tmp_path / "saved"),
                          trust_remote_code=True, assistant_model=draft)
    assert torch.equal(via, ref)
    assert torch.equal(draft.spec_generate(target, prompt, max_new_tokens=24, temperature=0.0, draft_window=3), ref)
    cache = DynamicCache()
    first = draft.spec_generate(target, prompt, max_new_tokens=10, temperature=0.0, return_dict_in_generate=True,
                                past_key_values=cache)
    again = draft.spec_generate(target, first.sequences, max_new_tokens=14, temperature=0.0, past_key_values=cache)
    assert torch.equal(again, ref)

    class Collect(BaseStreamer):
        def __init__(self):
            self.tokens = []

        def put(self, value):
            self.tokens += value.reshape(-1).tolist()

        def end(self):
            pass

    streamer = Collect()
    draft.spec_generate(target, prompt, max_new_tokens=24, temperature=0.0, streamer=streamer)
    assert streamer.tokens == ref[0].tolist()


def test_converter_reads_a_deepspec_folder_verifies_and_writes_it(tmp_path):
    """``convert.convert_checkpoint`` on a folder in DeepSpec's layout: dialect ``deepspec``, every tensor kept
    (its own ``embed_tokens`` / ``lm_head`` included), the written folder loads through ``AutoModel`` +
    ``trust_remote_code`` as a DSpark drafter with the same tensors and runs exactly against a target; the
    engines' DSpark commands are printed (their names: tests/test_engine_args.py)."""
    import transformers
    from convert.convert_checkpoint import convert_checkpoint
    from tiny import tiny_target

    source = _folder(tmp_path / "deepspec", _config(), _tensors())
    target = tiny_target(layers=4)
    plan = convert_checkpoint(source, str(tmp_path / "out"), verify_target=target)
    import proposers
    saved = DFlashDraftModel.from_pretrained(source)
    saved.save_pretrained(tmp_path / "again")  # save_pretrained renames the in-memory architectures
    assert proposers.proposer_for(saved) is proposers.DSparkProposer  # it still drafts as DSpark
    assert plan.dialect == "deepspec" and not plan.dropped
    assert '"method": "dspark"' in plan.describe() and "--speculative-algorithm DSPARK" in plan.describe()
    loaded = transformers.AutoModel.from_pretrained(tmp_path / "out", trust_remote_code=True).eval()
    assert type(loaded).__name__ == "DSparkDraftModel"
    original = _tensors()
    state = loaded.state_dict()
    assert set(state) == set(original) and all(torch.equal(state[k], original[k]) for k in original)
    ids = torch.tensor([[3, 14, 15, 92, 65]])
    ref = target.generate(ids, max_new_tokens=16, do_sample=False)
    assert torch.equal(loaded.spec_generate(target, ids, max_new_tokens=16, temperature=0.0), ref)


# ----------------------------------------------------------------------------- own embed_tokens / lm_head vs the target's


@pytest.mark.parametrize("edit, named, diff", [(None, None, None),
                                               ("embed_tokens.weight", "embed_tokens.weight", 0.75),
                                               ("lm_head.weight", "lm_head.weight", 0.5),
                                               ("both", "embed_tokens.weight", 0.75)])
def test_own_copies_that_differ_from_the_targets_warn_once_naming_the_largest(tmp_path, caplog, edit, named, diff):
    """The drafter's own copies equal to the target's: nothing said. One differing (a single entry moved by
    ``diff``; with both edited, embed_tokens by 0.75 and lm_head by 0.5): one warning per call naming that tensor
    and its max abs difference, and the output is still the target's (the verify uses the target's head)."""
    import logging
    from tiny import tiny_target

    target = tiny_target(layers=4)
    tensors = _tensors()
    tensors["embed_tokens.weight"] = target.get_input_embeddings().weight.detach().clone()
    tensors["lm_head.weight"] = target.get_output_embeddings().weight.detach().clone()
    if edit in ("embed_tokens.weight", "both"):
        tensors["embed_tokens.weight"][7, 3] += 0.75
    if edit in ("lm_head.weight", "both"):
        tensors["lm_head.weight"][11, 5] -= 0.5
    draft = DFlashDraftModel.from_pretrained(_folder(tmp_path / "d", tensors=tensors)).eval()
    ids = torch.tensor([[3, 14, 15, 92, 65]])
    with caplog.at_level(logging.WARNING):
        out = draft.spec_generate(target, ids, max_new_tokens=6, temperature=0.0)
    warned = [r.getMessage() for r in caplog.records if "differs from the target's" in r.getMessage()]
    assert torch.equal(out, target.generate(ids, max_new_tokens=6, do_sample=False))
    if named is None:
        assert warned == [] and "DSpark" not in caplog.text
        return
    assert len(warned) == 1 and f"own {named} differs" in warned[0], warned
    assert f"max abs difference {diff:.4g}" in warned[0]


# ----------------------------------------------------------------------------- the other routes: native, pipeline, static


def test_native_dflash_route_refuses_a_dspark_drafter_by_name(tmp_path):
    """transformers' own DFlash loop (``speculation_type="dflash"``, 5.x) drafts slot k as ``start + k`` from the
    target's head: with a DSpark drafter it would run (lossless, wrong drafts), so the drafter refuses it by name
    and names the routes that run it. On 4.57 the route does not exist (``native_dflash_available``)."""
    from modeling_dflash import native_dflash_available
    from tiny import tiny_target

    if not native_dflash_available():
        pytest.skip("this transformers has no native DFlash candidate generator (speculation_type='dflash' is 5.x)")
    target = tiny_target(layers=4)
    prompt = torch.tensor([[3, 14, 15, 92, 65]])
    draft, _ = _oracle_draft(tmp_path, target, prompt, 8)
    with pytest.raises(ValueError, match=r"DSpark drafter \(Qwen3DSparkModel\) does not run on transformers' native "
                                         r"DFlash route.*spec_generate.*custom_generate="):
        target.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=8,
                        assistant_model=draft, speculation_type="dflash")


def test_pipeline_with_a_dspark_assistant_runs_it_exactly_through_custom_generate(tmp_path, monkeypatch):
    """``pipeline("text-generation", model=target, assistant_model=draft)`` with ``custom_generate=<folder>`` runs
    the DSpark loop (the Markov oracle's drafts accepted: counted on the proposer) and returns the plain
    pipeline's text; without a route named, transformers' own message naming ``custom_generate``."""
    import transformers
    from tiny import tiny_target, tiny_tokenizer

    target = tiny_target(layers=4)
    tok = tiny_tokenizer()
    text = "w3 w14 w15 w92 w65"
    prompt = tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
    oracle, _ = _oracle_draft(tmp_path, target, prompt, 12)
    oracle.save_pretrained(tmp_path / "saved")
    draft = transformers.AutoModel.from_pretrained(tmp_path / "saved", trust_remote_code=True).eval()
    remote_proposers = sys.modules[type(draft).__module__.rsplit(".", 1)[0] + ".proposers"]
    proposals = []
    original = remote_proposers.DSparkProposer.propose
    monkeypatch.setattr(remote_proposers.DSparkProposer, "propose",
                        lambda self, *a: proposals.append(original(self, *a)) or proposals[-1])
    plain = transformers.pipeline("text-generation", model=target, tokenizer=tok)(text, max_new_tokens=12,
                                                                                   do_sample=False)
    pipe = transformers.pipeline("text-generation", model=target, tokenizer=tok, assistant_model=draft)
    fast = pipe(text, max_new_tokens=12, do_sample=False, custom_generate=str(tmp_path / "saved"), trust_remote_code=True)
    assert fast == plain and proposals, "the pipeline never ran the DSpark proposer"
    with pytest.raises(AttributeError, match="custom_generate"):
        pipe(text, max_new_tokens=12, do_sample=False)


def test_static_loop_with_dspark_runs_the_dynamic_loop_with_one_info_log(tmp_path, caplog, monkeypatch):
    """``cache_implementation="static"`` with a DSpark drafter: the fixed-shape loop does not run its proposer
    (``DSparkProposer.static_loop`` False), so the call runs the dynamic loop (static_decode never called) with
    exactly one info log, and the tokens are the target's."""
    import logging
    import generation_utils
    from tiny import tiny_target

    target = tiny_target(layers=4)
    prompt = torch.tensor([[3, 14, 15, 92, 65]])
    draft, greedy = _oracle_draft(tmp_path, target, prompt, 12)
    monkeypatch.setattr(generation_utils, "static_decode", lambda *a, **k: pytest.fail("static loop used"))
    with caplog.at_level(logging.INFO):
        out = draft.spec_generate(target, prompt, max_new_tokens=12, temperature=0.0, cache_implementation="static",
                                  return_dict_in_generate=True)
    # The reason logged is generation_utils._static_loop's for a proposer with static_loop False (its wording
    # names DFlash 2's selector walk today); only the one info log is asserted here.
    logs = [r for r in caplog.records if "falls back to the dynamic loop" in r.getMessage()]
    assert len(logs) == 1 and logs[0].levelno == logging.INFO, [r.getMessage() for r in caplog.records]
    assert out.sequences[0].tolist() == greedy and sum(out.row_accepted_drafts[0]) >= 4


@pytest.mark.parametrize("rank, confidence", [(R, True), (0, False)])
def test_engine_only_conversion_writes_deepspecs_layout_unchanged(tmp_path, rank, confidence):
    """``--engine-only`` on a DeepSpec folder (DSpark, and the DFlash baseline): the written config.json is the
    source's byte for byte (``architectures: ["Qwen3DSparkModel"]``, top-level keys, no ``auto_map``, no
    ``dflash_config``), the tensors are the source's (names and bits), no remote code is written, and the
    folder still loads as a DSpark drafter; the engine commands are DSpark's (the baseline's with its note)."""
    from safetensors.torch import load_file
    from convert.convert_checkpoint import main as convert_main  # the command line users run

    source = _folder(tmp_path / "deepspec", _config(rank=rank, confidence=confidence),
                     _tensors(rank=rank, confidence=confidence))
    out = tmp_path / "out"
    assert convert_main([source, str(out), "--engine-only"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert (out / "config.json").read_bytes() == (tmp_path / "deepspec" / "config.json").read_bytes()
    written, original = load_file(str(out / "model.safetensors")), _tensors(rank=rank, confidence=confidence)
    assert set(written) == set(original) and all(torch.equal(written[k], original[k]) for k in original)
    model = DFlashDraftModel.from_pretrained(str(out))
    assert type(model) is DSparkDraftModel and (model.markov_head is None) == (rank == 0)
    from convert.convert_checkpoint import convert_checkpoint
    described = convert_checkpoint(source, str(tmp_path / "again"), engine_only=True, dry_run=True).describe()
    assert "--speculative-algorithm DSPARK" in described and ("markov_rank 0" in described) == (rank == 0)
