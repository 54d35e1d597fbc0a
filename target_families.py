"""What ``spec_generate`` needs to know about a target family, found through public accessors.

One place for every family rule (notes sections 3 and 7):

* the decoder layers and final norm (``get_decoder()``), for the taps; families whose layers do not
  return ``(B, T, H)`` states (Gemma-3n's AltUp stacks) are refused by name;
* every tap checked to be ``(B, T, H)`` with the T of the forward that produced it;
* prefill arguments (Gemma 4 with KV-shared layers must not get ``logits_to_keep``: it then runs its
  KV-shared layers on the last position only and the taps lose their length);
* sliding windows in every config spelling, and exact 4-D attention masks that count the window in
  TRUE positions, so ragged batches with cache holes keep each row's window;
* RoPE whose frequencies depend on the longest position of a forward (``dynamic``, ``longrope``):
  ``dynamic`` refused before any forward once a verify block could reach the switch; ``longrope``
  on Phi-3-style targets followed across it as their generate does (blocks clamped below the
  switch, one re-prefill at it), batch 1 only;
* vision-language targets: their multimodal inputs for the prefill and, per call and per row, the
  positions the target gives every later token (Qwen M-RoPE deltas; plain for Gemma 3/4);
* the execution device of an accelerate-offloaded target, and taps moved to the draft's device.
"""

import inspect
import sys

import torch
import transformers

SLIDING, FULL = "sliding_attention", "full_attention"
# Families whose decoder layers do not return (B, T, H) hidden states; name -> reason.
_REFUSED_FAMILIES = {
    "gemma3n": "Gemma-3n decoder layers return AltUp-stacked (altup_num_inputs, B, T, H) states and its "
               "reported hidden states are a projection of them, which a DFlash draft was never trained on",
    "gemma3n_text": "Gemma-3n decoder layers return AltUp-stacked (altup_num_inputs, B, T, H) states",
}
_POSITION_DEPENDENT_ROPE = ("dynamic", "longrope")
# Families whose generate drops its cache and re-prefills at the longrope switch (their own
# ``prepare_inputs_for_generation``), which spec_generate reproduces.
_REPREFILL_FAMILIES = ("phi3", "phimoe", "phi4_multimodal")


def text_config(target):
    """The text config of ``target`` (``get_text_config()`` on wrappers such as Gemma 4 / Qwen-VL)."""
    cfg = target.config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def check_family(target) -> None:
    """Raise NotImplementedError naming the family when its layers cannot be tapped exactly."""
    for cfg in (target.config, text_config(target)):
        kind = getattr(cfg, "model_type", None)
        if kind in _REFUSED_FAMILIES:
            raise NotImplementedError(f"target family {kind!r} is not supported by spec_generate: {_REFUSED_FAMILIES[kind]}")
    chunk = getattr(text_config(target), "attention_chunk_size", None)
    if chunk:
        raise NotImplementedError(
            f"target uses chunked attention (attention_chunk_size={chunk}, Llama-4 style); spec_generate does not "
            "build chunked masks")


def decoder_parts(target):
    """``(decoder layers, final norm)`` via the public ``get_decoder()`` (wrappers return their text model).

    Raises:
        ValueError: no ``layers`` / ``norm`` on the decoder.
    """
    decoder = target.get_decoder() if hasattr(target, "get_decoder") else getattr(target, "model", target)
    layers, norm = getattr(decoder, "layers", None), getattr(decoder, "norm", None)
    if layers is None or norm is None:
        raise ValueError(f"cannot find decoder `layers` and final `norm` on {type(target).__name__}.get_decoder()")
    return layers, norm


def check_tap(layer_id: int, state: torch.Tensor, batch: int, length: int) -> torch.Tensor:
    """Return ``state`` if it is ``(batch, length, H)``; else raise ValueError naming the layer and shapes.

    Catches families that slice or stack inside the decoder (Gemma 4 KV-shared layers under
    ``logits_to_keep``, Gemma-3n AltUp), which would otherwise fail later in ``torch.cat`` or, worse,
    broadcast silently.
    """
    if not torch.is_tensor(state) or state.dim() != 3 or tuple(state.shape[:2]) != (batch, length):
        shape = tuple(state.shape) if torch.is_tensor(state) else type(state).__name__
        raise ValueError(
            f"target layer {layer_id} returned hidden states of shape {shape}, expected ({batch}, {length}, hidden): "
            "this target family's layers cannot be tapped as DFlash expects")
    return state


