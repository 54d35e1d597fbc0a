"""Issue 26: every bad input a new user meets after the first hour is one line on stderr with exit status 1
(2 only for argparse usage errors, 130 for Ctrl-C), named, with no traceback and no Hub call; and the path
from a trained drafter to a card with its own figures (``--acceptance-out`` / ``demo.py --json``).

Each case calls the command's ``main(argv)`` in-process. The Hub lookup is replaced by one that raises a
connection error (``no_hub``), so a test that reached the Hub would say so instead of waiting on retries.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import demo
from convert import convert_checkpoint as cc
from convert import paths
from convert.push_to_hub import main as push_main
from model_cards.render import main as render_main
from tiny import tiny_draft, tiny_target

REPO = Path(__file__).resolve().parents[1]
PAIR = REPO / "pair"


@pytest.fixture(autouse=True)
def no_hub(monkeypatch):
    """Any Hub lookup fails as with no network; the list records the ids that were asked for."""
    asked = []

    def offline(repo_id, revision=None, token=None):
        asked.append(repo_id)
        raise ConnectionError("planted: no network in tests")

    monkeypatch.setattr(paths, "hub_lookup", offline)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return asked


def one_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Broken copies of the shipped drafter and a target of the wrong shape (vocab 4096 like the pair's
    tokenizer, hidden 40), shared by the cases below."""
    root = tmp_path_factory.mktemp("bad")
    wrong = root / "wrong_target"
    tiny_target(vocab_size=4096).save_pretrained(wrong)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(PAIR / "target" / name, wrong / name)
    missing = root / "drafter_missing_file"
    shutil.copytree(PAIR / "drafter", missing)
    (missing / "target_cache.py").unlink()
    truncated = root / "drafter_truncated"
    shutil.copytree(PAIR / "drafter", truncated)
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) // 2])
    engine = root / "engine_only"
    shutil.copytree(PAIR / "drafter", engine)
    config = json.loads((engine / "config.json").read_text())
    config.pop("auto_map")
    (engine / "config.json").write_text(json.dumps(config))
    shape = root / "drafter_wrong_shape"
    shutil.copytree(PAIR / "drafter", shape)
    sd = load_file(shape / "model.safetensors")
    sd["fc.weight"] = sd["fc.weight"][:, :-8].contiguous()
    save_file(sd, shape / "model.safetensors", metadata={"format": "pt"})
    return {"wrong": wrong, "missing": missing, "truncated": truncated, "engine": engine, "shape": shape, "root": root}


# ----------------------------------------------------------------------------- the local path rule


def test_local_path_rule(tmp_path, monkeypatch, no_hub):
    monkeypatch.chdir(REPO)
    assert paths.looks_local("pair/targetx") and paths.looks_local("./x") and paths.looks_local("~/x")
    assert not paths.looks_local("nobody/model")
    with pytest.raises(paths.CommandError, match=r"^--target pair/targetx: no such folder$"):
        paths.locate_model("pair/targetx", "--target")
    with pytest.raises(paths.CommandError, match="a file, not a model folder"):
        paths.locate_model("README.md", "--target")
    assert no_hub == []  # a local path never asks the Hub
    with pytest.raises(paths.CommandError, match="no local folder 'nobody/model', and the Hub cannot be reached "
                                                  "to look for repo 'nobody/model'"):
        paths.locate_model("nobody/model", "--draft")
    assert no_hub == ["nobody/model"]
    assert paths.locate_model("pair/target", "--target") == "pair/target"


# ----------------------------------------------------------------------------- python -m bench

BENCH = ["--num-prompts", "1", "--max-new-tokens", "4", "--rounds", "1", "--contenders", "target,package",
         "--plot", "", "--no-progress"]


@pytest.mark.parametrize("case, expected", [
    (["--draft", "pair/drafterx"], "--draft pair/drafterx: no such folder"),
    (["--target", "pair/targetx"], "--target pair/targetx: no such folder"),
    (["--draft", "nobody/no-drafter"], "the Hub cannot be reached to look for repo 'nobody/no-drafter'"),
    (["--draft", "{engine}"], "no auto_map"),
    (["--draft", "{missing}"], "lacks target_cache.py"),
    (["--draft", "{truncated}"], "unreadable safetensors weights"),
    (["--target", "{wrong}"], "does not fit --target"),
    (["--prompts", "{root}/none.json"], "no such file"),
])
def test_bench_bad_inputs_are_one_line(case, expected, folders, tmp_path, monkeypatch, capsys):
    from bench import cli

    monkeypatch.chdir(REPO)
    case = [c.format(**folders) for c in case]
    assert cli.main(BENCH + ["--out", str(tmp_path / "r.json")] + case) == 1
    assert expected in one_line(capsys)
    assert not (tmp_path / "r.json").exists()


