"""Drafter training (train/blocks.py, model_init.py, loop.py through train/train_drafter.py): anchors, packed masks, labels, loss, a learnable synthetic
target, checkpoints, the embedded pair and the demo. CPU, seconds each (the demo subprocess ~1 min)."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tiny import MASK_ID, tiny_target
from train import train_drafter as td

REPO = Path(__file__).resolve().parents[1]
PAIR = REPO / "pair"


# ----------------------------------------------------------------------------- anchors, labels, masks


def test_trainable_positions_and_anchor_sampling():
    assert td.trainable_anchor_positions(5, 12).tolist() == [5, 6, 7, 8, 9, 10]  # response, one label after
    assert td.trainable_anchor_positions(0, 4).tolist() == [1, 2]  # never position 0 (no context before it)
    assert td.trainable_anchor_positions(5, 6).tolist() == []
    every = td.sample_anchors(5, 12, 100)
    assert every.tolist() == [5, 6, 7, 8, 9, 10]
    draws = [td.sample_anchors(5, 40, 6, torch.Generator().manual_seed(s)) for s in range(5)]
    for a in draws:
        assert len(a) == 6 and len(set(a.tolist())) == 6 and a.tolist() == sorted(a.tolist())
        assert int(a.min()) >= 5 and int(a.max()) <= 38
    assert len({tuple(a.tolist()) for a in draws}) > 1  # resampling gives new anchors
    same = td.sample_anchors(5, 40, 6, torch.Generator().manual_seed(3))
    assert torch.equal(same, draws[3])
    with pytest.raises(ValueError, match="num_anchors"):
        td.sample_anchors(5, 12, 0)


def test_block_inputs_hand_checked():
    ids = torch.arange(100, 112)  # T = 12
    noise, pos, labels = td.block_inputs(ids, torch.tensor([5, 9]), 4, 7)
    assert noise.tolist() == [105, 7, 7, 7, 109, 7, 7, 7]
    assert pos.tolist() == [5, 6, 7, 8, 9, 10, 11, 12]
    # slot k predicts the token at anchor + k; slot 0 and positions past the end have no label
    assert labels.tolist() == [-100, 106, 107, 108, -100, 110, 111, -100]


def test_packed_block_mask_hand_checked():
    anchors = torch.tensor([2, 4])
    m = td.packed_block_mask(6, anchors, 3, causal=False).int().tolist()
    #        context 0..5      block0   block1
    want = [[1, 1, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0],  # block 0 (anchor 2) sees positions 0, 1 only
            [1, 1, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0],
            [1, 1, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0],
            [1, 1, 1, 1, 0, 0, 0, 0, 0, 1, 1, 1],  # block 1 (anchor 4) sees 0..3, never block 0
            [1, 1, 1, 1, 0, 0, 0, 0, 0, 1, 1, 1],
            [1, 1, 1, 1, 0, 0, 0, 0, 0, 1, 1, 1]]
    assert m == want
    c = td.packed_block_mask(6, anchors, 3, causal=True).int()
    assert c[:, 6:].tolist() == [[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0],
                                 [0, 0, 0, 1, 0, 0], [0, 0, 0, 1, 1, 0], [0, 0, 0, 1, 1, 1]]
    assert torch.equal(c[:, :6], torch.tensor(want)[:, :6])
    w = td.packed_block_mask(6, anchors, 3, causal=True, window=2).int()
    # query at position 5 (block 1, slot 1) keeps keys with 5 - k_pos < 2: context none (< anchor 4 and >= 4), block 4, 5
    assert w[4].tolist() == [0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 0]
    assert w[3].tolist() == [0, 0, 0, 1, 0, 0, 0, 0, 0, 1, 0, 0]  # position 4 sees context 3 and itself


def test_loss_weights():
    w = td.loss_weights(4, gamma=2.0)
    assert w[0] == 0
    assert torch.allclose(w[1:], torch.tensor([1.0, math.exp(-0.5), math.exp(-1.0)]))
    assert td.default_gamma(16) == 7 and td.default_gamma(10) == 5 and td.default_gamma(8) == 4
    assert torch.allclose(td.loss_weights(16)[1:3], torch.tensor([1.0, math.exp(-1 / 7)]))
    with pytest.raises(ValueError, match="gamma"):
        td.loss_weights(4, gamma=0.0)


# ----------------------------------------------------------------------------- packed forward == inference view


def _setup(seed=0, **draft_overrides):
    target = tiny_target(seed=seed)
    target.requires_grad_(False)
    cfg = td.build_draft_config(target, 2, 4, [0, 2], MASK_ID, **draft_overrides)
    torch.manual_seed(seed + 1)
    draft = td.DFlashDraftModel(cfg).eval()
    ids = torch.randint(0, 90, (20,), generator=torch.Generator().manual_seed(seed))
    feats = td.target_features(target, ids[None], cfg.target_layer_ids)[0]
    return target, draft, ids, feats


@pytest.mark.parametrize("overrides", [{}, {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 3}])
def test_packed_blocks_equal_one_block_at_a_time_inference(overrides):
    """Each packed block computes exactly what spec_generate's draft call computes for that anchor."""
    target, draft, ids, feats = _setup(**overrides)
    anchors = torch.tensor([3, 4, 11, 17])
    batch = td.pack_batch([(ids, feats, anchors)], draft.config)
    embed = target.get_input_embeddings()
    with torch.no_grad():
        packed = draft(position_ids=batch.position_ids, noise_embedding=embed(batch.noise_ids),
                       target_hidden=batch.target_hidden, attention_mask=batch.masks)[0]
        for i, a in enumerate(anchors.tolist()):
            block = torch.cat([ids[a:a + 1], torch.full((3,), MASK_ID)])
            pos = torch.arange(a + 4)[None]  # context 0..a-1 then the block a..a+3
            alone = draft(position_ids=pos, noise_embedding=embed(block[None]), target_hidden=feats[None, :a])[0]
            assert torch.allclose(packed[4 * i:4 * i + 4], alone, atol=1e-5), i