def concat_taps(store: dict, layer_ids, device=None) -> torch.Tensor:
    """``(B, T, len(layer_ids) * H)``: the taps of ``store`` (layer id -> state, ``"shape"`` -> the
    forward's ``(B, T)``) checked with [`check_tap`], moved to ``device``, concatenated in order."""
    if "shape" not in store:
        raise RuntimeError("no target forward was tapped inside capture_target_features: on a compiled target "
                           "(taps read from the forward's hidden states) call it through target_taps.run_target")
    batch, length = store["shape"]
    taps = [check_tap(k, store[k], batch, length) for k in layer_ids]
    return torch.cat([t if device is None or t.device == device else t.to(device) for t in taps], dim=-1)


def prefill_kwargs(target, forward_params) -> dict:
    """``logits_to_keep=1`` where the forward takes it and it does not shorten any tap."""
    if "logits_to_keep" not in forward_params:
        return {}
    if getattr(text_config(target), "num_kv_shared_layers", 0):  # Gemma 4: slices its KV-shared layers too
        return {}
    return {"logits_to_keep": 1}


# ----------------------------------------------------------------------------- sliding windows


def layer_windows(target) -> dict:
    """``{layer_type: window or None}`` for the attention kinds of the target, in any config spelling.

    * ``layer_types`` with ``sliding_attention`` + ``sliding_window`` (Gemma 2/3/4, gpt-oss, Cohere2,
      Qwen2/Qwen3 with ``use_sliding_window`` on 5.x);
    * ``sliding_window`` alone (Mistral, Phi-3, Mixtral, Starcoder2: every layer slides);
    * ``use_sliding_window`` + ``max_window_layers`` (Qwen2 on 4.57, whose config also fills
      ``layer_types``); ``use_sliding_window=False`` switches the window off.
    Returns ``{}`` when no layer slides. Window convention: key visible iff ``q - k < window``
    (transformers' ``sliding_window_overlay``).
    """
    cfg = text_config(target)
    window = getattr(cfg, "sliding_window", None)
    if getattr(cfg, "use_sliding_window", True) is False or not window:
        return {}
    types = getattr(cfg, "layer_types", None)
    if types:
        return {t: (window if t == SLIDING else None) for t in set(types)} if SLIDING in types else {}
    return {None: int(window)}  # one mask for every layer


def sliding_target(target) -> bool:
    return bool(layer_windows(target))


def window_masks(windows: dict, q_pos, k_pos, key_valid, dtype, allowed=None):
    """Additive 4-D masks ``(B, 1, Q, K)`` counting causality and windows in TRUE positions.

    Args:
        windows: from [`layer_windows`]; key ``None`` means one mask for all layers.
        q_pos: ``(B, Q)`` positions of the queries; k_pos/key_valid: ``(B, K)`` positions and validity
            of every key (cache slots followed by the queries).
        dtype: the target's float dtype (0 = attend, dtype min = masked; never -inf, so a fully
            masked padding query stays finite).
        allowed: ``(B, Q, K)`` bool or None: keys each query may see besides causality and windows (a draft
            tree's ancestor visibility, ``draft_trees.TreeBatch.visible``, after the cache slots).

    Returns a tensor (``windows`` keyed by None) or ``{layer_type: tensor}`` (models with
    ``layer_types`` read such a dict as their precomputed mask mapping).
    """
    diff = q_pos[:, :, None] - k_pos[:, None, :]  # (B, Q, K)
    base = key_valid[:, None, :].bool() & (diff >= 0)
    if allowed is not None:
        base = base & allowed
    low = torch.finfo(dtype).min
    out = {}
    for kind, window in windows.items():
        visible = base if window is None else base & (diff < window)
        out[kind] = torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill(~visible, low)[:, None]
    return out[None] if None in out else out


