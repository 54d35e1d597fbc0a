"""Target families: greedy equality with ``target.generate`` at batch 1 and in ragged batches,
past every sliding window (window 6, prompt + output up to 45 tokens), with oracle drafts that are
fully, partly and never accepted; one sampling distribution test on a Gemma-4 target; refusals
named before any forward (Gemma-3n, RoPE switches: dynamic, longrope in a batch); an accelerate disk-offloaded embedding.

Targets are peaked (``tiny.peak``) so that a window off by one or a shifted position changes the
output; the planted-bug notes on each test say what it was shown to catch.
"""

import pathlib

import pytest
import torch
import transformers

import generation_utils
import proposers
import target_families
from family_targets import BUILDERS, TARGET_CONFIGS, family_target, published_target
from patching import patch_called
from tiny import VOCAB, tiny_draft, tiny_target

LENS = (3, 11, 20)
NEW = 25  # 20 + 25 > 6 * 7: every row passes the window several times
PROMPTS = {n: torch.randint(0, 96, (1, n), generator=torch.Generator().manual_seed(100 + n)) for n in LENS}
IS_5 = int(transformers.__version__.split(".")[0]) >= 5


def _generate(target, ids, n):
    return target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n)


def _left_pad(prompts):
    width = max(p.shape[1] for p in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - p.shape[1]:], mask[i, width - p.shape[1]:] = p[0], 1
    return ids, mask


def _install_oracle(monkeypatch, refs):
    """Draft logits right for ``(step + row) % 3`` -> all / 1 / 0 slots, so blocks are fully, partly
    and never accepted, and rows of a batch accept different counts (cache holes)."""
    real = proposers._draft_logits
    counts = []

    def fake(draft, embed, head, anchor, ctx, draft_cache, draft_valid, start, b, mask_token_id):
        real(draft, embed, head, anchor, ctx, draft_cache, draft_valid, start, b, mask_token_id)
        rows = []
        for s, a in zip(start.tolist(), anchor[:, 0].tolist()):
            r = next(r for r, ref in enumerate(refs) if ref.shape[1] > s and ref[0, s] == a)
            want = torch.cat([refs[r][0, s + 1: s + b], torch.zeros(b, dtype=torch.long)])[: b - 1].clone()
            right = (b - 1, 1, 0)[(len(counts) + r) % 3]
            want[right:] = (want[right:] + 1) % VOCAB
            rows.append(torch.nn.functional.one_hot(want, VOCAB).float() * 30)
        counts.append(len(rows))
        return torch.stack(rows)

    patch_called(monkeypatch, proposers, "_draft_logits", fake)
    return counts


def _family_params():
    out = []
    for name in BUILDERS:
        marks = []
        if name == "gemma4":
            marks = [pytest.mark.skipif(not hasattr(transformers, "Gemma4ForCausalLM"),
                                        reason="Gemma 4 exists from transformers 5.x on")]
        out.append(pytest.param(name, marks=marks))
    return out


@pytest.mark.parametrize("name", _family_params())
def test_family_greedy_equals_generate_batch_1_and_ragged(name, monkeypatch):
    """Planted bugs caught: window off by one (``diff <= window`` in ``window_masks``) on every
    sliding family; no window mask on a ragged batch (the old 2-D mask) on mistral/qwen2/phi3;
    ``logits_to_keep=1`` on Gemma 4 (tap shape error)."""
    target = family_target(name)
    assert target_families.sliding_target(target), name
    draft = tiny_draft(block_size=4)
    refs = [_generate(target, PROMPTS[n], NEW) for n in LENS]
    assert len({tuple(r[0, -NEW:].tolist()) for r in refs}) == len(LENS)  # not a degenerate target
    calls = _install_oracle(monkeypatch, refs)
    for r, n in enumerate(LENS):
        out = draft.spec_generate(target, PROMPTS[n], max_new_tokens=NEW, temperature=0.0, return_dict_in_generate=True)
        assert torch.equal(out.sequences, refs[r]), (name, "batch 1", n)
        assert {1, 2, 4} <= set(out.acceptance_lengths)  # never, partly, fully accepted blocks
    ids, mask = _left_pad([PROMPTS[n] for n in LENS])
    calls.clear()
    out = draft.spec_generate(target, ids, attention_mask=mask, max_new_tokens=NEW, temperature=0.0,
                              return_dict_in_generate=True)
    for r, n in enumerate(LENS):
        assert torch.equal(out.sequences[r, ids.shape[1]:], refs[r][0, n:]), (name, "ragged row", r)
    rows = out.row_acceptance_lengths
    assert rows[0] != rows[1] != rows[2]  # rows committed different counts: the cache had holes


