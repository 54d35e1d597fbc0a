"""Tiny targets of every supported family (vocab 97, hidden 40, 3 layers, window 6), peaked.

Each builder returns an fp32 causal LM whose attention is sharp (``tiny.peak``; fused-qkv families
get the same q/k gain on their fused projection), so that a wrong position, a window off by one or a
doubly scaled embedding changes the greedy output. Families absent from the installed transformers
return None.
"""

import json
from pathlib import Path

import torch
import transformers

from tiny import HIDDEN, VOCAB, peak

WINDOW = 6
COMMON = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=72, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, head_dim=10, max_position_embeddings=512,
              eos_token_id=None, bos_token_id=None, pad_token_id=None)
MIXED = ["sliding_attention", "full_attention", "sliding_attention"]


def _build(config_name, model_name, **kwargs):
    config_cls, model_cls = getattr(transformers, config_name, None), getattr(transformers, model_name, None)
    if config_cls is None or model_cls is None:
        return None
    return model_cls(config_cls(**dict(COMMON, **kwargs)))


@torch.no_grad()
def _peak_fused_qkv(model, gain=25.0):
    """Phi-3 keeps q, k, v in one ``qkv_proj``: scale its q and k rows."""
    for module in model.modules():
        qkv = getattr(module, "qkv_proj", None)
        if isinstance(qkv, torch.nn.Linear):
            q_and_k = module.config.num_attention_heads * module.head_dim + module.config.num_key_value_heads * module.head_dim
            qkv.weight[:q_and_k] *= gain


BUILDERS = {
    "mistral": lambda: _build("MistralConfig", "MistralForCausalLM", sliding_window=WINDOW),
    "mixtral": lambda: _build("MixtralConfig", "MixtralForCausalLM", sliding_window=WINDOW, num_local_experts=3,
                              num_experts_per_tok=2),
    "starcoder2": lambda: _build("Starcoder2Config", "Starcoder2ForCausalLM", sliding_window=WINDOW),
    "phi3": lambda: _build("Phi3Config", "Phi3ForCausalLM", sliding_window=WINDOW),
    "qwen2": lambda: _build("Qwen2Config", "Qwen2ForCausalLM", use_sliding_window=True, sliding_window=WINDOW,
                            max_window_layers=1),
    "gemma3": lambda: _build("Gemma3TextConfig", "Gemma3ForCausalLM", sliding_window=WINDOW, layer_types=MIXED,
                             query_pre_attn_scalar=10),
    "gpt_oss": lambda: _build("GptOssConfig", "GptOssForCausalLM", sliding_window=WINDOW, layer_types=MIXED,
                              num_local_experts=3, num_experts_per_tok=2, head_dim=10),
    "gemma4": lambda: _build("Gemma4TextConfig", "Gemma4ForCausalLM", sliding_window=WINDOW,
                             layer_types=["sliding_attention", "full_attention", "full_attention"], num_kv_shared_layers=1, hidden_size_per_layer_input=8,
                             vocab_size_per_layer_input=VOCAB, global_head_dim=10, final_logit_softcapping=30.0,
                             rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                              "full_attention": {"rope_type": "default", "rope_theta": 1e6}}),
}


def family_target(name, seed=0):
    """The peaked tiny target of family ``name`` (fp32, eval, eos unset), or None if not installed."""
    torch.manual_seed(seed)
    model = BUILDERS[name]()
    if model is None:
        return None
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    if name == "phi3":
        _peak_fused_qkv(model)
    peak(model)
    return model.eval()


TARGET_CONFIGS = Path(__file__).resolve().parent / "fixtures" / "target_configs"
# a text-only config names no architecture: the causal-LM class of its model_type
TEXT_CLASSES = {"gemma4_text": "Gemma4ForCausalLM"}


def published_config(name):
    """The shrunk published ``config.json`` ``name`` (tests/fixtures/target_configs/README.md) as a dict."""
    return json.loads((TARGET_CONFIGS / f"{name}.json").read_text())


def published_target(name, seed=0):
    """A peaked fp32 target built from the shrunk published config ``name`` through ``AutoConfig.for_model``
    (the class its ``model_type`` maps to, as ``from_pretrained`` picks it) and the class its
    ``architectures`` names; its generation config is derived from that config, as ``from_pretrained``
    does without a ``generation_config.json``. Returns ``(target, None)``, or ``(None, reason)`` when the
    installed transformers lacks the family."""
    config_dict = published_config(name)
    model_type = config_dict["model_type"]
    class_name = config_dict.get("architectures", [TEXT_CLASSES.get(model_type)])[0]
    if model_type not in transformers.CONFIG_MAPPING or getattr(transformers, class_name, None) is None:
        return None, f"transformers {transformers.__version__} has no {model_type} / {class_name}"
    config = transformers.AutoConfig.for_model(**config_dict)
    torch.manual_seed(seed)
    model = getattr(transformers, class_name)(config)
    if model_type == "phi3":
        _peak_fused_qkv(model)
    hybrid = "linear_attention" in (getattr(config.get_text_config(), "layer_types", None) or [])
    peak(model, head=4.0 if hybrid else 10.0)  # x10 makes a hybrid stack loop on one token
    if hybrid:
        from test_hybrid import remember  # gates that keep memory, so a state bug changes the output

        remember(model)
    return model.eval(), None