def target_mask(windows, tokens_valid, positions, key_valid, known_masked: bool = False, *,
                dtype=torch.float32, flash: bool = False):
    """The ``attention_mask`` argument for a target forward over a cache with holes.

    Args:
        windows: [`layer_windows`] of the target ({} when nothing slides); dtype: of the 4-D masks (the
            target's); flash: the target runs flash-attention (``target_facts.TargetFacts`` reads both once).
        tokens_valid: ``(B, n)`` validity of the new tokens; positions ``(B, n)`` their true positions.
        key_valid: ``(B, cache_len)`` validity of the cached slots (committed slots in order).
        known_masked: the caller knows some slot is masked (host bookkeeping): the device check that
            returns None for an all-valid mask (a host synchronisation) is skipped.

    Returns None when every slot is valid (the model builds its own mask, as in ``generate``), the
    2-D ``(B, cache_len + n)`` validity mask for targets without windows, else [`window_masks`].
    """
    valid = torch.cat([key_valid, tokens_valid], dim=1)
    if not known_masked and bool(valid.all()):
        return None
    if not windows:
        return valid
    if flash:
        raise NotImplementedError(
            "a ragged batch on a sliding-window target needs explicit 4-D masks, which flash-attention does not "
            "take; load the target with attn_implementation='sdpa' or 'eager', or run the prompts one at a time")
    k_pos = valid.long().cumsum(1) - 1  # true position of every committed slot
    return window_masks(windows, positions, k_pos, valid, dtype)


# ----------------------------------------------------------------------------- RoPE


def _rope_entries(cfg):
    """Every RoPE parameter dict of the config (5.x ``rope_parameters``, per layer type or not; 4.x ``rope_scaling``)."""
    params = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        return list(params.items())
    return [(None, params)] if isinstance(params, dict) else []


def _rope_switches(cfg) -> list:
    """``[(rope_type, first_position)]`` for every position-dependent RoPE entry of the text config."""
    found = []
    for _, params in _rope_entries(cfg):
        kind = params.get("rope_type", params.get("type"))
        if kind == "dynamic":
            found.append((kind, int(cfg.max_position_embeddings)))
        elif kind == "longrope":
            limit = params.get("original_max_position_embeddings") or getattr(
                cfg, "original_max_position_embeddings", None) or cfg.max_position_embeddings
            found.append((kind, int(limit)))
    return found


def rope_switch(target):
    """``(rope_type, first_position)`` of the earliest position-dependent RoPE switch, or None.

    ``dynamic``: frequencies recomputed once ``max(position_ids) + 1 > max_position_embeddings``
    (``dynamic_rope_update``). ``longrope``: long factors once it exceeds
    ``original_max_position_embeddings``. ``first_position`` is the first position index whose
    forward uses the switched frequencies (the rule holds for the WHOLE forward: every position of
    a forward reaching it is computed with the switched frequencies).
    """
    found = _rope_switches(text_config(target))
    return min(found, key=lambda f: f[1]) if found else None


def _reprefills_at_switch(target, limit: int) -> bool:
    """Whether ``target.generate`` drops its cache and re-prefills at sequence length ``limit + 1``:
    Phi-3's ``prepare_inputs_for_generation`` (also PhiMoE, Phi-4-multimodal; 4.57 and 5.x alike)
    does so when ``input_ids`` first reach ``config.original_max_position_embeddings + 1``."""
    kinds = {getattr(target.config, "model_type", None), getattr(text_config(target), "model_type", None)}
    return bool(kinds & set(_REPREFILL_FAMILIES)) and getattr(
        text_config(target), "original_max_position_embeddings", None) == limit


def _stale_reprefill_mask(target, switch: int):
    """Why transformers 4.x's own Phi-3 re-prefill is not the model's forward here, or None.

    On 4.x, ``Phi3ForCausalLM.prepare_inputs_for_generation`` drops the cache but keeps the step's
    ``cache_position`` (``[switch]``), so a re-prefill forward that builds an explicit mask builds it
    for one query position: every earlier position then sees later tokens. sdpa skips the mask (and is
    exact) when no sliding window is at most the re-prefill length ``switch + 1``; eager always builds
    it; other kernels are not verified. 5.x passes no stale position: always exact.
    """
    if int(transformers.__version__.split(".")[0]) >= 5:
        return None
    impl = getattr(target.config, "_attn_implementation", None)
    window = getattr(text_config(target), "sliding_window", None)
    if impl != "sdpa":
        return f"attn_implementation={impl!r}"
    if window and window <= switch + 1:
        return f"sliding_window={window} <= {switch + 1}"
    return None