@pytest.mark.skipif(not hasattr(transformers, "Gemma4ForCausalLM"), reason="Gemma 4 exists from transformers 5.x on")
def test_gemma4_taps_are_checked_for_the_forward_length():
    """Gemma 4 slices its KV-shared layers under ``logits_to_keep``: the tap check names the layer."""
    target = family_target("gemma4")
    ids = PROMPTS[11]
    with torch.no_grad(), generation_utils.capture_target_features(target, [0, 2]) as get:
        target(input_ids=ids)
        assert get().shape == (1, 11, 80)
        target(input_ids=ids, logits_to_keep=1)
        with pytest.raises(ValueError, match=r"target layer 2 returned hidden states of shape \(1, 1, 40\), expected \(1, 11"):
            get()
    assert target_families.prefill_kwargs(target, {"logits_to_keep": None}) == {}


@pytest.mark.skipif(not hasattr(transformers, "Gemma4ForConditionalGeneration"),
                    reason="Gemma 4 exists from transformers 5.x on")
def test_gemma4_conditional_generation_wrapper_runs_exactly():
    """The multimodal wrapper: embeddings, head and decoder found through public accessors."""
    text = dict(family_target("gemma4").config.to_dict(), pad_token_id=0)  # the wrapper pads media slots with it
    torch.manual_seed(0)
    config = transformers.Gemma4Config(text_config=text, vision_config=None, audio_config=None)
    target = transformers.Gemma4ForConditionalGeneration(config).eval()
    target.generation_config.eos_token_id = target.generation_config.pad_token_id = None
    from tiny import peak
    peak(target)
    ref = _generate(target, PROMPTS[20], 20)
    out = tiny_draft(block_size=4).spec_generate(target, PROMPTS[20], max_new_tokens=20, temperature=0.0)
    assert torch.equal(out, ref)


def test_gemma3n_is_refused_by_name():
    if not hasattr(transformers, "Gemma3nForCausalLM"):
        pytest.skip("no Gemma-3n in this transformers")
    config = transformers.Gemma3nTextConfig(
        vocab_size=VOCAB, vocab_size_per_layer_input=VOCAB, hidden_size=40, intermediate_size=72, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=10, hidden_size_per_layer_input=8, sliding_window=6,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"], num_kv_shared_layers=0,
        altup_num_inputs=2, laurel_rank=4, activation_sparsity_pattern=[0.0, 0.0, 0.0])
    target = transformers.Gemma3nForCausalLM(config).eval()
    with pytest.raises(NotImplementedError, match="gemma3n_text.*AltUp"):
        tiny_draft().spec_generate(target, PROMPTS[3], max_new_tokens=4, temperature=0.0)


# ----------------------------------------------------------------------------- Gemma's block embedding


