"""Quiet mistakes get a warning or a pointer: unmasked left padding, an engine-only folder."""

import logging

import torch

from convert.convert_checkpoint import convert_checkpoint
from tiny import tiny_draft, tiny_target


def test_left_padded_batch_without_attention_mask_warns(caplog):
    target, draft = tiny_target(), tiny_draft()
    target.generation_config.pad_token_id = 0
    ids = torch.tensor([[0, 0, 5, 6], [7, 8, 9, 10]])
    with caplog.at_level(logging.WARNING):
        draft.spec_generate(target, ids, max_new_tokens=3, temperature=0.0)
    assert "rows [0] of input_ids start with the pad token 0" in caplog.text and "attention_mask" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):  # with the mask (or no padding) nothing is said
        draft.spec_generate(target, ids, attention_mask=(ids != 0).long(), max_new_tokens=3, temperature=0.0)
        draft.spec_generate(target, ids[1:].repeat(2, 1), max_new_tokens=3, temperature=0.0)
    assert "pad token" not in caplog.text


def test_engine_only_output_says_how_to_load_it(tmp_path):
    tiny_draft().save_pretrained(tmp_path / "src")
    plan = convert_checkpoint(str(tmp_path / "src"), str(tmp_path / "out"), engine_only=True, dry_run=True)
    assert "plain Qwen3Model" in plan.describe() and "DFlashDraftModel.from_pretrained" in plan.describe()
    assert "plain Qwen3Model" not in convert_checkpoint(str(tmp_path / "src"), str(tmp_path / "o2"), dry_run=True).describe()