def test_gradient_is_zero_for_features_at_or_after_the_anchor_and_for_other_blocks():
    target, draft, ids, feats = _setup()
    draft.train()
    anchors = torch.tensor([2, 6, 9, 15])
    batch = td.pack_batch([(ids, feats, anchors)], draft.config)
    batch.target_hidden.requires_grad_(True)
    emb = target.get_input_embeddings()(batch.noise_ids).detach().requires_grad_(True)
    hidden = draft(position_ids=batch.position_ids, noise_embedding=emb, target_hidden=batch.target_hidden,
                   attention_mask=batch.masks)
    logits = target.get_output_embeddings()(hidden)
    for i, a in enumerate(anchors.tolist()):
        loss = torch.nn.functional.cross_entropy(logits[0, 4 * i + 1:4 * i + 4], batch.labels[0, 4 * i + 1:4 * i + 4])
        g_feat, g_emb = torch.autograd.grad(loss, [batch.target_hidden, emb], retain_graph=True)
        assert torch.count_nonzero(g_feat[0, a:]) == 0, f"block {i} leaks features at positions >= its anchor {a}"
        assert torch.count_nonzero(g_feat[0, a - 1]) > 0  # the position just before the anchor is used
        others = torch.ones(len(anchors) * 4, dtype=torch.bool)
        others[4 * i:4 * i + 4] = False
        assert torch.count_nonzero(g_emb[0, others]) == 0, f"block {i} sees another block"
        assert torch.count_nonzero(g_emb[0, 4 * i:4 * i + 4]) > 0


