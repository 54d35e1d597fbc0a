"""Anchors, packed blocks, their attention masks and the weighted block loss (the draft side of training).

DFlash paper, section 4: per sequence, random anchors over response positions; anchor ``a`` makes the
block ``[x_a, MASK x (B-1)]`` at positions ``a..a+B-1``; every block of a row goes through ONE draft
forward with a mask (a block sees context features at positions strictly ``< a``, its own block, never
another block); slot ``k`` predicts the token at ``a + k`` (slot 0 has no loss), cross-entropy through
the frozen target head weighted ``exp(-(k-1)/gamma)``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from train._paths import DFlashConfig, draft_block_embedding, draft_logits

IGNORE = -100  # label of a position without loss (the torch cross-entropy convention)
PUBLISHED_GAMMA = {8: 4.0, 10: 5.0, 16: 7.0}  # DFlash paper, section 4 and appendix


def trainable_anchor_positions(prompt_len: int, length: int) -> torch.Tensor:
    """Positions ``p`` that may anchor a block: ``max(prompt_len, 1) <= p <= length - 2``.

    The anchor is a response token (at inference the first anchor is the first generated token, at
    position ``prompt_len``), at least one context position precedes it, and at least one label
    (position ``p + 1``) exists. Returns a possibly empty LongTensor.
    """
    return torch.arange(max(prompt_len, 1), max(length - 1, max(prompt_len, 1)))


def sample_anchors(prompt_len: int, length: int, num_anchors: int, generator=None) -> torch.Tensor:
    """Up to ``num_anchors`` distinct anchor positions, sorted, uniform over the trainable positions.

    All trainable positions when there are no more than ``num_anchors``. Raises ValueError when
    ``num_anchors < 1``.
    """
    if num_anchors < 1:
        raise ValueError(f"num_anchors must be >= 1, got {num_anchors}")
    pos = trainable_anchor_positions(prompt_len, length)
    if len(pos) > num_anchors:
        pos = pos[torch.randperm(len(pos), generator=generator)[:num_anchors]]
    return pos.sort().values


def block_inputs(input_ids: torch.Tensor, anchors: torch.Tensor, block_size: int, mask_token_id: int):
    """Packed block tokens, positions and labels for one sequence.

    Args:
        input_ids: ``(T,)`` the sequence; anchors: ``(n,)`` positions in ``[0, T)``.

    Returns:
        ``(noise_ids, positions, labels)``, each ``(n * block_size,)`` LongTensor: block ``i`` is
        ``[input_ids[a_i], MASK, ...]`` at positions ``a_i .. a_i + B - 1``; ``labels`` holds
        ``input_ids[a_i + k]`` for slot ``k >= 1`` inside the sequence, ``-100`` for slot 0 and past the end.
    """
    n, T = len(anchors), len(input_ids)
    slot = torch.arange(block_size).repeat(n)
    positions = anchors.repeat_interleave(block_size) + slot
    noise = torch.full((n * block_size,), mask_token_id, dtype=torch.long)
    noise[slot == 0] = input_ids[anchors]
    labels = torch.full_like(noise, IGNORE)
    ok = (slot > 0) & (positions < T)
    labels[ok] = input_ids[positions[ok]]
    return noise, positions, labels


def packed_block_mask(ctx_len: int, anchors: torch.Tensor, block_size: int, causal: bool,
                      window: Optional[int] = None) -> torch.Tensor:
    """Visibility ``(n * B, ctx_len + n * B)`` bool (True = attend) for packed blocks over [context ++ blocks].

    Query slot ``k`` of block ``i`` (position ``a_i + k``) sees context key ``j`` iff ``j < a_i`` (strictly
    before the anchor: the anchor's own feature does not exist at inference, notes sections 1 and 4),
    and block keys of block ``i`` only: all of them (bidirectional) or slots ``<= k`` (``causal``). A
    sliding ``window`` additionally keeps ``q_pos - k_pos < window`` (the transformers convention).
    """
    n = len(anchors)
    slot = torch.arange(block_size).repeat(n)
    block_id = torch.arange(n).repeat_interleave(block_size)
    q_pos = anchors.repeat_interleave(block_size) + slot
    ctx = torch.arange(ctx_len)[None, :] < anchors[block_id][:, None]  # (q, ctx)
    blk = block_id[:, None] == block_id[None, :]  # (q, q)
    if causal:
        blk &= slot[None, :] <= slot[:, None]
    if window is not None:
        ctx &= (q_pos[:, None] - torch.arange(ctx_len)[None, :]) < window
        blk &= (q_pos[:, None] - q_pos[None, :]) < window
    return torch.cat([ctx, blk], dim=1)


def default_gamma(block_size: int) -> float:
    """Loss decay gamma: the published 7 (B=16), 5 (B=10), 4 (B=8); else ``max(1, 0.45 * B)``."""
    return PUBLISHED_GAMMA.get(block_size, max(1.0, 0.45 * block_size))


def loss_weights(block_size: int, gamma: Optional[float] = None) -> torch.Tensor:
    """Per-slot weights ``(B,)``: 0 for slot 0, ``exp(-(k - 1) / gamma)`` for slot ``k >= 1``.

    Raises ValueError when ``gamma <= 0``.
    """
    gamma = default_gamma(block_size) if gamma is None else gamma
    if gamma <= 0:
        raise ValueError(f"gamma must be > 0, got {gamma}")
    k = torch.arange(block_size, dtype=torch.float32)
    w = torch.exp(-(k - 1) / gamma)
    w[0] = 0.0
    return w


@dataclass
class PackedBatch:
    """One packed draft forward for ``b`` rows of ``q = n * B`` block tokens over ``T`` context positions.

    noise_ids ``(b, q)``, labels ``(b, q)`` (-100 = no loss), slots ``(b, q)``, position_ids ``(b, T + q)``,
    target_hidden ``(b, T, F)``, masks ``{"full_attention", "sliding_attention"}`` -> ``(b, 1, q, T + q)`` bool.
    """

    noise_ids: torch.Tensor
    labels: torch.Tensor
    slots: torch.Tensor
    position_ids: torch.Tensor
    target_hidden: torch.Tensor
    masks: dict

    def to(self, device):
        """A copy on ``device``."""
        return PackedBatch(self.noise_ids.to(device), self.labels.to(device), self.slots.to(device),
                           self.position_ids.to(device), self.target_hidden.to(device),
                           {k: v.to(device) for k, v in self.masks.items()})


def _layer_kind(config: DFlashConfig, layer_type: str):
    """(causal, window) of the draft's layers of ``layer_type`` (config rule, notes section 2)."""
    for i, t in enumerate(config.layer_types):
        if t == layer_type:
            return config.layer_is_causal(i), config.layer_window(i)
    causal = config.is_causal if config.is_causal is not None else layer_type == "sliding_attention"
    return bool(causal), config.sliding_window if layer_type == "sliding_attention" else None


def pack_batch(rows: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], config: DFlashConfig,
               block_size: Optional[int] = None) -> PackedBatch:
    """Pack rows ``(input_ids (T_i,), features (T_i, F), anchors (n_i,))`` into one :class:`PackedBatch`.

    Rows are right padded to the longest context and to the largest anchor count; padding blocks sit at
    anchor 0 with mask tokens and no labels, padding context is never visible (every anchor < T_i).
    """
    B = block_size or config.block_size
    T = max(len(r[0]) for r in rows)
    n = max(len(r[2]) for r in rows)
    feat_dim = rows[0][1].shape[-1]
    q = n * B
    noise = torch.full((len(rows), q), config.mask_token_id, dtype=torch.long)
    labels = torch.full((len(rows), q), IGNORE, dtype=torch.long)
    positions = torch.zeros(len(rows), T + q, dtype=torch.long)
    hidden = torch.zeros(len(rows), T, feat_dim, dtype=rows[0][1].dtype)
    masks = {t: torch.zeros(len(rows), 1, q, T + q, dtype=torch.bool) for t in ("full_attention", "sliding_attention")}
    for r, (ids, feats, anchors) in enumerate(rows):
        pad = n - len(anchors)
        all_anchors = torch.cat([anchors, anchors.new_zeros(pad)])
        nz, pos, lab = block_inputs(ids, all_anchors, B, config.mask_token_id)
        if pad:
            lab[len(anchors) * B:] = IGNORE
            nz[len(anchors) * B:] = config.mask_token_id
        noise[r], labels[r] = nz, lab
        positions[r, : len(ids)] = torch.arange(len(ids))
        positions[r, T:] = pos
        hidden[r, : len(ids)] = feats
        for t in masks:
            causal, window = _layer_kind(config, t)
            m = packed_block_mask(len(ids), all_anchors, B, causal, window)
            masks[t][r, 0, :, : len(ids)] = m[:, : len(ids)]
            masks[t][r, 0, :, T:] = m[:, len(ids):]
    slots = torch.arange(B).repeat(n)[None].expand(len(rows), q)
    return PackedBatch(noise, labels, slots, positions, hidden, masks)


