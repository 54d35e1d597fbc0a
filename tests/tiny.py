"""Tiny models with odd sizes, built in-process (tests never touch the Hub)."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from configuration_dflash import DFlashConfig
from modeling_dflash import DFlashDraftModel

VOCAB, HIDDEN, MASK_ID = 97, 40, 96


def tiny_target(kind: str = "qwen3", seed: int = 0, layers: int = 3, **overrides):
    """A random fp32 causal LM: vocab 97, hidden 40, 3 layers, eos unset (so nothing stops early)."""
    torch.manual_seed(seed)
    common = dict(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=72, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=10, max_position_embeddings=512,
        eos_token_id=None, bos_token_id=None, pad_token_id=None,
    )
    common.update(overrides)
    if kind == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**common))
    elif kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    else:
        raise ValueError(kind)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    return model.eval()


def tiny_draft_config(**overrides) -> DFlashConfig:
    kwargs = dict(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=56, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=10, block_size=4, rms_norm_eps=1e-6,
        target_layer_ids=[0, 2], mask_token_id=MASK_ID, num_target_layers=3, max_position_embeddings=512,
    )
    kwargs.update(overrides)
    return DFlashConfig(**kwargs)


def tiny_draft(seed: int = 1, **overrides) -> DFlashDraftModel:
    torch.manual_seed(seed)
    return DFlashDraftModel(tiny_draft_config(**overrides)).eval()


CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)


def tiny_tokenizer():
    """A word-level tokenizer over exactly VOCAB ids, with a chat template and a pad token."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "[UNK]"]
    words = special + [f"w{i}" for i in range(VOCAB - len(special) - 1)] + ["<|mask|>"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                   unk_token="[UNK]", mask_token="<|mask|>",
                                   additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    fast.chat_template = CHAT_TEMPLATE
    return fast
