"""The target's cache for ``spec_generate``, including hybrid linear-attention targets with exact rollback.

Attention layers are cut back after a verify block like any KV cache. Linear-attention layers (Gated
DeltaNet in Qwen3.5 / Qwen3.6 / Qwen3-Next) cannot be cut: their convolution window and recurrent
state have already absorbed every token of the block, rejected drafts included, and cropping would
silently move the target off its own path (notes section 3). Method (the one the authors' MLX port
uses, notes section 7): during the verify forward each linear-attention mixer's states are
snapshotted and its input is recorded (forward pre-hooks shared by every call on the target while any
of them records, each recording into the cache its forward was given, so threads sharing a target
never record each other's forwards); after the
verify, every row whose block was not fully accepted gets its states back from the snapshot and
replays its own committed prefix through the linear-attention mixers only (no MLP, no attention, no
LM head). Rows are replayed in groups of equal committed length, never padded, because a padded
position would still decay the gated-delta state and shift the convolution window. The serving
engines instead keep one state per block position during verify; that needs a kernel that emits
per-position states, which transformers' layers did not expose before 5.25.

Replay, not transformers 5.25's recurrent-state history (``activate_past_recording(recurrent_states_to_keep=b)``
then ``crop``), measured (``bench/hybrid_rollback.py``, random fp32 Qwen3.5 of 31 M parameters, 6 of 8 layers
linear, committed 1..b cycled, 16 steps, one CPU thread, PyTorch fallback kernels, transformers 5.25.0, load
average 3.8-4.3 on 2 shared cores), per target step at batch 1: block 16, replay 79.2 ms (verify 54.6 + rollback
24.6) against history 79.9 ms (verify 79.5: the block's tokens run one by one through the recurrent rule instead
of the chunked kernel, + rollback 0.3), and 0.88x in a second run; block 8, history 0.62x the replay; block 4,
0.98x; states equal to 1.7e-8. The history is as fast or faster at batch 1 on this CPU, and the replay stays:
it is the one path for 5.24 and 5.25 (both tested and admitted), it keeps a committed count per row where the
history's ``crop`` keeps one per cache (a ragged batch would need per-row picks from ``recurrent_states_history``
and the recorded conv window, private attributes new in 5.25, the kind of internals whose change broke this
module: issue 48), it costs nothing when a row accepts its whole block, and on a GPU the history's b one-token
recurrent steps per layer against one chunked call are unmeasured. A batch-1 history path on >= 5.25 is the
follow-up where a GPU measurement shows it pays.

Everything here uses transformers' public cache (``DynamicCache(config=...)``); the few reads and
writes of a linear-attention cache layer's state dictionaries are isolated in ``_states`` /
``_set_states`` / ``_is_linear`` and checked by ``check_target_cache`` before any forward.
"""

import contextlib
import inspect
import threading
import weakref

import torch
import transformers
from transformers import DynamicCache

try:
    from .tested_versions import warn_if_untested
except ImportError:  # imported from the repository root instead of as a Hub remote-code package
    from tested_versions import warn_if_untested

LINEAR = "linear_attention"
_ATTENTION = ("full_attention", "sliding_attention")
# model_type of the text config -> the families whose rollback is implemented and tested.
# Qwen3.6 checkpoints are published with the Qwen3.5 types (qwen3_5 dense, qwen3_5_moe MoE).
HYBRID_FAMILIES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next")


def linear_layer_ids(target) -> list:
    """Indices of the target's linear-attention decoder layers (``layer_types``), ``[]`` for attention-only."""
    layer_types = getattr(target.config.get_text_config(), "layer_types", None) or []
    return [i for i, t in enumerate(layer_types) if t == LINEAR]