def check_rope(target, prompt_len: int, max_new_tokens: int, batch: int = 1, padded: bool = False):
    """Decide, before any forward, how a call meets a position-dependent RoPE switch.

    ``generate`` feeds one position per step, so a ``dynamic``/``longrope`` target computes each
    position with the frequencies of its own length; a verify block computes several positions with
    those of its LAST one. Below the switch both agree exactly. The highest position generate computes
    is ``prompt_len + max_new_tokens - 2`` with ``prompt_len`` the LONGEST row's true length (left
    padding does not count: positions are ``cumsum(attention_mask) - 1``), and the loops keep every
    verify forward at or below it for every row: the dynamic loop sizes blocks from the fastest row
    ([`verify_budget`]), the static loop, whose blocks are full, falls back to it when a block could
    reach the switch ([`static_rope_reason`]).

    * ``dynamic`` past the switch: refused (generate recomputes the frequencies at every new length,
      so every token past it would need its own target pass: no speculation left).
    * ``longrope`` on a family whose generate re-prefills at the switch (Phi-3, PhiMoE,
      Phi-4-multimodal), batch 1 without padding, prompt at most ``first_position`` tokens (on
      transformers 4.x also sdpa without a short window: [`_stale_reprefill_mask`]): returns
      ``first_position`` (``original_max_position_embeddings``); the loop then clamps verify blocks
      so none crosses it and re-prefills once at committed length ``first_position + 1``, as generate
      does ([`longrope_block_limit`]). A prompt already longer than the switch runs long factors
      throughout, as generate does: nothing to do.

    Args:
        prompt_len: the longest row's true prompt length (not the padded width); max_new_tokens: the
            token budget (``1 << 40`` when unbounded).
        batch: rows; padded: whether any prompt position is padding.

    Returns None (nothing to do) or the longrope switch ``original_max_position_embeddings`` (int).

    Raises:
        NotImplementedError: naming the RoPE type, the switch and the first position that would
            diverge (dynamic; longrope in a batch or padded prompt, naming the batch size; longrope on a
            family whose generate does not re-prefill there; on 4.x, a re-prefill generate gets wrong).
    """
    if max_new_tokens < 2:
        return None
    last = prompt_len + max_new_tokens - 2
    crossing = None
    for kind, first in sorted(_rope_switches(text_config(target)), key=lambda f: f[1]):
        if last < first:
            continue
        head = (f"target RoPE type {kind!r} changes its frequencies from position {first} on (sequence length > "
                f"{first}); this call would reach position {last}")
        if kind == "dynamic":
            raise NotImplementedError(
                f"{head}, and a verify block there would not match generate (which recomputes the frequencies "
                f"at every new length). Keep prompt_len + max_new_tokens <= {first + 1} (here {prompt_len} + "
                f"{max_new_tokens})")
        if batch > 1 or padded:
            raise NotImplementedError(
                f"{head}; crossing it is supported at batch size 1 without padding only (got batch {batch}"
                f"{', padded' if padded else ''}). Run the prompts one at a time, or keep prompt_len + "
                f"max_new_tokens <= {first + 1}")
        if not _reprefills_at_switch(target, first):
            raise NotImplementedError(
                f"{head}; spec_generate follows generate across it only for families whose generate re-prefills "
                f"there ({', '.join(_REPREFILL_FAMILIES)}), not {getattr(target.config, 'model_type', None)!r}. "
                f"Keep prompt_len + max_new_tokens <= {first + 1}")
        if prompt_len > first:
            continue  # the prefill already runs long factors, and so does every later forward
        stale = _stale_reprefill_mask(target, first)
        if stale is not None:
            raise NotImplementedError(
                f"{head}; with {stale}, transformers {transformers.__version__}'s own Phi-3 generate re-prefills "
                f"there with a stale cache_position (its mask covers one query), so generate differs from the "
                f"model's forward and spec_generate cannot follow it. Use attn_implementation='sdpa' without a "
                f"sliding window <= {first + 1}, or transformers >= 5")
        if crossing is not None and crossing != first:
            raise NotImplementedError(f"target has two longrope switches ({crossing} and {first}); not supported")
        crossing = first
    return crossing


