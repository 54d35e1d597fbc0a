"""Static-cache decode loop for ``spec_generate(..., cache_implementation="static")``: fixed shapes, so the
draft forward and the verify forward can be compiled once (CUDA graphs with ``mode="reduce-overhead"``).

What stays fixed from step to step (the reason this path exists; notes section 1 for the step itself):

* the target cache is a transformers ``StaticCache`` of ``prompt + max_new_tokens + block_size`` slots;
  every verify writes a block of exactly ``block_size`` tokens at explicit positions, and rejected
  drafts are rolled back by LENGTH (the next block overwrites them; the causal mask, built from the
  positions, hides the stale slots meanwhile), never by cropping tensors;
* the draft context lives in [`StaticDraftContext`], a preallocated K/V buffer with a length counter;
  every draft pass takes exactly ``block_size`` new context features (the verify block's features,
  of which the first ``committed`` are real) plus the block, and a key-validity mask hides the rest;
* target features are taps from the verify forward's own outputs (``output_hidden_states``), so no
  hook runs inside a compiled region (the eager prefill uses the hooks of ``capture_target_features``).

Scope: batch 1 without padding, attention-only targets without sliding-window layers, sdpa or eager
attention; ``spec_generate`` sends anything else to the dynamic loop with one info log. Greedy output
equals the dynamic path token for token; sampling uses the same processors and ``speculative_verify``
(prefix-dependent processors, custom stopping criteria and ``output_scores``/``output_logits`` stay on
the dynamic loop). The last verify step is not shortened to the remaining budget (the shape stays
fixed): it verifies a full block and the tokens past ``max_new_tokens`` are cut as always.
"""

import contextlib
import functools
import threading
import weakref
from types import SimpleNamespace

import torch
from transformers import StaticCache
from transformers.utils import logging

try:
    from .decode_step import _commit, _prefill_commit, _sync
    from .proposers import Proposal, choose_tokens
    from .target_facts import TargetFacts
    from .target_families import draft_block_embedding, draft_logits, sliding_target
    from .target_taps import capture_target_features, forward_lock, hidden_states_request, run_target
    from .target_taps import warm_output_capture
except ImportError:  # imported from the repository root instead of as a Hub remote-code package
    from decode_step import _commit, _prefill_commit, _sync
    from proposers import Proposal, choose_tokens
    from target_facts import TargetFacts
    from target_families import draft_block_embedding, draft_logits, sliding_target
    from target_taps import capture_target_features, forward_lock, hidden_states_request, run_target
    from target_taps import warm_output_capture

logger = logging.get_logger(__name__)

_STATIC_ATTENTION = ("sdpa", "eager")


def static_unsupported_reason(target, input_ids, prompt_mask):
    """Why the static path cannot run this call (a sentence), or None when it can.

    The static path assumes one row with no padding (the cache has no holes) and a target whose every
    layer is full attention (a ``StaticCache`` of sliding layers wraps around; linear-attention layers
    keep state that a length rollback cannot undo)."""
    if input_ids.shape[0] != 1 or not bool(prompt_mask.all()):
        return f"it supports batch size 1 without padding (got batch {input_ids.shape[0]})"
    cfg = target.config.get_text_config()
    other = sorted({t for t in (getattr(cfg, "layer_types", None) or []) if t != "full_attention"})
    if other or sliding_target(target):
        return f"it supports full-attention targets only (target layer types {other or ['sliding_attention']})"
    impl = getattr(target.config, "_attn_implementation", None)
    if impl not in _STATIC_ATTENTION:
        return f"it supports attn_implementation in {_STATIC_ATTENTION} (target uses {impl!r})"
    return None