@pytest.mark.parametrize("override", [None, 2.5])
@pytest.mark.parametrize("name", [p for p in _family_params() if p.values[0] in ("gemma3", "gemma4")])
def test_gemma_block_embedding_is_the_raw_row_times_sqrt_hidden(name, override):
    """Gemma 3/4 targets: the draft block is the raw row x sqrt(hidden) (= the embedding module's own
    output, nothing else), unless the drafter sets ``input_embedding_scale``; greedy output is the
    target's either way. Planted bug caught: the raw row alone (the convention before issue 26)."""
    target, draft = family_target(name), tiny_draft(block_size=4, input_embedding_scale=override)
    embed, mask = target.get_input_embeddings(), draft.config.mask_token_id
    seen = []
    handle = draft.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["noise_embedding"]), with_kwargs=True)
    try:
        out = draft.spec_generate(target, PROMPTS[11], max_new_tokens=12, temperature=0.0)
    finally:
        handle.remove()
    assert torch.equal(out, _generate(target, PROMPTS[11], 12))
    block = torch.tensor([[int(out[0, 11]), mask, mask, mask]])
    factor = 40 ** 0.5 if override is None else override
    torch.testing.assert_close(seen[0], embed.weight[block] * factor, rtol=0, atol=0)
    if override is None:
        torch.testing.assert_close(seen[0], embed(block))


# ----------------------------------------------------------------------------- RoPE switches


def _dynamic_target():
    return tiny_target("llama", peaked=True, max_position_embeddings=40,
                       rope_scaling={"rope_type": "dynamic", "factor": 2.0})


def _longrope_target():
    factors = [1.0, 1.5, 2.0, 3.0, 4.0]  # head_dim 10 -> 5 frequencies
    torch.manual_seed(0)
    config = transformers.Phi3Config(
        vocab_size=VOCAB, hidden_size=40, intermediate_size=72, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, original_max_position_embeddings=32,
        rope_scaling={"type": "longrope", "short_factor": factors, "long_factor": [f * 2 for f in factors]},
        eos_token_id=None, bos_token_id=None, pad_token_id=None)
    target = transformers.Phi3ForCausalLM(config).eval()
    target.generation_config.eos_token_id = target.generation_config.pad_token_id = None
    return target


@pytest.mark.parametrize("build, kind, first, batch", [(_dynamic_target, "dynamic", 40, 1),
                                                       (_longrope_target, "longrope", 32, 2)])
def test_position_dependent_rope_exact_below_the_switch_refused_past_it(build, kind, first, batch):
    """``dynamic`` is refused past its switch at any batch; ``longrope`` in a batch (batch 1 crosses it
    exactly, tests/test_longrope.py). Planted bug caught: a switch one position late (``last > first``)
    lets a diverging call run."""
    target, draft = build(), tiny_draft(block_size=4)
    assert target_families.rope_switch(target) == (kind, first)
    prompt = PROMPTS[11].repeat(batch, 1)
    below = first + 1 - 11  # highest position fed = 11 + below - 2 = first - 1
    out = draft.spec_generate(target, prompt, max_new_tokens=below, temperature=0.0)
    assert torch.equal(out, _generate(target, prompt, below))
    calls = []
    handle = target.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        with pytest.raises(NotImplementedError, match=rf"RoPE type '{kind}' .* position {first} .* reach position {first}"):
            draft.spec_generate(target, prompt, max_new_tokens=below + 1, temperature=0.0)
    finally:
        handle.remove()
    assert calls == []  # refused before any forward


# ----------------------------------------------------------------------------- offloaded targets


@pytest.mark.skipif(not IS_5, reason="transformers 4.57.1: generate itself fails on a disk-offloaded embedding")
def test_disk_offloaded_embedding_runs_exactly(tmp_path):
    target = tiny_target(peaked=True)
    target.save_pretrained(tmp_path / "t")
    device_map = {"model.embed_tokens": "disk", "model.layers": "cpu", "model.norm": "cpu",
                  "model.rotary_emb": "cpu", "lm_head": "cpu"}
    offloaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "t", device_map=device_map, offload_folder=str(tmp_path / "off")).eval()
    assert offloaded.get_input_embeddings().weight.device.type == "meta"
    offloaded.generation_config.eos_token_id = offloaded.generation_config.pad_token_id = None
    ref = _generate(target, PROMPTS[20], 20)
    assert torch.equal(_generate(offloaded, PROMPTS[20], 20), ref)
    out = tiny_draft(block_size=4).spec_generate(offloaded, PROMPTS[20], max_new_tokens=20, temperature=0.0)
    assert torch.equal(out, ref)


