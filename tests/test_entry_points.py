"""The drafter behind transformers' own entry points, on the shipped pair (pair/target + pair/drafter):
the native DFlash assistant (5.x), the Hub ``custom_generate`` entry, pipelines; the acceptance plot.

Every entry-point test also counts the drafter's forward calls: a silent fallback to plain decoding
(same text, no drafting) fails."""

import contextlib
import importlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import transformers
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer, TextStreamer, pipeline

import generation_utils
from modeling_dflash import native_dflash_available
from tiny import tiny_draft

REPO = Path(__file__).resolve().parents[1]
PAIR = REPO / "pair"
NEW = 40  # new tokens per prompt: long enough for several multi-token verify steps on this pair

needs_native = pytest.mark.skipif(
    not native_dflash_available(),
    reason=f"transformers {transformers.__version__} has no native DFlash candidate generator "
           "(speculation_type='dflash' arrived in 5.x); custom_generate= covers this version")

# The shipped tokenizer has no chat template; this one renders a chat as Python source (system as a comment).
CHAT_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'system' %}# {{ m['content'] }}\n"
                 "{% else %}{{ m['content'] }}{% endif %}{% endfor %}")


@pytest.fixture(scope="module")
def pair():
    draft = AutoModel.from_pretrained(PAIR / "drafter", trust_remote_code=True, dtype=torch.float32).eval()
    target = AutoModelForCausalLM.from_pretrained(PAIR / "target", dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(PAIR / "target")
    tok.chat_template = CHAT_TEMPLATE
    return draft, target, tok


def prompts(n=3):
    return [p["prompt"] for p in json.loads((PAIR / "heldout_prompts.json").read_text())[:n]]


@contextlib.contextmanager
def draft_calls(draft):
    """Counts the drafter's forward calls inside the block (a list, one entry per call)."""
    calls = []
    handle = draft.register_forward_hook(lambda module, args, output: calls.append(1))
    try:
        yield calls
    finally:
        handle.remove()


def encode(tok, text):
    return tok(text, return_tensors="pt", add_special_tokens=False)


# ----------------------------------------------------------------------------- native assistant (5.x)


@needs_native
def test_native_assistant_greedy_equals_generate_and_spec_generate(pair):
    draft, target, tok = pair
    for text in prompts(3)[1:]:
        enc = encode(tok, text)
        ref = target.generate(**enc, max_new_tokens=NEW, do_sample=False)
        with draft_calls(draft) as calls:
            native = target.generate(**enc, max_new_tokens=NEW, do_sample=False, assistant_model=draft,
                                     speculation_type="dflash")
        assert len(calls) >= 1, "the native path never called the drafter"
        ours = draft.spec_generate(target, enc["input_ids"], max_new_tokens=NEW, temperature=0.0)
        assert native.tolist() == ref.tolist() == ours.tolist()


@needs_native
def test_native_assistant_streams_the_same_text(pair, capsys):
    draft, target, tok = pair
    enc = encode(tok, prompts(1)[0])
    capsys.readouterr()
    with draft_calls(draft) as calls:
        out = target.generate(**enc, max_new_tokens=NEW, do_sample=False, assistant_model=draft,
                              speculation_type="dflash", streamer=TextStreamer(tok, skip_prompt=True))
    streamed = capsys.readouterr().out
    assert len(calls) >= 1
    assert streamed.rstrip("\n") == tok.decode(out[0, enc["input_ids"].shape[1]:]).rstrip("\n")
    assert out.tolist() == target.generate(**enc, max_new_tokens=NEW, do_sample=False).tolist()


@needs_native
def test_native_stats_equal_the_steps_the_target_took(pair):
    """Reference: the target's own verify forwards (step i committed start[i+1] - start[i] tokens, the
    last one final_len - 1 - start[-1]), read from its position_ids, independently of the draft hook."""
    draft, target, tok = pair
    for text, new in zip(prompts(2), (NEW, 7)):  # 7: the generator stops drafting near max_length
        ids = encode(tok, text)["input_ids"]
        starts = []
        handle = target.register_forward_pre_hook(
            lambda module, args, kwargs: starts.append(int(kwargs["position_ids"][0, 0])), with_kwargs=True)
        try:
            with generation_utils.native_acceptance_stats(draft, target) as stats:
                seq = target.generate(ids, max_new_tokens=new, do_sample=False, assistant_model=draft,
                                      speculation_type="dflash")
        finally:
            handle.remove()
        steps = starts[1:]  # the first forward is the prefill
        reference = [b - a for a, b in zip(steps, steps[1:])] + [seq.shape[1] - 1 - steps[-1]]
        native = stats(seq, ids.shape[1])
        assert native.acceptance_lengths == reference and sum(reference) == new - 1
        assert native.num_target_forwards == len(starts) and native.block_size == draft.config.block_size
        assert native.num_draft_forwards >= 1
        if new == NEW:  # same draft, same greedy target: tau agrees with spec_generate's
            # fixed blocks: the native loop drafts the whole block every step, so only they take its steps
            ours = draft.spec_generate(target, ids, max_new_tokens=new, temperature=0.0, return_dict_in_generate=True,
                                       adaptive_block_size=False)
            assert max(reference) > 1 and abs(len(reference) - len(ours.acceptance_lengths)) <= 1


def test_generate_without_speculation_type_names_the_working_routes(pair):
    draft, target, tok = pair
    enc = encode(tok, prompts(1)[0])
    with pytest.raises(AttributeError, match="spec_generate") as err:
        target.generate(**enc, max_new_tokens=4, do_sample=False, assistant_model=draft)
    assert 'speculation_type="dflash"' in str(err.value) and "custom_generate=" in str(err.value)
    if not native_dflash_available():
        assert "no native DFlash path" in str(err.value)
    assert not hasattr(draft, "generation_config")


def test_what_4_57_says_to_speculation_type_is_what_the_readme_says(pair):
    """4.57.1 has no native DFlash loop and validates generate's keyword arguments before it touches the
    assistant, so the package cannot intercept: the routes table quotes transformers' own refusal."""
    if native_dflash_available():
        pytest.skip("transformers 5.x runs speculation_type='dflash' (tested above)")
    from test_readme import all_text

    draft, target, tok = pair
    enc = encode(tok, prompts(1)[0])
    with pytest.raises(ValueError, match=r"not used by the model: \['speculation_type'\]"):
        target.generate(**enc, max_new_tokens=4, assistant_model=draft, speculation_type="dflash")
    assert "not used by the model: ['speculation_type']" in all_text()


def test_forward_answers_the_native_names_with_the_same_numbers():
    """Two consecutive draft calls (the second over a cache holding the first's context), in both spellings."""
    draft = tiny_draft()
    gen = torch.Generator().manual_seed(0)
    ours_cache, native_cache = transformers.DynamicCache(), transformers.DynamicCache()
    past = 0
    for ctx_len in (5, 3):
        noise, ctx = torch.randn(1, 4, 40, generator=gen), torch.randn(1, ctx_len, 80, generator=gen)
        pos = torch.arange(past, past + ctx_len + 4)[None]
        ours = draft(position_ids=pos, noise_embedding=noise, target_hidden=ctx, past_key_values=ours_cache)
        native = draft(noise_embeds=noise, context_hidden_states=ctx, position_ids=pos,
                       attention_mask=torch.ones(1, past + ctx_len + 4, dtype=torch.long), cache=native_cache)
        assert isinstance(ours, torch.Tensor) and torch.allclose(native.last_hidden_state, ours, atol=1e-6)
        for cache in (ours_cache, native_cache):
            generation_utils.crop_cache(cache, past + ctx_len)  # the block is thrown away, as both loops do
        past += ctx_len
    with pytest.raises(ValueError, match="not both"):
        draft(position_ids=pos, noise_embedding=noise, context_hidden_states=ctx)


# ----------------------------------------------------------------------------- custom_generate


def test_save_pretrained_writes_the_custom_generate_entry(tmp_path):
    tiny_draft().save_pretrained(tmp_path / "d")
    assert (tmp_path / "d" / "custom_generate" / "generate.py").read_text() == generation_utils.CUSTOM_GENERATE_PY


CUSTOM_GENERATE_SCRIPT = textwrap.dedent('''
    import json, sys, torch, transformers
    from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer
    torch.set_num_threads(1)
    folder, pair = sys.argv[1], sys.argv[2]
    draft = AutoModel.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32).eval()
    target = AutoModelForCausalLM.from_pretrained(pair + "/target", dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(pair + "/target")
    calls = []
    draft.register_forward_hook(lambda m, a, o: calls.append(1))
    report = {"version": transformers.__version__, "equal": [], "calls": []}
    try:  # 5.x gates a local custom_generate behind trust_remote_code; 4.57.1 runs local code without it
        target.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2, custom_generate=folder, assistant_model=draft,
                        trust_remote_code=False)
        report["untrusted"] = "ran"
    except ValueError as err:
        report["untrusted"] = "refused: " + str(err)
    for p in json.load(open(pair + "/heldout_prompts.json"))[1:3]:
        enc = tok(p["prompt"], return_tensors="pt", add_special_tokens=False)
        ref = target.generate(**enc, max_new_tokens=40, do_sample=False)
        before = len(calls)
        out = target.generate(**enc, max_new_tokens=40, do_sample=False, custom_generate=folder,
                              trust_remote_code=True, assistant_model=draft)
        report["equal"].append(out.tolist() == ref.tolist())
        report["calls"].append(len(calls) - before)
    try:
        target.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2, custom_generate=folder, trust_remote_code=True)
    except ValueError as err:
        report["no_assistant"] = str(err)
    print("REPORT " + json.dumps(report))
''')


def test_custom_generate_from_a_folder_in_a_fresh_process(tmp_path):
    """A drafter folder (here a copy of pair/drafter) as custom_generate=, in a new interpreter with an
    empty modules cache (4.57.1 caches custom_generate by the folder's basename)."""
    folder = tmp_path / "my-dflash-drafter"
    shutil.copytree(PAIR / "drafter", folder)
    script = tmp_path / "run.py"
    script.write_text(CUSTOM_GENERATE_SCRIPT)
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules"), "TOKENIZERS_PARALLELISM": "false",
           "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, str(script), str(folder), str(PAIR)], capture_output=True, text=True,
                          timeout=300, env=env, cwd=tmp_path, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("REPORT "))
    report = json.loads(line[len("REPORT "):])
    assert report["equal"] == [True, True]
    assert all(c >= 1 for c in report["calls"]), report["calls"]
    assert "assistant_model=" in report["no_assistant"]
    if int(report["version"].split(".")[0]) >= 5:
        assert report["untrusted"].startswith("refused") and "custom generation code" in report["untrusted"]
    else:
        assert report["untrusted"] == "ran"


