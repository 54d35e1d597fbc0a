"""The benchmark: its statistics, prompt sources (dataset adapters on tiny local files in each set's
column layout), the length sweep, the reference-loop crop patch, and a smoke run on the embedded pair."""

import json
from pathlib import Path

import pytest
import torch

from bench import contenders, prompts, stats

REPO = Path(__file__).resolve().parents[1]
PAIR = REPO / "pair"


def test_acceptance_stats_hand_checked():
    # block 4, max_new 9: row 0 steps (4, 1, 3) -> new = 1 + 8 = 9; step 3 drafts min(4, 9 - 6) - 1 = 2 slots.
    # row 1: one step (2) then a stop: new = 3.
    s = stats.acceptance_stats([[4, 1, 3], [2]], [9, 3], block_size=4, max_new_tokens=9)
    assert s["steps"] == 4
    assert s["tau"] == pytest.approx((8 + 2) / 4)
    assert s["row_tau"] == pytest.approx([8 / 3, 2.0])
    # slot 1 drafted in all 4 steps, accepted (>= 1 draft) in steps 4, 3, 2 -> 3/4; slot 2: drafted 4,
    # accepted by 4 and 3 -> 2/4; slot 3: drafted by steps 1, 2, 4 (step 3 drafted 2) -> accepted by step 1 -> 1/3
    assert s["per_slot"] == pytest.approx([3 / 4, 2 / 4, 1 / 3])
    assert s["histogram"] == pytest.approx([1 / 4, 1 / 4, 1 / 4, 1 / 4])
    assert stats.step_cost(3.0, 1.5) == pytest.approx(2.0)


def test_pooled_tau_is_one_definition_for_every_contender():
    # a plain decoder: one token per verify step -> tau 1; the prefill token is not a step
    assert stats.pooled_tau([128], [127]) == 1.0
    assert stats.pooled_tau([1, 1], [0, 0]) == 1.0


def test_prompt_lookup_baseline_hand_checked():
    assert stats.prompt_lookup_propose([1, 2, 3, 1, 2], 2) == [3, 1]
    assert stats.prompt_lookup_tau([1, 2, 3], [1, 2, 3, 1, 2, 3], 4, 6) == [4, 1]


# ----------------------------------------------------------------------------- prompt sources

ROWS = {  # one row per set, in the set's own column layout
    "gsm8k": {"question": "Tom has 3 apples.", "answer": "#### 3"},
    "math500": {"problem": "Solve x+1=2.", "solution": "x=1", "answer": "1", "subject": "Algebra", "level": 1,
                "unique_id": "a"},
    "humaneval": {"task_id": "HumanEval/0", "prompt": "def f(x):\n", "canonical_solution": "  return x",
                  "test": "", "entry_point": "f"},
    "mbpp": {"source_file": "x", "task_id": 2, "prompt": "Write a function.", "code": "", "test_imports": [],
             "test_list": ["assert 1"]},
    "mt-bench": {"prompt": ["First turn?", "Second turn?"], "prompt_id": 81, "category": "writing",
                 "reference": []},
}


@pytest.mark.parametrize("name", sorted(ROWS))
def test_dataset_adapter_reads_its_column_layout(tmp_path, name):
    path = tmp_path / f"{name}.jsonl"
    path.write_text(json.dumps(ROWS[name]) + "\n" + json.dumps(ROWS[name]) + "\n")
    got = prompts.dataset_prompts(name, data_files=path, limit=1)
    assert len(got) == 1 and got[0]["id"] == f"{name}/0"
    first = got[0]["turns"][0]
    expected = {"gsm8k": "Tom has 3 apples.\nPlease reason step by step", "math500": "Solve x+1=2.\nPlease reason",
                "humaneval": "```python\ndef f(x):\n\n```", "mbpp": "Write a function.", "mt-bench": "First turn?"}
    assert expected[name] in first
    if name == "mt-bench":
        assert got[0]["turns"] == ["First turn?", "Second turn?"]


