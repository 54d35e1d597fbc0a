"""Continuing ``spec_generate`` from a previous call's cache: multi-turn chat without re-prefilling the history.

A chat loop calls generate once per turn. ``generate(..., return_dict_in_generate=True)`` returns the
target's cache (field ``cache`` on transformers 5.x, ``past_key_values`` on 4.57) and takes it back
(``cache=`` / deprecated ``past_key_values=`` on 5.x, ``past_key_values=`` on 4.57), together with the
whole conversation as ``input_ids``; only the uncached tokens are computed. ``spec_generate`` does the
same, on batch 1 (the loop's cache holds holes of other rows in a batch):

* the passed cache is the target's working cache, advanced in place (as generate does): it holds, after
  the call, every token of the output but the last (what generate's cache holds for the same output), so
  generate and spec_generate continue from each other's caches;
* a cache that ``spec_generate`` returns carries the draft's context for its positions (attribute
  ``DRAFT_CONTEXT``: the draft's K/V cache and the pending target features, with the length they cover);
  the next call uses it after checking that length against the cache's;
* a cache without it (prefilled by the user, e.g. on a shared system prompt, or advanced by generate)
  gives the draft context from its first uncached token on (one info log). Positions are then shifted
  for the draft by that origin (``_ShiftedDraft``): RoPE depends on distances only, and the draft's
  causal / sliding masks, which take cached keys to sit at ``0..past_len-1``, stay right.

Source: issue 25 (z-lab #165: an 18K-token prompt re-prefilled every turn).
"""

from dataclasses import dataclass
from typing import Optional

import torch
from transformers import DynamicCache
from transformers.generation import GenerateDecoderOnlyOutput
from transformers.utils import logging

try:
    from .decode_step import _Context, crop_cache
    from .target_cache import linear_layer_ids, new_target_cache
    from .tested_versions import warn_if_untested
except ImportError:  # imported from the repository root instead of as a Hub remote-code package
    from decode_step import _Context, crop_cache
    from target_cache import linear_layer_ids, new_target_cache
    from tested_versions import warn_if_untested

logger = logging.get_logger(__name__)

# The output field generate returns the cache in, and the names generate takes it under, on this version.
CACHE_FIELD = "cache" if "cache" in GenerateDecoderOnlyOutput.__dataclass_fields__ else "past_key_values"
CACHE_NAMES = ("cache", "past_key_values") if CACHE_FIELD == "cache" else ("past_key_values",)
DRAFT_CONTEXT = "dflash_draft_context"  # attribute of a cache returned by spec_generate


@dataclass
class DraftContext:
    """The draft's context for the first ``length`` positions of the target cache it is attached to.

    draft_cache: ``DynamicCache`` of the draft, context K/V of positions ``origin .. origin + D - 1``.
    pending: ``_Context`` (features ``(1, C, F)``, true positions ``(1, C)``) of the next ``C`` positions,
        not yet in ``draft_cache``; ``length = origin + D + C``.
    origin: first position the draft has context for (> 0 when the first turn started from a cache that
        carried none); the draft sees positions shifted by it.
    owner: ``id`` of the draft that built it (another draft's K/V are not reused).
    """

    draft_cache: DynamicCache
    pending: Optional[_Context]
    origin: int
    length: int
    owner: int


def cache_length(cache) -> int:
    """Tokens in ``cache``, a Python int: on transformers 5.25 a hybrid target's ``DynamicCache`` answers
    ``get_seq_length()`` with its first layer's live token counter (``cumulative_length_linear``, a 0-dim
    tensor the next forward moves in place), so a length kept across forwards (``Resume.cached``, the
    ``DraftContext.length`` of a returned cache) must be a copy. One host read per call."""
    return int(cache.get_seq_length())


def pop_passed_cache(kwargs: dict):
    """Remove the cache from ``spec_generate``'s keyword arguments and return it (None when not passed).

    Raises:
        TypeError: ``cache=`` on transformers 4.57 (generate takes ``past_key_values=`` there); a cache that
            is not a transformers ``DynamicCache`` (legacy tuples, static or quantized caches: the loop
            rolls rejected drafts back by cropping, which those do not support exactly).
        ValueError: both names passed.
    """
    if "cache" in kwargs and "cache" not in CACHE_NAMES:
        raise TypeError("cache= is the transformers >= 5 name; on this version pass past_key_values=, as to generate")
    given = {name: kwargs.pop(name) for name in CACHE_NAMES if name in kwargs}
    given = {name: value for name, value in given.items() if value is not None}
    if len(given) > 1:
        raise ValueError(f"pass the cache once, as {' or '.join(CACHE_NAMES)}, got both")
    if not given:
        return None
    (name, cache), = given.items()
    if not isinstance(cache, DynamicCache):
        raise TypeError(f"{name}= must be a transformers DynamicCache (as generate returns it), got "
                        f"{type(cache).__name__}: spec_generate rolls rejected drafts back by cropping it")
    return cache


