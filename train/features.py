"""Target features for training: the frozen target's tapped hidden states, computed live per batch or
read from an offline cache.

The taps are ``target_taps.capture_target_features`` -- the very hooks ``spec_generate`` uses at
inference -- so training and inference read the same tensors (layer ``k`` = output of decoder layer
``k``; DFlash paper, section 3).

Packing: several documents share one target forward row; a block-diagonal causal mask keeps each
document from attending to another and positions restart at 0 for each, so every document's features
equal those of the document run alone (up to float summation order). Sliding-window targets get the
window inside each document too (one mask per attention kind, ``target_families.layer_windows``: a
4-D mask replaces the model's own, window included). Hybrid linear-attention targets are refused: their
recurrent state would carry one document into the next (no per-document reset in a packed forward).

Cache (:func:`write_feature_cache`): safetensors shards plus ``index.json``; bf16 by default. Disk cost
per token = ``len(target_layer_ids) x hidden_size x 2`` bytes in bf16 (Qwen3-8B, 5 taps x 4096: 40 KB
per token, 41 GB per million tokens).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Optional, Sequence

import torch

from train._paths import capture_target_features, layer_windows, linear_layer_ids, run_target

INDEX = "index.json"


@torch.no_grad()
def target_features(target, input_ids: torch.Tensor, layer_ids, attention_mask=None, position_ids=None) -> torch.Tensor:
    """Captured target features ``(b, T, len(layer_ids) * hidden)`` for ``input_ids`` ``(b, T)``.

    ``attention_mask`` may be 2-D ``(b, T)`` padding or 4-D ``(b, 1, T, T)`` additive (see
    :func:`packed_inputs`); ``position_ids`` ``(b, T)`` for packed rows.
    """
    device = target.get_input_embeddings().weight.device
    kwargs = {}
    if isinstance(attention_mask, dict):  # one 4-D mask per attention kind (packed sliding-window targets)
        kwargs["attention_mask"] = {kind: m.to(device) for kind, m in attention_mask.items()}
    elif attention_mask is not None:
        kwargs["attention_mask"] = attention_mask.to(device)
    if position_ids is not None:
        kwargs["position_ids"] = position_ids.to(device)
    with capture_target_features(target, list(layer_ids)) as get:
        run_target(target, input_ids=input_ids.to(device), use_cache=False, **kwargs)  # compiled targets too
        return get()


def pack_documents(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Greedy in-order packing: lists of document indices whose lengths sum to ``<= max_tokens`` (a
    longer document gets a row of its own). ``max_tokens <= 0`` puts every document alone."""
    rows, cur, used = [], [], 0
    for i, n in enumerate(lengths):
        if cur and (max_tokens <= 0 or used + n > max_tokens):
            rows.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += n
    if cur:
        rows.append(cur)
    return rows


def packed_inputs(docs: list[torch.Tensor], dtype: torch.dtype = torch.float32, windows: Optional[dict] = None):
    """One target row holding ``docs`` (each ``(T_i,)``) side by side.

    Returns ``(input_ids (1, W), position_ids (1, W), attention_mask)`` with ``W = sum T_i``: positions
    restart at 0 for each document and the additive ``dtype`` mask ``(1, 1, W, W)`` is causal inside a
    document and ``finfo(dtype).min`` between documents (block diagonal), so no document sees another.
    ``windows`` (``target_families.layer_windows`` of the target; {} or None: no sliding layer) adds each
    sliding window inside its document (key visible iff ``q - k < window``, transformers' rule): one mask
    for every layer (windows keyed None, Mistral style), else ``{layer_type: mask}``, which models with
    ``layer_types`` take as their mask mapping.
    """
    ids = torch.cat(docs)[None]
    doc = torch.cat([torch.full((len(d),), i) for i, d in enumerate(docs)])
    pos = torch.cat([torch.arange(len(d)) for d in docs])[None]
    idx = torch.arange(len(doc))
    diff = idx[:, None] - idx[None, :]  # (W, W) query index - key index: the distance inside a document
    allowed = (doc[:, None] == doc[None, :]) & (diff >= 0)  # (W, W)

    def additive(visible):
        return torch.zeros(visible.shape, dtype=dtype).masked_fill(~visible, torch.finfo(dtype).min)[None, None]

    if not windows:
        return ids, pos, additive(allowed)
    masks = {kind: additive(allowed if w is None else allowed & (diff < w)) for kind, w in windows.items()}
    return ids, pos, masks[None] if None in masks else masks


