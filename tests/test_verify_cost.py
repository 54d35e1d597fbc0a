"""The verify-length policy's cost source (``verify_cost.py``, issue 49): a cost model from the shapes priced by
device constants measured once by raw torch ops and kept in ``device_speed.json`` under a lock; no generation
and no forward while a call resolves its cost; a ``verify_cost`` from any module copy or a plain mapping;
tensor-parallel ranks take rank 0's cost.

Planted bugs each test was shown to catch are listed in its docstring.
"""

import importlib.util
import json
import multiprocessing
import os
import time
from types import SimpleNamespace

import pytest
import torch
from transformers import Qwen3Config

import generation_utils
import verify_cost
from configuration_dflash import DFlashConfig
from tiny import tiny_draft, tiny_target

CPU = verify_cost.DeviceSpeed(op_s=2e-5, byte_s=5e-11, flop_s=2e-11, attn_flop_s=3e-11)
GPU = verify_cost.DeviceSpeed(op_s=8e-6, byte_s=1 / 3e12, flop_s=1 / 4e14, attn_flop_s=1 / 2e14)  # H100-like
FAKE = verify_cost.DeviceSpeed(1e-6, 1e-11, 1e-11, 1e-11)
DEAR = {"widths": [1, 2], "verify": [1.0, 50.0], "draft": 5.0}  # nothing pays: every step plain


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty cost folder, no pinned cost, an empty process dict."""
    monkeypatch.setenv("DFLASH_HF_CACHE", str(tmp_path))
    monkeypatch.delenv(verify_cost.COST_ENV, raising=False)
    monkeypatch.setattr(verify_cost, "_SPEEDS", {})
    monkeypatch.setattr(verify_cost, "_WARNED", set())
    return tmp_path


def _counting_measure(monkeypatch, speed=FAKE):
    calls = []
    monkeypatch.setattr(verify_cost, "measure_speed", lambda device, dtype: calls.append(1) or speed)
    return calls


def test_the_modelled_cost_grows_with_width_and_batch():
    """Seconds per step grow with the verified width and the batch; every cost is >= 1 and non-decreasing.
    Planted bug caught: the matmul's flops not multiplied by the rows (batch 32 costs what batch 1 does)."""
    target, draft = tiny_target(), tiny_draft(block_size=16)
    secs = {(b, w): verify_cost.step_seconds(target, draft, CPU, b, 512, w, 16) for b in (1, 32) for w in (1, 2, 8, 16)}
    for b in (1, 32):
        assert secs[b, 1] < secs[b, 2] < secs[b, 8] < secs[b, 16]
    for w in (1, 2, 8, 16):
        assert secs[1, w] < secs[32, w]
    cost = verify_cost.model_step_cost(target, draft, CPU, 32, 2048, 16, 16)
    assert cost.widths == (1, 2, 4, 8, 16) and cost.verify[0] == 1.0 and list(cost.verify) == sorted(cost.verify)


def _big():
    """Qwen3-8B's shapes and a 5-layer DFlash drafter for it (configs only: no weights)."""
    target = SimpleNamespace(config=Qwen3Config(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                                                num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                                                vocab_size=151936))
    draft = SimpleNamespace(config=DFlashConfig(hidden_size=4096, intermediate_size=12288, num_hidden_layers=5,
                                                num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                                                vocab_size=151936, target_layer_ids=[1, 9, 17, 25, 33],
                                                mask_token_id=151669, num_target_layers=36))
    return target, draft


def test_a_gpu_like_device_verifies_16_positions_of_an_8b_model_for_about_one_plain_step():
    """H100-like constants (3 TB/s, 400 TFLOP/s, 8 us per op): a 16-position verify of an 8B model at batch 1
    costs about one plain step (launch- and weight-bound: the extra positions are nearly free; what is left is
    the drafting step's own ops); the same shapes at batch 32 x 2,048 cost more, and the shipped pair on a
    CPU-like device more still. Planted bug caught: attention flops priced per row instead of per query
    position (batch 1 comes out near 1 but batch 32 does not grow)."""
    target, draft = _big()
    one = verify_cost.model_step_cost(target, draft, GPU, 1, 512, 16, 16, nbytes=2)
    assert one.verify_cost(16) <= 1.6, one
    busy = verify_cost.model_step_cost(target, draft, GPU, 32, 2048, 16, 16, nbytes=2)
    assert busy.verify_cost(16) > one.verify_cost(16) + 0.25, (one, busy)