# ----------------------------------------------------------------------------- loss


def drafter_loss(draft, target, batch: PackedBatch, weights: torch.Tensor, reduction: str = "mean"):
    """Weighted block cross-entropy through the frozen target embedding and head.

    Args:
        draft: a ``DFlashDraftModel``; target: the causal LM (embedding + head are read, never trained).
        batch: a :class:`PackedBatch` on the draft's device; weights: ``(B,)`` from :func:`loss_weights`.
        reduction: ``"mean"`` -> ``sum(w * ce) / sum(w)`` over labelled tokens; ``"sum"`` -> ``sum(w * ce)``
            (the data-parallel loop divides by the weight summed over all processes, so the loss of N
            processes equals the loss of one process on the same global batch); ``"none"`` -> per-token
            weighted losses ``(b, q)`` (0 where unlabelled), e.g. to isolate one block in tests.

    Returns:
        ``(loss, stats)``; ``stats`` = ``{"correct": (B,), "count": (B,)}`` float tensors of top-1 hits
        and labelled tokens per slot (detached, on CPU) and ``"weight"``: ``sum(w)`` (0-dim, detached,
        on the loss's device).
    """
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    config = getattr(draft, "module", draft).config  # the draft may come wrapped (DistributedDataParallel)
    with torch.no_grad():
        noise_embedding = draft_block_embedding(config, embed, batch.noise_ids)  # same as spec_generate
    hidden = draft(position_ids=batch.position_ids, noise_embedding=noise_embedding,
                   target_hidden=batch.target_hidden, attention_mask=batch.masks)
    valid = batch.labels != IGNORE
    logits = draft_logits(config, head, hidden[valid]).float()  # output_multiplier / softcap as at inference
    labels, slots = batch.labels[valid], batch.slots[valid]
    w = weights.to(logits.device)[slots]
    ce = F.cross_entropy(logits, labels, reduction="none")
    B = len(weights)
    with torch.no_grad():
        hit = (logits.argmax(-1) == labels).float()
        stats = {"correct": torch.zeros(B).index_add_(0, slots.cpu(), hit.cpu()),
                 "count": torch.zeros(B).index_add_(0, slots.cpu(), torch.ones_like(hit).cpu()),
                 "weight": w.sum().detach()}
    if reduction == "none":
        out = torch.zeros(batch.labels.shape, dtype=ce.dtype, device=ce.device)
        out[valid] = w * ce
        return out, stats
    if reduction == "sum":
        return (w * ce).sum(), stats
    return (w * ce).sum() / w.sum().clamp_min(1e-12), stats