# ----------------------------------------------------------------------------- sampling on Gemma 4


@pytest.mark.skipif(not hasattr(transformers, "Gemma4ForCausalLM"), reason="Gemma 4 exists from transformers 5.x on")
def test_gemma4_sampling_distribution_is_the_targets():
    """Chi-square of spec_generate samples against the enumerated Gemma-4 distribution (soft-capped
    target logits; draft with its own soft-capping), as in test_sampling."""
    from test_sampling import _chi_square, _exact_joint, _sampled_counts
    from transformers import LogitsProcessorList, TemperatureLogitsWarper

    vocab = 8
    torch.manual_seed(11)
    config = transformers.Gemma4TextConfig(
        vocab_size=vocab, hidden_size=16, intermediate_size=24, num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, global_head_dim=8, sliding_window=3, num_kv_shared_layers=1,
        layer_types=["sliding_attention", "full_attention", "full_attention"], hidden_size_per_layer_input=4,
        vocab_size_per_layer_input=vocab, final_logit_softcapping=5.0, eos_token_id=None, bos_token_id=None,
        pad_token_id=None, rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                            "full_attention": {"rope_type": "default", "rope_theta": 1e6}})
    target = transformers.Gemma4ForCausalLM(config).eval()
    with torch.no_grad():
        target.get_input_embeddings().weight.mul_(4.0)  # tied head: sharper logits
    target.generation_config.eos_token_id = target.generation_config.pad_token_id = None
    draft = tiny_draft(seed=12, vocab_size=vocab, mask_token_id=vocab - 1, block_size=2, hidden_size=16,
                       intermediate_size=24, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                       final_logit_softcapping=5.0)
    prompt = torch.tensor([[1, 4, 2, 5, 3]])
    exact = _exact_joint(target, prompt, LogitsProcessorList([TemperatureLogitsWarper(0.8)]), 3)
    counts = _sampled_counts(draft, target, prompt, 6000, 3, 0, temperature=0.8, top_k=0)
    stat, crit = _chi_square(counts, exact)
    assert stat < crit, (stat, crit)


# ----------------------------------------------------------------------------- published model configs


@pytest.mark.parametrize("name", sorted(p.stem for p in TARGET_CONFIGS.glob("*.json")))
def test_published_config_target_greedy_equals_generate(name, monkeypatch):
    """Each supported family's published ``config.json``, shrunk (tests/fixtures/target_configs/README.md:
    every other key as published: RoPE scaling, soft-capping, eos ids, ``cache_implementation``, biases,
    tied heads...), greedy in a ragged left-padded batch past every window (6) with oracle drafts fully,
    partly and never accepted, and at batch 1. Planted bug caught: window off by one (``diff <= window``
    in ``window_masks``) on Mistral v0.1, Starcoder2, Phi-3, Gemma 2/3/4 and gpt-oss. Not caught here:
    test_hybrid's planted rollback bugs on the Qwen3.5 config (at these sizes and 25 tokens the state
    errors change no greedy token; tests/test_hybrid.py catches them on its own targets)."""
    target, reason = published_target(name)
    if target is None:
        pytest.skip(reason)
    layers = target.config.get_text_config().num_hidden_layers
    draft = tiny_draft(block_size=4, num_target_layers=layers, target_layer_ids=[0, layers - 1])
    ids, mask = _left_pad([PROMPTS[n] for n in LENS])
    batch = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW)
    rows = [batch[r:r + 1, ids.shape[1] - n:] for r, n in enumerate(LENS)]  # each row without its padding
    assert len({tuple(r[0, -NEW:].tolist()) for r in rows}) == len(LENS)  # not a degenerate target
    _install_oracle(monkeypatch, rows)
    out = draft.spec_generate(target, ids, attention_mask=mask, max_new_tokens=NEW, temperature=0.0,
                              return_dict_in_generate=True)
    assert torch.equal(out.sequences, batch), (name, "ragged")
    assert {1, 2, 4} <= set(out.acceptance_lengths)  # never, partly, fully accepted blocks
    prompt = PROMPTS[LENS[-1]]
    one = draft.spec_generate(target, prompt, max_new_tokens=NEW, temperature=0.0)
    assert torch.equal(one, _generate(target, prompt, NEW)), (name, "batch 1")