def verify_budget(host_new: list, budget: int, rope_bounded: bool) -> int:
    """Largest verify block of a step that commits no row past its budget and, on targets with a
    position-dependent RoPE (``rope_bounded``: [`rope_switch`] is not None), runs no row past the last
    position ``generate`` computes for it.

    Row ``r`` (``host_new[r]`` tokens committed, the last of them the anchor at position
    ``len_r + host_new[r] - 1``) is fed by ``generate`` up to position ``len_r + budget - 2``; a block of
    ``b`` slots reaches ``len_r + host_new[r] + b - 2``. So ``b <= budget - host_new[r]`` for EVERY row:
    the block is sized from the fastest row, not only the slowest, else a row ahead of the others runs
    the whole batch's forward past ``check_rope``'s limit, where its frequencies switch for every row
    and every position, committed tokens included (issue "targets as users run them", item 1). Other
    targets size it from the slowest row (a faster row's extra slots are cut by the budget).
    """
    return budget - (max(host_new) if rope_bounded else min(host_new))


def static_rope_reason(target, prompt_len: int, budget: int, block_size: int):
    """Why the static loop, whose every verify is a full block, cannot run this call exactly on a
    position-dependent-RoPE target, or None. Its last block (anchor at ``prompt_len + budget - 2``, the
    last position generate computes) reaches ``prompt_len + budget + block_size - 3``; at or past the
    switch the whole forward would use the switched frequencies."""
    return rope_reach_reason(rope_switch(target), prompt_len, budget, block_size)


def rope_reach_reason(found, prompt_len: int, budget: int, block_size: int):
    """[`static_rope_reason`] from the target's [`rope_switch`] ``found`` (read once per call)."""
    if found is None:
        return None
    kind, first = found
    reach = prompt_len + budget + block_size - 3
    if reach < first:
        return None
    return (f"its full verify blocks would reach position {reach}, past the {kind!r} RoPE switch at position "
            f"{first} that generate never reaches here (the dynamic loop shortens blocks there)")


def longrope_block_limit(switch: int, committed: int, block_size: int) -> int:
    """Block size for a verify step of a longrope target below its switch (``check_rope``).

    With ``committed`` tokens (the last, the anchor, not yet in the target cache), a verify block of
    ``b`` slots covers positions ``committed - 1 .. committed + b - 2`` and uses long factors for ALL of
    them once ``committed + b - 1 > switch`` (``longrope_frequency_update``); generate computes every
    token up to position ``switch`` with short factors. So while ``committed <= switch`` the block is
    cut to ``switch - committed + 1`` (1 at ``committed == switch``: the anchor alone, as generate's
    last short step). Past it, ``block_size`` is returned unchanged.
    """
    return min(block_size, switch - committed + 1) if committed <= switch else block_size


# ----------------------------------------------------------------------------- draft embedding / logits


# Embedding modules of the families whose block embedding is the raw row x sqrt(hidden_size) (issue 26).
_SQRT_HIDDEN_EMBEDDINGS = ("Gemma3TextScaledWordEmbedding", "Gemma4TextScaledWordEmbedding")


def block_embedding_scale(config, embed):
    """The factor on the raw target-embedding row of the draft block: a float, or None (the raw row).

    ``config.input_embedding_scale`` when the drafter config sets it; else ``sqrt(hidden_size)`` for a
    Gemma 3/4 target (its embedding module is ``Gemma3TextScaledWordEmbedding`` /
    ``Gemma4TextScaledWordEmbedding``; ``hidden_size`` is the table's ``embedding_dim``), which is
    Gemma's own scale and nothing else of the module; else None. Sources for the Gemma default: vLLM PR
    #41703 (the Gemma 4 DFlash build the authors' instructions use: the drafter reads the target's
    embedding with Gemma's ``normalizer``), SGLang ``srt/speculative/dflash_worker.py`` (the block
    embedding from the target's embedding, which for Gemma carries the ``sqrt(hidden)`` scale), and
    transformers 5.x ``generation/candidate_generator.py`` (``DFlashTokenCandidateGenerator.
    _get_noise_embeds``: the embedding module's output, bypassing only an ``embed_norm``). Other families
    (Muse Glimmer's normed embedding, Gemma 1/2, Qwen, Llama) keep the raw row.
    """
    scale = getattr(config, "input_embedding_scale", None)
    if scale is None and any(c.__name__ in _SQRT_HIDDEN_EMBEDDINGS for c in type(embed).__mro__):
        scale = float(torch.tensor(embed.embedding_dim ** 0.5, dtype=embed.weight.dtype))  # Gemma rounds it so
    return scale