def test_a_missing_optional_package_is_one_line_naming_its_extra(monkeypatch, tmp_path, capsys):
    """``--dataset`` after a plain ``pip install -e .`` (no ``datasets``): one line naming the extra, exit 1,
    for the bench and for training; a missing module that is not optional stays a traceback (a bug).
    Before: a 31-line traceback ending in ``No module named 'datasets'``."""
    import sys

    from bench import cli
    from convert.cli import missing_package_message
    from train import train_drafter as td

    monkeypatch.chdir(REPO)
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` raises ModuleNotFoundError
    assert cli.main(BENCH + ["--out", str(tmp_path / "r.json"), "--dataset", "gsm8k"]) == 1
    assert "datasets is not installed (this command needs it): pip install -e '.[bench]'" in one_line(capsys)
    assert td.main(["--output-dir", str(tmp_path / "run"), "--target", "pair/target", "--data", "gsm8k"]) == 1
    assert "datasets is not installed" in one_line(capsys)
    assert missing_package_message(ModuleNotFoundError("No module named 'modeling_x'", name="modeling_x")) is None


def test_bench_ctrl_c_is_one_line(monkeypatch, tmp_path, capsys):
    from bench import cli

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "load_models", interrupted)
    assert cli.main(BENCH + ["--out", str(tmp_path / "r.json")]) == 130
    assert capsys.readouterr().err.strip() == "interrupted"
    with pytest.raises(KeyboardInterrupt):  # --debug: as raised
        cli.main(BENCH + ["--out", str(tmp_path / "r.json"), "--debug"])


def test_bench_acceptance_out_is_a_card_record(tmp_path, monkeypatch, capsys):
    """From a benchmark run to a card: the record names the dataset (--prompts stem, else --dataset-name),
    holds the package contender at the drafter's block size, and render/push_to_hub take it."""
    from bench import cli

    monkeypatch.chdir(REPO)
    prompts = tmp_path / "my_prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p["prompt"]}) + "\n"
                               for p in json.loads((PAIR / "heldout_prompts.json").read_text())[:2]))
    acc = tmp_path / "acc.json"
    argv = BENCH + ["--out", str(tmp_path / "r.json"), "--prompts", str(prompts), "--acceptance-out", str(acc)]
    assert cli.main(argv) == 0
    record = json.loads(acc.read_text())
    assert record["schema"] == "dflash-acceptance/v1" and record["block_size"] == 16
    assert record["datasets"][0]["name"] == "my_prompts" and record["target"] == "pair/target"
    report = json.loads((tmp_path / "r.json").read_text())
    assert record["datasets"][0]["tau"] == round(report["main"]["contenders"]["package@16"]["tau"], 4)
    assert cli.main(argv + ["--dataset-name", "my-chats"]) == 0
    assert json.loads(acc.read_text())["datasets"][0]["name"] == "my-chats"
    capsys.readouterr()
    assert render_main(["pair/drafter", "--repo-id", "me/d", "--license", "mit", "--acceptance", str(acc)]) == 0
    assert "| my-chats | 1 | 4 |" in capsys.readouterr().out
    assert push_main(["pair/drafter", "--repo-id", "me/d", "--license", "mit", "--dry-run", "--target-id", "me/t",
                      "--acceptance", str(acc)]) == 0
    assert "| my-chats |" in capsys.readouterr().out
    # the benchmark's own report is refused with the way to the record
    assert render_main(["pair/drafter", "--repo-id", "me/d", "--license", "mit",
                        "--acceptance", str(tmp_path / "r.json")]) == 1
    assert "--acceptance-out" in one_line(capsys)
    # the record is of package@<the drafter's block>: asked without it, refused before measuring
    assert cli.main(argv + ["--block-sizes", "8"]) == 1
    assert "add 16 to --block-sizes" in one_line(capsys)


# ----------------------------------------------------------------------------- demo.py


@pytest.mark.parametrize("layout", ["jsonl", "strings"])
def test_demo_takes_jsonl_and_lists_of_strings(layout, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    texts = [p["prompt"] for p in json.loads((PAIR / "heldout_prompts.json").read_text())[:2]]
    path = tmp_path / ("mine.jsonl" if layout == "jsonl" else "mine.json")
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts) if layout == "jsonl" else json.dumps(texts))
    out = tmp_path / "acc.json"
    assert demo.main(["--quick", "--quiet", "--prompts", str(path), "--json", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["datasets"][0]["name"] == "mine" and record["datasets"][0]["num_prompts"] == 2
    assert record["datasets"][0]["speedup"] is None  # --quick times nothing worth a card


@pytest.mark.parametrize("content, expected", [
    ("def f(): pass\n", "neither a JSON list nor JSONL (line 1"),
    ('[{"question": "x"}]', "record 0 needs a non-empty string, or an object with 'prompt', 'text' or 'turns'"),
    ("[]", "holds no prompt"),
])
def test_demo_bad_prompts_file_is_one_line(content, expected, tmp_path, capsys):
    path = tmp_path / "p.json"
    path.write_text(content)
    assert demo.main(["--quick", "--prompts", str(path)]) == 1
    assert expected in one_line(capsys)


def test_demo_help_says_what_prompts_takes(capsys):
    with pytest.raises(SystemExit):
        demo.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "JSON list of prompts" in text and "JSONL" in text


def test_demo_wrong_target_and_mistyped_paths_are_one_line(folders, monkeypatch, capsys, no_hub):
    monkeypatch.chdir(REPO)
    assert demo.main(["--quick", "--target", str(folders["wrong"])]) == 1
    assert "does not fit --target" in one_line(capsys)
    assert demo.main(["--quick", "--target", "pair/targetx"]) == 1
    assert one_line(capsys) == "error: --target pair/targetx: no such folder"
    assert no_hub == []


# ----------------------------------------------------------------------------- convert, push_to_hub


def test_convert_wrong_shape_target_and_weights_are_one_line(folders, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    out = tmp_path / "out"
    assert cc.main(["pair/drafter", str(out), "--verify-target", str(folders["wrong"])]) == 1
    line = one_line(capsys)
    assert "does not fit --verify-target" in line and "hidden 40" in line and not out.exists()
    assert cc.main(["pair/drafter", str(out), "--verify-target", "pair/targetx"]) == 1
    assert one_line(capsys) == "error: --verify-target pair/targetx: no such folder"
    assert cc.main([str(folders["shape"]), str(out)]) == 1
    line = one_line(capsys)
    assert "tensor 'fc.weight' has shape [192, 568], but the config implies [192, 576]" in line
    assert cc.main(["pair/drafterx", str(out)]) == 1
    assert one_line(capsys) == "error: source pair/drafterx: no such folder"


def test_push_dry_run_refuses_truncated_weights(folders, capsys):
    argv = [str(folders["truncated"]), "--repo-id", "me/d", "--license", "mit", "--dry-run", "--target-id", "me/t"]
    assert push_main(argv) == 1
    line = one_line(capsys)
    assert "model.safetensors is not a readable safetensors file" in line


# ----------------------------------------------------------------------------- train


def test_train_init_corrupt_drafter_and_missing_target_are_one_line(folders, tmp_path, monkeypatch, capsys):
    from train import train_drafter as td

    monkeypatch.chdir(REPO)
    common = ["--preset", "smoke", "--output-dir", str(tmp_path / "run"), "--no-progress"]
    assert td.main(common + ["--init", str(folders["truncated"]), "--layers", "2"]) == 1
    line = one_line(capsys)
    assert f"--init {folders['truncated']}: cannot load the drafter (SafetensorError" in line
    assert not (tmp_path / "run" / "data").exists()  # refused before the data phase
    assert td.main(common + ["--target", "pair/targetx"]) == 1
    assert one_line(capsys) == "error: --target pair/targetx: no such folder"


def test_train_default_taps_are_the_published_spread_never_the_last_layer():
    from train.presets import PRESETS, spread_layer_ids
    from train.train_drafter import build_parser

    assert build_parser().parse_args([]).target_layer_ids is None
    assert spread_layer_ids(36) == [1, 9, 17, 25, 33]
    for depth in range(2, 40):
        taps = spread_layer_ids(depth)
        assert taps and max(taps) < depth - 1 and taps == sorted(set(taps)), (depth, taps)
    assert spread_layer_ids(6) == [1, 2, 3]
    for name in ("smoke", "pair", "pair-long"):  # the presets that reproduce the shipped pair pin its taps
        assert PRESETS[name]["target_layer_ids"] == "1,3,5"


def test_train_no_chat_template_advice_names_responses():
    from train.data import render_prompt

    tok = type("Tok", (), {"chat_template": None})()
    with pytest.raises(ValueError, match="--responses"):
        render_prompt(tok, [{"role": "user", "content": "hi"}])


def test_plot_curves_missing_or_bad_log_is_one_line(tmp_path, capsys):
    from train import plot_curves

    assert plot_curves.main([str(tmp_path / "none.jsonl"), "-o", str(tmp_path / "x.png")]) == 1
    assert "no such log file" in one_line(capsys)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"step": 1, "loss": 2.0}\nnot json\n')
    assert plot_curves.main([str(bad), "-o", str(tmp_path / "x.png")]) == 1
    assert f"{bad}:2: not JSON" in one_line(capsys)


def test_converter_warns_naming_the_last_layer_tap(monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    assert cc.main(["pair/drafter", "/nonexistent/out", "--dry-run", "--target-id", "me/t"]) == 0
    assert "tap layer 5, the target's last layer (6 layers)" in capsys.readouterr().out
    assert cc.last_layer_tap_warning([1, 9, 17, 25, 33], 36) is None
    assert cc.last_layer_tap_warning([1, 3, 5], None) is None  # depth unknown: nothing to say
