"""DFlash 2 parts: the grouped dynamic causal convolution and the low-rank candidate selector.

DFlash 2 ("Keep Drafting Parallel", Inco AI, Aug 2026) is the DFlash drafter plus two parts, both
switched on by the checkpoint (``dflash_config.conv_*`` / ``selector_*``):

- a grouped dynamic causal convolution over the positions of the current block, before and after
  every attention and every MLP sublayer ([`GroupedDynamicCausalConv`]);
- a candidate selector that keeps the top-k tokens of each mask slot's draft logits and walks them
  left to right from the anchor, adding a low-rank bilinear term of the previous token, the slot's
  draft state and the candidate ([`CandidateSelector`], [`selector_walk`]).

Source of truth: z-lab/dflash ``dflash/model.py`` (``_grouped_dynamic_convolve``,
``GroupedDynamicCausalConv``, ``CandidateSelector.select``, ``DFlash2DraftModel.propose``), newer than
its release tag; cross-checked with SpecForge ``specforge/modeling/draft/dflash2.py``, SGLang
``python/sglang/srt/models/dflash.py`` (PR #35371) and vLLM
``vllm/model_executor/models/qwen3_dflash2.py`` (PR #52816). The order of every floating-point
operation follows z-lab's, so fp32 drafts on identical weights are identical to theirs.

This module imports only torch: ``modeling_dflash.py`` imports it, never the reverse.
"""

from typing import Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import nn

# Signature of a per-slot logits processor: ``(slot, drafted (B, slot), logits (B, V)) -> logits (B, V)``.
SlotProcessor = Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]
# ``from_pretrained(key_mapping=...)``: the codebooks under a trainer's ``nn.Embedding`` spelling
# (``.weight`` suffix) read as the published names (z-lab's own class maps the other way).
CODEBOOK_KEY_MAPPING = {r"^candidate_selector\.(predecessor|successor)_codebook\.weight$": r"candidate_selector.\1_codebook"}


# ----------------------------------------------------------------------------- the convolution


def _shift(x: torch.Tensor, offset: int) -> torch.Tensor:
    """``x`` ``(B, L, ...)`` moved ``offset`` positions later along dim 1, zeros before the block start."""
    if offset == 0:
        return x
    shifted = torch.zeros_like(x)
    if offset < x.shape[1]:
        shifted[:, offset:] = x[:, : x.shape[1] - offset]
    return shifted


def grouped_dynamic_causal_conv(hidden: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor,
                                group_size: int, block_length: Optional[int] = None) -> torch.Tensor:
    """One side of the DFlash 2 convolution over the positions of one block.

    ``out[t, c] = sum_o (base[o, c] + dynamic[t, o, c // group_size]) * hidden[t - o, c]``, with
    ``hidden[t - o] = 0`` before the block start (position 0, the anchor, sees only itself). The sum
    runs tap by tap, each tap adding ``base * x`` and then ``dynamic * x`` (``addcmul``): the
    operation order of z-lab ``_grouped_dynamic_convolve``, so fp32 results are bit-identical.

    Args:
        hidden: ``(B, L, H)`` the block (anchor first), any float dtype.
        dynamic: ``(B, L, K, H // group_size)`` per-position tap coefficients of each channel group.
        base: ``(K, H)`` static taps of this side.
        group_size: channels per group; divides ``H``.
        block_length: None (the ``L`` positions are one block), or the length of each of the
            ``L / block_length`` blocks packed one after another along dim 1 (training's packed
            blocks, ``train/blocks.py``): each is convolved alone, nothing crosses a block start.

    Returns:
        ``(B, L, H)`` in ``hidden``'s dtype.

    Raises:
        ValueError: ``block_length`` does not divide ``L``.
    """
    if block_length is not None and block_length != hidden.shape[1]:
        if block_length < 1 or hidden.shape[1] % block_length:
            raise ValueError(f"block_length={block_length} must divide the {hidden.shape[1]} packed positions")
        folded = hidden.reshape(-1, block_length, hidden.shape[-1])  # (B * n, block_length, H)
        out = grouped_dynamic_causal_conv(folded, dynamic.reshape(folded.shape[0], block_length, *dynamic.shape[2:]),
                                          base, group_size)
        return out.view_as(hidden)
    batch, length, hidden_size = hidden.shape
    taps, groups = base.shape[0], hidden_size // group_size
    x = hidden.view(batch, length, groups, group_size)  # (B, L, G, C)
    coefficients = dynamic.reshape(batch, length, taps, groups, 1)  # (B, L, K, G, 1)
    out = torch.zeros_like(x)
    for offset in range(taps):
        earlier = _shift(x, offset)  # x[t - offset]
        out = out + base[offset].view(1, 1, groups, group_size).to(hidden.dtype) * earlier
        out = torch.addcmul(out, coefficients[:, :, offset], earlier)
    return out.view_as(hidden)


