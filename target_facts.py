"""What one ``spec_generate`` call needs to know about its target, read once (``TargetFacts``).

The family rules live in ``target_families.py``; this module asks them once per call and keeps the
answers in one object that the decode loops and their steps read, so that no step re-derives a fact
from the model: which layers slide and how wide, the RoPE switch, the keyword of the cache, the
forward's parameters, the prefill's arguments, the embedding and head, the linear-attention layers of
hybrid targets, the devices, the dtype of explicit masks. Two facts depend on the call's prompt and
are added when the prompt is known (``for_call``): the execution device and the longrope switch the
call crosses. Source: issue "Seams for what comes next" (the same target was asked the same questions
in ten places per call, and ``target_mask`` at every verify step).
"""

import dataclasses
from typing import Optional

import torch

try:
    from .decode_step import _cache_kwarg, _forward_params
    from .target_cache import linear_layer_ids
    from .target_families import FAMILY as _families
except ImportError:  # imported from the repository root instead of as a Hub remote-code package
    from decode_step import _cache_kwarg, _forward_params
    from target_cache import linear_layer_ids
    from target_families import FAMILY as _families


@dataclasses.dataclass(frozen=True)
class TargetFacts:
    """The target as one call sees it.

    Attributes:
        forward_params: names of ``target.forward``'s parameters.
        cache_kw: ``"cache"`` (transformers >= 5.24) or ``"past_key_values"``: the forward's cache keyword.
        windows: ``target_families.layer_windows`` (``{}`` when no layer slides).
        prefill: extra keywords of the prefill forward (``target_families.prefill_kwargs``).
        rope: ``target_families.rope_switch``: ``(rope_type, first_position)`` or None.
        embed, head: the target's input embedding and output head (the draft reads both).
        linear_layers: indices of linear-attention layers (hybrid targets), ``()`` otherwise.
        mask_dtype: dtype of explicit 4-D masks (the target's first floating parameter).
        flash: the target runs flash-attention (which takes no 4-D mask).
        draft_device: where the draft's ``fc`` lives; taps are moved there.
        device: where the target's forward takes its inputs (``target_families.execution_device``; set
            by ``for_call``).
        crossing: the longrope switch this call crosses (``target_families.check_rope``), else None.
    """

    forward_params: frozenset
    cache_kw: str
    windows: dict
    prefill: dict
    rope: Optional[tuple]
    embed: torch.nn.Module
    head: torch.nn.Module
    linear_layers: tuple
    mask_dtype: torch.dtype
    flash: bool
    draft_device: torch.device
    device: Optional[torch.device] = None
    crossing: Optional[int] = None

    @classmethod
    def read(cls, target, draft) -> "TargetFacts":
        """Read ``target``'s facts for a call with ``draft``.

        Raises:
            NotImplementedError: a family refused by name (``target_families.check_family``).
        """
        _families.check_family(target)
        params = _forward_params(target)
        return cls(
            forward_params=params, cache_kw=_cache_kwarg(target), windows=_families.layer_windows(target),
            prefill=_families.prefill_kwargs(target, params), rope=_families.rope_switch(target),
            embed=target.get_input_embeddings(), head=target.get_output_embeddings(),
            linear_layers=tuple(linear_layer_ids(target)),
            mask_dtype=next((p.dtype for p in target.parameters() if p.is_floating_point()), torch.float32),
            flash=str(getattr(target.config, "_attn_implementation", "")).startswith("flash"),
            draft_device=_families.draft_device(draft))

    def for_call(self, target, input_ids, mask, budget: int) -> "TargetFacts":
        """These facts plus the prompt's: the execution device and the longrope switch the call crosses.

        Args:
            input_ids: ``(B, L)``; mask: ``(B, L)`` 0/1; budget: new tokens (``1 << 40`` when unbounded).
        Raises:
            NotImplementedError: what ``target_families.check_rope`` refuses, before any forward.
        """
        crossing = _families.check_rope(target, int(mask.sum(1).max()), budget, input_ids.shape[0],
                                        not bool(mask.all()))
        return dataclasses.replace(self, device=_families.execution_device(target, input_ids), crossing=crossing)

    @property
    def rope_bounded(self) -> bool:
        """Blocks are sized from the fastest row (``target_families.verify_budget``): a RoPE switch exists."""
        return self.rope is not None

    def mask(self, tokens_valid, positions, key_valid):
        """``target_families.target_mask`` for a forward over a cache with holes (some slot is known masked)."""
        return _families.target_mask(self.windows, tokens_valid, positions, key_valid, known_masked=True,
                                     dtype=self.mask_dtype, flash=self.flash)

    def tree_mask(self, key_valid, cache_len: int, positions, visible):
        """The 4-D mask of a draft tree's verify forward (``target_families.window_masks``).

        Args:
            key_valid: ``(A, cache_len)`` validity of the cached slots, or None (every slot valid).
            positions: ``(A, n + 1)`` the nodes' true positions (``start + depth``); visible: ``(A, n + 1, n + 1)``
                bool, each node's ancestors and itself (``draft_trees.TreeBatch.visible``).
        Each node sees the committed context (windows counted in true positions) and its own ancestors only.
        """
        a, q = positions.shape
        if key_valid is None:
            key_valid = positions.new_ones(a, cache_len)
        k_pos = torch.cat([key_valid.long().cumsum(1) - 1, positions], dim=1)  # (A, cache_len + n + 1)
        valid = torch.cat([key_valid.long(), positions.new_ones(a, q)], dim=1)
        allowed = torch.cat([visible.new_ones(a, q, cache_len), visible], dim=2)  # (A, n + 1, cache_len + n + 1)
        return _families.window_masks(self.windows or {None: None}, positions, k_pos, valid, self.mask_dtype, allowed)


__all__ = ["TargetFacts"]