def draft_block_embedding(config, embed, ids: torch.LongTensor) -> torch.Tensor:
    """The embedding of the block ``[anchor, MASK, ...]`` fed to the draft: ``(B, b)`` ids -> ``(B, b, H)``.

    Convention (one function, used by ``spec_generate``, the static path and ``train/`` alike): the RAW
    row of the target's input-embedding table (never the output of an embedding module, which may
    normalise or scale inside ``forward``) times [`block_embedding_scale`]: the drafter config's
    ``input_embedding_scale`` if set, else ``sqrt(hidden_size)`` on Gemma 3/4 targets (rounded to the
    table's dtype, as Gemma's own embedding and vLLM's normaliser round it: bf16 makes ``sqrt(3072)``
    55.5), else 1. The authors' reference loop (z-lab/dflash ``dflash/model.py``,
    ``_raw_input_embeddings``) multiplies by ``input_embedding_scale`` only; the serving engines and
    transformers' DFlash generator add Gemma's scale, and the published Gemma 4 drafter is served there.

    An accelerate-offloaded table (weight on ``meta``) is brought in with the module's own hook
    (``pre_forward`` / ``post_forward``), so the raw row is read exactly; a tensor-parallel table
    (``DTensor``) is read across its shards ([`_sharded_embedding`]).
    """
    scale = block_embedding_scale(config, embed)
    weight, hook = embed.weight, getattr(embed, "_hf_hook", None)
    if weight.device.type == "meta" and hook is not None:
        hook.pre_forward(embed, ids)
        try:
            rows = torch.nn.functional.embedding(ids.to(embed.weight.device), embed.weight)
        finally:
            hook.post_forward(embed, None)
    elif _is_dtensor(weight):  # a tensor-parallel target (tp_plan="auto"): the table is sharded across ranks
        rows = _sharded_embedding(ids.to(weight.device), weight)
    else:
        rows = torch.nn.functional.embedding(ids if ids.device == weight.device else ids.to(weight.device), weight)
    return rows if scale is None else rows * scale


def _is_dtensor(weight) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without distributed support
        return False
    return isinstance(weight, DTensor)


def _sharded_embedding(ids, weight):
    """Rows of a ``DTensor`` embedding table (transformers' tensor parallelism shards it rowwise on 5.x) for
    plain ``ids`` on every rank: the ids enter as a replicated ``DTensor``, the lookup runs sharded, and the
    rows come back whole (``full_tensor``), the same on every rank. Exact: each row is read from the one
    rank that holds it. Source: issue 39 (5.24 raised "aten.embedding.default got mixed torch.Tensor and
    DTensor" in the draft's block embedding)."""
    from torch.distributed.tensor import DTensor, Replicate

    ids = DTensor.from_local(ids, weight.device_mesh, [Replicate()] * len(weight.placements), run_check=False)
    return torch.nn.functional.embedding(ids, weight).full_tensor()


def draft_logits(config, head, hidden: torch.Tensor) -> torch.Tensor:
    """Draft logits ``(B, n, V)`` from final draft states ``(B, n, H)``: ``head(h)``, times
    ``config.output_multiplier``, then soft-capped ``cap * tanh(logits / cap)`` with
    ``config.final_logit_softcapping`` (each step only when the drafter config sets it; the keys
    engines read on drafter configs, notes section 7). A quantized head (an integer weight: bitsandbytes)
    takes the states in their own float dtype."""
    dtype = head.weight.dtype
    logits = head(hidden if hidden.dtype == dtype or not dtype.is_floating_point else hidden.to(dtype))
    multiplier = getattr(config, "output_multiplier", None)
    if multiplier is not None:
        logits = logits * multiplier
    cap = getattr(config, "final_logit_softcapping", None)
    if cap is not None:
        logits = torch.tanh(logits / cap) * cap
    return logits


# ----------------------------------------------------------------------------- vision-language targets