class GroupedDynamicCausalConv(nn.Module):
    """The convolution wrapped around one sublayer: ``prepare`` before it, ``finish`` after it.

    Both sides' coefficients come from ONE projection of the sublayer's normed input ``u``:
    ``D = kernel_projection(u).view(B, L, 2, K, G)`` (side, tap, group); ``prepare(u)`` returns
    ``conv(u, D[:, :, 0], base_kernel[0])`` (the sublayer's input) and ``D[:, :, 1]``;
    ``finish(y, D1) = conv(y, D1, base_kernel[1])`` on the sublayer's output ``y``. Source: z-lab
    ``GroupedDynamicCausalConv.prepare`` / ``finish``.

    Parameters (published names): ``base_kernel`` ``(2, K, H)``, ``kernel_projection.weight``
    ``(2 * K * H / group_size, H)``, no bias. They are built as the identity (tap 0 of both sides 1,
    every other tap and the projection 0), so a fresh module passes its input through unchanged (the
    reference leaves ``base_kernel`` as uninitialised memory).

    Raises:
        ValueError: ``group_size`` does not divide ``hidden_size``, or a size below 1.
    """

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int):
        super().__init__()
        if kernel_size < 1 or group_size < 1 or hidden_size % group_size:
            raise ValueError(f"conv_group_size={group_size} must divide hidden_size={hidden_size} and "
                             f"conv_kernel_size={kernel_size} must be >= 1")
        self.kernel_size = kernel_size
        self.group_size = group_size
        self.num_groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.num_groups, bias=False)
        self.reset_to_identity()

    @torch.no_grad()
    def reset_to_identity(self, keep: Callable[[nn.Parameter], bool] = lambda p: False) -> None:
        """Set the identity: ``base_kernel[:, 0] = 1``, other taps 0, ``kernel_projection`` 0.
        A parameter for which ``keep(param)`` is True (e.g. one loaded from a checkpoint) is left alone."""
        if not keep(self.base_kernel):
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1.0
        if not keep(self.kernel_projection.weight):
            self.kernel_projection.weight.zero_()

    def prepare(self, hidden: torch.Tensor, block_length: Optional[int] = None):
        """``hidden`` ``(B, L, H)`` normed sublayer input -> (convolved input ``(B, L, H)``, output-side
        coefficients ``(B, L, K, G)``). ``block_length``: see [`grouped_dynamic_causal_conv`]."""
        dynamic = self.kernel_projection(hidden).view(*hidden.shape[:-1], 2, self.kernel_size, self.num_groups)
        convolved = grouped_dynamic_causal_conv(hidden, dynamic[..., 0, :, :], self.base_kernel[0], self.group_size,
                                                block_length)
        return convolved, dynamic[..., 1, :, :]

    def finish(self, hidden: torch.Tensor, dynamic: torch.Tensor, block_length: Optional[int] = None) -> torch.Tensor:
        """``hidden`` ``(B, L, H)`` sublayer output, ``dynamic`` from [`prepare`] -> ``(B, L, H)``."""
        return grouped_dynamic_causal_conv(hidden, dynamic, self.base_kernel[1], self.group_size, block_length)


# ----------------------------------------------------------------------------- the selector


