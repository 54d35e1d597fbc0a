"""The ``dflash-hf`` console script (run as installed, from another folder) with the authors' flag names,
the one-line failures of every command line (spec_generate's refusals, swapped folders, a missing chat
template, an early Ctrl-C), and the one message for a non-drafter where a drafter belongs."""

import fnmatch
import json
import runpy
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import torch
from transformers import AutoModel

import convert.cli
import demo
import generation_utils
from convert import convert_checkpoint as cc
from convert import sources
from generation_arguments import NOT_A_DRAFTER
from native_routes import native_acceptance_stats
from tiny import tiny_draft, tiny_target
from versions import newest_transformers_only

REPO = Path(__file__).resolve().parents[1]
PAIR = REPO / "pair"
pytestmark = newest_transformers_only
BENCH = ["--num-prompts", "1", "--max-new-tokens", "4", "--rounds", "1", "--contenders", "target,package",
         "--plot", "", "--no-progress"]


def one_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def interrupt(*args, **kwargs):
    raise KeyboardInterrupt


@pytest.fixture
def installed_main():
    """The ``dflash-hf`` console script's function, as the installed distribution declares it."""
    [ep] = [e for e in metadata.entry_points(group="console_scripts") if e.name == "dflash-hf"]
    assert ep.value == "dflash_hf.cli:main"
    return ep.load()


# ----------------------------------------------------------------------------- dflash-hf, installed


def test_generate_from_another_folder_with_the_authors_flags(installed_main, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # the defaults (the shipped pair) resolve inside the package, not the cwd
    argv = ["generate", "transformers", "--max-new-tokens", "12", "--block-size", "8", "--temperature", "0",
            "--draft-model", str(PAIR / "drafter"), "def add(a, b):"]
    assert installed_main(argv) == 0
    out = capsys.readouterr()
    assert out.out.strip() and "12 new tokens, tau" in out.err and "no chat template" in out.err
    assert list(tmp_path.iterdir()) == []


def test_generate_sampling_flags_become_spec_generate_arguments():
    import cli

    args = cli.generate_parser().parse_args(["--temperature", "0.7", "--top-p", "0.9", "--top-k", "5", "x"])
    assert cli.sampling_arguments(args) == {"do_sample": True, "temperature": 0.7, "top_p": 0.9, "top_k": 5}
    assert cli.sampling_arguments(cli.generate_parser().parse_args(["x"])) == {"temperature": 0.0}


def test_generate_applies_the_chat_template_unless_told_not_to():
    import cli
    from tiny import tiny_tokenizer

    tok = tiny_tokenizer()
    text, how = cli.prompt_text(tok, "hi", True, False)
    assert how == "chat template" and text.startswith("<|im_start|> user hi") and text.endswith("assistant ")
    assert cli.prompt_text(tok, "hi", False, False) == ("hi", "plain continuation")


def test_benchmark_maps_the_authors_flags_and_runs_from_another_folder(installed_main, tmp_path, monkeypatch, capsys):
    import cli

    assert cli.bench_argv(["--model", "M", "--draft-model=D", "--max-samples", "3", "--block-size", "8", "--top-k", "2"]) == [
        "--target", "M", "--draft=D", "--num-prompts", "3", "--block-sizes", "8", "--top-k", "2"]
    monkeypatch.chdir(tmp_path)
    argv = ["benchmark", "transformers", "--max-samples", "1", "--max-new-tokens", "4", "--rounds", "1",
            "--contenders", "target,package", "--plot", "", "--no-progress", "--out", "r.json"]
    assert installed_main(argv) == 0
    assert json.loads((tmp_path / "r.json").read_text())["settings"]["num_prompts"] == 1
    capsys.readouterr()
    with pytest.raises(SystemExit):  # the help names the command and the authors' flags it takes
        installed_main(["benchmark", "--help"])
    shown = capsys.readouterr().out
    assert shown.startswith("usage: dflash-hf benchmark")
    assert "--model TARGET" in shown and "--max-samples NUM_PROMPTS" in shown and "--draft-model DRAFT" in shown


@pytest.mark.parametrize("argv, named", [
    (["generate", "--reasoning", "high", "x"], "--reasoning"),
    (["generate", "--model-preset=qwen3-8b", "x"], "--model-preset"),
    (["benchmark", "--base-url", "http://localhost:8000"], "--base-url"),
    (["benchmark", "transformers", "--concurrency", "8"], "--concurrency"),
    (["generate", "openai", "--model", "M", "x"], "openai backend"),
    (["benchmark", "mlx", "--dataset", "gsm8k"], "mlx backend"),
    (["benchmark", "--top-p", "0.9"], "--top-p"),
])
def test_the_authors_flags_without_meaning_here_are_refused_by_name(argv, named, installed_main, capsys):
    assert installed_main(argv) == 1
    assert named in one_line(capsys)


def test_usage_errors_exit_2_and_help_needs_no_torch(tmp_path):
    code = ("import sys; from dflash_hf.cli import main\n"
            "codes = [main(['nonsense']), main([])]\n"
            "try: main(['generate', '--help'])\n"
            "except SystemExit as e: codes.append(e.code)\n"
            "assert codes == [2, 2, 0], codes\n"
            "assert 'torch' not in sys.modules, 'torch imported before --help'")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-1500:]
    assert "usage: dflash-hf generate" in proc.stdout and "--draft-model" in proc.stdout


