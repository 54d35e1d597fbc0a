"""The training CLI end to end (transformers 5.x only; about 90 s together on 2 cores):

* 2 data-parallel CPU processes (``accelerate launch --multi_gpu --num_processes 2``, gloo) train exactly
  like 1 process on the same global batch;
* ``--preset smoke`` runs, Ctrl-C ends it with one line, ``--resume`` finishes it with real progress values.
"""
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import transformers

from train import train_drafter as td

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(int(transformers.__version__.split(".")[0]) < 5,
                                reason="CLI runs are budgeted on transformers 5.x only (CI time); the pieces "
                                       "they use are tested on both versions in test_train_pipeline.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "CUDA_VISIBLE_DEVICES": ""}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _losses(run: Path) -> list:
    return [r["loss"] for r in map(json.loads, (run / "train_log.jsonl").read_text().splitlines()) if "loss" in r]


def test_two_processes_train_exactly_like_one_on_the_same_global_batch(tmp_path):
    g = torch.Generator().manual_seed(0)
    rows = [{"prompt_ids": torch.randint(2, 4000, (5,), generator=g).tolist(),
             "response_ids": torch.randint(2, 4000, (int(n),), generator=g).tolist()}
            for n in torch.randint(12, 40, (18,), generator=g)]
    responses = tmp_path / "responses.jsonl"
    responses.write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = ["--preset", "smoke", "--responses", str(responses), "--num-eval-prompts", "2", "--max-steps", "10",
              "--log-every", "1", "--features", "live", "--eval-tau-prompts", "0", "--ckpt-every", "5",
              "--save-dtype", "float32", "--no-progress"]
    two = tmp_path / "two"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--main_process_port", str(_free_port()), "-m", "train.train_drafter", *common, "--batch", "2",
           "--output-dir", str(two), "--expect-processes", "2"]
    proc = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    one = tmp_path / "one"
    assert td.main([*common, "--batch", "4", "--output-dir", str(one)]) == 0  # same global batch, 1 process

    summary = json.loads((two / "summary.json").read_text())
    assert summary["num_processes"] == 2 and summary["global_batch"] == 4
    l2, l1 = _losses(two), _losses(one)
    assert len(l1) == len(l2) == 10
    for step, (a, b) in enumerate(zip(l1, l2), 1):
        assert abs(a - b) <= 1e-4 * abs(a), f"step {step}: 1 process {a}, 2 processes {b}"
    assert l1[-1] < l1[0]

    from transformers import AutoModel

    for folder in (two / "drafter", two / "checkpoints" / "checkpoint-10"):
        loaded = AutoModel.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32)
        assert type(loaded).__name__ == "DFlashDraftModel"
    ref = AutoModel.from_pretrained(one / "drafter", trust_remote_code=True, dtype=torch.float32)
    for (name, a), b in zip(ref.state_dict().items(), loaded.state_dict().values()):
        assert torch.allclose(a, b, atol=1e-4), name


def test_smoke_preset_interrupt_then_resume(tmp_path):
    """Ctrl-C during training: one line, exit 130, a checkpoint at that step; --resume finishes the run on
    the same data with the log continuous and the progress bar showing the restored tau (never nan)."""
    run = tmp_path / "smoke"
    cmd = [sys.executable, "-m", "train.train_drafter", "--preset", "smoke", "--output-dir", str(run),
           "--eval-every", "12"]
    err_path = tmp_path / "first.err"
    with open(err_path, "w") as err:
        proc = subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=subprocess.DEVNULL, stderr=err)
        log = run / "train_log.jsonl"
        deadline = time.time() + 400
        while time.time() < deadline and proc.poll() is None:
            if log.exists() and any(json.loads(x).get("step", 0) >= 15 and "loss" in x
                                    for x in log.read_text().splitlines() if x.strip()):
                break
            time.sleep(0.5)
        assert proc.poll() is None, "the smoke run ended before it could be interrupted"
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=120)
    first = err_path.read_text()
    last = [line for line in first.replace("\r", "\n").splitlines() if line.strip()][-1]
    assert rc == 130 and "Traceback" not in first, first[-2000:]
    assert last.startswith("interrupted at step ") and "--resume" in last
    step = int(last.split()[3].rstrip(","))
    assert (run / "checkpoints" / f"checkpoint-{step}" / "trainer_state.json").exists()
    data_before = (run / "data" / "train_greedy.jsonl").read_text()

    proc = subprocess.run(cmd + ["--resume"], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert f"resuming from {run / 'checkpoints' / f'checkpoint-{step}'}" in proc.stdout
    assert "target responses" not in proc.stderr  # the generated data was reused, not regenerated
    assert (run / "data" / "train_greedy.jsonl").read_text() == data_before
    bar = proc.stderr.replace("\r", "\n")
    assert "tau=" in bar and "nan" not in bar
    recs = [json.loads(x) for x in (run / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs if "loss" in r] == list(range(3, 37, 3))  # no gap, no duplicate
    assert recs[-1]["step"] == 36 and recs[-1]["tau"] >= 1.0
    from transformers import AutoModel

    AutoModel.from_pretrained(run / "drafter", trust_remote_code=True)