class CandidateSelector(nn.Module):
    """Low-rank scorer of a candidate given the previous chosen token (z-lab ``CandidateSelector``).

    ``score(prev, c) = unary[c] + <predecessor_codebook[prev] * hidden_projection(h), successor_codebook[c]>``
    for the ``top_k`` candidates of a slot, ``h`` the slot's final draft state.

    Parameters (published names, no ``.weight`` suffix on the codebooks):
    ``hidden_projection.weight`` ``(r, H)``, ``predecessor_codebook`` ``(V, r)``,
    ``successor_codebook`` ``(V, r)``. Built with ``successor_codebook = 0`` (every bilinear term
    vanishes: the walk is the per-slot argmax of the unary logits, i.e. DFlash 1 greedy drafts),
    the predecessor codebook and the projection normal with std ``init_std``.

    Raises:
        ValueError: ``rank < 1``, or ``top_k`` outside ``[1, vocab_size]``.
    """

    def __init__(self, hidden_size: int, vocab_size: int, rank: int, top_k: int, init_std: float = 0.02):
        super().__init__()
        if rank < 1 or not 1 <= top_k <= vocab_size:
            raise ValueError(f"selector_rank={rank} must be >= 1 and selector_top_k={top_k} in [1, vocab_size={vocab_size}]")
        self.top_k = top_k
        self.init_std = init_std
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.reset_to_identity()
        self._register_load_state_dict_pre_hook(_read_embedding_spelling)

    @torch.no_grad()
    def reset_to_identity(self, keep: Callable[[nn.Parameter], bool] = lambda p: False) -> None:
        """``successor_codebook = 0``; predecessor codebook and projection normal(0, ``init_std``).
        A parameter for which ``keep(param)`` is True is left alone."""
        if not keep(self.successor_codebook):
            self.successor_codebook.zero_()
        for param in (self.predecessor_codebook, self.hidden_projection.weight):
            if not keep(param):
                param.normal_(mean=0.0, std=self.init_std)

    def candidates(self, logits: torch.Tensor, top_k: Optional[int] = None):
        """``logits`` ``(..., V)`` -> ``(unary (..., k), candidate ids (..., k))``: ``torch.topk`` with
        ``sorted=False`` as z-lab, so the candidate order (which decides argmax ties) is the same."""
        return torch.topk(logits, top_k or self.top_k, dim=-1, sorted=False)

    def score(self, unary: torch.Tensor, candidates: torch.Tensor, projected: torch.Tensor,
              previous: torch.Tensor) -> torch.Tensor:
        """Scores ``(B, k)`` of one slot's candidates.

        Args:
            unary: ``(B, k)`` the candidates' draft logits; ``candidates``: ``(B, k)`` their ids.
            projected: ``(B, r)`` ``hidden_projection`` of the slot's draft state.
            previous: ``(B,)`` id of the token chosen at the previous slot (the anchor for slot 0).
        """
        context = F.embedding(previous, self.predecessor_codebook) * projected  # (B, r)
        return unary + torch.einsum("br,bkr->bk", context, F.embedding(candidates, self.successor_codebook))


def _read_embedding_spelling(state_dict, prefix, *args) -> None:
    """``load_state_dict`` reads ``{prefix}predecessor_codebook.weight`` (an ``nn.Embedding``'s name, as
    in z-lab's class) as the published ``{prefix}predecessor_codebook``; the same for the successor."""
    for name in ("predecessor_codebook", "successor_codebook"):
        spelled = f"{prefix}{name}.weight"
        if spelled in state_dict and f"{prefix}{name}" not in state_dict:
            state_dict[f"{prefix}{name}"] = state_dict.pop(spelled)


class SelectorDraft(NamedTuple):
    """What [`selector_walk`] drafts for one block.

    ``tokens`` ``(B, n)`` long: the chosen token of each mask slot. ``q`` ``(B, n, V)`` float32: the
    distribution each token was drawn from (softmax over the slot's k candidates of score / T given the
    chosen predecessor, zero elsewhere; one-hot when greedy): the ``q`` of the rejection test.
    ``candidates`` ``(B, n, k)`` long and ``candidate_q`` ``(B, n, k)`` float32: the same rows over the
    candidates only (z-lab's ``q_rows``; one-hot when greedy).
    """

    tokens: torch.Tensor
    q: torch.Tensor
    candidates: torch.Tensor
    candidate_q: torch.Tensor


