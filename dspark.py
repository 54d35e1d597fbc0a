"""DSpark parts: the Markov head, the confidence head and the Markov walk of a drafted block.

DSpark (DeepSeek / PKU, arXiv 2607.05147) is a DFlash-style block drafter (the same ``fc`` /
``hidden_norm`` fusion, KV-injected bidirectional layers and final ``norm``) with three differences
from z-lab DFlash, all read from deepseek-ai/DeepSpec main (commit ``afdfa7c9``, 2026-06-30):

- every one of the ``block_size`` slots is drafted and slot k predicts the token at ``start + k + 1``
  (``deepspec/modeling/dspark/qwen3/modeling.py`` ``Qwen3DSparkModel.forward``: ``label_offsets``
  ``1 .. block_size``; ``deepspec/eval/dspark/draft_ops.py`` ``build_dspark_proposal`` proposes all
  ``block_size`` slots), with the drafter's own ``embed_tokens`` / ``lm_head`` (frozen copies of the
  target's, ``initialize_embeddings_and_head``);
- a Markov head adds ``markov_w2(markov_w1[previous token])`` to each slot's logits, walked left to
  right from the anchor (``deepspec/modeling/dspark/markov_head.py`` ``VanillaMarkov.sample_block_tokens``);
- a confidence head, ``proj`` over ``[slot hidden state, markov_w1[previous token]]`` (or the hidden state
  alone), whose sigmoid cuts the block at the first slot under a threshold
  (``deepspec/modeling/dspark/common.py`` ``AcceptRatePredictor``, ``Qwen3DSparkModel.predict_confidence_step``,
  ``draft_ops._confident_prefix_length``).

DeepSpec's DFlash block7 baselines are the same class with ``markov_rank`` 0 and no confidence head.
Only the ``vanilla`` Markov head of the published configs (``config/dspark/*.py``) is implemented.
The code here is written from those sources, not copied; the tensor names are DeepSpec's.

This module imports only torch: ``modeling_dflash.py`` imports it, never the reverse.
"""

from typing import NamedTuple, Optional

import torch
from torch import nn


class MarkovHead(nn.Module):
    """The ``vanilla`` Markov head: a rank-``r`` bigram bias ``markov_w2(markov_w1[prev])`` ``(..., V)``.

    Tensors ``markov_w1.weight`` ``(V, r)`` (an embedding) and ``markov_w2.weight`` ``(V, r)`` (a linear
    map r -> V), as DeepSpec ``VanillaMarkov`` names them."""

    def __init__(self, vocab_size: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)

    def prev_rows(self, token_ids: torch.Tensor) -> torch.Tensor:
        """``markov_w1[token_ids]``: ``(...,)`` ids -> ``(..., r)``."""
        return self.markov_w1(token_ids.long())

    def bias(self, token_ids: torch.Tensor) -> torch.Tensor:
        """The logit bias given the previous tokens: ``(...,)`` -> ``(..., V)``."""
        return self.markov_w2(self.prev_rows(token_ids))