def check_packable(target) -> None:
    """Raise NotImplementedError, naming the family, for targets whose packed features cannot equal each
    sequence alone: hybrid linear-attention targets (their recurrent and convolution state runs on
    through the whole packed row, carrying one document into the next)."""
    linear = linear_layer_ids(target)
    if linear:
        kind = getattr(target.config.get_text_config(), "model_type", None)
        raise NotImplementedError(
            f"--pack-tokens: target {kind!r} has linear-attention layers {linear}, whose state would carry one "
            "document into the next in a packed row; run its sequences one per row (--pack-tokens 0)")


@torch.no_grad()
def compute_features(target, sequences: list[torch.Tensor], layer_ids, pack_tokens: int = 0,
                     dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """Features ``(T_i, len(layer_ids) * hidden)`` on CPU in ``dtype`` for every sequence ``(T_i,)``.

    ``pack_tokens > 0`` packs sequences into target rows of at most that many tokens (:func:`packed_inputs`,
    windows included); 0 runs each sequence alone (then live and cached features are bit-identical: same
    shapes, same kernels). Raises NotImplementedError for packing a hybrid target (:func:`check_packable`).
    """
    mask_dtype = target.get_input_embeddings().weight.dtype
    if pack_tokens > 0:
        check_packable(target)
    windows = layer_windows(target)
    out: list[Optional[torch.Tensor]] = [None] * len(sequences)
    for row in pack_documents([len(s) for s in sequences], pack_tokens):
        if len(row) == 1:
            feats = target_features(target, sequences[row[0]][None], layer_ids)[0]
            out[row[0]] = feats.to("cpu", dtype)
            continue
        ids, pos, mask = packed_inputs([sequences[i] for i in row], mask_dtype, windows)
        feats = target_features(target, ids, layer_ids, attention_mask=mask, position_ids=pos)[0].to("cpu", dtype)
        start = 0
        for i in row:
            out[i] = feats[start:start + len(sequences[i])].clone()
            start += len(sequences[i])
    return out


class LiveFeatures:
    """Features computed by the frozen target when a batch asks for them (nothing stored).

    ``source(indices) -> [features (T_i, F)]`` for ``examples[indices]``, in float32.
    """

    def __init__(self, target, examples, layer_ids, pack_tokens: int = 0):
        self.target, self.examples, self.layer_ids, self.pack_tokens = target, examples, list(layer_ids), pack_tokens
        if pack_tokens > 0:
            check_packable(target)  # refused at construction, before any forward

    def __call__(self, indices: Sequence[int]) -> list[torch.Tensor]:
        return compute_features(self.target, [self.examples[i].input_ids for i in indices], self.layer_ids,
                                self.pack_tokens, torch.float32)


class ListFeatures:
    """Features already in memory: ``source(indices)`` picks from a list (notebook use, tests)."""

    def __init__(self, features: list):
        self.features = features

    def __call__(self, indices: Sequence[int]) -> list[torch.Tensor]:
        return [self.features[i] for i in indices]


def fingerprint(examples) -> str:
    """sha256 over every example's token ids and prompt length: a cache is only valid for its data."""
    h = hashlib.sha256()
    for e in examples:
        h.update(str(e.prompt_len).encode())
        h.update(e.input_ids.to(torch.int64).numpy().tobytes())
    return h.hexdigest()


def write_feature_cache(target, examples, layer_ids, out_dir, dtype: torch.dtype = torch.bfloat16,
                        shard_tokens: int = 2**20, pack_tokens: int = 0, progress: bool = True) -> Path:
    """Run the frozen target once over ``examples`` and store their features under ``out_dir``.

    Layout: ``features-00000.safetensors``, ... (tensor ``"<example index>"`` of shape ``(T_i, F)`` in
    ``dtype``, about ``shard_tokens`` tokens per shard) and ``index.json`` (``layer_ids``, ``dtype``,
    ``feature_dim``, ``num_examples``, ``fingerprint`` of the data, ``shard`` of every example). Written in
    ``out_dir.tmp`` and renamed, so a present ``out_dir`` is complete. An existing complete cache for the
    same data and layers is reused. Returns ``out_dir``.

    Raises:
        ValueError: ``out_dir`` holds a cache of other data, layers or dtype.
    """
    from safetensors.torch import save_file
    from tqdm import tqdm

    out_dir = Path(out_dir)
    fp = fingerprint(examples)
    if (out_dir / INDEX).exists():
        FeatureCache(out_dir).check(examples, layer_ids, dtype, fp)
        return out_dir
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    shard_of, shard, used, n_shard = {}, {}, 0, 0
    feat_dim = None

    def flush():
        nonlocal shard, used, n_shard
        if shard:
            save_file(shard, str(tmp / f"features-{n_shard:05d}.safetensors"))
            n_shard += 1
        shard, used = {}, 0

    chunk = 64
    for start in tqdm(range(0, len(examples), chunk), desc="feature cache", disable=not progress):
        idx = list(range(start, min(start + chunk, len(examples))))
        feats = compute_features(target, [examples[i].input_ids for i in idx], layer_ids, pack_tokens, dtype)
        for i, f in zip(idx, feats):
            feat_dim = f.shape[-1]
            shard[str(i)] = f.contiguous()
            shard_of[str(i)] = f"features-{n_shard:05d}.safetensors"
            used += len(f)
            if used >= shard_tokens:
                flush()
    flush()
    index = {"layer_ids": list(layer_ids), "dtype": str(dtype).replace("torch.", ""), "feature_dim": feat_dim,
             "num_examples": len(examples), "num_tokens": sum(len(e.input_ids) for e in examples),
             "fingerprint": fp, "shard": shard_of}
    (tmp / INDEX).write_text(json.dumps(index) + "\n")
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
    return out_dir


class FeatureCache:
    """Read a cache written by :func:`write_feature_cache`: ``cache(indices) -> [features (T_i, F)]`` in
    float32 (the training dtype; bf16 on disk is upcast). Shards are memory-mapped by safetensors.

    Raises:
        FileNotFoundError: no ``index.json`` in ``path``.
    """

    def __init__(self, path):
        self.path = Path(path)
        if not (self.path / INDEX).is_file():
            raise FileNotFoundError(f"{self.path} is not a feature cache (no {INDEX})")
        self.index = json.loads((self.path / INDEX).read_text())
        self._open = {}

    def check(self, examples, layer_ids, dtype=None, fp: Optional[str] = None) -> None:
        """Raise ValueError naming the mismatch when the cache was built for other data, taps or dtype."""
        if list(layer_ids) != self.index["layer_ids"]:
            raise ValueError(f"feature cache {self.path} holds layers {self.index['layer_ids']}, not {list(layer_ids)}; "
                             "delete it or use another --output-dir")
        if dtype is not None and str(dtype).replace("torch.", "") != self.index["dtype"]:
            raise ValueError(f"feature cache {self.path} is {self.index['dtype']}, asked for {dtype}; delete it to rebuild")
        if (fp or fingerprint(examples)) != self.index["fingerprint"]:
            raise ValueError(f"feature cache {self.path} was built from other training data; delete it to rebuild")

    def _shard(self, name):
        from safetensors import safe_open

        if name not in self._open:
            self._open[name] = safe_open(str(self.path / name), framework="pt")
        return self._open[name]

    def __call__(self, indices: Sequence[int]) -> list[torch.Tensor]:
        return [self._shard(self.index["shard"][str(i)]).get_tensor(str(i)).float() for i in indices]


def disk_bytes_per_token(num_taps: int, hidden_size: int, dtype: torch.dtype = torch.bfloat16) -> int:
    """Cache size per token: ``num_taps x hidden_size x bytes(dtype)`` (bf16: 2 bytes)."""
    return num_taps * hidden_size * torch.empty((), dtype=dtype).element_size()