def test_ctrl_c_at_any_point_of_dflash_hf_is_one_line(installed_main, monkeypatch, capsys):
    monkeypatch.setitem(installed_main.__globals__, "dispatch", interrupt)
    assert installed_main(["generate", "x"]) == 130
    assert capsys.readouterr().err.strip() == "interrupted"


def test_the_wheel_holds_the_command_lines_and_the_shipped_pair():
    """``pip install .`` builds from this configuration: every command-line package and every file of
    ``pair/`` (the demo and the bench defaults) must be in it."""
    tomllib = pytest.importorskip("tomllib")
    tool = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    packages = set(tool["packages"])
    assert {f"dflash_hf.{p.parent.name}" for p in REPO.glob("*/__init__.py") if p.parent.name != "tests"} <= packages
    globs = tool["package-data"]["dflash_hf"]
    shipped = [p.relative_to(REPO).as_posix() for p in PAIR.rglob("*") if p.is_file() and p.suffix != ".pyc"]
    needed = [f for f in shipped if f.endswith(".json") or f.count("/") > 1]  # not the training logs and plots
    assert needed and [f for f in needed if not any(fnmatch.fnmatch(f, g) for g in globs)] == []


# ----------------------------------------------------------------------------- one-line failures


def test_demo_block_size_above_the_drafters_is_one_line(capsys):
    assert demo.main(["--quick", "--quiet", "--block-size", "32"]) == 1
    assert "block_size must be in [1, 16]" in one_line(capsys)


def test_bench_block_sizes_above_the_drafters_is_one_line(tmp_path, monkeypatch, capsys):
    from bench import cli

    monkeypatch.chdir(REPO)
    assert cli.main(BENCH + ["--out", str(tmp_path / "r.json"), "--block-sizes", "32"]) == 1
    assert "block_size must be in [1, 16]" in one_line(capsys)


def test_bench_chat_template_without_one_is_one_line(tmp_path, monkeypatch, capsys):
    from bench import cli

    monkeypatch.chdir(REPO)
    assert cli.main(BENCH + ["--out", str(tmp_path / "r.json"), "--chat-template"]) == 1
    assert "has no chat template" in one_line(capsys)


def test_a_bug_raising_value_error_keeps_its_traceback():
    """Only the package's own refusals under spec_generate are expected; a ValueError from elsewhere is a bug."""
    try:
        int("x")
    except ValueError as err:
        assert convert.cli.expected_failure(err) is None