# Parameters of a target's forward that the loop builds itself: never taken from the caller as model inputs.
_LOOP_ARGUMENTS = frozenset({
    "self", "args", "kwargs", "input_ids", "attention_mask", "position_ids", "past_key_values", "cache",
    "inputs_embeds", "labels", "use_cache", "cache_position", "logits_to_keep", "output_attentions",
    "output_hidden_states", "return_dict",
})
# Families whose generate feeds more than the prompt's multimodal inputs at later steps; name -> reason.
_REFUSED_VISION = {
    "mllama": "its text layers cross-attend to the image at every step (cross_attention_mask grows with each "
              "token), which a verify block does not reproduce",
}


def pop_model_inputs(target, forward_params, kwargs: dict) -> dict:
    """Pop the target's own prompt inputs besides ``input_ids`` (``pixel_values``, ``image_grid_thw``,
    ``pixel_values_videos``, ``video_grid_thw``, ``token_type_ids``, ``mm_token_type_ids``, ``image_sizes``
    ...: any name ``target.forward`` takes that the loop does not build) out of ``kwargs``; those left at
    None are dropped. Returns them as a dict (empty for a text-only call).

    Raises:
        NotImplementedError: multimodal inputs for a family in ``_REFUSED_VISION`` or for a target whose
            M-RoPE positions (``mrope_section`` in its rope config) have no public ``get_rope_index`` and come
            from no generate-built ``position_ids`` (checked later, [`vision_prompt`]), before any forward.
    """
    found = {k: kwargs.pop(k) for k in list(kwargs) if k in forward_params and k not in _LOOP_ARGUMENTS}
    found = {k: v for k, v in found.items() if v is not None}
    if found:
        for cfg in (target.config, text_config(target)):
            kind = getattr(cfg, "model_type", None)
            if kind in _REFUSED_VISION:
                raise NotImplementedError(
                    f"multimodal inputs {sorted(found)} for target family {kind!r} are not supported by "
                    f"spec_generate: {_REFUSED_VISION[kind]}")
    return found


def prepared_model_inputs(model_kwargs: dict) -> dict:
    """The prompt's model inputs as ``generate`` prepared them for its first forward (the ``model_kwargs``
    handed to a ``custom_generate`` callable), less what the loop builds itself: transformers 5.x replaces
    ``pixel_values`` there by the vision tower's ``mm_encoder_outputs``, so the caller's names are not enough."""
    return {k: v for k, v in model_kwargs.items() if v is not None and k not in _LOOP_ARGUMENTS}


def _mrope(target) -> bool:
    """The text model's RoPE takes multi-axis positions (Qwen2/2.5/3-VL, Qwen3.5 M-RoPE)."""
    cfg = text_config(target)
    return any(isinstance(e, dict) and "mrope_section" in e for e in (
        getattr(cfg, "rope_parameters", None), getattr(cfg, "rope_scaling", None)))


def _rope_index(target):
    """The target's public ``get_rope_index`` (on the wrapper or its ``model``), or None."""
    for owner in (target, getattr(target, "model", None)):
        method = getattr(owner, "get_rope_index", None)
        if callable(method):
            return method
    return None


class VisionPrompt:
    """One call's multimodal prompt: what the target's prefill takes and the positions of every later token.

    Built per call from the call's own inputs (nothing read from state kept on the target between calls,
    such as ``model.rope_deltas``).

    Attributes:
        inputs: the multimodal inputs, handed to the prefill only (generate drops pixel values after the
            first step through the model's ``prepare_inputs_for_generation``; later tokens are text).
        prefill_positions: ``(C, B, L)`` long, the target's own position ids of the prompt (M-RoPE: C = 3
            on transformers 4.x, 4 = text + 3 M-RoPE axes on 5.x), or None (plain positions).
        deltas: ``(C, B)`` long or None: a token at 1-D true position ``p`` of row ``b`` (image tokens
            counted) has the target position ``p + deltas[:, b]``; None: plain positions.
    """

    def __init__(self, inputs: dict, prefill_positions=None, deltas=None):
        self.inputs, self.prefill_positions, self.deltas = inputs, prefill_positions, deltas

    def rope(self, positions: torch.Tensor, rows: torch.Tensor):
        """``(C, A, n)`` target positions for 1-D ``positions`` ``(A, n)`` of original rows ``rows`` ``(A,)``,
        or None (plain positions: the target takes ``positions`` themselves)."""
        if self.deltas is None:
            return None
        return positions[None] + self.deltas[:, rows, None]  # (C, A, n)