def test_custom_generate_passes_generate_arguments_through(pair):
    """generate()'s config fields land in the generation_config spec_generate reads; unsupported ones are named."""
    draft, target, tok = pair
    enc = encode(tok, prompts(1)[0])
    folder = str(PAIR / "drafter")
    ref = target.generate(**enc, max_length=enc["input_ids"].shape[1] + 12, do_sample=False)
    out = target.generate(**enc, max_length=enc["input_ids"].shape[1] + 12, do_sample=False,
                          custom_generate=folder, trust_remote_code=True, assistant_model=draft)
    assert out.tolist() == ref.tolist()
    res = target.generate(**enc, max_new_tokens=12, do_sample=False, return_dict_in_generate=True,
                          custom_generate=folder, trust_remote_code=True, assistant_model=draft)
    assert res.sequences.tolist() == ref.tolist() and len(res.acceptance_lengths) >= 1
    with pytest.raises(NotImplementedError, match="num_beams"):
        target.generate(**enc, max_new_tokens=4, custom_generate=folder, trust_remote_code=True,
                        assistant_model=draft, num_beams=2)


def test_the_default_policy_prices_its_steps_inside_generate_without_nested_calls(pair, tmp_path, monkeypatch):
    """Through ``custom_generate`` ``spec_generate`` runs inside ``target.generate``, and without a pinned cost
    (``DFLASH_VERIFY_COST`` unset: the suite pins none, and one in the caller's shell is dropped) the default policy's cost comes from the remote copy's
    ``verify_cost`` (the cost model on this device's constants, measured by raw matmuls into
    ``device_speed.json``), with no nested ``spec_generate``: the output equals ``generate``. Planted bug
    caught: the old per-shape table (nested ``spec_generate`` calls: the counter sees more than one)."""
    draft, target, tok = pair
    package = type(draft).__module__.rsplit(".", 1)[0]
    cost = importlib.import_module(package + ".verify_cost")  # the remote copy
    utils = importlib.import_module(package + ".generation_utils")
    monkeypatch.delenv(cost.COST_ENV, raising=False)  # conftest pins none; a value from the shell would hide the model
    monkeypatch.setenv("DFLASH_HF_CACHE", str(tmp_path))
    monkeypatch.setattr(cost, "_SPEEDS", {})
    real, calls = utils._spec_loop, []
    monkeypatch.setattr(utils, "_spec_loop", lambda *a, **k: calls.append(1) or real(*a, **k))
    enc = encode(tok, prompts(1)[0])
    ref = target.generate(**enc, max_new_tokens=NEW, do_sample=False)
    out = target.generate(**enc, max_new_tokens=NEW, do_sample=False, custom_generate=str(PAIR / "drafter"),
                          trust_remote_code=True, assistant_model=draft)
    assert out.tolist() == ref.tolist() and calls == [1]
    assert len(json.loads((tmp_path / "device_speed.json").read_text())) == 1


