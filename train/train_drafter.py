"""Train a DFlash drafter against a frozen target (the recipe of arXiv 2602.06036, training section).

Importable pieces first (usable from a notebook), a thin CLI last::

    python -m train.train_drafter                      # the shipped pair/drafter (see train/README.md)
    python -m train.train_drafter --resume             # continue an interrupted run (same flags)

Recipe:

* Data: prompts plus the TARGET'S OWN continuations (greedy, a share sampled) -- the default path --
  or text / JSONL files or a ``datasets.Dataset`` (:func:`load_examples`).
* Target features: the frozen target runs once over every sequence with its layers tapped by
  ``generation_utils.capture_target_features``, the very hooks ``spec_generate`` uses, so training and
  inference share one implementation of the layer-tap convention (layer ``k`` = output of layer ``k``).
* Random anchors over trainable (response) positions, resampled every epoch. Every anchor ``a`` makes a
  block ``[x_a, MASK x (B-1)]`` at positions ``a..a+B-1``; all blocks of a row are packed into ONE draft
  forward with a mask: a block sees context features at positions strictly ``< a``, its own block
  (bidirectionally, causally for sliding/causal layers), never another block.
* Slot ``k`` predicts the token at ``a + k``; slot 0 is excluded; cross-entropy through the frozen target
  head, weighted ``exp(-(k-1)/gamma)``.
* AdamW, warmup + cosine, gradient clipping, bf16 autocast on CUDA / fp32 on CPU, gradient accumulation,
  tqdm with loss and per-slot accuracy, periodic checkpoints that are plain ``save_pretrained`` folders of
  ``DFlashDraftModel`` (they load with ``AutoModel.from_pretrained(..., trust_remote_code=True)``) plus a
  ``trainer_state.pt`` (optimizer, step, RNG), resume from them.
* Only the draft's parameters are trainable; the target (its embedding and head included) is frozen.

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

import argparse
import contextlib
import json
import math
import os
import platform
import random
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:  # the flat Hub files live at the repository root
    sys.path.insert(0, str(_ROOT))

from configuration_dflash import DFlashConfig  # noqa: E402
from generation_utils import capture_target_features, spec_generate  # noqa: E402
from modeling_dflash import DFlashDraftModel  # noqa: E402
from target_families import draft_block_embedding, draft_logits  # noqa: E402

IGNORE = -100
PUBLISHED_GAMMA = {8: 4.0, 10: 5.0, 16: 7.0}  # notes section 4


# ----------------------------------------------------------------------------- data


@dataclass
class Example:
    """One training sequence: ``input_ids`` ``(T,)`` LongTensor; positions ``>= prompt_len`` are trainable."""

    input_ids: torch.Tensor
    prompt_len: int
    source: str = ""


def training_prompts(n: int, max_chars: int = 600, seed: int = 0) -> list[str]:
    """``n`` ``def`` + docstring prompts from the TRAINING split of the stdlib corpus (train/corpus.py).

    The held-out modules (``pair/heldout_prompts.json``, the demo's prompts) are never used. Order is
    shuffled deterministically by ``seed``. Raises ValueError when fewer than ``n`` exist.
    """
    from train import corpus

    root = corpus.stdlib_root()
    train_rel, _ = corpus.split(corpus.list_sources(root))
    prompts = [p["prompt"] for p in corpus.select_prompts(train_rel, root, n=10**9, max_chars=max_chars)]
    if len(prompts) < n:
        raise ValueError(f"asked for {n} training prompts, the training split has {len(prompts)}")
    random.Random(seed).shuffle(prompts)
    return prompts[:n]


@torch.no_grad()
def generate_continuations(target, tokenizer, prompts: list[str], max_new_tokens: int, temperature: float = 0.0,
                           batch_size: int = 16, seed: int = 0, progress: bool = True) -> list[Example]:
    """The target's own continuations of ``prompts`` (the paper's data recipe).

    Greedy when ``temperature == 0``, else sampled with ``top_k=0, top_p=1``. Prompts are batched with left
    padding; each example is ``prompt ++ continuation`` cut after the first eos. Returns one
    :class:`Example` per prompt (``prompt_len`` = prompt token count), in order.
    """
    from tqdm import tqdm

    device = target.get_input_embeddings().weight.device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos = tokenizer.eos_token_id
    enc = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in tqdm(range(0, len(enc), batch_size), desc=f"continuations T={temperature}", disable=not progress):
        rows = enc[i:i + batch_size]
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for j, r in enumerate(rows):
            ids[j, width - len(r):] = torch.tensor(r)
            mask[j, width - len(r):] = 1
        kwargs = dict(do_sample=False) if temperature == 0 else dict(do_sample=True, temperature=temperature,
                                                                     top_k=0, top_p=1.0)
        torch.manual_seed(int(torch.randint(2**31 - 1, (1,), generator=gen)))
        seqs = target.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                               max_new_tokens=max_new_tokens, pad_token_id=pad, eos_token_id=eos, **kwargs).cpu()
        for j, r in enumerate(rows):
            new = seqs[j, width:].tolist()
            if eos is not None and eos in new:
                new = new[: new.index(eos) + 1]
            out.append(Example(torch.tensor(r + new, dtype=torch.long), len(r), f"target T={temperature}"))
    return out


def _record_to_example(tokenizer, rec: dict, max_len: int) -> Optional[Example]:
    """``{"prompt", "response"|"completion"}`` (trainable = response) or ``{"text"}`` (trainable from token 1)."""
    if "prompt" in rec and ("response" in rec or "completion" in rec):
        p = tokenizer(rec["prompt"], add_special_tokens=False)["input_ids"]
        r = tokenizer(rec.get("response", rec.get("completion")), add_special_tokens=False)["input_ids"]
        ids, plen = (p + r)[:max_len], len(p)
    elif "text" in rec:
        ids, plen = tokenizer(rec["text"], add_special_tokens=False)["input_ids"][:max_len], 1
    else:
        raise ValueError(f"a record needs 'text' or 'prompt'+'response'/'completion', got keys {sorted(rec)}")
    if len(ids) - max(plen, 1) < 2:
        return None
    return Example(torch.tensor(ids, dtype=torch.long), plen, "data")


def load_examples(source, tokenizer, max_len: int = 512) -> list[Example]:
    """Examples from a ``datasets.Dataset`` (or any iterable of dicts), or from file paths.

    Files: ``.jsonl`` (one record per line), anything else is plain text (one example per file, or per
    ``max_len``-token chunk). Records: ``{"text": ...}`` (trainable from token 1) or
    ``{"prompt": ..., "response"|"completion": ...}`` (trainable = response). Examples with fewer than
    two trainable tokens are dropped. Raises ValueError on records with neither shape.
    """
    if isinstance(source, (str, Path)):
        source = [source]
    items = list(source)
    out = []
    if items and isinstance(items[0], (str, Path)):
        for path in map(Path, items):
            if path.suffix == ".jsonl":
                for line in path.read_text().splitlines():
                    if line.strip():
                        ex = _record_to_example(tokenizer, json.loads(line), max_len)
                        out += [ex] if ex else []
            else:
                ids = tokenizer(path.read_text(), add_special_tokens=False)["input_ids"]
                for i in range(0, len(ids), max_len):
                    if len(ids[i:i + max_len]) >= 3:
                        out.append(Example(torch.tensor(ids[i:i + max_len], dtype=torch.long), 1, str(path)))
        return out
    for rec in items:
        ex = _record_to_example(tokenizer, dict(rec), max_len)
        out += [ex] if ex else []
    return out


def save_examples(examples: list[Example], path) -> None:
    """Store examples (token ids + prompt lengths) so a resumed run trains on the very same data."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    torch.save([{"input_ids": e.input_ids, "prompt_len": e.prompt_len, "source": e.source} for e in examples], path)


