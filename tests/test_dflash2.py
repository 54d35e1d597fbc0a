"""DFlash 2 drafters (issue 21, model half): config, strict loading of the published layout, the
grouped dynamic causal convolution and the candidate-selector walk against formulas written here.

The published layout is tests/fixtures/drafters/dflash2-config.json (z-lab/dflash
tests/fixtures/dflash2-config.json, shrunk) and dflash2-safetensors-header.json (the tensor names of
z-lab/dflash tests/fixtures/dflash2-safetensors-header.json with shrunk shapes).
"""

import json
import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModel

import dflash2
from configuration_dflash import DFlashConfig
from convert import ConversionError
from convert.convert_checkpoint import convert_checkpoint
from dflash2 import CandidateSelector, grouped_dynamic_causal_conv, selector_walk
from modeling_dflash import DFlash2DraftModel, DFlashDraftModel, block_attention_mask

FIXTURES = Path(__file__).parent / "fixtures" / "drafters"
CONFIG = json.loads((FIXTURES / "dflash2-config.json").read_text())
HEADER = {k: v for k, v in json.loads((FIXTURES / "dflash2-safetensors-header.json").read_text()).items()
          if k != "__metadata__"}
CODEBOOKS = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")
H, V, K, G, R, TOP_K = 40, 97, 2, 8, 8, 4  # the shrunk fixture's sizes


def published_tensors(seed: int = 0) -> dict:
    """A random bf16 tensor for every name of the header, in its shape (norm weights around 1)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, entry in HEADER.items():
        value = torch.randn(entry["shape"], generator=gen) * 0.3
        out[name] = (value + 1.0 if "norm" in name else value).to(torch.bfloat16)
    return out


def write_published(folder: Path, tensors=None, config=None) -> Path:
    """The published DFlash 2 layout: config.json as published (shrunk) + one model.safetensors."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config or CONFIG, indent=2))
    save_file(tensors if tensors is not None else published_tensors(), str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    return folder


def stored(folder: Path) -> dict:
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def assert_holds(model, tensors: dict) -> None:
    """Every tensor of ``tensors`` is the model's, bit for bit, and the model has no other."""
    state = model.state_dict()
    assert set(state) == set(tensors)
    for name, value in tensors.items():
        assert torch.equal(state[name].float(), value.float()), name


def random_dflash2(seed: int = 0, **overrides) -> DFlash2DraftModel:
    """The fixture's model in fp32 with every weight random (no identity left anywhere)."""
    model = DFlash2DraftModel(DFlashConfig(**dict(CONFIG, **overrides))).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.3 + (1.0 if "norm" in name else 0.0))
    return model