def _run_as_main(module: str, argv: list, monkeypatch) -> int:
    """``python -m module argv`` in this process (its SystemExit code)."""
    monkeypatch.setattr(sys, "argv", [module] + argv)
    monkeypatch.delitem(sys.modules, module, raising=False)  # runpy warns when the module was imported already
    with pytest.raises(SystemExit) as stop:
        runpy.run_module(module, run_name="__main__", alter_sys=False)
    return stop.value.code


def test_ctrl_c_while_python_m_bench_imports_is_one_line(monkeypatch, capsys):
    monkeypatch.setattr(convert.cli, "main_of", interrupt)  # the import of bench.cli (torch, transformers)
    assert _run_as_main("bench", [], monkeypatch) == 130
    assert capsys.readouterr().err.strip() == "interrupted"


def test_ctrl_c_early_in_the_converter_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(convert.cli, "main_of", interrupt)
    assert _run_as_main("convert.convert_checkpoint", [str(PAIR / "drafter"), str(tmp_path / "o")], monkeypatch) == 130
    assert capsys.readouterr().err.strip() == "interrupted"
    monkeypatch.setattr(sources, "resolve_source", interrupt)  # the converter's first step
    assert cc.main([str(PAIR / "drafter"), str(tmp_path / "o")]) == 130
    assert capsys.readouterr().err.strip() == "interrupted"


def test_swapped_folders_say_which_is_the_drafter(tmp_path, capsys):
    target, drafter = str(PAIR / "target"), str(PAIR / "drafter")
    assert cc.main([target, str(tmp_path / "o"), "--verify-target", drafter]) == 1
    line = one_line(capsys)
    assert "a target model" in line and f"--verify-target {drafter} is the drafter: swap them" in line
    assert "auto_map" not in line
    assert cc.main([drafter, str(tmp_path / "o"), "--verify-target", drafter]) == 1
    assert "--verify-target" in (line := one_line(capsys)) and "a DFlash drafter folder" in line
    assert demo.main(["--quick", "--target", drafter, "--draft", target]) == 1
    line = one_line(capsys)
    assert f"--target {drafter} is the DFlash drafter" in line and "swap them" in line and "auto_map" not in line
    assert not (tmp_path / "o").exists()


# ----------------------------------------------------------------------------- a non-drafter as the drafter


@pytest.fixture(scope="module")
def plain_and_target(tmp_path_factory):
    """What ``AutoModel.from_pretrained(drafter_folder)`` gives without trust_remote_code: a plain Qwen3Model."""
    folder = tmp_path_factory.mktemp("drafter")
    tiny_draft().save_pretrained(folder)
    plain = AutoModel.from_pretrained(folder)
    assert type(plain).__name__ == "Qwen3Model"
    return plain, tiny_target(), folder


def test_every_entry_point_names_a_non_drafter(plain_and_target):
    plain, target, folder = plain_and_target
    ids = torch.tensor([[5, 6, 7]])
    calls = [lambda: generation_utils.spec_generate(plain, target, ids, max_new_tokens=2),
             lambda: generation_utils.spec_generate_from_generate_arguments(plain, target, inputs=ids),
             lambda: native_acceptance_stats(plain).__enter__(),
             lambda: target.generate(ids, max_new_tokens=2, custom_generate=str(folder), assistant_model=plain,
                                     trust_remote_code=True)]
    for call in calls:
        with pytest.raises(ValueError, match="Qwen3Model") as err:
            call()
        assert NOT_A_DRAFTER in str(err.value)


def test_a_non_drafter_through_a_command_line_is_one_line(plain_and_target, capsys):
    """spec_generate's refusal under a command (e.g. a drafter object built elsewhere) is one line."""
    plain, target, _ = plain_and_target

    def command(args):
        generation_utils.spec_generate(plain, target, torch.tensor([[5]]), max_new_tokens=1)

    assert convert.cli.run_command(command, type("A", (), {"debug": False})()) == 1
    assert NOT_A_DRAFTER in one_line(capsys)