def selector_walk(selector: CandidateSelector, hidden: torch.Tensor, logits: torch.Tensor, anchor_ids: torch.Tensor,
                  *, do_sample: bool = False, temperature: float = 1.0, generator: Optional[torch.Generator] = None,
                  top_k: Optional[int] = None, process: Optional[SlotProcessor] = None) -> SelectorDraft:
    """Walk a block's mask slots left to right from the anchor, choosing one candidate per slot.

    Slot ``j`` keeps the top-k of its logits, scores each candidate with [`CandidateSelector.score`]
    given the token chosen at slot ``j - 1`` (the anchor for slot 0), and takes the argmax (greedy) or
    draws from ``softmax(scores / temperature)`` (``torch.multinomial`` with ``generator``; the global
    RNG when None, as z-lab). Source: z-lab ``CandidateSelector.select`` and ``DFlash2DraftModel.propose``.

    Args:
        selector: the drafter's ``candidate_selector``.
        hidden: ``(B, n, H)`` final draft states of the mask slots (the block without its anchor).
        logits: ``(B, n, V)`` the slots' draft logits, already transformed as the drafter's logits are
            (``output_multiplier``, soft cap: ``target_families.draft_logits``), and already through
            every logits processor that does not depend on the drafted prefix.
        anchor_ids: ``(B,)`` (or ``(B, 1)``) the block's anchor token: the predecessor of slot 0.
        do_sample: draw (True) or take the argmax (False; ``q`` one-hot).
        temperature: generate's temperature ``T > 0``, used when ``do_sample``.
        generator: RNG of the draws.
        top_k: candidates per slot (default ``selector.top_k``).
        process: per-slot processor ``process(j, drafted, logits_j) -> logits_j`` with ``drafted``
            ``(B, j)`` the tokens chosen at slots ``0..j-1`` (the caller's prefix is its committed
            sequence, ending with the anchor, followed by ``drafted``) and ``logits_j`` ``(B, V)``;
            applied to the full-vocabulary logits before the top-k. None: one batched top-k over all
            slots (z-lab's computation exactly).

    Returns:
        A [`SelectorDraft`].

    Raises:
        ValueError: mismatched shapes, ``top_k`` outside ``[1, V]``, or ``do_sample`` with ``temperature <= 0``.
    """
    anchor_ids = anchor_ids.reshape(-1)
    _check_walk(hidden, logits, anchor_ids, do_sample, temperature, top_k or selector.top_k)
    projected = selector.hidden_projection(hidden)  # (B, n, r)
    if process is None:
        return _table_walk(selector, projected, *selector.candidates(logits, top_k), anchor_ids, logits,
                           do_sample, temperature, generator)
    previous = anchor_ids
    chosen, candidate_rows, q_rows = [], [], []
    for slot in range(hidden.shape[1]):
        drafted = torch.stack(chosen, dim=1) if chosen else anchor_ids.new_zeros(anchor_ids.shape[0], 0)
        unary, candidates = selector.candidates(process(slot, drafted, logits[:, slot]), top_k)
        scores = selector.score(unary, candidates, projected[:, slot], previous)  # (B, k)
        if do_sample:
            q = torch.softmax(scores.float() / temperature, dim=-1)
            index = torch.multinomial(q, 1, generator=generator)[:, 0]
        else:
            index = torch.argmax(scores, dim=-1)
            q = F.one_hot(index, scores.shape[-1]).float()
        previous = candidates.gather(-1, index[:, None])[:, 0]
        chosen.append(previous)
        candidate_rows.append(candidates)
        q_rows.append(q)
    tokens = torch.stack(chosen, dim=1) if chosen else anchor_ids.new_zeros(anchor_ids.shape[0], 0)
    candidates = _stack(candidate_rows, logits, top_k or selector.top_k, torch.long)
    candidate_q = _stack(q_rows, logits, top_k or selector.top_k, torch.float32)
    q = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device).scatter_(-1, candidates, candidate_q)
    return SelectorDraft(tokens, q, candidates, candidate_q)


def transition_scores(selector: CandidateSelector, unary: torch.Tensor, candidates: torch.Tensor,
                      projected: torch.Tensor) -> torch.Tensor:
    """Every score the walk can need after slot 0, in one pass: ``(B, n - 1, k, k)``, entry
    ``[b, j - 1, p, c]`` the score of candidate ``c`` of slot ``j`` after candidate ``p`` of slot ``j - 1``.

    Each entry is computed by the same operations on the same operands as [`CandidateSelector.score`]
    (gathers, one elementwise product, an ``einsum("br,bkr->bk")`` whose rows are the ``k`` possible
    predecessors instead of the chosen one, then ``unary +``), so the scores are bit-identical to the
    slot-by-slot walk (z-lab's; one einsum over all predecessors at once, ``"bjpr,bjkr->bjpk"``, rounds
    differently at rank 256 on CPU, tests/test_dflash2.py). The walk then shrinks to a chain of lookups
    (greedy) or a gather and a draw per slot: the sequential part of a DFlash 2 draft, about 15 slots of
    small operations, was most of its extra cost per step on CPU (README, DFlash 2 cost per step).
    Memory: the successor rows are repeated per predecessor, ``B (n-1) k k r`` values (3.5 MiB in fp32
    at batch 1, block 16, top-k 16, rank 256), freed after the call.

    Args:
        unary, candidates: ``(B, n, k)`` the slots' top-k draft logits and their ids.
        projected: ``(B, n, r)`` ``hidden_projection`` of the slots' states.
    """
    b, n, k = candidates.shape
    if n < 2:
        return unary.new_zeros(b, 0, k, k)
    context = F.embedding(candidates[:, :-1], selector.predecessor_codebook) * projected[:, 1:, None, :]  # (B, n-1, k, r)
    successors = F.embedding(candidates[:, 1:], selector.successor_codebook)  # (B, n-1, k, r)
    r = context.shape[-1]
    successors = successors[:, :, None].expand(b, n - 1, k, k, r).reshape(-1, k, r)  # (B (n-1) k, k, r)
    bilinear = torch.einsum("br,bkr->bk", context.reshape(-1, r), successors).view(b, n - 1, k, k)
    return unary[:, 1:, None, :] + bilinear


