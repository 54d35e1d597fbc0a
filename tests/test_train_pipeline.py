"""Drafter training pipeline (train/data.py, features.py, evaluate.py, loop.py, train_drafter.py CLI):
packing, the feature cache, chat data with the target's template, evaluation definitions, one-line CLI
errors. CPU, seconds each, transformers 4.57 and 5.x."""
import json
from pathlib import Path

import pytest
import torch

from tiny import MASK_ID, tiny_target
from train import blocks, data, evaluate, features, loop
from train import train_drafter as td

REPO = Path(__file__).resolve().parents[1]
PAIR_DRAFTER = str(REPO / "pair" / "drafter")

THINK_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}{% endif %}")


def _docs(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 90, (n,), generator=g) for n in lengths]


def test_packed_row_features_equal_each_document_alone():
    target = tiny_target(peaked=True)
    docs = _docs([7, 12, 5, 9])
    alone = [features.target_features(target, d[None], [0, 2])[0] for d in docs]
    assert features.pack_documents([7, 12, 5, 9], 24) == [[0, 1, 2], [3]]
    packed = features.compute_features(target, docs, [0, 2], pack_tokens=24)
    for i, (a, p) in enumerate(zip(alone, packed)):
        assert p.shape == a.shape
        assert torch.allclose(a, p, atol=1e-5), f"document {i} sees another document in the packed row"
    # the mask really matters: without it (one causal row, positions continuing) document 1 differs
    ids = torch.cat(docs[:3])[None]
    leaky = features.target_features(target, ids, [0, 2])[0, 7:19]
    assert not torch.allclose(leaky, alone[1], atol=1e-3)
    _, pos, mask = features.packed_inputs(docs[:2])
    assert pos[0].tolist() == list(range(7)) + list(range(12))
    assert mask[0, 0, 8, 6] < -1e30 and mask[0, 0, 8, 7] == 0 and mask[0, 0, 8, 9] < -1e30


def _tiny_run(tmp_path, source, steps=5, seed=3):
    target = tiny_target(peaked=True)
    cfg = td.build_draft_config(target, 1, 4, [0, 2], MASK_ID)
    torch.manual_seed(seed)
    draft = td.DFlashDraftModel(cfg)
    losses = []
    tc = loop.TrainConfig(num_anchors=6, batch_size=2, max_steps=steps, lr=3e-3, eval_every=0, ckpt_every=0,
                          progress=False, log_every=1)
    loop.train_drafter(draft, target, _examples(), source(target), tc, on_step=lambda r: losses.append(r["loss"]))
    return losses, draft


def _examples():
    return [data.Example(d, 3) for d in _docs([14, 9, 20, 11, 16, 12], seed=5)]


def test_training_from_the_feature_cache_equals_live_features_bit_for_bit(tmp_path):
    ex = _examples()
    live, d_live = _tiny_run(tmp_path, lambda t: features.LiveFeatures(t, ex, [0, 2]))

    def cached(t):
        features.write_feature_cache(t, ex, [0, 2], tmp_path / "cache", torch.float32, shard_tokens=30, progress=False)
        return features.FeatureCache(tmp_path / "cache")

    from_cache, d_cache = _tiny_run(tmp_path, cached)
    assert len(live) == 5 and live == from_cache
    for a, b in zip(d_live.parameters(), d_cache.parameters()):
        assert torch.equal(a, b)
    index = json.loads((tmp_path / "cache" / "index.json").read_text())
    assert index["num_examples"] == 6 and len(set(index["shard"].values())) > 1  # several shards
    with pytest.raises(ValueError, match="other training data"):
        features.FeatureCache(tmp_path / "cache").check(ex[:5], [0, 2])
    with pytest.raises(ValueError, match="layers"):
        features.write_feature_cache(tiny_target(), ex, [1, 2], tmp_path / "cache", torch.float32, progress=False)
    assert features.disk_bytes_per_token(5, 4096) == 40960  # Qwen3-8B, 5 taps, bf16: 40 KB per token


def _chat_tokenizer():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(REPO / "pair" / "target")
    tok.chat_template = THINK_TEMPLATE
    return tok


