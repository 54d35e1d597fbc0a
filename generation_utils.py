"""Lossless speculative decoding with a DFlash draft: ``spec_generate`` and the target-feature taps.

One step (notes section 1): the draft fills the block ``[anchor, MASK x (b-1)]`` in one pass,
conditioned on the captured target features of every committed position before the anchor; the
target verifies the block in one pass; the longest prefix of drafts equal to the target's own
choice is kept, plus the target's token at the first mismatch (the bonus token). Both KV caches
are then cut back to the committed length.
"""

import contextlib
import inspect
import time
from dataclasses import dataclass, field
from typing import Optional

import torch
from transformers import DynamicCache, GenerationConfig, LogitsProcessorList
from transformers import MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

# generation_config options that change which token is chosen and that spec_generate does not apply.
_UNSUPPORTED = {
    "repetition_penalty": 1.0, "encoder_repetition_penalty": 1.0, "no_repeat_ngram_size": 0,
    "bad_words_ids": None, "force_words_ids": None, "min_length": 0, "min_new_tokens": None,
    "forced_bos_token_id": None, "forced_eos_token_id": None, "suppress_tokens": None,
    "begin_suppress_tokens": None, "sequence_bias": None, "exponential_decay_length_penalty": None,
    "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "num_beams": 1, "penalty_alpha": None,
    "guidance_scale": None, "watermarking_config": None, "num_return_sequences": 1,
}


@dataclass
class DFlashGenerateOutput:
    """What ``spec_generate(..., return_dict_in_generate=True)`` returns.

    sequences: ``(1, prompt_len + new_len)`` LongTensor, prompt first.
    acceptance_lengths: tokens committed by each verify step, bonus token included (1..block_size);
        their mean is the acceptance length tau. The token from the prefill is not counted.
    num_draft_forwards / num_target_forwards: forward passes (the target's include the prefill).
    timings: only with ``output_timings=True``: ``prefill_s``, ``decode_s``, ``total_s`` (seconds,
        device-synchronised) and ``new_tokens``.
    """

    sequences: torch.LongTensor = None
    acceptance_lengths: list = field(default_factory=list)
    num_draft_forwards: int = 0
    num_target_forwards: int = 0
    timings: Optional[dict] = None


# ----------------------------------------------------------------------------- target feature taps


def _decoder_parts(target):
    """(decoder layers, final norm) of a causal LM, via the public ``get_decoder()``."""
    decoder = target.get_decoder() if hasattr(target, "get_decoder") else getattr(target, "model", target)
    layers, norm = getattr(decoder, "layers", None), getattr(decoder, "norm", None)
    if layers is None or norm is None:
        raise ValueError(f"cannot find decoder `layers` and final `norm` on {type(target).__name__}.get_decoder()")
    return layers, norm


@contextlib.contextmanager
def capture_target_features(target, layer_ids):
    """Capture the outputs of target layers ``layer_ids`` during forwards inside the ``with`` block.

    Layer id ``k`` is the OUTPUT of decoder layer ``k`` (HF ``hidden_states[k + 1]``); for the last
    layer that is the post-final-norm state, as in HF's ``hidden_states[-1]`` (notes section 1; an
    off-by-one here silently ruins acceptance, notes section 6). Only these layers are kept, never all.

    Yields a callable ``get() -> (batch, seq, len(layer_ids) * hidden)`` returning the features of the
    most recent forward, concatenated in ``layer_ids`` order. Hooks are removed on exit.

    Raises:
        ValueError: a layer id outside ``[0, num_layers)``.
    """
    layers, norm = _decoder_parts(target)
    bad = [k for k in layer_ids if not 0 <= k < len(layers)]
    if bad:
        raise ValueError(f"target_layer_ids {list(layer_ids)} include {bad}, but the target has {len(layers)} layers")
    store = {}

    def hook_for(k):
        def hook(module, args, output):
            store[k] = output[0] if isinstance(output, (tuple, list)) else output
        return hook

    handles = [
        (norm if k == len(layers) - 1 else layers[k]).register_forward_hook(hook_for(k)) for k in layer_ids
    ]
    try:
        yield lambda: torch.cat([store[k] for k in layer_ids], dim=-1)
    finally:
        for h in handles:
            h.remove()
        store.clear()