def _mixers(target) -> dict:
    """``{layer index: linear-attention mixer module}``; every mixer must say it is that layer."""
    decoder = target.get_decoder() if hasattr(target, "get_decoder") else target.model
    mixers = {}
    for i in linear_layer_ids(target):
        mixer = getattr(decoder.layers[i], "linear_attn", None)
        if mixer is None or getattr(mixer, "layer_idx", None) != i:
            raise NotImplementedError(
                f"target layer {i} is '{LINEAR}' but has no `linear_attn` mixer with layer_idx={i} "
                f"(got {type(mixer).__name__}); spec_generate cannot roll its state back"
            )
        mixers[i] = mixer
    return mixers


def _is_linear(layer) -> bool:
    """A transformers >= 5 linear-attention cache layer: conv and recurrent states, no K/V."""
    return hasattr(layer, "conv_states") and hasattr(layer, "recurrent_states") and not hasattr(layer, "keys")


def _states(layer):
    """``(conv (B, conv_dim, kernel), recurrent (B, heads, k_dim, v_dim))`` of one linear cache layer."""
    return layer.conv_states[0], layer.recurrent_states[0]


def _set_states(layer, conv, recurrent):
    layer.conv_states[0], layer.recurrent_states[0] = conv, recurrent


def _token_count(layer):
    """A linear cache layer's token counter, or None where there is none (transformers < 5.25).

    transformers 5.25 counts the tokens a linear-attention layer has absorbed in ``cumulative_length_linear``
    (a 0-dim LongTensor, moved in place by ``update_conv_state`` and by its own ``crop``), and reads it as the
    cache's length: ``Cache.get_seq_length()`` asks layer 0, a linear layer in every published hybrid stack,
    and ``generate``'s ``_prefill``, the model's default positions and Qwen3.5's mRoPE offsets take that
    length. ``HybridCache`` moves it as the attention layers move (``crop``) and leaves it where it was
    across a replay (``_restore_layer``)."""
    return getattr(layer, "cumulative_length_linear", None)


def check_target_cache(target):
    """Refuse, before any forward, a target whose cache ``spec_generate`` cannot roll back exactly.

    Attention-only targets pass. Hybrid targets pass when their family is in ``HYBRID_FAMILIES`` and
    the installed transformers keeps linear-attention state in its ``DynamicCache`` (5.x). Qwen3-Next
    on transformers 4.57 does not: its own ``Qwen3NextDynamicCache`` restarts the gated-delta state
    from zero in every multi-token forward, so a verify block is wrong from its first token and only
    one-token verification (no speed-up) would be exact; it is refused with the version named.

    Raises:
        NotImplementedError: layer types other than attention / ``linear_attention``, a hybrid family
            not listed, a transformers version whose cache has no linear-attention layers.
    """
    text = target.config.get_text_config()
    layer_types = getattr(text, "layer_types", None) or []
    odd = sorted({t for t in layer_types if t not in _ATTENTION + (LINEAR,)})
    if odd:
        raise NotImplementedError(
            f"target layer types {odd} ({text.model_type}) keep state that spec_generate cannot roll back after a "
            f"rejected draft; supported: attention layers and the '{LINEAR}' layers of {', '.join(HYBRID_FAMILIES)}"
        )
    linear = linear_layer_ids(target)
    if not linear:
        return
    if text.model_type not in HYBRID_FAMILIES:
        raise NotImplementedError(
            f"hybrid target model_type '{text.model_type}': exact rollback of its '{LINEAR}' state is implemented and "
            f"tested for {', '.join(HYBRID_FAMILIES)} only"
        )
    probe = DynamicCache(config=target.config)
    if len(probe.layers) <= max(linear) or not all(_is_linear(probe.layers[i]) for i in linear):
        raise NotImplementedError(
            f"transformers {transformers.__version__} cannot run a '{text.model_type}' target exactly with "
            "spec_generate: its linear-attention layers restart their state from zero in multi-token forwards "
            "(only one-token verification, with no speed-up, would be exact). transformers >= 5.24 serves it."
        )
    _mixers(target)


def new_target_cache(target):
    """An empty cache for ``target``: ``DynamicCache()``, or a [`HybridCache`] for linear-attention targets."""
    return HybridCache(target) if linear_layer_ids(target) else DynamicCache()


