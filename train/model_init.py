"""Draft config shaped like the target, and the draft's initialisation from the target's last layers.

Initialisation (:func:`init_draft_from_target`): draft layer ``i`` of ``n`` copies target layer
``L - n + i`` (the last ``n`` layers) wherever shapes match, the final ``norm`` copies the target's final
norm, ``hidden_norm`` starts at ones and ``fc`` at small noise (std ``initializer_range``) plus the
identity on the slice of the DEEPEST tapped layer. Why: the draft's output goes through the target's
frozen final-norm + head, so starting from the target's own last layers puts the draft's residual
stream in the space that head reads; the identity slice makes the injected context keys/values start as
(normed) deep target states, the space the copied ``k_proj``/``v_proj`` were trained on, instead of a
random projection. The rest of ``fc`` is left to training.
"""
from __future__ import annotations

from typing import Optional

import torch

from train._paths import DFlashConfig, decoder_parts


def _target_text_config(target):
    cfg = target.config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def _rope_theta(cfg) -> float:
    """The target's rope base (``rope_parameters`` on transformers 5.x, ``rope_theta`` on 4.x)."""
    params = getattr(cfg, "rope_parameters", None)
    if isinstance(params, dict):
        if "full_attention" in params and isinstance(params["full_attention"], dict):
            params = params["full_attention"]
        if params.get("rope_theta") is not None:
            return float(params["rope_theta"])
    return float(getattr(cfg, "rope_theta", None) or 10000.0)


def build_draft_config(target, num_layers: int, block_size: int, target_layer_ids: list[int], mask_token_id: int,
                       target_model_id: Optional[str] = None, **overrides) -> DFlashConfig:
    """A draft config shaped like one target layer (hidden, heads, head_dim, MLP, eps, rope base).

    The draft must share the target's hidden size (it reads the target's embedding and head). ``overrides``
    replace any field (e.g. ``layer_types``, ``sliding_window``). Raises ValueError (from the config) on
    bad layer ids or mask id.
    """
    t = _target_text_config(target)
    n_layers = t.num_hidden_layers
    kwargs = dict(
        vocab_size=t.vocab_size, hidden_size=t.hidden_size, intermediate_size=t.intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=t.num_attention_heads,
        num_key_value_heads=getattr(t, "num_key_value_heads", None) or t.num_attention_heads,
        head_dim=getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads,
        rms_norm_eps=getattr(t, "rms_norm_eps", 1e-6), max_position_embeddings=t.max_position_embeddings,
        rope_theta=_rope_theta(t), block_size=block_size, mask_token_id=mask_token_id,
        target_layer_ids=list(target_layer_ids), num_target_layers=n_layers, target_hidden_size=t.hidden_size,
        target_model_id=target_model_id, initializer_range=getattr(t, "initializer_range", 0.02),
        architectures=["DFlashDraftModel"],
        # the target's special ids: the drafter uses its tokenizer (a pipeline compares them to tell)
        **{name: getattr(t, name, None) for name in ("bos_token_id", "eos_token_id", "pad_token_id")},
    )
    kwargs.update(overrides)
    return DFlashConfig(**kwargs)


@torch.no_grad()
def init_draft_from_target(draft, target, fc_identity: bool = True) -> dict:
    """Initialise ``draft`` from ``target`` in place (module docstring explains why).

    Draft layer ``i`` of ``n`` copies every same-named, same-shaped tensor of target layer ``L - n + i``;
    ``norm`` copies the target's final norm; ``fc`` = noise (std ``initializer_range``) plus, with
    ``fc_identity``, the identity on the deepest tapped layer's slice; ``hidden_norm`` = ones.

    Returns ``{"copied": [draft param names], "random": [draft param names]}``.
    """
    layers, norm = decoder_parts(target)
    n, L = len(draft.layers), len(layers)
    copied = []
    for i, layer in enumerate(draft.layers):
        src = layers[max(L - n + i, 0)].state_dict()
        for name, p in layer.named_parameters():
            if name in src and src[name].shape == p.shape:
                p.copy_(src[name].to(p.dtype))
                copied.append(f"layers.{i}.{name}")
    if norm.weight.shape == draft.norm.weight.shape:
        draft.norm.weight.copy_(norm.weight.to(draft.norm.weight.dtype))
        copied.append("norm.weight")
    std = draft.config.initializer_range
    draft.fc.weight.normal_(0.0, std)
    if fc_identity:
        H, ids = draft.config.hidden_size, draft.config.target_layer_ids
        deepest = ids.index(max(ids))
        th = draft.config.target_hidden_size
        if th == H:
            draft.fc.weight[:, deepest * th:(deepest + 1) * th] += torch.eye(H, dtype=draft.fc.weight.dtype)
    draft.hidden_norm.weight.fill_(1.0)
    names = [n_ for n_, _ in draft.named_parameters()]
    return {"copied": copied, "random": [n_ for n_ in names if n_ not in copied]}