def test_no_forward_or_nested_generation_while_a_call_resolves_its_cost(cache, monkeypatch):
    """The default call (no pinned cost, an empty cache) resolves its cost with no target forward and one
    ``_spec_loop``; the output equals ``generate``. Planted bugs caught: a probe forward in ``call_cost``;
    the old per-shape table (nested ``spec_generate`` calls)."""
    target, draft = tiny_target(peaked=True), tiny_draft(block_size=8)
    real_cost, real_loop, loops = verify_cost.call_cost, generation_utils._spec_loop, []

    def guarded(target, *args, **kwargs):
        forward = target.forward
        target.forward = lambda *a, **k: pytest.fail("a forward ran while the cost was resolved")
        try:
            return real_cost(target, *args, **kwargs)
        finally:
            target.forward = forward

    monkeypatch.setattr(generation_utils, "call_cost", guarded)
    monkeypatch.setattr(generation_utils, "_spec_loop", lambda *a, **k: loops.append(1) or real_loop(*a, **k))
    ids = torch.tensor([[5, 17, 33, 2, 61, 8]])
    out = draft.spec_generate(target, ids, max_new_tokens=16, temperature=0.0)
    ref = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=16)
    assert torch.equal(out, ref) and loops == [1]


def test_a_dynamic_rope_target_at_60_percent_of_its_window_runs_the_default(cache):
    """Dynamic NTK switching at 40, a prompt of 14 and 10 new tokens (24 = 60%): the default runs and equals
    ``generate``. Planted bug caught: a cost that runs the loop at a context rounded up past the switch
    (the old measurement raised NotImplementedError here)."""
    target = tiny_target("llama", peaked=True, max_position_embeddings=40,
                         rope_scaling={"rope_type": "dynamic", "factor": 4.0})
    draft = tiny_draft(block_size=8)
    ids = torch.randint(2, 90, (1, 14), generator=torch.Generator().manual_seed(3))
    out = draft.spec_generate(target, ids, max_new_tokens=10, temperature=0.0)
    ref = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=10)
    assert torch.equal(out, ref)


def test_max_time_is_kept_on_a_first_call(cache):
    """``max_time=0.5`` on an empty cache (the device measured in the call) returns within about 1 s.
    Planted bug caught: the old table (5-7 s before the first token)."""
    target, draft = tiny_target(), tiny_draft(block_size=8)
    ids = torch.randint(2, 90, (1, 8), generator=torch.Generator().manual_seed(1))
    start = time.perf_counter()
    draft.spec_generate(target, ids, max_new_tokens=1000, temperature=0.0, max_time=0.5)
    assert time.perf_counter() - start < 1.5


def _write_one(folder: str, i: int) -> None:
    """One of the processes of the test below: a fake device of its own, measured (slowly) and stored."""
    os.environ["DFLASH_HF_CACHE"] = folder
    verify_cost.device_name = lambda device: f"fake-device-{i}"
    verify_cost.measure_speed = lambda device, dtype: time.sleep(0.2) or FAKE
    verify_cost.device_speed("cpu", torch.float32)


def test_four_processes_writing_at_once_lose_no_entry(cache):
    """4 spawned processes, each with another device key, store their constants at once: all 4 entries are
    kept and the file has the user's umask. Planted bugs caught: no file lock (read, change, rewrite: entries
    lost); ``tempfile.mkstemp`` (0600)."""
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_write_one, args=(str(cache), i)) for i in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert all(p.exitcode == 0 for p in procs)
    path = cache / verify_cost.SPEED_FILE
    assert sorted(k.split("|")[0] for k in json.loads(path.read_text())) == [f"fake-device-{i}" for i in range(4)]
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask


def test_an_unwritable_folder_warns_once_and_runs(cache, monkeypatch, caplog):
    """A cost folder under a plain file: one warning for two dtypes, the constants kept in the process, the
    call runs. Planted bug caught: the OSError escaping into the user's call."""
    (cache / "a_file").write_text("")
    monkeypatch.setenv("DFLASH_HF_CACHE", str(cache / "a_file" / "sub"))
    calls = _counting_measure(monkeypatch)
    with caplog.at_level("WARNING"):
        verify_cost.device_speed("cpu", torch.float32)
        verify_cost.device_speed("cpu", torch.float64)
        verify_cost.device_speed("cpu", torch.float32)
    assert calls == [1, 1] and caplog.text.count("cannot keep the device speed constants") == 1
    target, draft = tiny_target(), tiny_draft(block_size=8)
    draft.spec_generate(target, torch.tensor([[5, 17, 33]]), max_new_tokens=6, temperature=0.0)


