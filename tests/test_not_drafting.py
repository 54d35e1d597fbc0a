"""The not-drafting warning (issue 39): one warning per call when at least 16 verify steps drafted and they
accepted on average at most ``low_acceptance_warning`` drafted tokens per step; never for a healthy drafter;
``None`` silences it; steps that drafted nothing do not count; the output never changes.

Planted bugs caught: counting ``block_size=1`` steps (no drafted token) as drafting steps (the
``block_size=1`` case then warns); the threshold compared with accepted tokens including the bonus
(mean >= 1: never fires).
"""

import json
import logging
from pathlib import Path

import pytest
import torch
import transformers

from tiny import tiny_draft, tiny_target

PAIR = Path(__file__).resolve().parents[1] / "pair"
WARNING = "the drafter is not drafting"


def _warnings(caplog):
    return [r for r in caplog.records if WARNING in r.getMessage() and r.levelno == logging.WARNING]


def test_an_untrained_drafter_warns_once_and_the_shipped_one_never(caplog):
    """The shipped drafter (tau about 4) never warns; the same drafter untrained (what the loop sees of a
    drafter trained for another target: taps read from layers it was not trained on still accept about
    0.2 drafts per step here, reversed or all from layer 0) accepts next to nothing, the output is still
    the target's, and one warning names the figure and the first cause."""
    target = transformers.AutoModelForCausalLM.from_pretrained(PAIR / "target", dtype=torch.float32).eval()
    draft = transformers.AutoModel.from_pretrained(PAIR / "drafter", trust_remote_code=True,
                                                   dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(PAIR / "target")
    prompt = json.loads((PAIR / "heldout_prompts.json").read_text())[0]["prompt"]
    ids = tok(prompt, return_tensors="pt", add_special_tokens=False).input_ids
    ref = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=48)
    with caplog.at_level(logging.WARNING):
        healthy = draft.spec_generate(target, ids, max_new_tokens=48, temperature=0.0)
    assert torch.equal(healthy, ref) and not _warnings(caplog)
    torch.manual_seed(0)
    draft = type(draft)(draft.config).eval()  # the same drafter untrained: drafts unrelated to this target
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        out = draft.spec_generate(target, ids, max_new_tokens=48, temperature=0.0, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    steps = [d for d in out.row_draft_lengths[0] if d]
    mean = sum(out.row_accepted_drafts[0]) / len(steps)
    warned = _warnings(caplog)
    # under the default policy the untrained drafter goes plain after its first steps: judged on the positions
    # its first steps and probes tried (generation_output.MIN_DRAFTED_POSITIONS), not on 16 drafting steps
    assert mean <= 0.1 and len(steps) >= 3 and sum(steps) >= 8 and len(warned) == 1, (mean, steps, caplog.text)
    assert f"{mean:.3f}" in warned[0].getMessage() and "target_layer_ids" in warned[0].getMessage()


def test_threshold_none_and_plain_steps(caplog):
    """A random tiny drafter accepts nothing: it warns at the default threshold, not with None, not when no
    step drafted (``block_size=1``), and a bad threshold is refused by name before any work."""
    draft, target = tiny_draft(), tiny_target(peaked=True)
    ids = torch.tensor([[5, 17, 33, 2, 61]])
    with caplog.at_level(logging.WARNING):
        out = draft.spec_generate(target, ids, max_new_tokens=40, temperature=0.0, return_dict_in_generate=True)
    assert sum(out.row_accepted_drafts[0]) <= 0.1 * len(out.row_accepted_drafts[0])
    assert len(_warnings(caplog)) == 1
    for extra in ({"low_acceptance_warning": None}, {"block_size": 1}):
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            draft.spec_generate(target, ids, max_new_tokens=40, temperature=0.0, **extra)
        assert not _warnings(caplog), extra
    caplog.clear()
    with caplog.at_level(logging.WARNING):  # fewer than 3 drafting steps (16 with fixed blocks): no verdict yet
        draft.spec_generate(target, ids, max_new_tokens=10, temperature=0.0)
    assert not _warnings(caplog)
    target.generation_config.low_acceptance_warning = None  # read from the generation config too
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        draft.spec_generate(target, ids, max_new_tokens=40, temperature=0.0)
    assert not _warnings(caplog)
    with pytest.raises(ValueError, match="low_acceptance_warning"):
        draft.spec_generate(target, ids, low_acceptance_warning="high")