class StaticDraftContext:
    """Preallocated draft context K/V: ``(1, kv_heads, capacity, head_dim)`` per draft layer.

    Behaves like a transformers ``Cache`` for the draft forward (``update`` / ``get_seq_length``), with
    fixed shapes: ``update`` writes the incoming ``n`` keys at slots ``length .. length + n - 1`` and
    returns the WHOLE buffer; the caller's key-validity mask decides which slots are real. ``length``
    (a 0-d long tensor, the number of committed context positions) only moves when the caller sets it
    (``set_length``): rolling back is setting a smaller length, nothing is copied or freed. Buffers are
    allocated on the first ``update`` (shape, dtype and device of the draft's keys), which runs eagerly.
    """

    def __init__(self, num_layers: int, capacity: int, device):
        self.capacity = capacity
        self.length = torch.zeros((), dtype=torch.long, device=device)
        self.keys, self.values = [None] * num_layers, [None] * num_layers
        _mark_static(self.length)

    def update(self, key_states, value_states, layer_idx: int, cache_kwargs=None):
        """Write ``(1, h, n, d)`` keys/values at ``length + arange(n)``; return the full buffers ``(1, h, capacity, d)``."""
        if self.keys[layer_idx] is None:
            shape = (*key_states.shape[:2], self.capacity, key_states.shape[-1])
            self.keys[layer_idx] = key_states.new_zeros(shape)
            self.values[layer_idx] = value_states.new_zeros(shape[:3] + value_states.shape[-1:])
            _mark_static(self.keys[layer_idx], self.values[layer_idx])
        slots = self.length + torch.arange(key_states.shape[2], device=key_states.device)
        self.keys[layer_idx].index_copy_(2, slots, key_states)
        self.values[layer_idx].index_copy_(2, slots, value_states)
        return self.keys[layer_idx], self.values[layer_idx]

    def get_seq_length(self, layer_idx: int = 0):
        """Committed context length, a 0-d tensor (a Python int would be baked into a compiled graph)."""
        return self.length

    def set_length(self, length) -> None:
        """Roll forward/back to ``length`` committed context positions (int or 0-d tensor), in place."""
        self.length.copy_(torch.as_tensor(length, dtype=torch.long))

    def reset(self) -> None:
        """Empty, keeping the allocation (and the addresses a compiled graph read): zeros, length 0."""
        for buffer in self.keys + self.values:
            if buffer is not None:
                buffer.zero_()
        self.length.zero_()


def _mark_static(*tensors):
    """Tell dynamo these tensors keep their address (CUDA graphs then read them in place, no copy)."""
    mark = getattr(getattr(torch, "_dynamo", None), "mark_static_address", None)
    if mark is not None:
        for t in tensors:
            mark(t)


# ----------------------------------------------------------------------------- the two compiled forwards


def _draft_forward(draft, embed, head, anchor, features, n_ctx, cache, block_size: int, mask_token_id: int,
                   draft_window=None):
    """One draft pass over ``[anchor, MASK x (block_size-1)]`` with a fixed-shape context.

    Args:
        anchor: ``(1, 1)`` last committed token, at position ``start = cache.length + n_ctx``.
        features: ``(1, P, F)`` target features of positions ``cache.length ..``; only the first
            ``n_ctx`` (0-d long tensor) are real, the rest is padding that the mask hides.
        cache: [`StaticDraftContext`]; gets the P context entries and the block written after
            ``cache.length`` (the caller then sets its length to ``start``, dropping the block).
        draft_window: ``spec_generate``'s (None: the whole context); a Python int, fixed per call (a
            compiled graph specialises on it).

    Returns ``(1, block_size - 1, V)`` draft logits for slots 1..block_size-1.
    """
    past, device = cache.length, anchor.device
    n_pad = features.shape[1]
    noise = torch.cat([anchor, anchor.new_full((1, block_size - 1), mask_token_id)], dim=1)  # (1, b)
    start = past + n_ctx
    positions = torch.cat([past + torch.arange(n_pad, device=device), start + torch.arange(block_size, device=device)])
    slots = torch.arange(cache.capacity, device=device)
    block_from = past + n_pad
    key_valid = (slots < start) | ((slots >= block_from) & (slots < block_from + block_size))  # (capacity,)
    hidden = draft(position_ids=positions[None], noise_embedding=draft_block_embedding(draft.config, embed, noise),
                   target_hidden=features, past_key_values=cache, use_cache=True, attention_mask=key_valid[None],
                   **({} if draft_window is None else {"draft_window": draft_window}))
    return draft_logits(draft.config, head, hidden[:, 1:])


def _verify_forward(target, cache, tokens, positions, layer_ids: tuple, cache_kw: str, pass_cache_position: bool,
                    feature_device=None):
    """Target logits ``(1, n, V)`` and features ``(1, n, len(layer_ids) * H)`` for ``tokens`` ``(1, n)``
    at ``positions`` ``(1, n)``, writing their K/V into the ``StaticCache`` at those positions.

    Features are ``hidden_states[k + 1]`` of the forward's outputs (layer ``k``'s output; the last
    layer's is post-norm, the convention of ``capture_target_features``), each moved to
    ``feature_device`` (the draft's) before concatenation: a target split over devices gives states
    on several devices."""
    extra = {"cache_position": positions[0]} if pass_cache_position else {}
    out = target(input_ids=tokens, position_ids=positions, use_cache=True,
                 output_hidden_states=hidden_states_request(layer_ids), **extra, **{cache_kw: cache})
    return out.logits, torch.cat([out.hidden_states[k + 1].to(feature_device) for k in layer_ids], dim=-1)


