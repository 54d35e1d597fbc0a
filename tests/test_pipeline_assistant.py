"""Issue 26: ``pipeline("text-generation", model=target, assistant_model=draft)`` constructs (transformers
compares the assistant config's special ids with the target's to decide whether it needs its own
tokenizer; 5.x configs no longer define them, so a DFlashConfig without them raised AttributeError), and
each call still has to name a route."""

from pathlib import Path

import pytest
import torch
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer, pipeline

from configuration_dflash import DFlashConfig
from tiny import HIDDEN, MASK_ID, VOCAB

REPO = Path(__file__).resolve().parents[1]
PAIR = REPO / "pair"


def test_config_always_has_the_special_ids():
    config = DFlashConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=1, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=10, intermediate_size=72, target_layer_ids=[0],
                          mask_token_id=MASK_ID)
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (None, None, None)
    kept = DFlashConfig.from_dict({**config.to_dict(), "eos_token_id": 5})
    assert kept.eos_token_id == 5 and kept.to_dict()["eos_token_id"] == 5


@pytest.fixture(scope="module")
def trained_here(tmp_path_factory):
    """A drafter for the shipped target built the way the training CLI builds one (random weights: the
    output is the target's whatever the drafts), saved and loaded back through AutoModel."""
    from train.model_init import build_draft_config
    from modeling_dflash import DFlashDraftModel

    target = AutoModelForCausalLM.from_pretrained(PAIR / "target", dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(PAIR / "target")
    config = build_draft_config(target, num_layers=1, block_size=4, target_layer_ids=[1, 3], mask_token_id=1)
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("drafter")
    DFlashDraftModel(config).save_pretrained(folder)
    draft = AutoModel.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32).eval()
    return draft, target, tok, folder


def test_pipeline_with_assistant_model_constructs_and_calls_name_a_route(trained_here):
    draft, target, tok, folder = trained_here
    assert draft.config.eos_token_id == target.config.eos_token_id  # the target's ids, recorded by training
    pipe = pipeline("text-generation", model=target, tokenizer=tok, assistant_model=draft)
    prompt = 'def median(values):\n    """Return the median."""\n'
    plain = pipeline("text-generation", model=target, tokenizer=tok)(prompt, max_new_tokens=12, do_sample=False)
    assert pipe(prompt, max_new_tokens=12, do_sample=False, custom_generate=str(folder),
                trust_remote_code=True) == plain
    with pytest.raises(AttributeError, match="custom_generate"):  # no route: today's message naming them
        pipe(prompt, max_new_tokens=12, do_sample=False)