# ----------------------------------------------------------------------------- pipelines


def pipeline_routes():
    routes = [pytest.param(dict(custom_generate=str(PAIR / "drafter"), trust_remote_code=True), id="custom_generate")]
    routes.append(pytest.param(dict(speculation_type="dflash"), id="native", marks=needs_native))
    return routes


@pytest.mark.parametrize("route", pipeline_routes())
@pytest.mark.parametrize("chat", [False, True], ids=["text", "chat"])
def test_pipeline_with_the_drafter_gives_the_same_text(pair, route, chat):
    draft, target, tok = pair
    pipe = pipeline("text-generation", model=target, tokenizer=tok)
    for text in prompts(2):
        inputs = [{"role": "system", "content": "complete the function"}, {"role": "user", "content": text}] if chat \
            else text
        plain = pipe(inputs, max_new_tokens=NEW, do_sample=False)
        with draft_calls(draft) as calls:
            fast = pipe(inputs, max_new_tokens=NEW, do_sample=False, assistant_model=draft, **route)
        assert len(calls) >= 1, "the pipeline never called the drafter"
        assert fast == plain
        generated = fast[0]["generated_text"]
        assert (generated[-1]["role"] == "assistant") if chat else generated.startswith(text)


# ----------------------------------------------------------------------------- plot


