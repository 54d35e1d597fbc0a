"""Tiny fake published DFlash drafters, one per input dialect, built on disk in the test (no network).

The config follows notes section 2 (the z-lab / SpecForge ``config.json``: Qwen3 + top-level
``block_size`` + ``dflash_config``), with the sizes of ``tests/tiny.py``.
"""

import json
import os

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from tiny import MASK_ID, VOCAB, tiny_draft

DTYPE = torch.bfloat16  # the published drafts are bf16


def published_config(dialect: str = "z-lab", **overrides) -> dict:
    """A ``config.json`` dict as the z-lab Hub repos publish it (``specforge``: without ``auto_map``)."""
    config = {
        "architectures": ["DFlashDraftModel"],
        "attention_bias": False, "attention_dropout": 0.0, "block_size": 4, "bos_token_id": 1,
        "dflash_config": {"mask_token_id": MASK_ID, "target_layer_ids": [0, 2]}, "eos_token_id": 2,
        "head_dim": 10, "hidden_act": "silu", "hidden_size": 40, "initializer_range": 0.02,
        "intermediate_size": 56, "layer_types": ["full_attention", "full_attention"],
        "max_position_embeddings": 512, "max_window_layers": 2, "model_type": "qwen3",
        "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2, "num_target_layers": 3,
        "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.57.1",
        "use_cache": True, "use_sliding_window": False, "vocab_size": VOCAB,
    }
    if dialect == "z-lab":
        config["auto_map"] = {"AutoModel": "dflash.DFlashDraftModel"}
    config.update(overrides)
    return config


def source_tensors(seed: int = 1) -> dict:
    """The published state dict (no ``model.`` prefix) of a tiny draft, in bf16."""
    return {k: v.to(DTYPE).contiguous() for k, v in tiny_draft(seed=seed).state_dict().items()}


def write_source(folder, dialect="z-lab", tensors=None, config=None, prefix="", sharded=False, pickle=False) -> str:
    """Write a fake published drafter into ``folder`` and return its path.

    Args:
        dialect: ``"z-lab"`` (auto_map + stub ``dflash.py``) or ``"specforge"`` (neither).
        tensors: state dict to store (default [`source_tensors`]); keys get ``prefix`` prepended.
        config: config dict (default [`published_config`] of the dialect).
        sharded: two safetensors shards + ``model.safetensors.index.json``.
        pickle: ``pytorch_model.bin`` instead of safetensors.
    """
    os.makedirs(folder, exist_ok=True)
    tensors = {prefix + k: v for k, v in (source_tensors() if tensors is None else tensors).items()}
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config if config is not None else published_config(dialect), f, indent=2)
    if dialect == "z-lab":
        with open(os.path.join(folder, "dflash.py"), "w") as f:
            f.write("raise RuntimeError('the source remote code must never be imported')\n")
    if pickle:
        torch.save(tensors, os.path.join(folder, "pytorch_model.bin"))
    elif sharded:
        keys = sorted(tensors)
        shards = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
        for name, names in shards.items():
            save_file({k: tensors[k] for k in names}, os.path.join(folder, name))
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
                 "weight_map": {k: name for name, names in shards.items() for k in names}}
        with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2)
    else:
        save_file(tensors, os.path.join(folder, "model.safetensors"))
    return str(folder)


def random_draft_inputs(seed: int = 0, context_len: int = 6, block: int = 4) -> dict:
    """Random ``forward`` inputs of the tiny draft, in bf16."""
    gen = torch.Generator().manual_seed(seed)
    return {
        "position_ids": torch.arange(context_len + block).unsqueeze(0),
        "noise_embedding": torch.randn(1, block, 40, generator=gen).to(DTYPE),
        "target_hidden": torch.randn(1, context_len, 80, generator=gen).to(DTYPE),
    }


def source_draft(seed: int = 1):
    """The in-memory draft of [`published_config`] holding the tensors of [`source_tensors`], in bf16.

    Built independently of the converter (the published rope_theta 1e6 differs from tests/tiny.py's
    default, so a converter that lost the draft's own rope would fail the comparison)."""
    return tiny_draft(seed=seed, rope_theta=1000000.0).to(DTYPE)


def save_tiny_tokenizer(folder) -> None:
    """A word-level tokenizer over the tiny vocabulary (``w1``..``w95``) with a chat template."""
    vocab = {"[UNK]": 0, **{f"w{i}": i for i in range(1, VOCAB - 1)}, "[MASK]": MASK_ID}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    template = "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}w7{% endif %}"
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", chat_template=template).save_pretrained(folder)