def draft_inputs(batch=2, ctx=5, block=16, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return dict(position_ids=torch.arange(ctx + block).expand(batch, -1),
                noise_embedding=torch.randn(batch, block, H, generator=gen),
                target_hidden=torch.randn(batch, ctx, 3 * H, generator=gen))


# ----------------------------------------------------------------------------- config


def test_published_config_reads_every_dflash2_key_and_its_rope():
    """The shrunk published config: nested DFlash 2 keys, top-level is_causal false, all layers sliding,
    rope_parameters theta 5e5 (transformers 4.57's Qwen3Config would keep 1e4)."""
    cfg = DFlashConfig(**CONFIG)
    assert cfg.is_dflash2 and (cfg.conv_kernel_size, cfg.conv_group_size, cfg.selector_rank, cfg.selector_top_k) == (K, G, R, TOP_K)
    assert cfg.rope_theta == 500000.0 and cfg.is_causal is False and cfg.layer_is_causal(0) is False
    plain = {k: v for k, v in CONFIG.items() if k not in ("architectures", "dflash_config")}
    assert not DFlashConfig(**plain, dflash_config={"target_layer_ids": [0, 1, 2], "mask_token_id": 96}).is_dflash2


def test_dflash2_keys_nested_first_then_top_level():
    nested = dict(CONFIG["dflash_config"])
    top = {k: nested.pop(k) for k in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")}
    flat = DFlashConfig(**dict(CONFIG, dflash_config=nested, **top))
    assert (flat.conv_group_size, flat.selector_top_k) == (G, TOP_K)
    both = DFlashConfig(**dict(CONFIG, selector_top_k=2))  # nested 4 wins over top-level 2
    assert both.selector_top_k == TOP_K
    assert DFlashConfig(**dict(CONFIG, dflash_config=dict(CONFIG["dflash_config"], is_causal=True))).is_causal is True
    saved = DFlashConfig(**dict(CONFIG, dflash_config=nested, **top)).to_dict()
    assert {k: saved["dflash_config"][k] for k in top} == top and not set(top) & set(saved)


@pytest.mark.parametrize("change, match", [
    ({"conv_group_size": 16}, r"conv_group_size=16 does not divide hidden_size=40"),
    ({"selector_top_k": 98}, r"selector_top_k=98 exceeds vocab_size=97"),
    ({"selector_rank": 0}, r"selector_rank must be an integer >= 1, got 0"),
    ({"selector_rank": None}, r"needs all of .* but not \['selector_rank'\]"),
])
def test_bad_dflash2_keys_are_refused_naming_the_values(change, match):
    nested = {k: v for k, v in dict(CONFIG["dflash_config"], **change).items() if v is not None}
    with pytest.raises(ValueError, match=match):
        DFlashConfig(**dict(CONFIG, dflash_config=nested))


def test_each_class_refuses_the_other_generation():
    with pytest.raises(ValueError, match="use DFlash2DraftModel"):
        DFlashDraftModel(DFlashConfig(**CONFIG))
    plain = {k: v for k, v in CONFIG["dflash_config"].items() if k in ("target_layer_ids", "mask_token_id")}
    with pytest.raises(ValueError, match="use DFlashDraftModel"):
        DFlash2DraftModel(DFlashConfig(**dict(CONFIG, architectures=None, dflash_config=plain)))


# ----------------------------------------------------------------------------- loading the published layout


def test_published_layout_loads_strictly_through_the_class(tmp_path, caplog):
    tensors = published_tensors()
    folder = write_published(tmp_path / "d", tensors)
    with caplog.at_level(logging.INFO):
        model = DFlashDraftModel.from_pretrained(str(folder), dtype=torch.float32)
    assert type(model) is DFlash2DraftModel
    assert [r.getMessage() for r in caplog.records if "DFlash 2 drafter" in r.getMessage()] == [
        f"{folder} is a DFlash 2 drafter: loading it as DFlash2DraftModel"]
    assert_holds(model, tensors)
    head_dim = CONFIG["head_dim"]
    want = 1.0 / 500000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    assert torch.equal(model.rotary_emb.inv_freq_on(torch.device("cpu")), want)  # theta 5e5 on 4.57.1 too
    assert model.config.layer_window(0) == 6 and not model.config.layer_is_causal(0)


@pytest.mark.parametrize("name", ["candidate_selector.successor_codebook", "layers.3.mlp_conv.base_kernel"])
def test_a_missing_tensor_is_an_error_naming_it(tmp_path, name):
    tensors = published_tensors()
    del tensors[name]
    folder = write_published(tmp_path / "d", tensors)
    with pytest.raises(ValueError, match=rf"missing_keys \['{name}'\]"):
        DFlashDraftModel.from_pretrained(str(folder))


def test_trainer_spelling_of_the_codebooks_is_read_and_saved_back_published(tmp_path):
    """``...codebook.weight`` (an nn.Embedding, as z-lab's class names it) loads; saving writes the
    published names (transformers 5 would otherwise rename them back, with a trailing '$')."""
    tensors = published_tensors()
    spelled = {(k + ".weight" if k in CODEBOOKS else k): v for k, v in tensors.items()}
    model = DFlashDraftModel.from_pretrained(str(write_published(tmp_path / "d", spelled)), dtype=torch.float32)
    assert_holds(model, tensors)
    model.save_pretrained(tmp_path / "saved")
    assert set(stored(tmp_path / "saved")) == set(HEADER)
    by_hook = DFlash2DraftModel(DFlashConfig(**CONFIG))  # the state-dict route (z-lab's state dict) too
    by_hook.load_state_dict({k: v.float() for k, v in spelled.items()})
    assert_holds(by_hook, tensors)


def test_folder_written_here_loads_with_automodel_remote_code(tmp_path):
    tensors = published_tensors()
    model = DFlashDraftModel.from_pretrained(str(write_published(tmp_path / "d", tensors)))
    model.save_pretrained(tmp_path / "ours")
    saved = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert saved["architectures"] == ["DFlash2DraftModel"]
    assert saved["auto_map"] == {"AutoConfig": "configuration_dflash.DFlashConfig", "AutoModel": "modeling_dflash.DFlash2DraftModel"}
    assert {k: saved["dflash_config"][k] for k in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")} == {
        "conv_kernel_size": K, "conv_group_size": G, "selector_rank": R, "selector_top_k": TOP_K}
    assert (tmp_path / "ours" / "dflash2.py").is_file()
    assert set(stored(tmp_path / "ours")) == set(HEADER)  # published names, codebooks without .weight
    remote = AutoModel.from_pretrained(str(tmp_path / "ours"), trust_remote_code=True, dtype=torch.float32)
    assert type(remote).__name__ == "DFlash2DraftModel" and type(remote).__module__.startswith("transformers_modules")
    assert_holds(remote, tensors)
    assert remote.config.rope_theta == 500000.0
    plain = AutoConfig.from_pretrained(str(tmp_path / "ours"))  # engines read a plain Qwen3 config
    assert type(plain).__name__ == "Qwen3Config" and plain.dflash_config["selector_top_k"] == TOP_K


def test_automodel_loads_a_dflash1_folder_after_a_dflash2_one_in_the_same_process(tmp_path):
    """transformers 5 maps the remote config class to the first model class loaded for it: a DFlash 1
    folder (same configuration_dflash.py, same basename) loaded after a DFlash 2 one must still get
    DFlashDraftModel, and the reverse."""
    from tiny import tiny_draft

    DFlashDraftModel.from_pretrained(str(write_published(tmp_path / "src"))).save_pretrained(tmp_path / "two" / "drafter")
    tiny_draft().save_pretrained(tmp_path / "one" / "drafter")
    for name, want in [("two", "DFlash2DraftModel"), ("one", "DFlashDraftModel"), ("two", "DFlash2DraftModel")]:
        model = AutoModel.from_pretrained(str(tmp_path / name / "drafter"), trust_remote_code=True)
        assert type(model).__name__ == want


def test_converter_reads_verifies_and_writes_dflash2(tmp_path):
    tensors = published_tensors()
    prefixed = {("model." + k if k.startswith("layers.0.") else k): v for k, v in tensors.items()}
    prefixed = {(k + ".weight" if k in CODEBOOKS else k): v for k, v in prefixed.items()}
    plan = convert_checkpoint(str(write_published(tmp_path / "src", prefixed)), str(tmp_path / "out"))
    assert plan.dialect == "specforge" and len(plan.renamed) == 15 + 2
    assert "dflash2.py" in plan.files and any("AutoModel(trust_remote_code=True)" in c for c in plan.checks)
    assert set(stored(tmp_path / "out")) == set(HEADER)
    for name, value in stored(tmp_path / "out").items():
        assert torch.equal(value, tensors[name]), name
    text = plan.describe()
    assert f"DFlash 2: convolution {K} taps, groups of {G} channels; selector top-k {TOP_K}, rank {R}" in text
    assert "vllm-project/vllm#52816" in text and "--speculative-algorithm DFLASH" in text
    assert '"method": "dflash"' in text and '"num_speculative_tokens": 15' in text
    from model_cards.render import render_model_card

    card = str(render_model_card(str(tmp_path / "out"), "me/Tiny-DFlash2", license="mit"))
    assert "is a [DFlash](https://arxiv.org/abs/2602.06036) 2 draft model" in card
    assert f"candidate selector: top-k {TOP_K}, rank r = {R}" in card


def test_converter_refuses_the_muse_glimmer_v1_weights_by_name(tmp_path):
    tensors = published_tensors()
    tensors["encoder.fc.weight"] = tensors.pop("fc.weight")
    with pytest.raises(ConversionError, match=r"'encoder\.fc\.weight'.*Muse Glimmer v1 assistant"):
        convert_checkpoint(str(write_published(tmp_path / "src", tensors)), str(tmp_path / "out"), dry_run=True)


def test_block_size_below_the_trained_size(tmp_path):
    folder = write_published(tmp_path / "d")
    model = DFlashDraftModel.from_pretrained(str(folder), dtype=torch.float32, block_size=4)
    assert model.config.block_size == 4 and model.config.conv_kernel_size == K
    head = torch.nn.Linear(H, V, bias=False)
    with torch.no_grad():
        hidden = model(**draft_inputs(block=4))
        draft = model.propose(hidden, torch.tensor([3, 5]), head)
    assert draft.tokens.shape == (2, 3) and draft.q.shape == (2, 3, V)


# ----------------------------------------------------------------------------- identity init


def test_fresh_dflash2_is_the_identity_and_drafts_as_its_dflash1_backbone():
    """Fresh DFlash 2 parts (tap 0 = 1, projection 0, successor codebook 0) on a DFlash 1 backbone:
    the same hidden states bit for bit and the greedy walk picks the per-slot argmax."""
    dflash1_config = {k: v for k, v in CONFIG["dflash_config"].items()
                      if k not in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")}
    torch.manual_seed(0)
    backbone = DFlashDraftModel(DFlashConfig(**dict(CONFIG, architectures=None, dflash_config=dflash1_config))).eval()
    torch.manual_seed(1)
    model = DFlash2DraftModel(DFlashConfig(**CONFIG)).eval()
    conv = model.layers[0].attention_conv
    assert torch.equal(conv.base_kernel[:, 0], torch.ones(2, H)) and not conv.base_kernel[:, 1:].any()
    assert not conv.kernel_projection.weight.any() and not model.candidate_selector.successor_codebook.any()
    missing, unexpected = model.load_state_dict(backbone.state_dict(), strict=False)
    assert not unexpected and all("_conv." in k or k.startswith("candidate_selector.") for k in missing)
    head = torch.nn.Linear(H, V, bias=False)
    with torch.no_grad():
        hidden = model(**draft_inputs())
        assert torch.equal(hidden, backbone(**draft_inputs()))
        draft = model.propose(hidden, torch.tensor([3, 5]), head)
    assert torch.equal(draft.tokens, head(hidden[:, 1:]).argmax(-1))


def test_init_weights_leaves_loaded_parameters_alone():
    model = random_dflash2()
    conv, selector = model.layers[1].mlp_conv, model.candidate_selector
    base, codebook = conv.base_kernel.detach().clone(), selector.successor_codebook.detach().clone()
    conv.base_kernel._is_hf_initialized = True  # what transformers sets on a tensor read from the checkpoint
    selector.successor_codebook._is_hf_initialized = True
    model._init_weights(conv)
    model._init_weights(selector)
    assert torch.equal(conv.base_kernel, base) and not conv.kernel_projection.weight.any()
    assert torch.equal(selector.successor_codebook, codebook)


# ----------------------------------------------------------------------------- the convolution


def conv_by_hand(x, dynamic, base, group):
    """out[t, c] = sum over taps o with t - o >= 0 of (base[o, c] + dynamic[t, o, c // group]) * x[t - o, c]."""
    out = torch.zeros_like(x)
    for t in range(x.shape[1]):
        for o in range(base.shape[0]):
            if t - o >= 0:
                out[:, t] += (base[o] + dynamic[:, t, o].repeat_interleave(group, dim=-1)) * x[:, t - o]
    return out


def test_convolution_matches_the_formula_and_sees_nothing_before_the_block():
    gen = torch.Generator().manual_seed(0)
    x, base = torch.randn(2, 6, H, generator=gen), torch.randn(3, H, generator=gen)
    dynamic = torch.randn(2, 6, 3, H // G, generator=gen)
    torch.testing.assert_close(grouped_dynamic_causal_conv(x, dynamic, base, G), conv_by_hand(x, dynamic, base, G))
    later = x.clone()
    later[:, 3:] += 5.0  # later positions never reach earlier outputs
    assert torch.equal(grouped_dynamic_causal_conv(later, dynamic, base, G)[:, :3],
                       grouped_dynamic_causal_conv(x, dynamic, base, G)[:, :3])
    short = grouped_dynamic_causal_conv(x[:, :1], dynamic[:, :1], base, G)  # a 1-token block: the anchor alone
    torch.testing.assert_close(short, (base[0] + dynamic[:, :1, 0].repeat_interleave(G, -1)) * x[:, :1])


def test_dflash2_layer_matches_the_formula_on_both_sides_of_both_sublayers():
    """h = x + conv(attn(conv(ln1 x; D_a0)); D_a1), out = h + conv(mlp(conv(ln2 h; D_m0)); D_m1), both sides'
    D from the normed input. Planted bug caught: a layer that skips the output side (finish)."""
    model = random_dflash2()
    layer = model.layers[2]
    inputs = draft_inputs(block=7)
    x = inputs["noise_embedding"]
    target_hidden = model.hidden_norm(model.fc(inputs["target_hidden"]))
    embeddings = model.rotary_emb(x, inputs["position_ids"])
    mask = model._layer_masks(inputs["position_ids"], 7, 0, None)[2]

    def sides(conv, u):
        d = (u @ conv.kernel_projection.weight.T).view(*u.shape[:2], 2, K, H // G)
        return d[:, :, 0], d[:, :, 1], conv.base_kernel

    with torch.no_grad():
        u = layer.input_layernorm(x)
        pre, post, base = sides(layer.attention_conv, u)
        attended = layer.self_attn(conv_by_hand(u, pre, base[0], G), target_hidden, embeddings, mask)
        h = x + conv_by_hand(attended, post, base[1], G)
        u = layer.post_attention_layernorm(h)
        pre, post, base = sides(layer.mlp_conv, u)
        want = h + conv_by_hand(layer.mlp(conv_by_hand(u, pre, base[0], G)), post, base[1], G)
        got = layer(x, target_hidden, embeddings, mask)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)  # the hand sum runs in another order


def test_non_causal_sliding_window_is_two_sided_inside_the_block():
    """z-lab _attention_mask: a bidirectional sliding layer also hides keys window or more positions AHEAD
    (the published DFlash 2 layers are non-causal sliding; it matters once window < block)."""
    q_pos, k_pos = torch.arange(2, 8)[None], torch.arange(0, 8)[None]
    mask = block_attention_mask(q_pos, k_pos, causal=False, window=3, key_valid=None)[0, 0]
    visible = {(int(q), int(k)) for q in q_pos[0] for k in k_pos[0] if abs(int(q) - int(k)) < 3}
    assert {(int(q_pos[0, i]), j) for i, j in mask.nonzero().tolist()} == visible


# ----------------------------------------------------------------------------- the selector walk


def strong_selector(seed=0) -> CandidateSelector:
    """A selector whose bilinear term is as large as the unary logits (it changes the walked path)."""
    selector = CandidateSelector(H, V, R, TOP_K)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in selector.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.6)
    return selector


@torch.no_grad()
def walk_by_hand(selector, hidden, logits, anchors, k, temperature=None, path=None, ban_repeats=False):
    """Row by row, slot by slot, in Python: candidates = the k largest logits (a set); score(c) = logits[c] +
    sum_r A[prev, r] * (P h)[r] * B[c, r]. Greedy: argmax. With ``path`` (a sampled walk), q of each slot is
    softmax(score / T) given the predecessor ``path`` chose. Returns (tokens, candidate sets, q rows {c: q})."""
    A, B, P = selector.predecessor_codebook, selector.successor_codebook, selector.hidden_projection.weight
    tokens, sets, qs = [], [], []
    for b in range(hidden.shape[0]):
        prev, row_tokens, row_sets, row_qs = int(anchors[b]), [], [], []
        for j in range(hidden.shape[1]):
            row = logits[b, j].clone()
            if ban_repeats and j > 0:
                row[prev] = float("-inf")
            cands = set(torch.argsort(row, descending=True)[:k].tolist())
            projected = P @ hidden[b, j]
            score = {c: float(row[c]) + float((A[prev] * projected * B[c]).sum()) for c in cands}
            if temperature is None:
                chosen = max(score, key=score.get)
            else:
                z = torch.tensor([score[c] / temperature for c in sorted(cands)]).softmax(-1)
                row_qs.append(dict(zip(sorted(cands), z.tolist())))
                chosen = int(path[b, j])
            row_tokens.append(chosen)
            row_sets.append(cands)
            prev = chosen
        tokens.append(row_tokens)
        sets.append(row_sets)
        qs.append(row_qs)
    return torch.tensor(tokens), sets, qs


def walk_inputs(batch=6, slots=5, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, slots, H, generator=gen), torch.randn(batch, slots, V, generator=gen) * 2, \
        torch.randint(0, V, (batch,), generator=gen)


def test_greedy_walk_matches_the_independent_walk():
    selector = strong_selector()
    hidden, logits, anchors = walk_inputs()
    with torch.no_grad():
        draft = selector_walk(selector, hidden, logits, anchors)
        tokens, sets, _ = walk_by_hand(selector, hidden, logits, anchors, TOP_K)
    assert torch.equal(draft.tokens, tokens)
    assert [[set(c.tolist()) for c in row] for row in draft.candidates] == sets
    assert torch.equal(draft.q, F.one_hot(draft.tokens, V).float()) and draft.q.dtype == torch.float32
    changed = (draft.tokens != logits.argmax(-1)).float().mean()
    assert changed >= 1 / 3, f"the bilinear term changed only {changed:.2f} of the slots: the test has no teeth"


def test_sampled_q_rows_are_softmax_over_the_candidates_given_the_sampled_predecessor():
    """Planted bugs caught: q computed from the greedy predecessor; q at T=1 while drawing at T=0.7."""
    selector = strong_selector()
    hidden, logits, anchors = walk_inputs(batch=8)
    with torch.no_grad():
        draft = selector_walk(selector, hidden, logits, anchors, do_sample=True, temperature=0.7,
                              generator=torch.Generator().manual_seed(3))
        greedy = selector_walk(selector, hidden, logits, anchors)
        _, sets, qs = walk_by_hand(selector, hidden, logits, anchors, TOP_K, temperature=0.7, path=draft.tokens)
    assert (draft.tokens[:, :-1] != greedy.tokens[:, :-1]).any()  # some slots follow a non-greedy predecessor
    for b in range(hidden.shape[0]):
        for j in range(hidden.shape[1]):
            want = torch.zeros(V)
            for c, p in qs[b][j].items():
                want[c] = p
            torch.testing.assert_close(draft.q[b, j], want)
            assert set(draft.candidates[b, j].tolist()) == sets[b][j]
    torch.testing.assert_close(draft.candidate_q, draft.q.gather(-1, draft.candidates))


def test_sampled_walk_draws_from_its_q():
    """4000 copies of one block: slot 0 tokens follow q_0; slot 1 tokens after the most frequent slot-0
    token follow the q_1 computed from that predecessor (the conditional the rejection test uses)."""
    selector = strong_selector(seed=2)
    hidden, logits, anchors = walk_inputs(batch=1, slots=2, seed=4)
    n = 4000
    with torch.no_grad():
        draft = selector_walk(selector, hidden.expand(n, -1, -1), logits.expand(n, -1, -1), anchors.expand(n),
                              do_sample=True, temperature=0.7, generator=torch.Generator().manual_seed(5))
    first = draft.tokens[:, 0]
    torch.testing.assert_close(torch.bincount(first, minlength=V).float() / n, draft.q[0, 0], atol=0.03, rtol=0)
    a = int(torch.mode(first).values)
    rows = first == a
    _, _, qs = walk_by_hand(selector, hidden, logits, anchors, TOP_K, temperature=0.7, path=torch.tensor([[a, 0]]))
    want = torch.zeros(V)
    for c, p in qs[0][1].items():
        want[c] = p
    seen = torch.bincount(draft.tokens[rows, 1], minlength=V).float() / rows.sum()
    torch.testing.assert_close(seen, want, atol=0.05, rtol=0)


def test_per_slot_processor_sees_the_drafted_prefix():
    selector = strong_selector()
    hidden, logits, anchors = walk_inputs()
    calls = []

    def no_repeat(slot, drafted, slot_logits):
        calls.append((slot, drafted.clone()))
        if slot == 0:
            return slot_logits
        return slot_logits.scatter(-1, drafted[:, -1:], float("-inf"))

    with torch.no_grad():
        identity = selector_walk(selector, hidden, logits, anchors, process=lambda slot, drafted, x: x)
        batched = selector_walk(selector, hidden, logits, anchors)
        banned = selector_walk(selector, hidden, logits, anchors, process=no_repeat)
        tokens, _, _ = walk_by_hand(selector, hidden, logits, anchors, TOP_K, ban_repeats=True)
    assert all(torch.equal(x, y) for x, y in zip(identity, batched))
    assert torch.equal(banned.tokens, tokens) and (banned.tokens[:, 1:] != banned.tokens[:, :-1]).all()
    assert [slot for slot, _ in calls] == list(range(hidden.shape[1]))
    assert all(torch.equal(drafted, banned.tokens[:, :slot]) for slot, drafted in calls)


@pytest.mark.parametrize("rank,top_k", [(R, TOP_K), (256, 16)])  # the fixture's sizes; the published ones
def test_table_walk_is_bit_identical_to_the_slot_by_slot_walk(rank, top_k):
    """Without processors the walk reads every score after slot 0 from ``transition_scores`` (one batched
    pass); with an identity processor it scores slot by slot as z-lab does. Sampled q rows equal bit for
    bit (so do the scores under them), with the same draws from the same generator, and greedy walks
    equal. Planted bugs caught: predecessors taken from the slot's own candidates; the bilinear term as one
    einsum over all predecessors at once (``bjpr,bjkr->bjpk``: other rounding, rank 256 fails)."""
    selector = CandidateSelector(H, V, rank, top_k)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for param in selector.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.6)
        hidden, logits, anchors = walk_inputs(batch=5, slots=15, seed=8)
        walks = {sample: [selector_walk(selector, hidden, logits, anchors, do_sample=sample, temperature=0.7,
                                        generator=torch.Generator().manual_seed(9), process=process)
                          for process in (None, lambda slot, drafted, x: x)] for sample in (False, True)}
        for sample, (table, by_slot) in walks.items():
            assert all(torch.equal(x, y) for x, y in zip(table, by_slot)), f"do_sample={sample}"
        assert (walks[False][0].tokens != logits.argmax(-1)).float().mean() > 0.3  # the bilinear term decides
        one = selector_walk(selector, hidden[:, :1], logits[:, :1], anchors)  # one mask slot: no table
        by_hand = walk_by_hand(selector, hidden[:, :1], logits[:, :1], anchors, top_k)[0]
        assert torch.equal(one.tokens, by_hand)
    best = torch.randint(0, top_k, (5, 14, top_k), generator=gen)  # the greedy chain: host (CPU) and device way
    first = torch.randint(0, top_k, (5,), generator=gen)
    host, device = (dflash2._greedy_chain(first, best, 5, 15, on_host=way) for way in (True, False))
    assert torch.equal(host, device) and host[2, 3] == best[2, 2, host[2, 2]]


def test_walk_refuses_bad_input_before_any_work():
    selector = strong_selector()
    hidden, logits, anchors = walk_inputs()
    with pytest.raises(ValueError, match="sampling needs temperature > 0, got 0.0"):
        selector_walk(selector, hidden, logits, anchors, do_sample=True, temperature=0.0)
    with pytest.raises(ValueError, match=r"hidden \(6, 4, 40\) and logits \(6, 5, 97\)"):
        selector_walk(selector, hidden[:, :4], logits, anchors)
    with pytest.raises(ValueError, match=r"top_k=98 must be in \[1, vocab size 97\]"):
        selector_walk(selector, hidden, logits, anchors, top_k=98)


def test_propose_walks_the_transformed_logits_of_the_mask_slots():
    """propose = selector_inputs (slots 1.., head x output_multiplier, soft-capped) + selector_walk."""
    model = random_dflash2()
    head = torch.nn.Linear(H, V, bias=False)
    with torch.no_grad():
        hidden = model(**draft_inputs())
        draft = model.propose(hidden, torch.tensor([3, 5]), head)
        cap, mult = CONFIG["dflash_config"]["final_logit_softcapping"], CONFIG["dflash_config"]["output_multiplier"]
        logits = torch.tanh(head(hidden[:, 1:]) * mult / cap) * cap
        tokens, _, _ = walk_by_hand(model.candidate_selector, hidden[:, 1:], logits, torch.tensor([3, 5]), TOP_K)
    assert torch.equal(draft.tokens, tokens) and draft.tokens.shape == (2, 15)
    assert dflash2.SelectorDraft._fields == ("tokens", "q", "candidates", "candidate_q")


def test_spec_generate_with_a_dflash2_drafter_gives_the_targets_tokens():
    """The loop runs a DFlash 2 drafter (convolutions and selector walk; oracle, sampling and routes in
    test_dflash2_generate.py) and stays lossless: greedy output == target.generate."""
    from tiny import tiny_target

    target, draft = tiny_target(peaked=True), random_dflash2()
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    assert torch.equal(draft.spec_generate(target, ids, max_new_tokens=20, temperature=0.0),
                       target.generate(ids, max_new_tokens=20, do_sample=False))