class HybridCache(DynamicCache):
    """A ``DynamicCache`` built from the target's config (linear-attention layers included) that
    ``spec_generate`` can roll back exactly (module docstring).

    ``crop(-n)`` cuts the attention layers only; ``restore_linear_states(committed)`` then puts every
    linear-attention layer at the state after exactly the committed tokens of each row.
    ``batch_select_indices`` also selects rows of the linear states. The snapshots and recorded
    inputs live on this object (per call, never on the target's modules), for one verify forward at a time.
    """

    def __init__(self, target):
        warn_if_untested("hybrid cache")
        super().__init__(config=target.config)
        self._mixers = _mixers(target)
        self._snapshots, self._inputs, self._recording = {}, {}, False
        params = inspect.signature(next(iter(self._mixers.values())).forward).parameters
        self._cache_kw = "cache" if "cache" in params else "cache_params"

    def crop(self, tokens_to_remove: int) -> None:
        """Cut ``-tokens_to_remove`` tokens off the attention layers (negative counts, as 5.x's ``crop``).

        The linear layers' states are left for ``restore_linear_states``; only their token counter
        (``_token_count``, transformers >= 5.25) follows the attention layers, so that the cache's length stays
        the same whichever layer is asked (it drifted by every rejected draft: issue 48)."""
        for layer in self.layers:
            if not _is_linear(layer):
                layer.crop(tokens_to_remove)
            elif _token_count(layer) is not None:
                _token_count(layer).sub_(abs(tokens_to_remove))

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens held by layer ``layer_idx``, a Python int; a linear layer answers with the first attention
        layer's length (as transformers 5.24's ``Cache`` does; 5.25's returns the linear layer's own counter,
        a 0-dim tensor that later forwards move in place, so a length kept from it changes under the holder)."""
        if layer_idx < len(self.layers) and _is_linear(self.layers[layer_idx]):
            layer_idx = next((i for i, layer in enumerate(self.layers) if not _is_linear(layer)), layer_idx)
        return int(super().get_seq_length(layer_idx))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        for layer in self.layers:
            if _is_linear(layer):
                _set_states(layer, *(s[indices] for s in _states(layer)))
            else:
                layer.batch_select_indices(indices)

    @contextlib.contextmanager
    def recording(self):
        """Inside: every linear mixer snapshots its layer's states and records its input ``(B, b, hidden)``,
        for forwards that run on THIS cache only (``_record_mixer_input``): other calls on the same
        target, in other threads, pass their own cache and are never recorded here."""
        self._snapshots, self._inputs = {}, {}
        with _mixer_hooks(self._mixers):
            self._recording = True
            try:
                yield
            finally:
                self._recording = False

    def _record(self, i: int, module, args, kwargs) -> None:
        """Pre-forward of mixer ``i`` on this cache: snapshot its states, keep its input."""
        assert module is self._mixers.get(i), f"mixer of layer {module.layer_idx} is not this cache's layer {i}"
        conv, recurrent = _states(self.layers[i])
        self._snapshots[i] = (conv.clone(), recurrent.clone())
        self._inputs[i] = args[0] if args else kwargs["hidden_states"]

    def restore_linear_states(self, committed: torch.Tensor) -> None:
        """Put each linear layer at the state after the first ``committed[r]`` tokens of row ``r``'s block.

        Args:
            committed: ``(B,)`` LongTensor in ``[1, b]``, tokens of the last verify block each row keeps.
                Rows with ``committed == b`` keep the verify's own states; the others are restored from
                the snapshot and replay their prefix, one mixer call per layer and distinct length.
        Raises:
            AssertionError: a linear layer has no snapshot / recorded input from this verify, or they do
                not match its current states (a snapshot that is not its layer's).
        """
        assert set(self._snapshots) == set(self._mixers) == set(self._inputs), (
            f"linear layers {sorted(self._mixers)} but snapshots of {sorted(self._snapshots)}")
        for i in self._mixers:
            _restore_layer(self, i, committed)
        self._snapshots, self._inputs = {}, {}


_HOOKS_LOCK = threading.Lock()
_HOOKS = weakref.WeakKeyDictionary()  # first mixer of a target -> [open recordings, hook handles]


def _record_mixer_input(module, args, kwargs=None):
    """Forward pre-hook shared by every call on one target: records into the cache the forward runs on,
    when that cache is a ``HybridCache`` inside ``recording()``; any other forward passes untouched.
    ``kwargs`` may be missing when another thread removes the hook while this forward starts."""
    kwargs = kwargs or {}
    cache = kwargs.get("cache", kwargs.get("cache_params"))
    if isinstance(cache, HybridCache) and cache._recording:
        cache._record(module.layer_idx, module, args, kwargs)


@contextlib.contextmanager
def _mixer_hooks(mixers: dict):
    """Hooks on ``mixers`` while at least one recording on them is open (counted under a lock, as
    ``target_taps`` shares its hooks): a hook is never added or removed for one call while another
    call's recording is open, so concurrent calls on one target neither miss nor cross records."""
    key = next(iter(mixers.values()))
    with _HOOKS_LOCK:
        entry = _HOOKS.get(key)
        if entry is None:
            handles = [m.register_forward_pre_hook(_record_mixer_input, with_kwargs=True) for m in mixers.values()]
            entry = _HOOKS[key] = [0, handles]
        entry[0] += 1
    try:
        yield
    finally:
        with _HOOKS_LOCK:
            entry[0] -= 1
            if entry[0] == 0:
                for h in entry[1]:
                    h.remove()
                _HOOKS.pop(key, None)


def _replay_groups(committed: torch.Tensor, width: int) -> list:
    """``[(rows (R,), length)]``: rows that kept fewer than ``width`` tokens, grouped by that count.

    Never pad rows to a common length: a padded position still decays the gated-delta state and
    shifts the convolution window, even with a zero input."""
    return [((committed == c).nonzero()[:, 0], c) for c in sorted(set(committed.tolist()) - {width})]


def _restore_layer(cache: "HybridCache", i: int, committed: torch.Tensor) -> None:
    """Linear layer ``i``: snapshot rows + replay of their committed prefix; other rows keep the verify's states."""
    layer, mixer, inputs = cache.layers[i], cache._mixers[i], cache._inputs[i]  # inputs (B, b, hidden)
    conv_now, recurrent_now = _states(layer)
    snap_conv, snap_recurrent = cache._snapshots[i]
    assert snap_conv.shape == conv_now.shape and snap_recurrent.shape == recurrent_now.shape, f"layer {i}"
    assert inputs.shape[0] == committed.shape[0], (i, tuple(inputs.shape), tuple(committed.shape))
    count = _token_count(layer)
    counted = None if count is None else count.clone()  # the replay re-counts tokens the cache already holds
    for rows, length in _replay_groups(committed, inputs.shape[1]):
        _set_states(layer, snap_conv[rows].clone(), snap_recurrent[rows].clone())
        mixer(hidden_states=inputs[rows, :length], **{cache._cache_kw: cache})  # updates the states in place
        conv_rows, recurrent_rows = _states(layer)
        conv_now[rows], recurrent_now[rows] = conv_rows.to(conv_now.dtype), recurrent_rows.to(recurrent_now.dtype)
    _set_states(layer, conv_now, recurrent_now)
    if counted is not None:
        count.copy_(counted)


def recording(cache):
    """Context for one verify forward: records what ``HybridCache.restore_linear_states`` needs; else nothing."""
    return cache.recording() if isinstance(cache, HybridCache) else contextlib.nullcontext()


def restore_linear_states(cache, committed: torch.Tensor) -> None:
    """After the attention layers were cut back: exact linear-attention states per row (no-op for other caches)."""
    if isinstance(cache, HybridCache):
        cache.restore_linear_states(committed)


__all__ = ["check_target_cache", "new_target_cache", "HybridCache", "recording", "restore_linear_states",
           "linear_layer_ids", "HYBRID_FAMILIES"]