def _prefill(target, cache, input_ids, layer_ids: tuple, cache_kw: str, pass_cache_position: bool, feature_device=None,
             prefill=None):
    """Eager prompt pass: last-position logits ``(1, 1 or P, V)`` and features ``(1, P, len(layer_ids) * H)``.

    Features come from hooks on the chosen layers only (``capture_target_features``): asking the
    forward for ``output_hidden_states`` would hold every layer's states of the whole prompt. Each tap is
    moved to ``feature_device`` (the draft's) before concatenation. ``prefill``: the prefill's extra keywords
    (``TargetFacts.prefill``: ``logits_to_keep=1`` where the target takes it)."""
    positions = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
    extra = dict(prefill or {})
    if pass_cache_position:
        extra["cache_position"] = positions[0]
    with capture_target_features(target, layer_ids, feature_device) as features:
        logits = run_target(target, input_ids=input_ids, position_ids=positions, use_cache=True, **extra,
                            **{cache_kw: cache}).logits
        return logits, features()


def _rollback_target(cache, pass_cache_position: bool, written: int, keep: int) -> None:
    """Roll the target ``StaticCache`` back from ``written`` to ``keep`` slots, by length only.

    transformers 4.57 writes each block at the ``cache_position`` it is given and keeps no counter:
    nothing to do. transformers 5.x writes at its own counter (``cumulative_length``), which the
    public ``crop(-n)`` moves back without touching the tensors."""
    if not pass_cache_position and written > keep:
        cache.crop(keep - written)


# Logged once per static call on a CPU target (figures: docs/speed.md "Static cache and torch.compile",
# bench/static_cpu.py).
CPU_NOTE = ("cache_implementation='static' on CPU is not faster than spec_generate's dynamic loop: on the shipped "
            "pair (1 thread, greedy, time.thread_time) the static loop ran at 0.88x-0.94x of the dynamic loop's "
            "speed, and at 0.70x with compile_config (inductor); it is meant for CUDA with compile_config "
            "(fixed shapes, CUDA graphs). Leave cache_implementation unset on CPU (docs/speed.md: Static cache).")

_COMPILED = {}
CAPACITY_BUCKET = 256