def test_drafter_loss_weighting_and_per_slot_stats():
    target, draft, ids, feats = _setup()
    batch = td.pack_batch([(ids, feats, torch.tensor([5, 17]))], draft.config)  # block 2 runs past T = 20
    w = td.loss_weights(4, gamma=2.0)
    loss, stats = td.drafter_loss(draft, target, batch, w)
    per_token, _ = td.drafter_loss(draft, target, batch, w, reduction="none")
    assert per_token[0, 0] == 0 and per_token[0, 4] == 0  # slot 0 excluded
    assert per_token[0, 7] == 0  # position 20 is past the end: no label
    assert stats["count"].tolist() == [0, 2, 2, 1]
    total_w = 2 * w[1] + 2 * w[2] + w[3]
    assert torch.allclose(loss, per_token.sum() / total_w, atol=1e-6)
    with pytest.raises(ValueError, match="one feature tensor per example"):
        td.train_drafter(draft, target, [td.Example(ids, 2)], [], td.TrainConfig())


def test_pack_batch_pads_rows_of_different_lengths():
    target, draft, ids, feats = _setup()
    rows = [(ids, feats, torch.tensor([3, 8, 12])), (ids[:10], feats[:10], torch.tensor([4]))]
    b = td.pack_batch(rows, draft.config)
    assert b.noise_ids.shape == (2, 12) and b.target_hidden.shape == (2, 20, feats.shape[-1])
    assert (b.labels[1, 4:] == -100).all()  # padding blocks carry no loss
    assert not b.masks["full_attention"][1, 0, :, 10:20].any()  # padded context never visible
    with torch.no_grad():
        h = draft(position_ids=b.position_ids, noise_embedding=target.get_input_embeddings()(b.noise_ids),
                  target_hidden=b.target_hidden, attention_mask=b.masks)
    assert torch.isfinite(h).all()


def test_init_from_target_copies_last_layers_and_norm():
    target, draft, _, _ = _setup()
    report = td.init_draft_from_target(draft, target)
    t_layers = target.get_decoder().layers
    assert torch.equal(draft.layers[1].self_attn.q_proj.weight, t_layers[2].self_attn.q_proj.weight)
    assert torch.equal(draft.layers[0].mlp.down_proj.weight, t_layers[1].mlp.down_proj.weight)
    assert torch.equal(draft.norm.weight, target.get_decoder().norm.weight)
    assert "fc.weight" in report["random"] and "layers.0.self_attn.k_proj.weight" in report["copied"]
    H = draft.config.hidden_size
    assert torch.allclose(draft.fc.weight[:, H:], torch.eye(H), atol=0.2)  # identity on the deepest tap (layer 2)


# ----------------------------------------------------------------------------- learning a rule end to end

PERIOD = 96  # tokens 0..95, the mask id (96) never appears


def _pattern(n, length, g):
    """Rows of the rule x_t = (x_{t-1} + 3) mod 96 from random starts: ``(n, length)``."""
    return (torch.randint(PERIOD, (n, 1), generator=g) + 3 * torch.arange(length)) % PERIOD


