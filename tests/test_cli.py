"""Every command line turns expected failures into one line on stderr (naming the file or id and what
to do) with a non-zero exit status, keeps the traceback behind ``--debug``, and never hides a bug."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

import demo
from convert import convert_checkpoint as cc
from convert.cli import run_command
from convert.push_to_hub import main as push_main
from model_cards.render import main as render_main
from tiny import tiny_draft
from versions import newest_transformers_only

REPO = pathlib.Path(__file__).resolve().parents[1]
pytestmark = newest_transformers_only


@pytest.fixture
def drafter(tmp_path):
    folder = tmp_path / "drafter"
    tiny_draft().save_pretrained(folder)
    return folder


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def test_corrupt_safetensors_is_one_line_naming_the_file(drafter, tmp_path, capsys):
    weights = drafter / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # truncated: safetensors says "incomplete metadata"
    assert cc.main([str(drafter), str(tmp_path / "out")]) == 1
    line = _one_error_line(capsys)
    assert str(weights) in line and "corrupt" in line
    assert not (tmp_path / "out").exists()
    with pytest.raises(cc.ConversionError):  # --debug: the traceback
        cc.main([str(drafter), str(tmp_path / "out"), "--debug"])


def test_existing_output_is_one_line(drafter, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    assert cc.main([str(drafter), str(out)]) == 1
    line = _one_error_line(capsys)
    assert str(out) in line and "--overwrite" in line


def test_output_folder_gets_normal_permissions(drafter, tmp_path):
    out = tmp_path / "out"
    assert cc.main([str(drafter), str(out), "--no-verify"]) == 0
    umask = os.umask(0)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o777 & ~umask


def test_missing_hub_id_offline_is_one_line(tmp_path):
    """A real process, as a user runs it: HF_HUB_OFFLINE=1 and an id that is in no cache."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    proc = subprocess.run([sys.executable, "-m", "convert.convert_checkpoint", "nobody/no-such-drafter", str(tmp_path / "o")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and "'nobody/no-such-drafter'" in err[0] and "HF_HUB_OFFLINE" in err[0], proc.stderr


def test_an_internal_error_keeps_its_traceback(drafter, tmp_path, monkeypatch):
    """The handler only shortens expected failures: a bug (here a planted KeyError) propagates."""
    def broken(*args, **kwargs):
        raise KeyError("planted internal error")

    monkeypatch.setattr(cc, "plan_conversion", broken)
    with pytest.raises(KeyError, match="planted internal error"):
        cc.main([str(drafter), str(tmp_path / "out")])
    # and a CommandError that a bug wraps in something else is not mistaken for an expected failure
    with pytest.raises(RuntimeError):
        run_command(lambda args: (_ for _ in ()).throw(RuntimeError("bug")), type("A", (), {"debug": False})())


def test_push_refuses_a_local_target_unless_target_id_is_a_hub_id(monkeypatch, capsys):
    monkeypatch.chdir(REPO)  # pair/drafter records its target as the folder pair/target
    args = ["pair/drafter", "--repo-id", "me/pair-drafter", "--license", "mit", "--dry-run"]
    assert push_main(args) == 1
    line = _one_error_line(capsys)
    assert "'pair/target'" in line and "--target-id" in line
    assert push_main(args + ["--target-id", "./pair/target"]) == 1
    assert "not a Hub repo id" in _one_error_line(capsys)
    assert push_main(args + ["--target-id", "someorg/tiny-target"]) == 0
    out = capsys.readouterr().out
    assert "https://huggingface.co/someorg/tiny-target" in out and "vllm serve someorg/tiny-target" in out


def test_converter_flags_a_local_target(monkeypatch, tmp_path, capsys):
    monkeypatch.chdir(REPO)
    assert cc.main(["pair/drafter", str(tmp_path / "out"), "--dry-run"]) == 0
    assert "recorded as 'pair/target', which is not a Hub repo id" in capsys.readouterr().out
    assert cc.main(["pair/drafter", str(tmp_path / "out"), "--dry-run", "--target-id", "someorg/t"]) == 0
    assert "not a Hub repo id" not in capsys.readouterr().out