def check_passed_cache(cache, input_ids: torch.Tensor, mask: torch.Tensor, target, static) -> None:
    """Refuse, before any work, a passed cache this call cannot continue from exactly.

    Args:
        input_ids: ``(B, L)`` the whole conversation (cached tokens first); mask: ``(B, L)`` 0/1.
        static: the static-loop request (``cache_implementation="static"``) or None.
    Raises:
        ValueError: batch size > 1 (the loop's cache holds holes of other rows), a padded prompt, a cache
            holding as many tokens as ``input_ids`` or more, ``cache_implementation="static"`` (generate
            refuses that pair too), a hybrid target's cache without linear-attention layers.
        NotImplementedError: transformers 4.57 sliding-window cache layers (they cannot be cropped once
            past the window, notes section 3).
    """
    if cache is None:
        return
    bsz, length = input_ids.shape
    if bsz != 1:
        raise ValueError(f"a passed cache ({'/'.join(CACHE_NAMES)}=) needs batch size 1, got batch {bsz}: the "
                         "loop's cache holds rejected slots and padding of other rows in a batch")
    if not bool(mask.all()):
        raise ValueError("a passed cache needs an unpadded prompt (attention_mask all ones)")
    cached = cache_length(cache)
    if cached >= length:
        raise ValueError(f"the cache holds {cached} tokens but input_ids only {length}: pass the whole conversation "
                         "(the cached tokens first, then at least one new token), as to generate")
    if static is not None:
        raise ValueError("cache_implementation='static' and a passed cache cannot be combined (generate refuses them too)")
    layers = getattr(cache, "layers", [])
    linear = linear_layer_ids(target)
    if linear and cached and not all(hasattr(layers[i], "conv_states") for i in linear if i < len(layers)):
        raise ValueError("a hybrid target's cache must hold its linear-attention layers: build it with "
                         "DynamicCache(config=target.config) or take the one generate returns")
    if any(getattr(layer, "is_sliding", False) and not hasattr(layer, "activate_past_recording") for layer in layers):
        raise NotImplementedError(
            "this transformers version's sliding-window cache layers cannot be rolled back once past the window: "
            "pass a DynamicCache() built without config (full layers; generate continues from it exactly too)")


class _ShiftedDraft:
    """The draft seen with positions shifted by ``origin`` (its context starts there): called as the loop
    calls it, with ``position_ids - origin``; every other attribute is the draft's own (``config``, a
    DFlash 2 drafter's ``selector_inputs`` and ``candidate_selector``, whatever a drafter kind adds).

    Source: issue 34 item 3 (the wrapper forwarded ``config`` only: a DFlash 2 drafter continuing from a
    cache without draft context raised ``AttributeError: ... 'selector_inputs'``)."""

    def __init__(self, draft, origin: int):
        self.draft, self.origin = draft, origin

    def __call__(self, position_ids, **kwargs):
        return self.draft(position_ids=position_ids - self.origin, **kwargs)

    def __getattr__(self, name):  # only for names not set in __init__: everything but the call is the draft's
        if name == "draft":  # not yet set (copy / unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.draft, name)