def test_plot_shows_per_slot_acceptance_and_the_histogram(pair):
    import matplotlib

    matplotlib.use("Agg")
    draft, target, tok = pair
    ids = encode(tok, prompts(1)[0])["input_ids"]
    out = draft.spec_generate(target, ids, max_new_tokens=NEW, temperature=0.0, return_dict_in_generate=True)
    fig = out.plot(block_size=draft.config.block_size)
    slots, hist = fig.axes
    heights = [bar.get_height() for bar in slots.patches]
    assert heights == pytest.approx([0.0 if r is None else r for r in out.slot_acceptance()])
    assert len(heights) == 15 and heights == sorted(heights, reverse=True)  # slot k+1 needs slot k
    counts = [bar.get_height() for bar in hist.patches]
    assert sum(counts) == len(out.acceptance_lengths)
    assert counts[0] == sum(a == 1 for a in out.acceptance_lengths)
    drafting = [a for a, d in zip(out.row_acceptance_lengths[0], out.row_draft_lengths[0]) if d > 0]
    tau = sum(drafting) / len(drafting)  # over the steps that drafted (a last plain step at the budget is not)
    assert hist.lines[0].get_xdata()[0] == pytest.approx(tau)
    fig.canvas.draw()  # a Figure of its own (fig.savefig, not plt.savefig); whole-number slot ticks
    assert all(float(t).is_integer() for t in slots.get_xticks() if 1 <= t <= 15)


def test_per_slot_acceptance_counts_steps_that_accepted_at_least_k_drafts():
    # lengths 1, 3, 4 with block 4: 0, 2, 3 drafts accepted; slot 1: 2/3, slot 2: 2/3, slot 3: 1/3
    assert generation_utils.per_slot_acceptance([1, 3, 4], 4) == pytest.approx([2 / 3, 2 / 3, 1 / 3])


# ----------------------------------------------------------------------------- issue 34: inputs_embeds


def test_inputs_embeds_is_refused_by_name_on_every_entry_point_before_any_forward(tmp_path):
    """Issue 34: ``generate(inputs_embeds=..., custom_generate=<drafter>)`` raised ``TypeError: spec_generate()
    missing 1 required positional argument: 'input_ids'``. Refused with or without ``input_ids`` (the loop
    drafts and verifies token ids), directly, on the static loop and through ``custom_generate``."""
    from tiny import tiny_target

    tiny_draft().save_pretrained(tmp_path)
    draft = AutoModel.from_pretrained(str(tmp_path), trust_remote_code=True).eval()
    target = tiny_target(peaked=True)
    ids = torch.tensor([[5, 6, 7]])
    embeds = target.get_input_embeddings()(ids).detach()
    forwards = []
    for model in (target, draft):
        model.register_forward_hook(lambda *a: forwards.append(1))
    route = dict(custom_generate=str(tmp_path), trust_remote_code=True, assistant_model=draft)
    calls = [lambda: draft.spec_generate(target, inputs_embeds=embeds, max_new_tokens=4),
             lambda: draft.spec_generate(target, ids, inputs_embeds=embeds, max_new_tokens=4),
             lambda: draft.spec_generate(target, ids, inputs_embeds=embeds, max_new_tokens=4, cache_implementation="static"),
             lambda: target.generate(inputs_embeds=embeds, max_new_tokens=4, do_sample=False, **route),
             lambda: target.generate(ids, inputs_embeds=embeds, max_new_tokens=4, do_sample=False, **route)]
    for call in calls:
        with pytest.raises(ValueError, match=r"inputs_embeds \(shape \(1, 3, \d+\)\) is not supported"):
            call()
    assert forwards == []
    assert torch.equal(target.generate(ids, max_new_tokens=4, do_sample=False, **route),
                       target.generate(ids, max_new_tokens=4, do_sample=False))