def read_examples(path) -> list[Example]:
    """Inverse of :func:`save_examples`."""
    return [Example(d["input_ids"], d["prompt_len"], d.get("source", "")) for d in torch.load(path)]


# ----------------------------------------------------------------------------- target features


@torch.no_grad()
def target_features(target, input_ids: torch.Tensor, layer_ids, attention_mask=None) -> torch.Tensor:
    """Captured target features ``(b, T, len(layer_ids) * hidden)`` for ``input_ids`` ``(b, T)``.

    Uses ``capture_target_features`` -- the hooks ``spec_generate`` uses at inference -- so training and
    inference read exactly the same tensors (layer ``k`` = output of decoder layer ``k``).
    """
    device = target.get_input_embeddings().weight.device
    with capture_target_features(target, list(layer_ids)) as get:
        target(input_ids=input_ids.to(device),
               attention_mask=None if attention_mask is None else attention_mask.to(device), use_cache=False)
        return get()


def precompute_features(target, examples: list[Example], layer_ids, batch_size: int = 8,
                        dtype=torch.float32, progress: bool = True) -> list[torch.Tensor]:
    """Features ``(T_i, F)`` on CPU for every example (the frozen target runs once per sequence).

    Rows are right padded to batch them; causal attention makes the real positions exact.
    """
    from tqdm import tqdm

    feats = []
    for i in tqdm(range(0, len(examples), batch_size), desc="target features", disable=not progress):
        rows = examples[i:i + batch_size]
        width = max(len(e.input_ids) for e in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        for j, e in enumerate(rows):
            ids[j, : len(e.input_ids)] = e.input_ids
        f = target_features(target, ids, layer_ids).to("cpu", dtype)
        feats += [f[j, : len(e.input_ids)].clone() for j, e in enumerate(rows)]
    return feats


# ----------------------------------------------------------------------------- anchors, blocks, masks


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
        reduction: ``"mean"`` -> ``sum(w * ce) / sum(w)`` over labelled tokens; ``"none"`` -> per-token
            weighted losses ``(b, q)`` (0 where unlabelled), e.g. to isolate one block in tests.

    Returns:
        ``(loss, stats)``; ``stats`` = ``{"correct": (B,), "count": (B,)}`` float tensors of top-1 hits
        and labelled tokens per slot (detached, on CPU).
    """
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    with torch.no_grad():
        noise_embedding = draft_block_embedding(draft.config, embed, batch.noise_ids)
    hidden = draft(position_ids=batch.position_ids, noise_embedding=noise_embedding,
                   target_hidden=batch.target_hidden, attention_mask=batch.masks)
    valid = batch.labels != IGNORE
    logits = draft_logits(draft.config, head, hidden[valid]).float()
    labels, slots = batch.labels[valid], batch.slots[valid]
    w = weights.to(logits.device)[slots]
    ce = F.cross_entropy(logits, labels, reduction="none")
    B = len(weights)
    with torch.no_grad():
        hit = (logits.argmax(-1) == labels).float()
        stats = {"correct": torch.zeros(B).index_add_(0, slots.cpu(), hit.cpu()),
                 "count": torch.zeros(B).index_add_(0, slots.cpu(), torch.ones_like(hit).cpu())}
    if reduction == "none":
        out = torch.zeros(batch.labels.shape, dtype=ce.dtype, device=ce.device)
        out[valid] = w * ce
        return out, stats
    return (w * ce).sum() / w.sum().clamp_min(1e-12), stats


# ----------------------------------------------------------------------------- model building


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
    from generation_utils import _decoder_parts

    layers, norm = _decoder_parts(target)
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


# ----------------------------------------------------------------------------- evaluation


def mean_acceptance(draft, target, prompt_ids: list[torch.Tensor], max_new_tokens: int,
                    block_size: Optional[int] = None, stop_token_ids=None) -> float:
    """Acceptance length tau of greedy ``spec_generate`` (mean tokens per verify step) over prompts.

    Each prompt is ``(1, L)``; the mean is over all steps of all prompts (the convention of the paper).
    """
    was_training = draft.training
    draft.eval()
    steps = []
    for ids in prompt_ids:
        out = spec_generate(draft, target, ids, max_new_tokens=max_new_tokens, temperature=0.0,
                            block_size=block_size, stop_token_ids=stop_token_ids, return_dict_in_generate=True)
        steps += out.acceptance_lengths
    draft.train(was_training)
    return sum(steps) / max(len(steps), 1)


@torch.no_grad()
def eval_loss(draft, target, rows, config, weights, batch_size: int = 4, device="cpu") -> tuple[float, list]:
    """Mean weighted loss and per-slot accuracy over fixed rows ``(ids, feats, anchors)`` (no grad)."""
    was_training = draft.training
    draft.eval()
    tot, n = 0.0, 0
    correct = torch.zeros(len(weights))
    count = torch.zeros(len(weights))
    for i in range(0, len(rows), batch_size):
        batch = pack_batch(rows[i:i + batch_size], config, len(weights)).to(device)
        loss, st = drafter_loss(draft, target, batch, weights)
        tot += float(loss)
        n += 1
        correct += st["correct"]
        count += st["count"]
    draft.train(was_training)
    return tot / max(n, 1), (correct / count.clamp_min(1)).tolist()


# ----------------------------------------------------------------------------- training loop


@dataclass
class TrainConfig:
    """Optimisation settings of :func:`train_drafter` (all recorded in the log and summary)."""

    num_anchors: int = 48  # anchors per sequence, resampled each epoch
    batch_size: int = 4  # sequences per micro-batch
    grad_accum: int = 1  # micro-batches per optimizer step
    epochs: int = 6
    lr: float = 6e-4
    min_lr_ratio: float = 0.0
    warmup_ratio: float = 0.04
    weight_decay: float = 0.0
    betas: tuple = (0.9, 0.95)
    clip: float = 1.0
    gamma: Optional[float] = None  # None -> default_gamma(block_size)
    max_minutes: Optional[float] = None  # wall-clock budget; the cosine then runs on max(step, time) progress
    max_steps: Optional[int] = None
    seed: int = 0
    log_every: int = 10
    eval_every: int = 100  # steps between held-out loss + tau measurements (0 = never)
    ckpt_every: int = 100  # steps between checkpoints (0 = only at the end)
    keep_checkpoints: int = 2
    eval_max_new_tokens: int = 64
    progress: bool = True


def lr_at(step: int, total_steps: int, elapsed_s: float, cfg: TrainConfig) -> float:
    """Linear warmup over ``warmup_ratio * total_steps`` then cosine to ``min_lr_ratio * lr``.

    Progress is ``max(step / total_steps, elapsed_s / budget)`` when ``cfg.max_minutes`` is set, so a
    time-bounded run still anneals.
    """
    warm = max(1, int(round(cfg.warmup_ratio * total_steps)))
    if step < warm:
        return cfg.lr * (step + 1) / warm
    prog = (step - warm) / max(1, total_steps - warm)
    if cfg.max_minutes:
        prog = max(prog, elapsed_s / (60 * cfg.max_minutes))
    prog = min(1.0, prog)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * prog)))


def _epoch_order(n: int, seed: int, epoch: int) -> torch.Tensor:
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1000003 + epoch))


def _anchor_generator(seed: int, epoch: int, index: int) -> torch.Generator:
    """Anchors depend only on (seed, epoch, example index): resampled each epoch, identical on resume."""
    return torch.Generator().manual_seed((seed * 1000003 + epoch) * 1000033 + index)


def latest_checkpoint(ckpt_dir) -> Optional[Path]:
    """The newest complete ``checkpoint-<step>`` folder (one with ``trainer_state.pt``), or None."""
    ckpt_dir = Path(ckpt_dir)
    done = [p for p in ckpt_dir.glob("checkpoint-*") if (p / "trainer_state.pt").exists()]
    return max(done, key=lambda p: int(p.name.split("-")[1])) if done else None


def save_checkpoint(ckpt_dir, draft, optimizer, state: dict, keep: int = 2) -> Path:
    """``ckpt_dir/checkpoint-<step>/``: ``save_pretrained`` of the draft (fp32; loads with
    ``AutoModel.from_pretrained(path, trust_remote_code=True)``) + ``trainer_state.pt`` (optimizer, step,
    RNG) written last, so a folder with it is complete. Keeps the newest ``keep`` checkpoints."""
    path = Path(ckpt_dir) / f"checkpoint-{state['step']}"
    draft.save_pretrained(path)
    torch.save({"optimizer": optimizer.state_dict(), "state": dict(state), "torch_rng": torch.get_rng_state()},
               path / "trainer_state.pt.tmp")
    os.replace(path / "trainer_state.pt.tmp", path / "trainer_state.pt")
    done = sorted((p for p in Path(ckpt_dir).glob("checkpoint-*") if (p / "trainer_state.pt").exists()),
                  key=lambda p: int(p.name.split("-")[1]))
    for old in done[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return path


def _autocast(device: torch.device):
    """bf16 autocast on CUDA, nothing (fp32) elsewhere."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def train_drafter(draft, target, examples: list[Example], features: list[torch.Tensor], cfg: TrainConfig,
                  eval_examples: Optional[list[Example]] = None, eval_features: Optional[list] = None,
                  eval_prompts: Optional[list[torch.Tensor]] = None, log_path=None, ckpt_dir=None,
                  resume_from=None) -> dict:
    """Train ``draft`` in place against the frozen ``target``; returns a summary dict.

    Args:
        draft: ``DFlashDraftModel`` (fp32 master weights, on the training device); target: frozen causal LM
            on the same device. examples / features: training rows and their captured target features
            (:func:`precompute_features`). eval_examples / eval_features: fixed rows for the held-out loss;
            eval_prompts: ``(1, L)`` prompts for tau via ``spec_generate`` (every ``cfg.eval_every`` steps).
        log_path: JSONL log (appended; lines with ``loss`` or ``heldout_loss``/``tau``).
        ckpt_dir: where ``checkpoint-<step>`` folders go; resume_from: such a folder to continue from.

    Raises:
        ValueError: no examples, or a feature list of the wrong length.
    """
    from tqdm import tqdm

    if not examples or len(examples) != len(features):
        raise ValueError(f"need one feature tensor per example, got {len(examples)} examples, {len(features)} features")
    device = draft.fc.weight.device
    B = draft.config.block_size
    weights = loss_weights(B, cfg.gamma)
    target.requires_grad_(False)
    target.eval()
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay)
    per_step = cfg.batch_size * cfg.grad_accum
    steps_per_epoch = math.ceil(len(examples) / per_step)
    total = cfg.max_steps or steps_per_epoch * cfg.epochs
    state = {"step": 0, "epoch": 0, "pos": 0, "elapsed_s": 0.0, "tokens": 0}
    if resume_from is not None:
        ck = torch.load(Path(resume_from) / "trainer_state.pt", map_location="cpu", weights_only=False)
        opt.load_state_dict(ck["optimizer"])
        state = ck["state"]
        torch.set_rng_state(ck["torch_rng"])
        if log_path and Path(log_path).exists():  # drop lines logged after the checkpoint by the interrupted run
            kept = [line for line in Path(log_path).read_text().splitlines()
                    if line.strip() and json.loads(line).get("step", 0) <= state["step"]]
            Path(log_path).write_text("".join(line + "\n" for line in kept))
    log = open(log_path, "a") if log_path else None

    def log_line(rec):
        if log:
            log.write(json.dumps(rec) + "\n")
            log.flush()

    eval_rows = None
    if eval_examples:
        eval_rows = [(e.input_ids, f, sample_anchors(e.prompt_len, len(e.input_ids), cfg.num_anchors,
                                                     _anchor_generator(cfg.seed + 7, 0, i)))
                     for i, (e, f) in enumerate(zip(eval_examples, eval_features))]

    def evaluate():
        rec = {"step": state["step"], "elapsed_s": round(state["elapsed_s"], 1)}
        if eval_rows:
            rec["heldout_loss"], acc = eval_loss(draft, target, eval_rows, draft.config, weights, cfg.batch_size,
                                                 device)
            rec["heldout_acc_slot"] = [round(a, 4) for a in acc[1:]]
        if eval_prompts:
            rec["tau"] = mean_acceptance(draft, target, eval_prompts, cfg.eval_max_new_tokens)
        log_line(rec)
        return rec

    draft.train()
    order = _epoch_order(len(examples), cfg.seed, state["epoch"])
    t_start = time.time() - state["elapsed_s"]
    budget = 60 * cfg.max_minutes if cfg.max_minutes else float("inf")
    bar = tqdm(total=total, initial=state["step"], disable=not cfg.progress, mininterval=5, dynamic_ncols=True)
    win = {"loss": 0.0, "n": 0, "correct": torch.zeros(B), "count": torch.zeros(B)}
    last_eval = {}
    if state["step"] == 0 and cfg.eval_every:
        last_eval = evaluate()
    while state["step"] < total and time.time() - t_start < budget:
        lr = lr_at(state["step"], total, time.time() - t_start, cfg)
        for g in opt.param_groups:
            g["lr"] = lr
        opt.zero_grad(set_to_none=True)
        step_loss = 0.0
        for _ in range(cfg.grad_accum):
            if state["pos"] >= len(examples):
                state["epoch"] += 1
                state["pos"] = 0
                order = _epoch_order(len(examples), cfg.seed, state["epoch"])
            idx = order[state["pos"]: state["pos"] + cfg.batch_size].tolist()
            state["pos"] += cfg.batch_size
            rows = [(examples[i].input_ids, features[i],
                     sample_anchors(examples[i].prompt_len, len(examples[i].input_ids), cfg.num_anchors,
                                    _anchor_generator(cfg.seed, state["epoch"], i))) for i in idx]
            batch = pack_batch(rows, draft.config, B).to(device)
            with _autocast(device):
                loss, st = drafter_loss(draft, target, batch, weights)
            (loss / cfg.grad_accum).backward()
            step_loss += loss.item() / cfg.grad_accum
            win["correct"] += st["correct"]
            win["count"] += st["count"]
            state["tokens"] += int(st["count"].sum())
        gnorm = torch.nn.utils.clip_grad_norm_(params, cfg.clip)
        opt.step()
        state["step"] += 1
        state["elapsed_s"] = time.time() - t_start
        win["loss"] += step_loss
        win["n"] += 1
        bar.update(1)
        if state["step"] % cfg.log_every == 0 or state["step"] == total:
            acc = (win["correct"] / win["count"].clamp_min(1))[1:]
            rec = {"step": state["step"], "epoch": state["epoch"], "loss": win["loss"] / win["n"], "lr": lr,
                   "grad_norm": float(gnorm), "acc": float(acc.mean()), "acc_slot": [round(float(a), 4) for a in acc],
                   "label_tokens": state["tokens"], "elapsed_s": round(state["elapsed_s"], 1)}
            log_line(rec)
            shown = sorted({1, 2, 4, 8, B - 1} & set(range(1, B)))  # per-slot accuracy at a few slots
            bar.set_postfix(loss=f"{rec['loss']:.3f}", acc=f"{rec['acc']:.2f}",
                            acc_slot="/".join(f"{k}:{acc[k - 1]:.2f}" for k in shown),
                            tau=f"{last_eval.get('tau', float('nan')):.2f}")
            win = {"loss": 0.0, "n": 0, "correct": torch.zeros(B), "count": torch.zeros(B)}
        if cfg.eval_every and state["step"] % cfg.eval_every == 0:
            last_eval = evaluate()
        if ckpt_dir and cfg.ckpt_every and state["step"] % cfg.ckpt_every == 0:
            save_checkpoint(ckpt_dir, draft, opt, state, cfg.keep_checkpoints)
    bar.close()
    if cfg.eval_every and last_eval.get("step") != state["step"]:
        last_eval = evaluate()
    if ckpt_dir:
        save_checkpoint(ckpt_dir, draft, opt, state, cfg.keep_checkpoints)
    if log:
        log.close()
    draft.eval()
    return {"steps": state["step"], "total_steps_planned": total, "epochs_started": state["epoch"] + 1,
            "train_wall_s": round(state["elapsed_s"], 1), "label_tokens": state["tokens"], "final_eval": last_eval}