def test_a_step_cost_of_another_module_copy_and_a_mapping_are_accepted(cache, monkeypatch):
    """A ``StepCost`` of verify_cost.py loaded under another name (the installed package against the remote
    copy), a plain dict and an object with the fields all pin the policy (nothing pays: no draft forward).
    Planted bug caught: ``isinstance(given, StepCost)`` as the only test (the other copy's is refused)."""
    spec = importlib.util.spec_from_file_location("other_verify_cost", verify_cost.__file__)
    other = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(other)
    monkeypatch.setattr(verify_cost, "measure_speed", lambda *a: pytest.fail("a pinned cost measured the device"))
    target, draft = tiny_target(), tiny_draft(block_size=8)
    ids = torch.tensor([[5, 17, 33, 2]])
    for given in (other.StepCost((1, 2), (1.0, 50.0), 5.0), DEAR, SimpleNamespace(**DEAR)):
        out = draft.spec_generate(target, ids, max_new_tokens=8, temperature=0.0, verify_cost=given,
                                  return_dict_in_generate=True)
        assert out.num_draft_forwards == 0, given


def test_a_damaged_entry_is_measured_again_with_one_warning(cache, monkeypatch, caplog):
    """A hand-edited entry is measured again (one warning naming the file) and rewritten. Planted bug caught:
    ``DeviceSpeed(**entry)`` unguarded (a TypeError in every call)."""
    calls = _counting_measure(monkeypatch)
    key = verify_cost.speed_key("cpu", torch.float32)
    path = cache / verify_cost.SPEED_FILE
    path.write_text(json.dumps({key: "hello", "other": {"op_s": 1}}))
    with caplog.at_level("WARNING"):
        assert verify_cost.device_speed("cpu", torch.float32) == FAKE
    assert calls == [1] and caplog.text.count("are damaged") == 1 and str(path) in caplog.text
    stored = json.loads(path.read_text())
    assert stored[key]["op_s"] == FAKE.op_s and stored["other"] == {"op_s": 1}  # the others' entries kept


def test_an_old_entry_or_one_measured_under_passed_load_is_measured_again(cache, monkeypatch):
    """An entry 31 days old is measured again; so is one measured at load 100 when the load now is 0.1; a
    fresh one measured at rest is read. Planted bugs caught: no expiry; the load rule reversed."""
    calls = _counting_measure(monkeypatch)
    monkeypatch.setattr(verify_cost, "_load_avg", lambda: 0.1)
    key = verify_cost.speed_key("cpu", torch.float32)
    path = cache / verify_cost.SPEED_FILE
    entry = {"op_s": 2e-6, "byte_s": 2e-11, "flop_s": 2e-11, "attn_flop_s": 2e-11, "load": 0.1}
    for when, load, measured in ((time.time() - 31 * 86400, 0.1, 1), (time.time(), 100.0, 1), (time.time(), 0.1, 0)):
        path.write_text(json.dumps({key: {**entry, "measured_at": when, "load": load}}))
        monkeypatch.setattr(verify_cost, "_SPEEDS", {})
        calls.clear()
        verify_cost.device_speed("cpu", torch.float32)
        assert len(calls) == measured, (when, load)


def _rank(rank: int, init: str, out: str) -> None:
    """One gloo rank of the test below: its own constants, rank 0's cost back."""
    torch.distributed.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    own = verify_cost.StepCost((1, 2, 4), (1.0, 1.5 + rank, 2.0 + rank), 0.0)
    cost = verify_cost.shared_cost(own, torch.distributed.group.WORLD)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(list(cost.verify), f)
    torch.distributed.destroy_process_group()


def test_two_ranks_with_different_costs_take_rank_0s(tmp_path):
    """Two gloo ranks whose own costs differ both return rank 0's (``shared_cost``, used by ``call_cost`` for a
    sharded target). Planted bug caught: each rank keeping its own cost."""
    if not torch.distributed.is_available():
        pytest.skip("this torch build has no torch.distributed")
    ctx = multiprocessing.get_context("spawn")
    init = f"file://{tmp_path / 'store'}"
    procs = [ctx.Process(target=_rank, args=(r, init, str(tmp_path))) for r in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert all(p.exitcode == 0 for p in procs)
    assert [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)] == [[1.0, 1.5, 2.0]] * 2


def test_call_cost_shares_only_for_a_sharded_target(monkeypatch):
    """``_tp_group``: None without an initialized process group or for an unsharded model in several
    processes; the TP group for a target transformers sharded (``_tp_size`` > 1)."""
    target = tiny_target()
    assert verify_cost._tp_group(target) is None
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    assert verify_cost._tp_group(target) is None  # several processes, the model not sharded
    target._tp_size = 2
    assert verify_cost._tp_group(target) is torch.distributed.group.WORLD