# ----------------------------------------------------------------------------- published generation configs

GENERATION_CONFIGS = pathlib.Path(__file__).resolve().parent / "fixtures" / "generation_configs"
# each published instruct checkpoint's generation_config.json (fixtures README: sources) on a target of its family
# ("config", name): the target built from that published config.json (tests/fixtures/target_configs)
PUBLISHED = {"gemma-2-2b-it": ("config", "gemma-2-2b"), "gemma-2-9b-it": ("config", "gemma-2-2b"),
             "gemma-3-1b-it": "gemma3", "Llama-3.1-8B-Instruct": "llama",
             "Qwen3-Coder-480B-A35B-Instruct": "qwen3", "Mistral-7B-Instruct": "mistral",
             "Phi-3-mini-4k-instruct": "phi3", "gpt-oss-20b": "gpt_oss", "gemma-4-26B-A4B-it": "gemma4",
             "Qwen3.6-35B-A3B": ("config", "Qwen3.5-0.8B")}


def _published_target(name):
    family = PUBLISHED[name]
    if isinstance(family, tuple):
        target, reason = published_target(family[1])
    elif family in ("qwen3", "llama"):
        target, reason = tiny_target(family, peaked=True), None
    else:
        target, reason = family_target(family), f"transformers {transformers.__version__} has no {family}"
    if target is None:
        pytest.skip(reason)
    target.generation_config = transformers.GenerationConfig.from_pretrained(GENERATION_CONFIGS,
                                                                             config_file_name=f"{name}.json")
    return target


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_generation_config_greedy_equals_generate_on_every_route(name):
    """The target carries its checkpoint's published generation_config (Gemma 2/3: ``cache_implementation:
    "hybrid"``, eos lists, sampling defaults, Qwen's repetition penalty); greedy output equals generate's
    through spec_generate (batch 1 and ragged), custom_generate and a pipeline. Planted bug caught:
    ``_static_request`` raising for a config's "hybrid" (the code before issue 22) fails both Gemma cases."""
    from tiny import tiny_tokenizer

    target = _published_target(name)
    layers = target.config.get_text_config().num_hidden_layers
    draft = tiny_draft(block_size=4, num_target_layers=layers, target_layer_ids=[0, layers - 1])
    refs = [target.generate(PROMPTS[n], attention_mask=torch.ones_like(PROMPTS[n]), do_sample=False,
                            max_new_tokens=12) for n in LENS[:2]]
    for ref, n in zip(refs, LENS[:2]):
        assert torch.equal(draft.spec_generate(target, PROMPTS[n], max_new_tokens=12, temperature=0.0), ref), n
    ids, mask = _left_pad([PROMPTS[n] for n in LENS[:2]])
    batch = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=12)
    assert torch.equal(draft.spec_generate(target, ids, attention_mask=mask, max_new_tokens=12, temperature=0.0), batch)
    folder = str(pathlib.Path(__file__).resolve().parents[1] / "pair" / "drafter")
    out = target.generate(PROMPTS[LENS[0]], attention_mask=torch.ones_like(PROMPTS[LENS[0]]), do_sample=False,
                          max_new_tokens=12, custom_generate=folder, trust_remote_code=True, assistant_model=draft)
    assert torch.equal(out, refs[0])
    pipe = transformers.pipeline("text-generation", model=target, tokenizer=tiny_tokenizer())
    text = "w5 w17 w30 w2"
    plain = pipe(text, max_new_tokens=8, do_sample=False)
    assert pipe(text, max_new_tokens=8, do_sample=False, custom_generate=folder, trust_remote_code=True,
                assistant_model=draft) == plain