def _table_walk(selector, projected, unary, candidates, anchor_ids, logits, do_sample, temperature, generator):
    """[`selector_walk`] without per-slot processors: slot 0 scored from the anchor, the rest read from
    [`transition_scores`]; the same choices, draws (same RNG calls in the same order) and ``q``."""
    b, n, k = candidates.shape
    table = transition_scores(selector, unary, candidates, projected)  # (B, n-1, k, k)
    scores = selector.score(unary[:, 0], candidates[:, 0], projected[:, 0], anchor_ids) if n else None  # (B, k)
    q_rows = []
    if not do_sample:  # greedy: the best successor of every candidate, then a chain of lookups
        index = _greedy_chain(torch.argmax(scores, dim=-1) if n else None, torch.argmax(table, dim=-1), b, n)
    else:
        picks = []
        for slot in range(n):
            if slot:
                scores = table[:, slot - 1].gather(1, picks[-1][:, None, None].expand(b, 1, k))[:, 0]  # (B, k)
            q_rows.append(torch.softmax(scores.float() / temperature, dim=-1))
            picks.append(torch.multinomial(q_rows[-1], 1, generator=generator)[:, 0])
        index = torch.stack(picks, dim=1) if picks else candidates.new_zeros(b, 0)  # (B, n) chosen candidate per slot
    tokens = candidates.gather(-1, index[..., None])[..., 0]
    candidate_q = torch.stack(q_rows, dim=1) if do_sample and n else F.one_hot(index, k).float()  # (B, n, k)
    q = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device).scatter_(-1, candidates, candidate_q)
    return SelectorDraft(tokens, q, candidates, candidate_q)


def _greedy_chain(first: Optional[torch.Tensor], best: torch.Tensor, b: int, n: int,
                  on_host: Optional[bool] = None) -> torch.Tensor:
    """``(B, n)`` candidate index per slot: ``first`` ``(B,)`` for slot 0, then ``best[:, j - 1, previous]``
    (``best`` ``(B, n-1, k)``: argmax successor of each candidate, ties to the first as ``torch.argmax``).
    ``on_host`` (default: the tensors are on CPU): the chain runs in Python on two small transfers (no
    per-slot operator overhead); otherwise one gather per slot on the device (no host synchronisation)."""
    if n == 0:
        return best.new_zeros(b, 0)
    if first.device.type == "cpu" if on_host is None else on_host:
        chains = []
        for row, start in zip(best.tolist(), first.tolist()):
            chain = [start]
            for successors in row:
                chain.append(successors[chain[-1]])
            chains.append(chain)
        return torch.tensor(chains, dtype=torch.long, device=best.device)
    picks = [first]
    for slot in range(1, n):
        picks.append(best[:, slot - 1].gather(1, picks[-1][:, None])[:, 0])
    return torch.stack(picks, dim=1)


def _stack(rows: list, logits: torch.Tensor, k: int, dtype) -> torch.Tensor:
    """``(B, n, k)`` from n rows ``(B, k)`` (an empty ``(B, 0, k)`` for a block without mask slots)."""
    if rows:
        return torch.stack(rows, dim=1)
    return torch.zeros(logits.shape[0], 0, k, dtype=dtype, device=logits.device)


def _check_walk(hidden, logits, anchor_ids, do_sample, temperature, k) -> None:
    if hidden.dim() != 3 or logits.dim() != 3 or hidden.shape[:2] != logits.shape[:2]:
        raise ValueError(f"selector_walk needs hidden (B, n, H) and logits (B, n, V) with the same B and n, got "
                         f"hidden {tuple(hidden.shape)} and logits {tuple(logits.shape)}")
    if anchor_ids.shape[0] != logits.shape[0]:
        raise ValueError(f"anchor_ids has {anchor_ids.shape[0]} rows but logits has {logits.shape[0]}")
    if not 1 <= k <= logits.shape[-1]:
        raise ValueError(f"top_k={k} must be in [1, vocab size {logits.shape[-1]}]")
    if do_sample and not temperature > 0:
        raise ValueError(f"sampling needs temperature > 0, got {temperature!r}")


__all__ = ["CODEBOOK_KEY_MAPPING", "CandidateSelector", "GroupedDynamicCausalConv", "SelectorDraft", "SlotProcessor",
           "grouped_dynamic_causal_conv", "selector_walk", "transition_scores"]