class Resume:
    """What ``_decode`` starts from and hands back: the working caches, the cached length, the draft context.

    Attributes:
        target_cache: the cache the loop runs on (the passed one, or for hybrid targets a ``HybridCache``
            sharing its layers, so that the passed object advances in place).
        returned: the cache handed back (batch 1; None for batches): the passed object, or a new one.
        draft_cache: the draft's ``DynamicCache`` (the stored one when the context is reused).
        cached: tokens of ``input_ids`` already in ``target_cache`` (the prefill computes the rest).
        origin: first position the draft has context for; pending: stored features not yet in draft_cache.
    """

    def __init__(self, target, draft, passed, bsz: int, rope_switch=None):
        self.owner = id(draft)
        if passed is not None:
            warn_if_untested("cache reuse")
        self.cached = 0 if passed is None else cache_length(passed)
        self.target_cache = new_target_cache(target)
        for layer in getattr(passed, "layers", []):  # 5.x sliding layers keep what a crop past the window needs
            if getattr(layer, "is_sliding", False) and hasattr(layer, "activate_past_recording"):
                layer.activate_past_recording()
        if passed is not None:
            if type(self.target_cache) is DynamicCache:
                self.target_cache = passed
            else:  # a HybridCache: same layer objects, so the passed cache advances in place
                self.target_cache.layers = passed.layers
        self.returned = passed
        if passed is None and bsz == 1:
            self.returned = self.target_cache
            if type(self.target_cache) is not DynamicCache:  # hand back a plain cache (no target modules inside)
                self.returned = DynamicCache(config=target.config)
                self.returned.layers = self.target_cache.layers
        self.draft_cache, self.pending, self.origin = self._draft_context(passed)
        if rope_switch is not None and self.origin:  # its re-prefill rebuilds the draft context from position 0
            raise NotImplementedError(
                f"crossing the longrope switch (sequence length {rope_switch + 1}) from a cache without draft context "
                "for its first tokens is not supported: pass the cache a spec_generate call returned, or none")

    def _draft_context(self, passed):
        """``(draft_cache, pending, origin)``: the stored context cut to the cached length, else an empty one."""
        stored = getattr(passed, DRAFT_CONTEXT, None)
        n = self.cached
        if stored is None or stored.owner != self.owner or not stored.origin <= n <= stored.length:
            if n:
                why = "another draft's" if stored is not None and stored.owner != self.owner else "no"
                logger.info(f"the passed cache holds {n} tokens and carries {why} draft context for them: the draft "
                            f"sees context from position {n} on (output unchanged; acceptance may be lower)")
            return DynamicCache(), None, n
        drafted = n - stored.origin  # positions the draft keeps context for
        crop_cache(stored.draft_cache, drafted)
        pending = stored.pending
        keep = drafted - stored.draft_cache.get_seq_length()
        if pending is not None:
            pending = _Context(pending.features[:, :keep], pending.positions[:, :keep], None) if keep > 0 else None
        return stored.draft_cache, pending, stored.origin

    def draft(self, draft):
        """The draft as the loop should call it (shifted when its context does not start at 0)."""
        return draft if self.origin == 0 else _ShiftedDraft(draft, self.origin)

    def context(self, ctx: _Context) -> _Context:
        """The prefill's context ``ctx`` after the stored pending features."""
        return ctx if self.pending is None else self.pending.cat(ctx)

    def kept(self, run, committed: torch.Tensor, counts: list, finished: list):
        """``(committed, counts)`` of the step, cut to the tokens the output kept when the row finished in it
        (a stop or the budget inside an accepted block): the returned cache then holds every output token
        but the last, as generate's. Only when a cache is handed back (batch 1)."""
        if self.returned is None or not finished[0]:
            return committed, counts
        kept = run.out.row_acceptance_lengths[0][-1]  # tokens of this step in the output (>= 1)
        if kept == counts[0]:
            return committed, counts
        return committed.new_tensor([kept]), [kept]

    def finish(self, out, rows, draft_cache) -> None:
        """Attach the draft context to the returned cache and put it in ``out`` (field ``CACHE_FIELD``); the
        caller makes its tensors ordinary (``leave_inference_mode``) where the cache reaches the user."""
        if self.returned is None:
            return
        length = cache_length(self.target_cache)
        pending = rows.context()
        covered = self.origin + draft_cache.get_seq_length() + (0 if pending is None else pending.features.shape[1])
        assert covered == length, f"draft context covers {covered} positions, the target cache {length}"
        setattr(self.returned, DRAFT_CONTEXT, DraftContext(draft_cache, pending, self.origin, length, self.owner))
        out[CACHE_FIELD] = self.returned


def _ordinary(value):
    """``value`` with each inference tensor in it (nested in dicts, lists, tuples) an ordinary copy; dicts
    and lists are updated in place, anything else is returned as it is."""
    if isinstance(value, torch.Tensor):
        return value.clone() if value.is_inference() else value
    if isinstance(value, dict):
        value.update((key, _ordinary(item)) for key, item in list(value.items()))
    elif isinstance(value, list):
        value[:] = [_ordinary(item) for item in value]
    elif isinstance(value, tuple):
        return tuple(_ordinary(item) for item in value)
    return value


def leave_inference_mode(cache) -> None:
    """Make the cache ``spec_generate`` hands back, and the draft context attached to it, usable outside
    ``torch.inference_mode``: every inference tensor they hold (any cache layer kind's attributes: full and
    sliding K/V, linear-attention ``conv_states`` / ``recurrent_states``; the draft's K/V, the pending
    features and positions) becomes an ordinary copy, in place (the cache object stays the caller's).

    Tensors made under ``inference_mode`` (the loop's default) cannot be updated in place outside it, and
    generate and a later ``inference_mode=False`` call do so (hybrid layers' ``copy_``). Cost: one copy of
    each such tensor once per call, a tensor at a time (as much as one verify step's ``DynamicCache`` update,
    which concatenates every layer's K/V: 96 ms for 288 MiB, 36 layers x 2k tokens in bf16, on one CPU
    thread), only where the cache reaches the user (a passed cache, or ``return_dict_in_generate``); nothing
    is copied after a call run without inference mode. ``cache`` None: nothing to do.

    Source: issue 34 item 4 ("Inplace update to inference tensor outside InferenceMode is not allowed" when a
    hybrid target's cache returned by spec_generate was continued by generate)."""
    if cache is None:
        return
    context = getattr(cache, DRAFT_CONTEXT, None)
    holders = [cache, *getattr(cache, "layers", [])]
    if context is not None:
        holders += [context.draft_cache, *getattr(context.draft_cache, "layers", []), context.pending]
    with torch.inference_mode(False):
        for holder in holders:
            for name, value in list(vars(holder).items() if holder is not None else ()):
                setattr(holder, name, _ordinary(value))


__all__ = ["CACHE_FIELD", "CACHE_NAMES", "DRAFT_CONTEXT", "DraftContext", "Resume", "check_passed_cache",
           "leave_inference_mode", "pop_passed_cache"]