class ConfidenceHead(nn.Module):
    """``proj``: ``Linear(H [+ r], 1)`` whose output (squeezed) is the slot's acceptance logit (DeepSpec
    ``AcceptRatePredictor``)."""

    def __init__(self, input_dim: int):
        super().__init__()
        self.proj = nn.Linear(input_dim, 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.proj(features).squeeze(-1)


def build_heads(config) -> tuple:
    """``(markov_head or None, confidence_head or None)`` from the DSpark keys of ``config``
    (``markov_rank``, ``enable_confidence_head``, ``confidence_head_with_markov``; DeepSpec
    ``build_markov_head`` and ``Qwen3DSparkModel.__init__``)."""
    rank = int(config.markov_rank or 0)
    markov = MarkovHead(config.vocab_size, rank) if rank > 0 else None
    confidence = None
    if config.enable_confidence_head:
        confidence = ConfidenceHead(config.hidden_size + (rank if config.confidence_head_with_markov else 0))
    return markov, confidence


class DSparkDraft(NamedTuple):
    """One drafted block. ``tokens`` ``(B, b)`` (slot k is the token at ``start + k + 1``), ``logits``
    ``(B, b, V)`` the Markov-corrected logits of each slot given the token drawn before it (the q of the
    rejection test before any warper), ``confidence`` ``(B, b)`` acceptance logits or None."""

    tokens: torch.Tensor
    logits: torch.Tensor
    confidence: Optional[torch.Tensor]


def markov_walk(base_logits: torch.Tensor, anchor_ids: torch.Tensor, markov: Optional[MarkovHead],
                do_sample: bool = False, temperature: float = 1.0, generator=None) -> tuple:
    """Walk a block left to right from the anchor, each slot's logits plus the Markov bias of the token
    drawn before it (DeepSpec ``VanillaMarkov.sample_block_tokens``).

    Args:
        base_logits: ``(B, b, V)`` ``lm_head`` of the block's hidden states.
        anchor_ids: ``(B,)`` the token before slot 0.
        markov: the Markov head, or None (the DFlash baselines: slots independent).
        do_sample / temperature / generator: draw from ``softmax(logits / T)``; greedy (argmax) otherwise.

    Returns:
        ``(tokens (B, b), corrected logits (B, b, V))``.
    """
    tokens, rows = [], []
    prev = anchor_ids.long()
    for k in range(base_logits.shape[1]):
        row = base_logits[:, k] if markov is None else base_logits[:, k] + markov.bias(prev)
        if do_sample:
            prev = torch.multinomial(torch.softmax(row.float() / temperature, -1), 1, generator=generator)[:, 0]
        else:
            prev = row.argmax(-1)
        rows.append(row)
        tokens.append(prev)
    return torch.stack(tokens, 1), torch.stack(rows, 1)


def confidence_logits(head: Optional[ConfidenceHead], markov: Optional[MarkovHead], with_markov: bool,
                      hidden: torch.Tensor, prev_ids: torch.Tensor) -> Optional[torch.Tensor]:
    """Per-slot acceptance logits ``(B, b)`` (fp32) from the slots' hidden states ``(B, b, H)`` and the
    tokens before each slot ``prev_ids`` ``(B, b)`` (anchor, then the drafts), or None without a head
    (DeepSpec ``Qwen3DSparkModel.predict_confidence_step``)."""
    if head is None:
        return None
    if with_markov:
        hidden = torch.cat([hidden, markov.prev_rows(prev_ids).to(hidden.dtype)], dim=-1)
    return head(hidden).float()


def confident_length(confidence: Optional[torch.Tensor], threshold: float) -> torch.Tensor:
    """Per row, the slots kept: the index of the first slot whose ``sigmoid(confidence) < threshold``, or
    ``b`` (``threshold <= 0`` or no head keeps all). ``(B, b)`` -> ``(B,)`` long. DeepSpec
    ``draft_ops._confident_prefix_length`` (batch 1 there)."""
    below = confidence.sigmoid() < threshold
    if threshold <= 0:
        below = torch.zeros_like(below)
    full = torch.full(below.shape[:1], below.shape[1], dtype=torch.long, device=below.device)
    return torch.where(below.any(-1), below.long().argmax(-1), full)


def slot_inputs(model, hidden_states: torch.Tensor, head=None) -> tuple:
    """``(hidden (B, b, H), logits (B, b, V))`` of every slot, from the drafter's own ``lm_head`` (``head``, the
    target's, is not used: DeepSpec drafters carry their own copy). The loop's draft-pass seam
    (``proposers._draft_logits(slot_states=True)``), as ``DFlash2DraftModel.selector_inputs`` is."""
    return hidden_states, model.lm_head(hidden_states)


def dspark_propose(model, hidden_states: torch.Tensor, anchor_ids: torch.Tensor, **walk_options) -> DSparkDraft:
    """Draft a block with a DSpark drafter: its own ``lm_head`` over all ``b`` slots of the block's hidden
    states ``(B, b, H)``, the Markov walk from ``anchor_ids`` ``(B,)``, then the confidence logits given the
    drawn tokens (DeepSpec ``build_dspark_proposal``)."""
    tokens, logits = markov_walk(model.lm_head(hidden_states), anchor_ids, model.markov_head, **walk_options)
    prev = torch.cat([anchor_ids.long()[:, None], tokens[:, :-1]], dim=1)
    conf = confidence_logits(model.confidence_head, model.markov_head, model.config.confidence_head_with_markov,
                             hidden_states, prev)
    return DSparkDraft(tokens, logits, conf)


def copies_difference(draft, target_embed, target_head, chunk_rows: int = 8192) -> Optional[str]:
    """The warning for a DSpark drafter whose own ``embed_tokens`` / ``lm_head`` differ from the target's input
    embedding / output head, naming the tensor with the largest max abs difference; None when both are equal
    (DeepSpec copies the target's, ``initialize_embeddings_and_head``), or when a side cannot be compared (no
    floating weight: a quantized head, a ``meta`` offload). A differing copy is still run: the draft uses the
    drafter's own copies, the verify the target's, so the output is the target's either way.

    Compared in fp32, ``chunk_rows`` rows at a time on the drafter's device (memory bounded by a chunk, not V x H).
    """
    worst = None
    for name, own, theirs in (("embed_tokens.weight", draft.embed_tokens.weight, getattr(target_embed, "weight", None)),
                              ("lm_head.weight", draft.lm_head.weight, getattr(target_head, "weight", None))):
        if theirs is None or not (own.is_floating_point() and theirs.is_floating_point()) or "meta" in (
                own.device.type, theirs.device.type):
            continue
        if own.shape != theirs.shape:
            return (f"the DSpark drafter's own {name} has shape {tuple(own.shape)}, the target's {tuple(theirs.shape)}: "
                    "it drafts with its own copy (the target verifies with its own), so the output is the target's")
        diff = 0.0
        for i in range(0, own.shape[0], chunk_rows):
            part = theirs[i:i + chunk_rows].to(device=own.device, dtype=torch.float32)
            diff = max(diff, float((own[i:i + chunk_rows].float() - part).abs().max()))
        if diff > 0 and (worst is None or diff > worst[1]):
            worst = (name, diff)
    if worst is None:
        return None
    other = "input embedding" if worst[0] == "embed_tokens.weight" else "output head"
    return (f"the DSpark drafter's own {worst[0]} differs from the target's {other} (max abs difference "
            f"{worst[1]:.4g}; the largest of embed_tokens / lm_head): DeepSpec drafters carry copies of their "
            "target's, so this drafter may have been trained for another target. It drafts with its own copies and "
            "the target verifies with its own, so the output is the target's; only acceptance can suffer")


__all__ = ["ConfidenceHead", "DSparkDraft", "MarkovHead", "build_heads", "confidence_logits", "confident_length",
           "copies_difference", "dspark_propose", "markov_walk", "slot_inputs"]