def test_dataset_adapter_names_a_missing_column(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"text": "x"}) + "\n")
    with pytest.raises(ValueError, match="no column 'question'"):
        prompts.dataset_prompts("gsm8k", data_files=path)
    with pytest.raises(ValueError, match="unknown dataset 'gsm9k'"):
        prompts.dataset_prompts("gsm9k", data_files=path)


def test_local_prompts_and_chat_template_with_enable_thinking(tmp_path):
    from tiny import tiny_tokenizer

    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "w1 w2"}\n{"turns": ["w3", "w4"]}\n')
    recs = prompts.local_prompts(path)
    assert [r["turns"] for r in recs] == [["w1 w2"], ["w3", "w4"]]
    tok = tiny_tokenizer()
    assert prompts.render(tok, ["w1"], chat_template=False) == "w1"
    tok.chat_template = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                         "{% if enable_thinking %} <think>{% else %} nothink{% endif %}")
    assert prompts.render(tok, ["w1"], chat_template=True, enable_thinking=True) == "w1 <think>"
    assert prompts.render(tok, ["w1"], chat_template=True, enable_thinking=False) == "w1 nothink"
    tok.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        prompts.render(tok, ["w1"], chat_template=True)


def test_extend_prompt_takes_its_own_file_then_other_heldout_files(tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(PAIR / "target")
    (tmp_path / "own.py").write_text("import os\n\nX = 1\n\ndef f():\n    \"\"\"Doc.\"\"\"\n    return X\n")
    (tmp_path / "other.py").write_text("def g(a, b):\n    return a + b\n" * 20)
    rec = {"path": "own.py", "lineno": 5, "turns": ['def f():\n    """Doc."""\n    ']}
    own = prompts.encode(tok, rec["turns"][0])
    short = prompts.extend_prompt(tok, rec, len(own) + 3, root=tmp_path, files=["own.py", "other.py"])
    assert len(short) == len(own) + 3 and short[-len(own):] == own
    assert tok.decode(short[:3]) in "import os\n\nX = 1\n\n"  # taken from just before the prompt
    long = prompts.extend_prompt(tok, rec, 120, root=tmp_path, files=["own.py", "other.py"])
    assert len(long) == 120 and "return a + b" in tok.decode(long) and long[-len(own):] == own
    with pytest.raises(ValueError, match="only"):
        prompts.extend_prompt(tok, rec, 5000, root=tmp_path, files=["own.py", "other.py"])


def test_positive_crop_patch_keeps_n_tokens_on_every_version():
    from transformers import DynamicCache

    cache = DynamicCache()
    cache.update(torch.zeros(1, 2, 7, 4), torch.zeros(1, 2, 7, 4), 0)
    with contenders.positive_crop_patch():
        cache.crop(7)  # nothing to remove
        assert cache.get_seq_length() == 7
        cache.crop(5)
        assert cache.get_seq_length() == 5
    assert DynamicCache.crop is not None and cache.get_seq_length() == 5


# ----------------------------------------------------------------------------- smoke run on the embedded pair


@pytest.mark.skipif(not (PAIR / "drafter" / "config.json").exists(), reason="no embedded pair")
def test_benchmark_smoke_on_the_embedded_pair(tmp_path):
    from bench.cli import parse_args, run

    out, png = tmp_path / "r.json", tmp_path / "r.png"
    report = run(parse_args(["--num-prompts", "1", "--max-new-tokens", "24", "--rounds", "1", "--block-sizes", "8",
                   "--contenders", "target,package,adaptive,prompt_lookup,native", "--sweep", "48", "--draft-window", "8",
                   "--tree-budgets", "6,auto",
                   "--sweep-prompts", "1", "--sweep-rounds", "1", "--out", str(out), "--plot", str(png),
                   "--no-progress"]))
    saved = json.loads(out.read_text())
    assert png.stat().st_size > 0 and saved["main"] == json.loads(json.dumps(report["main"]))
    main_ = saved["main"]["contenders"]
    expect = {"target.generate", "package@8", "package@8/window8", "adaptive@8", "prompt_lookup", "tree@6",
              "tree@auto"} | (
        {"native"} if contenders.native_supported() else set())
    assert set(main_) == expect
    assert main_["target.generate"]["tau"] == 1.0 and main_["target.generate"]["speedup"] == 1.0
    assert main_["package@8"]["tau"] > 1.0 and len(main_["package@8"]["per_slot"]) == 7
    assert main_["tree@6"]["tau"] > 1.0 and len(main_["tree@6"]["per_slot"]) == 7  # per depth, block 8
    assert all(not e.get("mismatches") for e in main_.values())  # greedy: every output is the target's
    assert saved["environment"]["threads"] == 1 and saved["environment"]["dtype"] == "float32"
    assert set(saved["sweep"]) == {"48"} and saved["sweep"]["48"]["contenders"]["package@8"]["tau"] >= 1.0
    assert saved["sweep"]["48"]["contenders"]["package@8/window8"]["tau"] >= 1.0


def test_top_k_reaches_every_sampling_contender_and_refuses_the_authors_loop(tmp_path, capsys):
    """--top-k is the top-k of target.generate (prompt lookup and the native loop go through it) and of
    spec_generate (package, baseline); the authors' loop has none, so naming it with --top-k stops."""
    from bench import cli, contenders as C

    class Config:
        eos_token_id, pad_token_id = 0, None

    target = type("T", (), {"generation_config": Config()})()
    assert C.generate_kwargs(target, {"temperature": 0.7, "top_k": 50})["top_k"] == 50
    assert C.generate_kwargs(target, {"temperature": 0.7})["top_k"] == 0
    seen = {}

    class Draft:
        def spec_generate(self, target, ids, **kw):
            seen.update(kw)
            raise RuntimeError("stop")

    with pytest.raises(RuntimeError):
        C.package(Draft(), target, 16)(torch.tensor([[1, 2]]), 4, {"temperature": 0.7, "top_k": 50})
    assert seen["top_k"] == 50 and seen["do_sample"] and seen["temperature"] == 0.7
    (tmp_path / "dflash").mkdir()
    (tmp_path / "dflash" / "model.py").write_text("")
    with pytest.raises(SystemExit):
        cli.parse_args(["--top-k", "50", "--temperature", "1.0", "--reference-dir", str(tmp_path)])
    assert "leave reference out of --contenders" in capsys.readouterr().err
    args = cli.parse_args(["--top-k", "50", "--temperature", "1.0", "--reference-dir", str(tmp_path),
                           "--contenders", "target,package"])
    assert args.top_k == 50


@pytest.mark.parametrize("argv, expected", [
    (["--contenders", "target,pakage"], "unknown ['pakage']"),
    (["--num-prompts", "0"], "--num-prompts must be >= 1"),
    (["--rounds", "0"], "--rounds must be >= 1"),
    (["--sweep", "abc"], "--sweep 'abc'"),
    (["--block-sizes", "16,x"], "--block-sizes '16,x'"),
    (["--baseline", "no/such/folder"], "--baseline no/such/folder"),
    (["--reference-dir", "."], "dflash/model.py"),
    (["--draft-window", "0"], "--draft-window 0"),
    (["--draft-window", "8", "--contenders", "target"], "with package in --contenders"),
    (["--top-k", "50"], "> 0 only with --temperature > 0"),
    (["--top-k", "-1", "--temperature", "0.7"], "--top-k -1: expected an integer >= 0"),
    (["--tree-budgets", "15,0"], "--tree-budgets '15,0'"),
    (["--tree-budgets", "15,Auto"], "--tree-budgets '15,Auto': expected positive integers separated by commas (or 'auto')"),
    (["--ddtree-dir", ".", "--tree-budgets", "15"], "with ddtree.py"),
])
def test_bench_bad_arguments_stop_before_any_work(argv, expected, capsys):
    from bench import cli

    with pytest.raises(SystemExit) as stop:
        cli.parse_args(argv)
    assert stop.value.code == 2 and expected in capsys.readouterr().err


@pytest.mark.skipif(not (PAIR / "drafter" / "config.json").exists(), reason="no embedded pair")
def test_step_split_script_times_target_draft_and_glue(tmp_path):
    """``bench/step_split.py`` on the embedded pair, one prompt: every step has one target and one draft
    forward, the parts add up to the step, and the JSON is written."""
    from bench import step_split

    out = tmp_path / "split.json"
    report = step_split.run(step_split.parse_args(["--num-prompts", "1", "--max-new-tokens", "12", "--block-size", "4",
                                                   "--rounds", "1", "--out", str(out)]))
    package = report["summary"]["package"]
    assert package["steps"] >= 3 and package["target"] > 0 and package["draft"] > 0
    assert package["step"] == pytest.approx(package["target"] + package["draft"] + package["glue"])
    assert json.loads(out.read_text())["summary"] == json.loads(json.dumps(report["summary"]))


def test_left_pad_and_batches_of_hand_checked():
    from bench.batches import batches_of, left_pad

    ids, mask = left_pad([[5, 6, 7], [8]], pad=0, device="cpu")
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert batches_of([[1], [2], [3], [4], [5]], 2) == [[[1], [2]], [[3], [4]]]
    assert batches_of([[1], [2]], 4) == [[[1], [2]]]  # fewer prompts than one batch: one short batch


@pytest.mark.skipif(not (PAIR / "drafter" / "config.json").exists(), reason="no embedded pair")
def test_batch_sizes_run_ragged_batches_against_batched_generate(tmp_path):
    from bench.cli import parse_args, run

    out = tmp_path / "r.json"
    report = run(parse_args(["--num-prompts", "2", "--max-new-tokens", "8", "--rounds", "1", "--block-sizes", "4",
                             "--contenders", "target,package,prompt_lookup", "--batch-sizes", "1,2",
                             "--batch-rounds", "1", "--out", str(out), "--plot", str(tmp_path / "r.png"),
                             "--no-progress"]))
    batches = json.loads(out.read_text())["batches"]
    assert batches == json.loads(json.dumps(report["batches"])) and set(batches["sizes"]) == {"1", "2"}
    one, two = batches["sizes"]["1"], batches["sizes"]["2"]
    assert set(one["contenders"]) == {"target.generate", "package@4", "prompt_lookup"}
    assert two["unsupported"] == ["prompt_lookup"]  # transformers: assisted generation is batch-1 only
    for size in (one, two):
        package = size["contenders"]["package@4"]
        assert package["mismatched_rows"] == 0 and len(package["row_tau"]) == 2 and package["tau"] > 1
        assert package["block_size"] == 4 and package["step_ms"] > 0
    assert set(batches["best_block"]) == {"1", "2"}


def test_a_policy_contender_warms_up_on_every_prompt_before_the_timed_rounds():
    """``interleaved``: a contender with ``warm_every_prompt`` (the verify-length policy, whose cost tables are
    measured on first use of a shape) runs every prompt at full length before any timed run; others warm up
    once, briefly. Planted bug caught: the old warm-up (first prompt, 8 tokens) left the table of a second
    context bucket to be measured inside the first timed round (batch 1 greedy read 1.28x instead of 2.0x)."""
    from bench.contenders import Contender
    from bench.core import interleaved

    calls = []
    target = torch.nn.Linear(2, 2)
    prompts = [torch.zeros(1, n, dtype=torch.long) for n in (3, 40)]
    def record(name):
        def run(ids, new, sampling):
            target(torch.zeros(1, 2))  # one forward: the probe's first-token time
            calls.append((name, ids.shape[1], new))
            return [0] * new, None
        return run

    policy, plain = Contender("adaptive@16", record("policy"), 16, warm_every_prompt=True), Contender("p", record("p"))
    interleaved([policy, plain], target, prompts, 20, 1, {}, progress=False)
    assert calls[:3] == [("policy", 3, 20), ("policy", 40, 20), ("p", 3, 8)], calls
    assert len(calls) == 3 + 2 * 2