def vision_prompt(target, input_ids, mask, inputs: dict, given_positions=None):
    """The [`VisionPrompt`] of a call with multimodal ``inputs`` (None for a text-only call).

    Positions follow the target's own generate: on transformers 5.x generate builds ``position_ids``
    before decoding (``given_positions``; M-RoPE models: ``(4, B, L)`` text + 3 axes) and advances every
    axis by one per token, so ``deltas`` = the last prompt position - its 1-D position; on 4.x the
    M-RoPE models compute them in ``forward``: the prompt from ``get_rope_index`` and later tokens at
    cache slot + ``rope_deltas``, the slot being the 1-D position + the row's left padding.

    Args:
        input_ids: ``(B, L)``; mask: ``(B, L)`` 0/1 left padding; given_positions: generate's
            ``position_ids`` handed to the decoding function, or None.

    Raises:
        NotImplementedError: an M-RoPE target with neither ``get_rope_index`` nor generate-built M-RoPE positions.
    """
    if not inputs:
        return None
    last = mask.sum(1) - 1  # (B,) 1-D position of each row's last prompt token
    if given_positions is not None:
        if given_positions.dim() == 2 and not _mrope(target):
            return VisionPrompt(inputs)  # plain positions (Gemma 3/4)
        if given_positions.dim() == 2:
            raise NotImplementedError(
                f"{type(target).__name__} takes M-RoPE positions but its generate builds plain ones: spec_generate "
                "cannot place the tokens after its images as the model does; pass a text-only prompt")
        return VisionPrompt(inputs, given_positions, given_positions[..., -1] - last[None])
    rope_index = _rope_index(target)
    if rope_index is None:
        if _mrope(target):
            raise NotImplementedError(
                f"{type(target).__name__} takes M-RoPE positions but has no get_rope_index: spec_generate cannot "
                "place the tokens after its images exactly; pass a text-only prompt")
        return VisionPrompt(inputs)
    params = inspect.signature(rope_index).parameters
    positions, deltas = rope_index(input_ids, attention_mask=mask, **{k: v for k, v in inputs.items() if k in params})
    padding = input_ids.shape[1] - mask.sum(1)  # (B,)
    deltas = (deltas.reshape(-1).to(positions.device) + padding.to(positions.device))[None]  # (1, B)
    return VisionPrompt(inputs, positions, deltas.expand(positions.shape[0], -1))


# ----------------------------------------------------------------------------- devices


def execution_device(target, input_ids) -> torch.device:
    """Where the target's forward takes its inputs, as ``generate`` leaves them.

    An accelerate-dispatched embedding (``device_map`` with CPU/disk offload) reports its
    ``_hf_hook.execution_device``; otherwise the embedding weight's device, unless it is ``meta``
    (offloaded), in which case the input stays where the caller put it.
    """
    embed = target.get_input_embeddings()
    hook = getattr(embed, "_hf_hook", None)
    device = getattr(hook, "execution_device", None)
    if device is not None:
        return torch.device(device if not isinstance(device, int) else f"cuda:{device}")
    weight = embed.weight
    return input_ids.device if weight.device.type == "meta" else weight.device


def draft_device(draft) -> torch.device:
    return draft.fc.weight.device


# This module itself, so siblings can write ``from .target_families import FAMILY``: the Hub's
# remote-code scanner follows only ``from .name import ...`` relative imports.
FAMILY = sys.modules[__name__]

__all__ = [
    "FAMILY", "block_embedding_scale", "concat_taps", "draft_block_embedding", "draft_logits",
    "check_family", "check_rope", "check_tap", "decoder_parts", "draft_device", "execution_device",
    "layer_windows", "longrope_block_limit", "prefill_kwargs", "rope_reach_reason", "rope_switch", "sliding_target",
    "static_rope_reason",
    "target_mask", "text_config", "verify_budget", "window_masks", "pop_model_inputs", "prepared_model_inputs",
    "vision_prompt", "VisionPrompt",
]