# ----------------------------------------------------------------------------- CLI


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a = ap.add_argument
    a("--target", default="pair/target", help="target folder (AutoModelForCausalLM + AutoTokenizer)")
    a("--out", default="pair/drafter")
    a("--layers", type=int, default=2, help="draft decoder layers")
    a("--block-size", type=int, default=16)
    a("--target-layer-ids", default="1,3,5", help="comma-separated 0-based target layers (output of layer k)")
    a("--mask-token-id", type=int, default=None, help="default: the tokenizer's mask token")
    a("--init", choices=["target", "random"], default="target", help="see init_draft_from_target")
    # data
    a("--data", nargs="*", default=None, help=".jsonl / text files instead of target continuations")
    a("--num-prompts", type=int, default=1200, help="training-split prompts for target continuations")
    a("--num-eval-prompts", type=int, default=48, help="extra training-split prompts kept out of training (eval)")
    a("--max-new-tokens", type=int, default=192, help="continuation length")
    a("--sampled-fraction", type=float, default=0.25, help="share of prompts continued by sampling (rest greedy)")
    a("--sample-temperature", type=float, default=0.8)
    a("--gen-batch", type=int, default=32)
    a("--max-len", type=int, default=512)
    # optimisation
    a("--anchors", type=int, default=48)
    a("--batch", type=int, default=4)
    a("--grad-accum", type=int, default=1)
    a("--epochs", type=int, default=6)
    a("--lr", type=float, default=6e-4)
    a("--min-lr-ratio", type=float, default=0.0)
    a("--warmup-ratio", type=float, default=0.04)
    a("--weight-decay", type=float, default=0.0)
    a("--clip", type=float, default=1.0)
    a("--gamma", type=float, default=None, help="default: 7 for B=16, 5 for 10, 4 for 8")
    a("--max-minutes", type=float, default=None, help="training wall-clock budget (cosine follows time)")
    a("--max-steps", type=int, default=None)
    a("--seed", type=int, default=0)
    a("--threads", type=int, default=2)
    a("--device", default="auto")
    # io
    a("--ckpt-dir", default=".cache/drafter_ckpt")
    a("--ckpt-every", type=int, default=100)
    a("--eval-every", type=int, default=100)
    a("--eval-tau-prompts", type=int, default=4, help="eval prompts used for tau during training")
    a("--log", default="pair/drafter_train_log.jsonl")
    a("--summary", default="pair/drafter_train_summary.json")
    a("--save-dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    a("--resume", action="store_true", help="continue from the newest checkpoint in --ckpt-dir")
    a("--reuse-data", action="store_true", help="train on the sequences cached in --ckpt-dir by an earlier run")
    a("--no-progress", action="store_true")
    return ap.parse_args(argv)


def pick_device(name: str = "auto") -> torch.device:
    """``auto`` -> cuda when available, else cpu."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def main(argv=None) -> dict:
    """The CLI: data -> features -> train -> ``--out`` (``--save-dtype`` safetensors) + summary."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    import transformers

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    device = pick_device(args.device)
    t0 = time.time()
    tok = AutoTokenizer.from_pretrained(args.target)
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).to(device).eval()
    target.requires_grad_(False)
    layer_ids = [int(x) for x in args.target_layer_ids.split(",")]
    mask_id = args.mask_token_id if args.mask_token_id is not None else tok.mask_token_id
    if mask_id is None:
        raise ValueError("the tokenizer has no mask token; pass --mask-token-id (a reserved, never-generated id)")
    ckpt_dir = Path(args.ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    resume = latest_checkpoint(ckpt_dir) if args.resume else None
    if args.resume and resume is None:
        print(f"--resume: no complete checkpoint in {ckpt_dir}, starting fresh")

    # data (cached in ckpt_dir so a resumed run trains on the very same sequences)
    data_path, eval_path = ckpt_dir / "examples.pt", ckpt_dir / "eval_examples.pt"
    t_data = time.time()
    if (resume is not None or args.reuse_data) and data_path.exists():
        examples, eval_examples = read_examples(data_path), read_examples(eval_path)
    else:
        prompts = training_prompts(args.num_prompts + args.num_eval_prompts, seed=args.seed)
        eval_prompt_texts, prompts = prompts[: args.num_eval_prompts], prompts[args.num_eval_prompts:]
        if args.data:
            examples = load_examples(args.data, tok, args.max_len)
        else:
            n_sampled = int(round(args.sampled_fraction * len(prompts)))
            examples = generate_continuations(target, tok, prompts[n_sampled:], args.max_new_tokens, 0.0,
                                              args.gen_batch, args.seed, not args.no_progress)
            if n_sampled:
                examples += generate_continuations(target, tok, prompts[:n_sampled], args.max_new_tokens,
                                                   args.sample_temperature, args.gen_batch, args.seed + 1,
                                                   not args.no_progress)
        eval_examples = generate_continuations(target, tok, eval_prompt_texts, args.max_new_tokens, 0.0,
                                               args.gen_batch, args.seed + 2, not args.no_progress)
        save_examples(examples, data_path)
        save_examples(eval_examples, eval_path)
    data_s = time.time() - t_data
    t_feat = time.time()
    features = precompute_features(target, examples, layer_ids, progress=not args.no_progress)
    eval_features = precompute_features(target, eval_examples, layer_ids, progress=not args.no_progress)
    feat_s = time.time() - t_feat
    eval_prompts = [e.input_ids[None, : e.prompt_len].to(device) for e in eval_examples[: args.eval_tau_prompts]]

    # draft
    if resume is not None:
        draft = DFlashDraftModel.from_pretrained(resume, dtype=torch.float32)
        init_report = {"resumed_from": str(resume)}
        print(f"resuming from {resume}")
    else:
        cfg = build_draft_config(target, args.layers, args.block_size, layer_ids, mask_id,
                                 target_model_id=str(args.target))
        torch.manual_seed(args.seed)
        draft = DFlashDraftModel(cfg)
        init_report = init_draft_from_target(draft, target) if args.init == "target" else {"copied": []}
        Path(args.log).parent.mkdir(parents=True, exist_ok=True)
        Path(args.log).write_text("")
    draft.to(device)
    tcfg = TrainConfig(num_anchors=args.anchors, batch_size=args.batch, grad_accum=args.grad_accum,
                       epochs=args.epochs, lr=args.lr, min_lr_ratio=args.min_lr_ratio, warmup_ratio=args.warmup_ratio,
                       weight_decay=args.weight_decay, clip=args.clip, gamma=args.gamma,
                       max_minutes=args.max_minutes, max_steps=args.max_steps, seed=args.seed,
                       eval_every=args.eval_every, ckpt_every=args.ckpt_every, progress=not args.no_progress)
    n_train = sum(p.numel() for p in draft.parameters() if p.requires_grad)
    print(f"draft: {args.layers} layers, {n_train / 1e6:.3f} M trainable params; {len(examples)} training "
          f"sequences ({sum(len(e.input_ids) for e in examples)} tokens); data {data_s:.0f}s, features {feat_s:.0f}s")
    result = train_drafter(draft, target, examples, features, tcfg, eval_examples, eval_features, eval_prompts,
                           args.log, ckpt_dir, resume)

    # ship
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    draft.to(getattr(torch, args.save_dtype)).save_pretrained(out)
    size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    summary = {
        "command": "python -m train.train_drafter " + " ".join(argv if argv is not None else sys.argv[1:]),
        "args": vars(args), "train_config": asdict(tcfg), "draft_config": draft.config.to_dict(),
        "init": init_report, "trainable_params": n_train, "weights_bytes": size, "saved_dtype": args.save_dtype,
        "num_train_sequences": len(examples), "num_train_tokens": sum(len(e.input_ids) for e in examples),
        "num_eval_sequences": len(eval_examples), "data_wall_s": round(data_s, 1), "features_wall_s": round(feat_s, 1),
        "total_wall_s": round(time.time() - t0, 1), **result,
        "device": str(device), "threads": args.threads, "python_version": platform.python_version(),
        "torch": torch.__version__, "transformers": transformers.__version__,
    }
    Path(args.summary).write_text(json.dumps(summary, indent=1, default=str) + "\n")
    print(json.dumps({k: summary[k] for k in ("steps", "train_wall_s", "weights_bytes", "final_eval")}, default=str))
    return summary


if __name__ == "__main__":
    main()