# ----------------------------------------------------------------------------- small helpers


def crop_cache(cache, length: int) -> None:
    """Cut a transformers cache back to ``length`` tokens, on 4.57 and 5.x alike.

    Only ever calls ``crop`` with a negative count: 5.x rejects positive lengths, and on 4.57
    ``crop(0)`` empties the cache (notes section 3). Nothing is called when nothing is removed.
    """
    remove = cache.get_seq_length() - length
    if remove > 0:
        cache.crop(-remove)


def _cache_kwarg(model) -> str:
    """``cache`` on transformers >= 5.24 (``past_key_values`` is deprecated there), else ``past_key_values``."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _resolve_stop_ids(stop_token_ids, generation_config):
    if stop_token_ids is None:
        stop_token_ids = generation_config.eos_token_id
    if stop_token_ids is None:
        return []
    if isinstance(stop_token_ids, int):
        return [stop_token_ids]
    return [int(t) for t in (stop_token_ids.tolist() if torch.is_tensor(stop_token_ids) else stop_token_ids)]


def _logits_warpers(temperature, top_k, top_p, min_p) -> LogitsProcessorList:
    """The sampling warpers of ``generate`` in its order: temperature, top-k, top-p, min-p."""
    warpers = LogitsProcessorList()
    if temperature is not None and temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(temperature))
    if top_k is not None and top_k != 0:
        warpers.append(TopKLogitsWarper(top_k=top_k, min_tokens_to_keep=1))
    if top_p is not None and top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p=top_p, min_tokens_to_keep=1))
    if min_p is not None:
        warpers.append(MinPLogitsWarper(min_p=min_p, min_tokens_to_keep=1))
    return warpers


@dataclass
class _Sampling:
    """Resolved decoding settings; ``warpers`` is None for greedy decoding."""

    warpers: Optional[LogitsProcessorList]
    generator: Optional[torch.Generator]

    def choose(self, logits: torch.Tensor) -> torch.LongTensor:
        """``(b, n, V)`` logits -> ``(b, n)`` tokens: argmax, or a sample of the warped distribution."""
        if self.warpers is None:
            return logits.argmax(dim=-1)
        b, n, v = logits.shape
        scores = self.warpers(None, logits.reshape(b * n, v).float())
        probs = torch.softmax(scores, dim=-1)
        return torch.multinomial(probs, 1, generator=self.generator).view(b, n)


def _resolve_sampling(generation_config, temperature, do_sample, top_k, top_p, min_p, generator):
    """Explicit arguments win, then the target's ``generation_config``, as in ``generate``.

    ``do_sample`` unset: an explicit ``temperature`` decides (0 -> greedy, > 0 -> sampling, the
    published z-lab usage), else ``generation_config.do_sample``. Temperature 0 is always greedy.
    """
    for name, value in (("temperature", temperature), ("top_k", top_k)):
        if value is not None and value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if min_p is not None and not 0 <= min_p <= 1:
        raise ValueError(f"min_p must be in [0, 1], got {min_p}")
    if do_sample is None:
        do_sample = temperature > 0 if temperature is not None else bool(generation_config.do_sample)
    temperature = temperature if temperature is not None else generation_config.temperature
    if not do_sample or temperature == 0:
        return _Sampling(None, generator)
    top_k = top_k if top_k is not None else generation_config.top_k
    top_p = top_p if top_p is not None else generation_config.top_p
    min_p = min_p if min_p is not None else getattr(generation_config, "min_p", None)
    return _Sampling(_logits_warpers(temperature, top_k, top_p, min_p), generator)


def _check_generation_config(generation_config):
    for name, neutral in _UNSUPPORTED.items():
        value = getattr(generation_config, name, neutral)
        if value is not None and value != neutral and not (name == "min_length" and value == 0):
            raise NotImplementedError(
                f"generation_config.{name}={value!r} is not supported by spec_generate (expected {neutral!r}); "
                "pass generation_config=GenerationConfig(...) without it"
            )


def check_pairing(draft, target):
    """Raise ValueError unless ``draft`` was built for ``target`` (hidden size, layers, vocab)."""
    cfg = draft.config
    layers, _ = _decoder_parts(target)
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    t_hidden, t_vocab = embed.weight.shape[1], embed.weight.shape[0]
    n_feat = len(cfg.target_layer_ids)
    if draft.fc.in_features != n_feat * t_hidden:
        raise ValueError(
            f"draft fc expects {draft.fc.in_features} input features but the target gives "
            f"{n_feat} layers x hidden {t_hidden} = {n_feat * t_hidden}: this draft was not trained for this target"
        )
    if cfg.hidden_size != t_hidden or head.weight.shape[1] != cfg.hidden_size:
        raise ValueError(
            f"draft hidden_size={cfg.hidden_size} must equal the target embedding/head width {t_hidden}"
        )
    if max(cfg.target_layer_ids) >= len(layers):
        raise ValueError(f"target_layer_ids {cfg.target_layer_ids} reach beyond the target's {len(layers)} layers")
    if cfg.num_target_layers is not None and cfg.num_target_layers != len(layers):
        raise ValueError(f"draft was trained for a {cfg.num_target_layers}-layer target, this target has {len(layers)}")
    if not cfg.mask_token_id < min(t_vocab, head.weight.shape[0]):
        raise ValueError(f"mask_token_id={cfg.mask_token_id} is outside the target vocabulary of {t_vocab}")
    layer_types = getattr(target.config.get_text_config(), "layer_types", None) or []
    odd = sorted({t for t in layer_types if t not in ("full_attention", "sliding_attention")})
    if odd:
        raise NotImplementedError(
            f"target layer types {odd} keep recurrent state that cannot be rolled back after a rejected draft; "
            "spec_generate supports attention-only targets"
        )


def _prepare_input_ids(input_ids, attention_mask):
    if not torch.is_tensor(input_ids) or input_ids.dim() != 2 or input_ids.dtype != torch.long:
        raise ValueError(f"input_ids must be a (batch, prompt_len) LongTensor, got {getattr(input_ids, 'shape', input_ids)}")
    if input_ids.shape[0] != 1:
        raise NotImplementedError(f"spec_generate supports batch size 1 for now, got batch {input_ids.shape[0]}")
    if attention_mask is not None:
        if attention_mask.shape != input_ids.shape:
            raise ValueError(f"attention_mask shape {tuple(attention_mask.shape)} != input_ids shape {tuple(input_ids.shape)}")
        keep = attention_mask[0].bool()
        if keep.any() and not keep[keep.nonzero()[0, 0]:].all():
            raise ValueError("attention_mask must be left padding (zeros only before the first real token)")
        input_ids = input_ids[:, keep]
    if input_ids.shape[1] == 0:
        raise ValueError("the prompt is empty: spec_generate needs at least one input token")
    return input_ids


# ----------------------------------------------------------------------------- the decode loop


@torch.no_grad()  # not inference_mode: callers may feed the output to autograd (e.g. drafter training)
def spec_generate(
    draft,
    target,
    input_ids: torch.LongTensor,
    max_new_tokens: Optional[int] = None,
    stop_token_ids=None,
    temperature: Optional[float] = None,
    *,
    do_sample: Optional[bool] = None,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    min_p: Optional[float] = None,
    block_size: Optional[int] = None,
    attention_mask: Optional[torch.Tensor] = None,
    generation_config: Optional[GenerationConfig] = None,
    generator: Optional[torch.Generator] = None,
    streamer=None,
    return_dict_in_generate: Optional[bool] = None,
    output_timings: bool = False,
    mask_token_id: Optional[int] = None,
):
    """Generate with ``target``, drafting blocks with ``draft``; output equals the target alone.

    Args:
        draft: a ``DFlashDraftModel``.
        target: the causal LM the draft was trained for (any device/dtype; features are cast).
        input_ids: ``(1, prompt_len)`` LongTensor (left padding allowed with ``attention_mask``).
        max_new_tokens: upper bound on new tokens (tokens); None -> ``generation_config``.
        stop_token_ids: int or list; None -> ``generation_config.eos_token_id``; ``[]`` -> none.
            Generation ends right after the first stop token, even inside an accepted block.
        temperature, do_sample, top_k, top_p, min_p: as in ``generate``; None -> the target's
            ``generation_config``. Temperature 0 or ``do_sample=False`` is greedy and gives exactly
            ``target.generate(do_sample=False)``. Sampling is lossless: a draft token is accepted only
            when it equals the target's own sample at that position (the draft proposes its argmax).
        block_size: per-call block size in ``[1, draft.config.block_size]``.
        generator: ``torch.Generator`` for reproducible sampling.
        streamer: a transformers ``BaseStreamer``; gets the prompt once, then each committed chunk.
        return_dict_in_generate: return a [`DFlashGenerateOutput`] instead of the tensor.
        output_timings: add device-synchronised wall-clock timings (seconds) to the output.
        mask_token_id: override of ``draft.config.mask_token_id``.

    Returns:
        ``(1, prompt_len + new_len)`` LongTensor, prompt first (or a [`DFlashGenerateOutput`]).
        The output is cut by length, never by value: tokens equal to ``mask_token_id`` are kept.

    Raises:
        ValueError: bad input or a draft not built for this target, before any forward pass.
        NotImplementedError: batch > 1, recurrent-state targets, unsupported generation_config options.
    """
    generation_config = generation_config if generation_config is not None else target.generation_config
    _check_generation_config(generation_config)
    input_ids = _prepare_input_ids(input_ids, attention_mask)
    if max_new_tokens is None:
        max_new_tokens = generation_config.max_new_tokens
        if max_new_tokens is None:
            max_new_tokens = max(generation_config.max_length - input_ids.shape[1], 0)
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    trained = draft.config.block_size
    block_size = trained if block_size is None else block_size
    if not 1 <= block_size <= trained:
        raise ValueError(f"block_size must be in [1, {trained}] (the trained block size), got {block_size}")
    mask_token_id = draft.config.mask_token_id if mask_token_id is None else mask_token_id
    sampling = _resolve_sampling(generation_config, temperature, do_sample, top_k, top_p, min_p, generator)
    stop_ids = _resolve_stop_ids(stop_token_ids, generation_config)
    check_pairing(draft, target)
    if return_dict_in_generate is None:
        return_dict_in_generate = bool(getattr(generation_config, "return_dict_in_generate", False))

    device = target.get_input_embeddings().weight.device
    input_ids = input_ids.to(device)
    out = DFlashGenerateOutput(sequences=input_ids)
    if streamer is not None:
        streamer.put(input_ids.cpu())
    if max_new_tokens > 0:
        with capture_target_features(target, draft.config.target_layer_ids) as features:
            out = _decode(draft, target, input_ids, max_new_tokens, block_size, mask_token_id, sampling,
                          stop_ids, features, streamer, output_timings)
    if streamer is not None:
        streamer.end()
    return out if return_dict_in_generate else out.sequences


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _draft_logits(draft, embed, head, anchor, context, draft_cache, start, b, mask_token_id):
    """One draft pass over ``[anchor, MASK x (b-1)]`` at positions ``start..start+b-1``.

    ``context`` ``(1, n, F)`` holds the features of positions ``cache_len..start-1`` (everything
    before the anchor not yet in ``draft_cache``). Returns draft logits ``(1, b-1, V)`` for slots
    1..b-1 and leaves ``draft_cache`` holding context K/V of positions ``0..start-1`` only.
    """
    noise = torch.cat([anchor, anchor.new_full((1, b - 1), mask_token_id)], dim=1)
    pos = torch.arange(draft_cache.get_seq_length(), start + b, device=anchor.device)[None]
    hidden = draft(position_ids=pos, noise_embedding=embed(noise), target_hidden=context,
                   past_key_values=draft_cache, use_cache=True)
    crop_cache(draft_cache, start)  # block K/V are thrown away
    return head(hidden[:, 1:].to(head.weight.dtype))


def _decode(draft, target, input_ids, max_new_tokens, block_size, mask_token_id, sampling, stop_ids,
            features, streamer, output_timings):
    """The speculative loop for one sequence; positions are contiguous, so cache length == position."""
    device, prompt_len = input_ids.device, input_ids.shape[1]
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    cache_kw = _cache_kwarg(target)
    target_cache, draft_cache = DynamicCache(), DynamicCache()
    max_positions = getattr(target.config.get_text_config(), "max_position_embeddings", None) or 1 << 62
    stop = torch.tensor(stop_ids, dtype=torch.long, device=device)
    out = DFlashGenerateOutput(num_target_forwards=1)
    t0 = _sync(device) if output_timings else None

    # Prefill: the target's first token is the first anchor.
    positions = torch.arange(prompt_len, device=device)[None]
    logits = target(input_ids=input_ids, position_ids=positions, use_cache=True, **{cache_kw: target_cache}).logits
    tokens = [input_ids, sampling.choose(logits[:, -1:])]
    context = features()  # (1, prompt_len, n_feat * H): features of positions < anchor
    t1 = _sync(device) if output_timings else None
    if streamer is not None:
        streamer.put(tokens[-1].cpu())
    n_new, start = 1, prompt_len  # start = position of the anchor (committed, not yet seen by the target)
    done = bool(torch.isin(tokens[-1], stop).any()) or n_new >= max_new_tokens

    while not done and start < max_positions:
        b = min(block_size, max_new_tokens - n_new, max_positions - start)
        block = tokens[-1][:, -1:]
        if b > 1:
            logits = _draft_logits(draft, embed, head, block, context, draft_cache, start, b, mask_token_id)
            block = torch.cat([block, logits.argmax(dim=-1).to(device)], dim=1)  # (1, b)
            out.num_draft_forwards += 1
        pos = torch.arange(start, start + b, device=device)[None]
        logits = target(input_ids=block, position_ids=pos, use_cache=True, **{cache_kw: target_cache}).logits
        out.num_target_forwards += 1
        choice = sampling.choose(logits)  # (1, b): the target's token after each block slot
        accepted = int((block[:, 1:] == choice[:, :-1]).long().cumprod(dim=1).sum())
        new = torch.cat([block[:, 1 : accepted + 1], choice[:, accepted : accepted + 1]], dim=1)
        out.acceptance_lengths.append(accepted + 1)
        hits = torch.isin(new[0], stop).nonzero()
        if len(hits):
            new, done = new[:, : int(hits[0]) + 1], True
        tokens.append(new)
        if streamer is not None:
            streamer.put(new[0].cpu())
        context = features()[:, : accepted + 1]  # anchor + accepted drafts become context
        start += accepted + 1
        crop_cache(target_cache, start)
        n_new += new.shape[1]
        done = done or n_new >= max_new_tokens

    out.sequences = torch.cat(tokens, dim=1)
    if output_timings:
        t2 = _sync(device)
        out.timings = {"prefill_s": t1 - t0, "decode_s": t2 - t1, "total_s": t2 - t0, "new_tokens": n_new}
    return out


__all__ = ["spec_generate", "capture_target_features", "check_pairing", "crop_cache", "DFlashGenerateOutput"]