def test_chat_jsonl_streamed_rendered_with_thinking_switch_and_response_only_loss(tmp_path):
    tok = _chat_tokenizer()
    rows = [{"messages": [{"role": "user", "content": f"def f{i}(x):"}, {"role": "assistant", "content": "return x"}]}
            for i in range(3)] + [{"messages": [{"role": "system", "content": "be brief"},
                                                {"role": "user", "content": "import os"}]}]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    stream = data.load_chat_rows(str(path))
    assert type(stream).__name__ == "IterableDataset"  # streamed through datasets, nothing materialised
    off = data.chat_prompts(stream, tok, enable_thinking=False)
    on = data.chat_prompts(data.load_chat_rows(str(path)), tok, enable_thinking=True)
    assert tok.decode(off[0]["prompt_ids"]) == "<|user|>def f0(x):<|end|><|assistant|><think></think>"
    assert tok.decode(on[0]["prompt_ids"]) == "<|user|>def f0(x):<|end|><|assistant|>"
    assert tok.decode(off[3]["prompt_ids"]).startswith("<|system|>be brief<|end|><|user|>import os")
    kept = data.chat_prompts(data.load_chat_rows(str(path)), tok, False, keep_replies=True)
    assert len(kept) == 3 and tok.decode(kept[0]["response_ids"]) == "return x<|end|>"

    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(REPO / "pair" / "target", dtype=torch.float32).eval()
    out = data.regenerate_responses(target, tok, [p["prompt_ids"] for p in off], tmp_path / "r.jsonl", 6,
                                    batch_size=3, progress=False)
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert [w["prompt_ids"] for w in written] == [p["prompt_ids"] for p in off]
    ref = target.generate(torch.tensor([off[3]["prompt_ids"]]), max_new_tokens=6, do_sample=False)
    assert written[3]["response_ids"] == ref[0, len(off[3]["prompt_ids"]):].tolist()  # the target's own answer
    # resumable: a re-run with the rows present generates nothing new
    data.regenerate_responses(None, tok, [p["prompt_ids"] for p in off], out, 6, progress=False)
    assert len(out.read_text().splitlines()) == 4

    examples = data.read_responses(out)
    for e, p in zip(examples, off):
        assert e.prompt_len == len(p["prompt_ids"])
        anchors = blocks.sample_anchors(e.prompt_len, len(e.input_ids), 100)
        assert int(anchors.min()) == e.prompt_len  # anchors (and so labels) only in the response
        _, pos, labels = blocks.block_inputs(e.input_ids, anchors, 4, MASK_ID)
        assert (pos[labels != blocks.IGNORE] > e.prompt_len).all()
    with pytest.raises(ValueError, match="messages"):
        data.chat_prompts([{"text": "x"}], tok)


def test_tau_and_per_slot_acceptance_definitions(monkeypatch):
    class Out:  # two rows: 7 and 4 new tokens over 3 and 2 verify steps (block size 4); the last step of
        num_new_tokens = [7, 4]  # row 2 drafted one slot only (token budget)
        row_acceptance_lengths = [[4, 1, 1], [2, 1]]
        row_draft_lengths = [[3, 3, 3], [3, 1]]
        row_accepted_drafts = [[3, 0, 0], [1, 0]]

    monkeypatch.setattr(evaluate, "spec_generate", lambda *a, **k: Out())
    draft = torch.nn.Linear(1, 1)
    draft.config = type("C", (), {"block_size": 4})()
    st = evaluate.acceptance_stats(draft, None, [torch.zeros(1, 3)], 8)
    assert st["tau"] == ((7 - 1) + (4 - 1)) / 5  # pooled: sum(new - 1) / sum(steps)
    # slot k: steps accepting >= k draft tokens / steps drafting slot k (5 for slot 1, 4 for slots 2, 3)
    assert st["acceptance_slot"] == [2 / 5, 1 / 4, 1 / 4]


