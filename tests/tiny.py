"""Tiny models with odd sizes, built in-process (tests never touch the Hub)."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from configuration_dflash import DFlashConfig
from modeling_dflash import DFlashDraftModel

VOCAB, HIDDEN, MASK_ID = 97, 40, 96


def tiny_target(kind: str = "qwen3", seed: int = 0, layers: int = 3, peaked: bool = False, **overrides):
    """A random fp32 causal LM: vocab 97, hidden 40, 3 layers, eos unset (so nothing stops early).

    ``peaked=True`` sharpens attention and logits with [`peak`] (the default stays uniform-ish, so
    older tests keep their meaning)."""
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
    if peaked:
        peak(model)
    return model.eval()


@torch.no_grad()
def _scale_gain(module, scale: float) -> bool:
    """Multiply the output of a q/k RMSNorm by ``scale``, whether it computes ``w * x_hat`` (Qwen3,
    Llama-style) or ``(1 + w) * x_hat`` (Gemma-style). Returns False for a norm without a weight."""
    weight = getattr(module, "weight", None)
    if weight is None:
        return False
    probe = torch.ones(1, weight.shape[-1], dtype=weight.dtype)
    gain = module(probe)[0]  # x_hat of a constant vector is 1, so this is the effective gain
    if torch.allclose(gain, weight):
        weight.mul_(scale)
    elif torch.allclose(gain, 1 + weight):
        weight.copy_((1 + weight) * scale - 1)
    else:
        raise ValueError(f"cannot tell how {type(module).__name__} applies its weight")
    return True


@torch.no_grad()
def peak(model, qk: float = 3.0, head: float = 10.0, proj_qk: float = 25.0):
    """Make a tiny random model attend sharply and predict confidently (notes section 7).

    Tiny random models attend almost uniformly, which hides position, window and state bugs: a
    token at the wrong position or outside the window then changes nothing. This multiplies every
    attention layer's queries and keys by ``qk`` after their per-head norm (Qwen3, Gemma: ``q_norm``/
    ``k_norm``), or by ``proj_qk`` at ``q_proj``/``k_proj`` for families without q/k norms (Llama:
    projections of std 0.02 need the larger factor), and the LM head by ``head``. Returns ``model``.
    """
    for module in model.modules():
        q_norm, k_norm = getattr(module, "q_norm", None), getattr(module, "k_norm", None)
        if q_norm is not None and k_norm is not None and _scale_gain(q_norm, qk) and _scale_gain(k_norm, qk):
            continue
        q_proj, k_proj = getattr(module, "q_proj", None), getattr(module, "k_proj", None)
        if isinstance(q_proj, torch.nn.Linear) and isinstance(k_proj, torch.nn.Linear):
            q_proj.weight.mul_(proj_qk)
            k_proj.weight.mul_(proj_qk)
    head_layer = model.get_output_embeddings()
    if head_layer is not None and head_layer.weight is not model.get_input_embeddings().weight:
        head_layer.weight.mul_(head)
    return model


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