def _bucket(length: int) -> int:
    """Cache capacity rounded up to a multiple of ``CAPACITY_BUCKET`` slots, so that calls with other
    prompt lengths or budgets reuse the compiled graphs (their shapes include the capacity)."""
    return -(-length // CAPACITY_BUCKET) * CAPACITY_BUCKET


def compiled(fn, compile_config):
    """``fn`` compiled with a transformers ``CompileConfig`` (None -> ``fn`` itself), built once per
    (function, settings) so later calls reuse dynamo's cache. ``mode``/``options`` go to inductor only."""
    if compile_config is None:
        return fn
    backend = compile_config.backend
    key = (fn.__name__, backend, compile_config.mode, compile_config.fullgraph, compile_config.dynamic,
           repr(compile_config.options))
    if key not in _COMPILED:
        kwargs = dict(backend=backend, fullgraph=compile_config.fullgraph, dynamic=compile_config.dynamic)
        if backend == "inductor":
            if compile_config.options:
                kwargs["options"] = compile_config.options
            else:
                kwargs["mode"] = compile_config.mode
        _COMPILED[key] = torch.compile(fn, **kwargs)
    return _COMPILED[key]


class _CallCaches:
    """The two caches of one static call: a transformers ``StaticCache`` of ``target_capacity`` slots and a
    [`StaticDraftContext`] of ``draft_capacity``, for targets/drafts of ``key`` (their dtypes, devices and
    the draft's ``draft_context_shape``). ``busy`` while a call uses them."""

    def __init__(self, target, key, target_capacity: int, draft_capacity: int, num_layers: int, device):
        self.key, self.target_capacity, self.draft_capacity = key, target_capacity, draft_capacity
        self.target_cache = StaticCache(config=target.config, max_cache_len=target_capacity)
        self.draft_cache = StaticDraftContext(num_layers, draft_capacity, device)
        self.busy = False


# target -> threading.local whose `.caches` is that thread's _CallCaches. Weak on the target: the caches go
# with the model (as generate's own static cache lives on the model), and with the thread (threading.local);
# two threads never share one. Nothing is kept on the drafter.
_CALL_CACHES = weakref.WeakKeyDictionary()
_CALL_CACHES_LOCK = threading.Lock()


def draft_context_shape(draft) -> tuple:
    """What fixes a [`StaticDraftContext`]'s buffers for ``draft``, besides the capacity: per draft layer
    ``(kv_heads, head_dim, dtype, device)`` of its keys (``k_proj``'s weight; values have the same), so
    ``len(result)`` is the layer count.

    Source: issue 34 item 6. The kept caches were keyed by the layer count only, so a second drafter
    with other ``num_key_value_heads`` or ``head_dim`` on the same target and thread got the first one's
    buffers: ``index_copy_(): Source/destination tensor must have same slice shapes``."""
    return tuple((layer.self_attn.k_proj.out_features // layer.self_attn.head_dim, layer.self_attn.head_dim,
                  str(layer.self_attn.k_proj.weight.dtype), str(layer.self_attn.k_proj.weight.device))
                 for layer in draft.layers)


@contextlib.contextmanager
def call_caches(target, draft, target_len: int, draft_len: int, device):
    """``(target StaticCache, StaticDraftContext)`` for one call of at most ``target_len`` target slots and
    ``draft_len`` draft slots: this thread's caches for ``target`` when they are large enough and fit the
    models, emptied (``reset``: zeros, counters at 0), else new ones (bucketed capacities, ``_bucket``),
    kept for the next call.

    Why: a compiled forward's graph depends on the caches' shapes and reads their tensors at fixed
    addresses (``mark_static_address``); fresh caches at every call (or per prompt length) made dynamo
    compile again. The allocation is reused, never the contents. A call made while this thread's caches
    are in use (re-entrant, e.g. from a streamer) gets private ones. "Fit the models": the same target
    dtype and device, draft input dtype, call device and [`draft_context_shape`] (another drafter of other
    attention shapes, dtype or device gets new caches, which are then kept)."""
    key = (str(target.dtype), str(target.device), str(draft.fc.weight.dtype), str(device), draft_context_shape(draft))
    with _CALL_CACHES_LOCK:
        local = _CALL_CACHES.get(target)
        if local is None:
            local = _CALL_CACHES[target] = threading.local()
    kept = getattr(local, "caches", None)
    if kept is not None and not kept.busy and kept.key == key and kept.target_capacity >= target_len \
            and kept.draft_capacity >= draft_len:
        kept.target_cache.reset()
        kept.draft_cache.reset()
        caches = kept
    else:
        grow = kept is not None and kept.key == key
        caches = _CallCaches(target, key, _bucket(max(target_len, kept.target_capacity if grow else 0)),
                             _bucket(max(draft_len, kept.draft_capacity if grow else 0)),
                             draft.config.num_hidden_layers, device)
        if kept is None or not kept.busy:
            local.caches = caches
    caches.busy = True
    try:
        yield caches.target_cache, caches.draft_cache
    finally:
        caches.busy = False


def _draft_logits(draft_fn, draft, embed, head, anchor, features, n_ctx, cache, block_size, mask_token_id):
    """Draft logits ``(1, block_size - 1, V)`` from ``draft_fn`` (compiled or not); then the draft context
    holds every position before the anchor. Tests replace this to script the acceptance."""
    logits = draft_fn(draft, embed, head, anchor, features, n_ctx, cache, block_size, mask_token_id)
    cache.set_length(cache.length + n_ctx)
    return logits


def _step_marker(compile_config, device):
    """``torch.compiler.cudagraph_mark_step_begin`` for CUDA graphs (outputs of one step are not kept)."""
    mark = getattr(getattr(torch, "compiler", None), "cudagraph_mark_step_begin", None)
    use = compile_config is not None and device.type == "cuda" and mark is not None
    return mark if use else (lambda: None)


def static_decode(draft, target, input_ids, block_size, mask_token_id, sampling, output_timings, run,
                  compile_config=None, draft_window=None, facts=None):
    """The static-shape speculative loop (batch 1); fills ``run`` like the dynamic ``_decode``.

    Prefill and the first draft pass (whose context is the whole prompt) run eagerly; every later draft
    and verify forward has the same shapes and goes through the compiled functions. The caches are this
    thread's for ``target`` (``call_caches``), emptied first; ``draft_window``: see ``spec_generate``;
    ``facts``: the call's ``target_facts.TargetFacts`` (read here when not given)."""
    facts = facts if facts is not None else TargetFacts.read(target, draft)
    if input_ids.device.type == "cpu":
        logger.warning(CPU_NOTE)
    budget = run.stops.budget
    prompt_len, b = input_ids.shape[1], block_size
    with call_caches(target, draft, prompt_len + budget + b, prompt_len + budget + 2 * b, input_ids.device) as caches:
        _static_steps(draft, target, input_ids, b, mask_token_id, sampling, output_timings, run, compile_config,
                      draft_window, facts, *caches)


def _static_steps(draft, target, input_ids, b, mask_token_id, sampling, output_timings, run, compile_config,
                  draft_window, facts, target_cache, draft_cache):
    """``static_decode``'s loop over the given (emptied) caches."""
    device, prompt_len, out = input_ids.device, input_ids.shape[1], run.out
    embed, head, cache_kw = facts.embed, facts.head, facts.cache_kw
    pass_cache_position = "cache_position" in facts.forward_params
    layer_ids = tuple(draft.config.target_layer_ids)
    verify, draft_fn = compiled(_verify_forward, compile_config), compiled(_draft_forward, compile_config)
    if draft_window is not None:  # a Python constant of every draft call (one graph per window size)
        draft_fn = functools.partial(draft_fn, draft_window=draft_window)
    mark_step = _step_marker(compile_config, device)
    if compile_config is not None:  # a cold target would set up its hidden-state outputs inside the graph
        warm_output_capture(target, layer_ids)
    t0 = _sync(device) if output_timings else None

    feature_device = facts.draft_device  # taps go to the draft's device
    logits, features = _prefill(target, target_cache, input_ids, layer_ids, cache_kw, pass_cache_position,
                                feature_device, facts.prefill)
    first, scores = sampling.first(logits[:, -1], input_ids)
    out.num_target_forwards, out.num_draft_forwards = 1, 0
    done = bool(_prefill_commit(run, first, scores, logits[:, -1])[0])
    t1 = _sync(device) if output_timings else None
    rows = SimpleNamespace(ids=torch.zeros(1, dtype=torch.long, device=device),
                           n_new=torch.ones(1, dtype=torch.long, device=device), host_ids=[0], host_new=[1])
    anchor, start, n_ctx = first[:, None], prompt_len, torch.tensor(prompt_len, device=device)
    # the first pass has the prompt's length; later ones are fixed-shape
    draft_step = functools.partial(_draft_forward, draft_window=draft_window)

    while not done:
        mark_step()
        block, q, probs = anchor, None, anchor.new_zeros(1, 0, dtype=torch.float32)
        if b > 1:
            logits = _draft_logits(draft_step, draft, embed, head, anchor, features, n_ctx, draft_cache, b,
                                   mask_token_id)
            drafts, q, probs = choose_tokens(sampling, logits, rows)  # DFlash 1's choice (proposers.py)
            block = torch.cat([anchor, drafts.to(device)], dim=1)  # (1, b)
            out.num_draft_forwards += 1
            draft_step = draft_fn
        positions = start + torch.arange(b, device=device)[None]
        proposal = Proposal(block[:, 1:], positions, probs, q)
        with forward_lock(target):  # outside the compiled function: dynamo cannot enter a lock
            logits, features = verify(target, target_cache, block, positions, layer_ids, cache_kw, pass_cache_position,
                                      feature_device)
        out.num_target_forwards += 1
        accepted, next_token, scores = sampling.verify(proposal, logits, rows)[:3]
        counts, finished = _commit(run, rows, accepted, block[:, 1:], next_token, scores, logits)  # the step's one host sync
        done = finished[0] or run.stops.timed_out()
        c = counts[0]  # anchor + accepted drafts enter the caches; next_token is the new anchor
        _rollback_target(target_cache, pass_cache_position, written=start + b, keep=start + c)
        n_ctx = accepted[0] + 1  # the first c of this block's features are new context for the next draft
        features = features.clone()  # a CUDA-graph output is reused memory once the next step begins
        anchor, start, rows.n_new = next_token[:, None], start + c, rows.n_new + c
        rows.host_new = [rows.host_new[0] + c]

    if output_timings:
        t2 = _sync(device)
        out["timings"] = {"prefill_s": t1 - t0, "decode_s": t2 - t1, "total_s": t2 - t0,
                          "new_tokens": sum(len(sum(chunk, [])) for chunk in run.chunks)}


def log_fallback(reason: str) -> None:
    logger.info(f"cache_implementation='static' falls back to the dynamic loop: {reason}")


__all__ = ["StaticDraftContext", "static_decode", "static_unsupported_reason", "compiled", "call_caches"]