@pytest.fixture(scope="module")
def rule_target():
    """A tiny target trained in-test (150 steps, ~5 s) until its greedy continuation follows the rule."""
    target = tiny_target(seed=0)
    g = torch.Generator().manual_seed(0)
    opt = torch.optim.AdamW(target.parameters(), lr=3e-3)
    target.train()
    for _ in range(150):
        x = _pattern(16, 32, g)
        loss = target(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    target.eval().requires_grad_(False)
    out = target.generate(_pattern(1, 5, g), max_new_tokens=12, do_sample=False)[0]
    assert ((out[1:] - out[:-1]) % PERIOD == 3).all(), "the synthetic target did not learn the rule"
    return target


def test_training_raises_acceptance_length_measured_by_spec_generate(rule_target, tmp_path):
    g = torch.Generator().manual_seed(1)
    cfg = td.build_draft_config(rule_target, 1, 4, [0, 2], MASK_ID)
    torch.manual_seed(0)
    draft = td.DFlashDraftModel(cfg)
    td.init_draft_from_target(draft, rule_target)
    prompts = [_pattern(1, 6, g) for _ in range(4)]
    before = td.mean_acceptance(draft, rule_target, prompts, 24)
    examples = [td.Example(x, 4) for x in _pattern(32, 40, g)]
    feats = td.precompute_features(rule_target, examples, cfg.target_layer_ids, progress=False)
    tc = td.TrainConfig(num_anchors=16, batch_size=8, max_steps=120, lr=5e-3, eval_every=0, ckpt_every=0,
                        progress=False)
    result = td.train_drafter(draft, rule_target, examples, feats, tc, log_path=tmp_path / "log.jsonl")
    after = td.mean_acceptance(draft, rule_target, prompts, 24)
    assert result["steps"] == 120
    assert before < 1.5, before
    assert after >= 2.5, f"tau {before:.2f} -> {after:.2f}; block size 4 allows up to 4"
    log = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert log[-1]["loss"] < log[0]["loss"] and len(log[-1]["acc_slot"]) == 3


def test_checkpoint_loads_with_automodel_and_resume_continues(rule_target, tmp_path):
    from transformers import AutoModel

    g = torch.Generator().manual_seed(2)
    cfg = td.build_draft_config(rule_target, 1, 4, [0, 2], MASK_ID)
    draft = td.DFlashDraftModel(cfg)
    examples = [td.Example(x, 4) for x in _pattern(8, 24, g)]
    feats = td.precompute_features(rule_target, examples, cfg.target_layer_ids, progress=False)
    tc = td.TrainConfig(num_anchors=8, batch_size=4, max_steps=4, lr=1e-3, eval_every=0, ckpt_every=2,
                        progress=False)
    td.train_drafter(draft, rule_target, examples, feats, tc, ckpt_dir=tmp_path)
    ckpt = td.latest_checkpoint(tmp_path)
    assert ckpt.name == "checkpoint-4" and (ckpt / "trainer_state.json").exists() and (ckpt / "accelerate_state").is_dir()
    loaded = AutoModel.from_pretrained(ckpt, trust_remote_code=True, dtype=torch.float32)
    assert type(loaded).__name__ == "DFlashDraftModel"
    assert loaded.config.block_size == 4 and loaded.config.target_layer_ids == [0, 2]
    for (name, a), b in zip(draft.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name
    # resume: continue from checkpoint-4 up to step 6 with the optimizer state
    resumed = td.DFlashDraftModel.from_pretrained(ckpt, dtype=torch.float32)
    tc.max_steps = 6
    result = td.train_drafter(resumed, rule_target, examples, feats, tc, ckpt_dir=tmp_path, resume_from=ckpt)
    assert result["steps"] == 6 and td.latest_checkpoint(tmp_path).name == "checkpoint-6"
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-4", "checkpoint-6"]


class _WordTokenizer:
    """``"w3 w5"`` -> ``[3, 5]``: the one call ``load_examples`` makes."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [int(w[1:]) for w in text.split()]}


def test_load_examples_from_records_and_files(tmp_path):
    tok = _WordTokenizer()
    recs = [{"prompt": "w1 w2", "response": "w3 w4 w5"}, {"text": "w1 w2 w3 w4"}, {"text": "w1"}]
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    from_file = td.load_examples(path, tok)
    from_iter = td.load_examples(recs, tok)  # a datasets.Dataset iterates the same dicts
    assert len(from_file) == len(from_iter) == 2  # the 1-token text is dropped
    assert from_file[0].prompt_len == len(tok("w1 w2", add_special_tokens=False)["input_ids"])
    assert from_file[1].prompt_len == 1
    with pytest.raises(ValueError, match="'prompt_ids'.*'text', got keys \\['question'\\]"):
        td.load_examples([{"question": "x"}], tok)


def test_prompt_lookup_baseline_hand_checked():
    from bench.stats import prompt_lookup_propose, prompt_lookup_tau, repeated_ngram_share

    assert prompt_lookup_propose([1, 2, 3, 1, 2], 2) == [3, 1]  # suffix (1, 2) last seen at 0
    assert prompt_lookup_propose([5, 6, 7], 3) == []
    assert prompt_lookup_propose([1, 9, 1, 8, 1], 1) == [8]  # the LAST earlier occurrence wins
    # prompt [1,2,3], greedy continuation [1,2,3,1,2,3]: the prefill commits 1; step 1 drafts [2,3,1] from
    # the match of (1,) at 0 and all are accepted (+1 target token); step 2 has budget for 1 token only.
    assert prompt_lookup_tau([1, 2, 3], [1, 2, 3, 1, 2, 3], 4, 6) == [4, 1]
    assert prompt_lookup_tau([1, 2, 3], [4, 5, 6], 4, 3) == [1, 1]
    assert abs(repeated_ngram_share([1, 2, 3, 4, 1, 2, 3, 4]) - 0.2) < 1e-9  # 5 four-grams, (1,2,3,4) twice
    assert repeated_ngram_share([1, 2, 3]) == 0.0


# ----------------------------------------------------------------------------- the embedded pair and the demo

needs_pair = pytest.mark.skipif(not (PAIR / "drafter" / "config.json").exists()
                                or not (PAIR / "target" / "config.json").exists(),
                                reason="pair/drafter not trained yet (python -m train.train_drafter)")


@needs_pair
def test_embedded_pair_greedy_output_equals_the_target():
    from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

    draft = AutoModel.from_pretrained(PAIR / "drafter", trust_remote_code=True, dtype=torch.float32).eval()
    target = AutoModelForCausalLM.from_pretrained(PAIR / "target", dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(PAIR / "target")
    assert draft.config.mask_token_id == tok.mask_token_id
    prompt = json.loads((PAIR / "heldout_prompts.json").read_text())[0]["prompt"]
    ids = tok(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
    ref = target.generate(ids, max_new_tokens=48, do_sample=False)
    out = draft.spec_generate(target, ids, max_new_tokens=48, temperature=0.0, return_dict_in_generate=True)
    assert out.sequences.tolist() == ref.tolist()
    assert sum(out.acceptance_lengths) / len(out.acceptance_lengths) > 1.0


@needs_pair
def test_demo_quick_runs(tmp_path):
    out = tmp_path / "acc.json"
    proc = subprocess.run([sys.executable, str(REPO / "demo.py"), "--quick", "--json", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "tau" in proc.stdout and "identical to the target" in proc.stdout
    data = json.loads(out.read_text())
    assert data["schema"] == "dflash-acceptance/v1" and data["datasets"][0]["tau"] >= 1.0


@needs_pair
@pytest.mark.parametrize("name", ["configuration_dflash.py", "modeling_dflash.py", "generation_utils.py",
                                  "target_cache.py", "target_families.py", "static_generate.py", "dflash2.py"])
def test_embedded_drafter_ships_the_current_remote_code(name):
    """pair/drafter loads through its own copies of the Hub files; they must not go stale."""
    assert (PAIR / "drafter" / name).read_bytes() == (REPO / name).read_bytes(), (
        f"pair/drafter/{name} differs from ./{name}: cp {name} pair/drafter/")


@needs_pair
def test_embedded_drafter_ships_the_current_custom_generate_entry():
    """pair/drafter/custom_generate/generate.py is what save_pretrained writes today."""
    from generation_utils import CUSTOM_GENERATE_PY

    assert (PAIR / "drafter" / "custom_generate" / "generate.py").read_text() == CUSTOM_GENERATE_PY, (
        "pair/drafter/custom_generate/generate.py is stale: "
        "python -c \"import generation_utils as g; g.write_custom_generate('pair/drafter')\"")