def test_render_errors_are_one_line(tmp_path, capsys):
    assert render_main([str(tmp_path / "nowhere"), "--repo-id", "me/x", "--license", "mit"]) == 1
    assert "no config.json" in _one_error_line(capsys)
    bad = tmp_path / "acc.json"
    bad.write_text(json.dumps({"schema": "nope"}))
    assert render_main([str(REPO / "pair" / "drafter"), "--repo-id", "me/x", "--license", "mit", "--acceptance", str(bad)]) == 1
    assert "acceptance" in _one_error_line(capsys)


def test_demo_missing_folder_is_one_line(tmp_path, capsys):
    assert demo.main(["--quick", "--target", str(tmp_path / "none")]) == 1
    line = _one_error_line(capsys)
    assert str(tmp_path / "none") in line and "no such folder" in line
    (tmp_path / "empty").mkdir()  # a folder that is not a model folder
    assert demo.main(["--quick", "--target", str(tmp_path / "empty")]) == 1
    assert "config.json" in _one_error_line(capsys)


def test_demo_names_a_checkout_without_symlinks(tmp_path, capsys):
    """git with ``core.symlinks=false`` checks pair/drafter's links out as text files holding the target path."""
    draft = tmp_path / "drafter"
    draft.mkdir()
    (draft / "config.json").write_text((REPO / "pair" / "drafter" / "config.json").read_text())
    (draft / "modeling_dflash.py").write_text("../../modeling_dflash.py")
    assert demo.main(["--quick", "--draft", str(draft)]) == 1
    line = _one_error_line(capsys)
    assert "modeling_dflash.py" in line and "no symlinks" in line and "git config core.symlinks true" in line


def test_help_needs_no_torch():
    """``--help`` answers before the heavy imports (checked by module, not by time)."""
    code = ("import sys, runpy; sys.argv = ['x', '--help']\n"
            "try: runpy.run_module('{}', run_name='__main__')\n"
            "except SystemExit: pass\n"
            "assert 'torch' not in sys.modules, 'torch imported before --help'")
    for module in ("convert.convert_checkpoint", "convert.push_to_hub", "model_cards.render"):
        proc = subprocess.run([sys.executable, "-c", code.format(module)], cwd=REPO, capture_output=True, text=True)
        assert proc.returncode == 0 and "usage:" in proc.stdout, (module, proc.stderr[-1500:])
    proc = subprocess.run([sys.executable, "-c", code.replace("runpy.run_module('{}', run_name='__main__')",
                                                              "runpy.run_path('demo.py', run_name='__main__')")],
                          cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0 and "usage:" in proc.stdout, proc.stderr[-1500:]


@pytest.mark.parametrize("argv, expected", [
    (["--num-prompts", "0"], "--num-prompts must be >= 1"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["--threads", "-1"], "--threads must be >= 0"),
    (["--block-size", "0"], "--block-size must be >= 1"),
    (["--quick", "--max-new-tokens", "9"], "--quick sets"),
])
def test_demo_bad_numbers_stop_at_argument_parsing(argv, expected, capsys):
    with pytest.raises(SystemExit) as stop:
        demo.parse_args(argv)
    assert stop.value.code == 2 and expected in capsys.readouterr().err


def test_demo_wrong_device_or_swapped_folders_are_one_line(capsys):
    assert demo.main(["--quick", "--device", "tpu"]) == 1
    assert "--device 'tpu'" in _one_error_line(capsys)
    assert demo.main(["--quick", "--target", str(REPO / "pair" / "drafter")]) == 1
    assert "a DFlash drafter folder" in _one_error_line(capsys)


def test_network_errors_of_the_hub_client_are_one_line():
    """huggingface_hub's HTTP client raises transport errors that are not OSError (httpx-style)."""
    from convert.cli import expected_failure

    transport = type("TransportError", (Exception,), {"__module__": "httpx2"})
    connect = type("ConnectError", (transport,), {"__module__": "httpx2"})
    assert expected_failure(connect("[Errno -2] Name or service not known")).startswith("cannot reach the Hugging Face Hub")
    assert expected_failure(ConnectionError("refused")).startswith("cannot reach")
    assert expected_failure(RuntimeError("a bug")) is None  # bugs keep their traceback