def test_cli_errors_are_one_line_and_debug_shows_the_traceback(tmp_path, capsys, monkeypatch):
    existing = tmp_path / "run"
    existing.mkdir()
    (existing / "x").write_text("user data")
    assert td.main(["--output-dir", str(existing)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and str(existing) in err[0] and "--resume" in err[0]
    assert (existing / "x").read_text() == "user data"
    missing = tmp_path / "nope"
    assert td.main(["--output-dir", str(tmp_path / "r2"), "--target", str(missing)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(missing) in err[0]
    assert td.main(["--preset", "dflash-b16", "--target", "x"]) == 1
    assert "--data" in capsys.readouterr().err
    readme = (Path(td.__file__).parent / "README.md").read_text()
    assert "one line on stderr with exit code 1" in " ".join(readme.split())  # what the README promises
    with pytest.raises(td.UsageError):
        td.main(["--output-dir", str(existing), "--debug"])

    def planted(args):
        raise RuntimeError("planted internal bug")

    monkeypatch.setattr(td, "run", planted)  # an unexpected error keeps its traceback
    with pytest.raises(RuntimeError, match="planted"):
        td.main(["--output-dir", str(tmp_path / "r3")])


def test_default_output_is_under_runs_and_never_pair():
    args = td.parse_args(["--preset", "smoke"])
    assert args.output_dir == Path("runs") / "smoke" and args.target == "pair/target"
    assert td.parse_args(["--name", "x"]).output_dir == Path("runs/x")
    assert td.parse_args(["--reproduce-pair", "--init", PAIR_DRAFTER]).preset == "pair-long"
    with pytest.raises(td.UsageError, match="reproduce-pair"):
        td.parse_args(["--reproduce-pair", "--preset", "smoke"])
    with pytest.raises(td.UsageError, match="stage-1"):
        td.parse_args(["--reproduce-pair"])
    assert td.parse_args(["--preset", "smoke", "--epochs", "9"]).epochs == 9  # explicit flags win
    from train.presets import spread_layer_ids

    assert spread_layer_ids(36) == [1, 9, 17, 25, 33]  # the published Qwen3-8B drafter's taps


def test_long_prompt_and_fine_tune_flags_are_checked_before_any_work(tmp_path):
    args = td.parse_args(["--preset", "pair-long", "--init", PAIR_DRAFTER])
    assert args.long_lengths == (64, 1152) and args.max_len >= 1152 + args.max_new_tokens
    for bad in ("64", "a:b", "900:64", "0:10"):
        with pytest.raises(td.UsageError, match="--long-prompts"):
            td.parse_args(["--long-prompts", bad])
    with pytest.raises(td.UsageError, match="--data"):
        td.parse_args(["--long-prompts", "64:128", "--data", "x.jsonl"])
    with pytest.raises(td.UsageError, match="--init"):
        td.parse_args(["--init", str(tmp_path)])  # no config.json there
    wrong = td.parse_args(["--preset", "pair-long", "--init", PAIR_DRAFTER, "--layers", "3"])
    with pytest.raises(td.UsageError, match="--layers 2"):
        td._fine_tune_start(wrong, [1, 3, 5], 1)
    ok = td.parse_args(["--preset", "pair-long", "--init", PAIR_DRAFTER])
    draft, report = td._fine_tune_start(ok, [1, 3, 5], 1)
    assert report == {"fine_tuned_from": PAIR_DRAFTER} and draft.dtype == torch.float32


@pytest.mark.parametrize("family", ["mistral", "qwen2", "gemma3"])
def test_packed_features_keep_each_sliding_window_inside_its_document(family):
    """Window 6, documents of 9-14 tokens: packed == alone. Planted bug caught: no window in the packed
    mask (``packed_inputs`` without ``windows``): every family differs (the window is lost)."""
    from family_targets import family_target

    target = family_target(family)
    docs = _docs([9, 14, 11], seed=3)
    alone = [features.target_features(target, d[None], [0, 2])[0] for d in docs]
    packed = features.compute_features(target, docs, [0, 2], pack_tokens=40)
    assert features.pack_documents([9, 14, 11], 40) == [[0, 1, 2]]
    for i, (a, p) in enumerate(zip(alone, packed)):
        assert torch.allclose(a, p, atol=1e-5), (family, i, float((a - p).abs().max()))


def test_packing_a_hybrid_target_is_refused_by_name():
    """Linear-attention state would run from one document into the next: refused before any forward."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "Qwen3_5ForCausalLM"):
        pytest.skip("Qwen3.5 exists from transformers 5 on")
    from test_hybrid import tiny_hybrid

    target = tiny_hybrid("qwen3_5")
    calls = []
    target.register_forward_pre_hook(lambda *a: calls.append(1))
    with pytest.raises(NotImplementedError, match=r"--pack-tokens: target 'qwen3_5_text' has linear-attention layers"):
        features.compute_features(target, _docs([5, 6]), [0, 3], pack_tokens=20)
    with pytest.raises(NotImplementedError, match="linear-attention"):
        features.LiveFeatures(target, [], [0, 3], pack_tokens=20)
    assert calls == []
    assert len(features.compute_features(target, _docs([5, 6]), [0, 3], pack_tokens=0)) == 2  # one per row: fine
