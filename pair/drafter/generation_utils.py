"""Lossless speculative decoding with a DFlash draft: ``spec_generate`` and the target-feature taps.

One step (notes section 1): the draft fills the block ``[anchor, MASK x (b-1)]`` in one pass,
conditioned on the captured target features of every committed position before the anchor; the
target verifies the block in one pass. Greedy: the longest prefix of drafts equal to the target's
argmax is kept, plus the target's token at the first mismatch (the bonus token). Sampling: drafts
pass or fail the speculative-sampling test and the first failure is replaced by a residual sample
(``speculative_verify``). Both KV caches are then cut back to the committed length; in a batch,
every row commits its own count.
"""

import contextlib
import inspect
import time
from dataclasses import dataclass
from typing import Optional

import torch
from transformers import DynamicCache, GenerationConfig, LogitsProcessorList
from transformers import MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper
from transformers.utils import ModelOutput, logging

logger = logging.get_logger(__name__)

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
class DFlashGenerateOutput(ModelOutput):
    """What ``spec_generate(..., return_dict_in_generate=True)`` returns.

    sequences: ``(B, prompt_len + new_len)`` LongTensor, prompt first, right padded.
    acceptance_lengths: tokens each verify step accepted, bonus token included (1..block_size), all
        rows in row order; their mean is the acceptance length tau. Counted before the cut at a
        stop token or ``max_new_tokens``; the prefill token is not counted.
    row_acceptance_lengths: the same, one list per row.
    num_new_tokens: new tokens per row (the real length of each row's continuation).
    num_draft_forwards / num_target_forwards: forward passes (the target's include the prefill).
    timings: only with ``output_timings=True``: ``prefill_s``, ``decode_s``, ``total_s`` (seconds,
        device-synchronised) and ``new_tokens``.
    """

    sequences: torch.LongTensor = None
    acceptance_lengths: Optional[list] = None
    row_acceptance_lengths: Optional[list] = None
    num_new_tokens: Optional[list] = None
    num_draft_forwards: Optional[int] = None
    num_target_forwards: Optional[int] = None
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

# generate()'s own fallbacks for fields a generation_config leaves unset (5.x stores None for them).
_GENERATE_DEFAULTS = {"do_sample": False, "temperature": 1.0, "top_k": 50, "top_p": 1.0, "max_length": 20}


def _gen(generation_config, name):
    value = getattr(generation_config, name, None)
    return _GENERATE_DEFAULTS.get(name) if value is None else value


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
    """The sampling warpers of ``generate``, in its order: temperature, top-k, top-p, min-p."""
    warpers = LogitsProcessorList()
    if temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(temperature))
    if top_k is not None and top_k != 0:
        warpers.append(TopKLogitsWarper(top_k=top_k, min_tokens_to_keep=1))
    if top_p is not None and top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p=top_p, min_tokens_to_keep=1))
    if min_p is not None:
        warpers.append(MinPLogitsWarper(min_p=min_p, min_tokens_to_keep=1))
    return warpers


def speculative_verify(draft_tokens, draft_probs, target_probs, generator=None):
    """Speculative sampling acceptance (Leviathan et al. 2023, Algorithm 1; Chen et al. 2023).

    Draft token ``x_j`` is accepted with probability ``min(1, p_j(x_j) / q_j(x_j))``, in order, until
    the first rejection; there the next token is drawn from ``norm(max(p_j - q_j, 0))``; if all are
    accepted, the bonus token is drawn from ``p_{n}``. The committed tokens are then distributed
    exactly as the target's own samples. A one-hot ``q`` (greedy draft) is a valid special case.

    Args:
        draft_tokens: ``(B, n)`` LongTensor, drawn from ``draft_probs``.
        draft_probs: ``(B, n, V)`` float, the draft's processed distributions q.
        target_probs: ``(B, n + 1, V)`` float, the target's processed distributions p after each
            block slot (slot j predicts the token after it; the last one gives the bonus token).
        generator: ``torch.Generator`` for the uniforms and the residual draw.

    Returns:
        ``(accepted (B,), next_token (B,))``: accepted draft count in ``[0, n]`` and the token that
        follows them (residual sample or bonus).
    """
    bsz, n = draft_tokens.shape
    rows = torch.arange(bsz, device=draft_tokens.device)
    p_x = target_probs[:, :n].gather(-1, draft_tokens[..., None])[..., 0]
    q_x = draft_probs.gather(-1, draft_tokens[..., None])[..., 0]
    u = torch.rand(bsz, n, generator=generator, device=draft_tokens.device)
    ok = u * q_x < p_x  # u < p/q, with q(x) > 0 because x was drawn from q
    accepted = ok.long().cumprod(dim=1).sum(dim=1)
    p_next = target_probs[rows, accepted]
    q_next = torch.cat([draft_probs, target_probs.new_zeros(bsz, 1, target_probs.shape[-1])], dim=1)[rows, accepted]
    residual = (p_next - q_next).clamp_min(0)
    total = residual.sum(-1, keepdim=True)
    residual = torch.where(total > 0, residual / total.clamp_min(1e-30), p_next)  # p == q: never rejected
    return accepted, torch.multinomial(residual, 1, generator=generator)[:, 0]


@dataclass
class _Sampling:
    """Resolved decoding settings; ``warpers`` is None for greedy decoding."""

    warpers: Optional[LogitsProcessorList]
    generator: Optional[torch.Generator]
    sample_draft: bool = True

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """``(B, n, V)`` logits -> processed probabilities, fp32."""
        b, n, v = logits.shape
        return torch.softmax(self.warpers(None, logits.reshape(b * n, v).float()), dim=-1).view(b, n, v)

    def first(self, logits: torch.Tensor) -> torch.LongTensor:
        """The prefill token ``(B,)`` from the last prompt logits ``(B, V)``."""
        if self.warpers is None:
            return logits.argmax(dim=-1)
        return torch.multinomial(self.probs(logits[:, None])[:, 0], 1, generator=self.generator)[:, 0]

    def propose(self, draft_logits: torch.Tensor):
        """Draft tokens ``(B, n)`` and their distribution q ``(B, n, V)`` (None when greedy)."""
        if self.warpers is None:
            return draft_logits.argmax(dim=-1), None
        q = self.probs(draft_logits)
        if not self.sample_draft:
            tokens = q.argmax(dim=-1)
            return tokens, torch.nn.functional.one_hot(tokens, q.shape[-1]).to(q.dtype)
        tokens = torch.multinomial(q.flatten(0, 1), 1, generator=self.generator).view(q.shape[:2])
        return tokens, q

    def verify(self, drafts, q, target_logits):
        """``(accepted (B,), next_token (B,))`` for the block's drafts ``(B, n)``; see ``speculative_verify``."""
        if self.warpers is None:  # greedy: keep drafts equal to the target's argmax
            choice = target_logits.argmax(dim=-1)  # (B, n + 1)
            accepted = (drafts == choice[:, :-1]).long().cumprod(dim=1).sum(dim=1)
            return accepted, choice.gather(1, accepted[:, None])[:, 0]
        p = self.probs(target_logits)
        return speculative_verify(drafts, p[:, :0] if q is None else q, p, self.generator)


def _resolve_sampling(generation_config, temperature, do_sample, top_k, top_p, min_p, generator, sample_draft):
    """Explicit arguments win, then the target's ``generation_config``, then generate's defaults.

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
        do_sample = temperature > 0 if temperature is not None else bool(_gen(generation_config, "do_sample"))
    temperature = temperature if temperature is not None else _gen(generation_config, "temperature")
    if not do_sample or temperature == 0:
        return _Sampling(None, generator)
    top_k = top_k if top_k is not None else _gen(generation_config, "top_k")
    top_p = top_p if top_p is not None else _gen(generation_config, "top_p")
    min_p = min_p if min_p is not None else getattr(generation_config, "min_p", None)
    return _Sampling(_logits_warpers(temperature, top_k, top_p, min_p), generator, sample_draft)


def _check_generation_config(generation_config):
    for name, neutral in _UNSUPPORTED.items():
        value = getattr(generation_config, name, neutral)
        if value is not None and value != neutral:
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
        raise ValueError(f"draft hidden_size={cfg.hidden_size} must equal the target embedding/head width {t_hidden}")
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


def _check_is_causal_lm(target):
    """The target needs an input embedding, an output head and a generation_config."""
    try:
        ok = target.get_input_embeddings() is not None and target.get_output_embeddings() is not None
    except (AttributeError, NotImplementedError):
        ok = False
    if not ok or getattr(target, "generation_config", None) is None:
        raise ValueError(f"target must be a causal LM (an AutoModelForCausalLM), got {type(target).__name__}")


def _has_sliding_layers(target) -> bool:
    cfg = target.config.get_text_config()
    return "sliding_attention" in (getattr(cfg, "layer_types", None) or []) or bool(
        getattr(cfg, "use_sliding_window", False) and getattr(cfg, "sliding_window", None))


def _prepare_inputs(input_ids, attention_mask, vocab_size):
    """Validate ``input_ids`` ``(B, L)`` and the left-padding ``attention_mask``; returns the mask."""
    if not torch.is_tensor(input_ids) or input_ids.dim() != 2 or input_ids.dtype != torch.long:
        raise ValueError(f"input_ids must be a (batch, prompt_len) LongTensor, got {getattr(input_ids, 'shape', input_ids)}")
    if input_ids.shape[1] == 0:
        raise ValueError("the prompt is empty: spec_generate needs at least one input token")
    low, high = int(input_ids.min()), int(input_ids.max())
    if low < 0 or high >= vocab_size:
        raise ValueError(f"input_ids hold ids in [{low}, {high}], outside the target vocabulary [0, {vocab_size})")
    if attention_mask is None:
        return torch.ones_like(input_ids)
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask shape {tuple(attention_mask.shape)} != input_ids shape {tuple(input_ids.shape)}")
    mask = attention_mask.to(device=input_ids.device, dtype=torch.long)
    if ((mask != 0) & (mask != 1)).any():
        raise ValueError("attention_mask must hold only 0 and 1")
    if (mask[:, 1:] < mask[:, :-1]).any():
        raise ValueError(
            "attention_mask must be left padding (zeros only before the first real token); "
            "use tokenizer.padding_side = 'left'"
        )
    if (mask.sum(1) == 0).any():
        raise ValueError("a row of attention_mask is all zeros: that prompt is empty")
    return mask


def _warn_unmasked_left_padding(input_ids, attention_mask, pad_token_id) -> None:
    """Warn, as ``generate`` does, when rows start with the pad token but no ``attention_mask`` came:
    the padding would then be read as prompt tokens (the output still equals ``target.generate`` on the
    same unmasked input, but not what the caller meant)."""
    if attention_mask is not None or pad_token_id is None or input_ids.shape[0] < 2:
        return
    rows = (input_ids[:, 0] == pad_token_id).nonzero().flatten().tolist()
    if rows:
        logger.warning(
            f"rows {rows} of input_ids start with the pad token {pad_token_id} (left padding) but no attention_mask "
            "was passed, so the padding is read as prompt tokens: pass the tokenizer's attention_mask"
        )


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
    sample_draft: bool = True,
    block_size: Optional[int] = None,
    attention_mask: Optional[torch.Tensor] = None,
    generation_config: Optional[GenerationConfig] = None,
    generator: Optional[torch.Generator] = None,
    streamer=None,
    return_dict_in_generate: Optional[bool] = None,
    output_timings: bool = False,
    mask_token_id: Optional[int] = None,
):
    """Generate with ``target``, drafting blocks with ``draft``; the output is the target's own.

    Args:
        draft: a ``DFlashDraftModel``.
        target: the causal LM the draft was trained for (any device/dtype; features are cast).
        input_ids: ``(B, prompt_len)`` LongTensor; rows of different lengths are LEFT padded and
            described by ``attention_mask`` (1 = real token).
        max_new_tokens: upper bound on new tokens per row; None -> ``generation_config``.
        stop_token_ids: int or list; None -> ``generation_config.eos_token_id``; ``[]`` -> none.
            A row ends right after its first stop token, even inside an accepted block.
        temperature, do_sample, top_k, top_p, min_p: as in ``generate`` (None -> the target's
            ``generation_config``, then generate's defaults such as ``top_k=50``), applied with
            transformers' own logits warpers to target and draft logits alike. Temperature 0 or
            ``do_sample=False`` is greedy and equals ``target.generate(do_sample=False)`` token for
            token in fp32. Sampling is exact speculative sampling (``speculative_verify``).
        sample_draft: under sampling, draw draft tokens from the draft's processed distribution q
            (default) rather than taking its argmax. Default because acceptance is then
            ``sum_x min(p, q)``, which tends to 1 as the draft matches the target, while a one-hot
            draft is accepted with ``p(argmax q) <= max p``: at temperature 1 that is often well
            below 1. Both are exact.
        block_size: per-call block size in ``[1, draft.config.block_size]``.
        generator: ``torch.Generator`` (on the target's device) for reproducible sampling.
        streamer: a transformers ``BaseStreamer`` (batch size 1): gets the prompt once, then each
            committed chunk, never a token past a stop token or ``max_new_tokens``.
        return_dict_in_generate: return a [`DFlashGenerateOutput`] instead of the tensor.
        output_timings: add device-synchronised wall-clock timings (seconds) to the output.
        mask_token_id: override of ``draft.config.mask_token_id``.

    Returns:
        ``(B, prompt_len + new_len)`` LongTensor: the prompt as given, then each row's new tokens,
        right padded with the pad token (``generation_config.pad_token_id``, else the first eos,
        else 0) up to the longest row. Cut by length, never by value: tokens equal to
        ``mask_token_id`` are kept. Or a [`DFlashGenerateOutput`].

    Batches: every row keeps its own true positions (``cumsum(attention_mask) - 1``) and accepts its
    own number of tokens per step. Rows share one KV cache per model; slots a row does not own
    (left padding, drafts it rejected while another row accepted more) are masked out of attention
    by the 2-D attention mask, and RoPE uses the explicit positions, so each row computes exactly
    what it computes alone, up to floating-point summation order. Finished rows are dropped from
    the caches. Holes would shift a sliding-window target's window (transformers windows count
    cache slots), so batches of sliding-window targets are refused; the draft's own sliding layers
    take key positions from the mask and stay exact.

    Raises:
        ValueError: bad input or a draft not built for this target, before any forward pass.
        NotImplementedError: recurrent-state targets, sliding-window targets with batch > 1,
            unsupported ``generation_config`` options.
    """
    _check_is_causal_lm(target)
    generation_config = generation_config if generation_config is not None else target.generation_config
    _check_generation_config(generation_config)
    prompt_mask = _prepare_inputs(input_ids, attention_mask, target.get_input_embeddings().weight.shape[0])
    _warn_unmasked_left_padding(input_ids, attention_mask, generation_config.pad_token_id)
    if max_new_tokens is None:
        max_new_tokens = generation_config.max_new_tokens
        if max_new_tokens is None:
            max_new_tokens = max(_gen(generation_config, "max_length") - input_ids.shape[1], 0)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    trained = draft.config.block_size
    block_size = trained if block_size is None else block_size
    if not 1 <= block_size <= trained:
        raise ValueError(f"block_size must be in [1, {trained}] (the trained block size), got {block_size}")
    mask_token_id = draft.config.mask_token_id if mask_token_id is None else mask_token_id
    vocab = target.get_input_embeddings().weight.shape[0]
    if isinstance(mask_token_id, bool) or not isinstance(mask_token_id, int) or not 0 <= mask_token_id < vocab:
        raise ValueError(f"mask_token_id={mask_token_id!r} must be an integer in [0, {vocab}) (the target vocabulary)")
    sampling = _resolve_sampling(generation_config, temperature, do_sample, top_k, top_p, min_p, generator,
                                 sample_draft)
    stop_ids = _resolve_stop_ids(stop_token_ids, generation_config)
    check_pairing(draft, target)
    if input_ids.shape[0] > 1 and streamer is not None:
        raise ValueError(f"streamer supports batch size 1, got batch {input_ids.shape[0]}")
    if input_ids.shape[0] > 1 and _has_sliding_layers(target):
        raise NotImplementedError(
            "batched spec_generate with a sliding-window target is not exact (cache holes shift its window); "
            "run the prompts one at a time"
        )
    if return_dict_in_generate is None:
        return_dict_in_generate = bool(getattr(generation_config, "return_dict_in_generate", False))
    pad = generation_config.pad_token_id
    if pad is None:
        pad = stop_ids[0] if stop_ids else 0

    device = target.get_input_embeddings().weight.device
    input_ids, prompt_mask = input_ids.to(device), prompt_mask.to(device)
    if streamer is not None:
        streamer.put(input_ids[0].cpu())
    out = DFlashGenerateOutput(sequences=input_ids, acceptance_lengths=[], row_acceptance_lengths=[[] for _ in input_ids],
                               num_new_tokens=[0] * input_ids.shape[0], num_draft_forwards=0, num_target_forwards=0)
    if max_new_tokens > 0:
        with capture_target_features(target, draft.config.target_layer_ids) as features:
            _decode(draft, target, input_ids, prompt_mask, max_new_tokens, block_size, mask_token_id,
                    sampling, stop_ids, features, streamer, output_timings, pad, out)
    if streamer is not None:
        streamer.end()
    return out if return_dict_in_generate else out.sequences


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _draft_logits(draft, embed, head, anchor, ctx, draft_cache, draft_valid, start, b, mask_token_id):
    """One draft pass over ``[anchor, MASK x (b-1)]`` at positions ``start..start+b-1`` per row.

    Args:
        anchor: ``(B, 1)`` last committed token of each row; ``start`` ``(B,)`` its position.
        ctx: ``_Context`` with the features ``(B, C, F)`` of positions before the anchor that are not
            yet in ``draft_cache``, their positions ``(B, C)`` and validity ``(B, C)``.
        draft_valid: ``(B, cache_len)`` validity of the cached slots, or None when all are valid.

    Returns draft logits ``(B, b-1, V)`` for slots 1..b-1; ``draft_cache`` keeps context K/V only.
    """
    bsz = anchor.shape[0]
    noise = torch.cat([anchor, anchor.new_full((bsz, b - 1), mask_token_id)], dim=1)
    block_pos = start[:, None] + torch.arange(b, device=anchor.device)
    key_valid = None
    if draft_valid is not None or not bool(ctx.valid.all()):
        cached = draft_valid if draft_valid is not None else ctx.valid.new_ones(bsz, draft_cache.get_seq_length())
        key_valid = torch.cat([cached, ctx.valid, ctx.valid.new_ones(bsz, b)], dim=1)
    kept = draft_cache.get_seq_length() + ctx.features.shape[1]
    hidden = draft(position_ids=torch.cat([ctx.positions, block_pos], dim=1), noise_embedding=embed(noise),
                   target_hidden=ctx.features, past_key_values=draft_cache, use_cache=True, attention_mask=key_valid)
    crop_cache(draft_cache, kept)  # block K/V are thrown away
    return head(hidden[:, 1:].to(head.weight.dtype))


@dataclass
class _Context:
    """Target features not yet in the draft cache: ``features (B, C, F)``, ``positions``/``valid`` ``(B, C)``."""

    features: torch.Tensor
    positions: torch.Tensor
    valid: torch.Tensor

    def cat(self, other: "_Context") -> "_Context":
        return _Context(*(torch.cat(pair, dim=1) for pair in zip(
            (self.features, self.positions, self.valid), (other.features, other.positions, other.valid))))

    def select(self, keep) -> "_Context":
        return _Context(self.features[keep], self.positions[keep], self.valid[keep])


@dataclass
class _Rows:
    """Per-row state of the rows still generating (index ``i`` is original row ``ids[i]``)."""

    ids: torch.Tensor  # (A,) original row indices
    anchor: torch.Tensor  # (A, 1) last committed token, not yet seen by the target
    start: torch.Tensor  # (A,) position of the anchor
    n_new: torch.Tensor  # (A,) new tokens committed so far
    target_valid: torch.Tensor  # (A, target cache length) 1 = slot holds a committed token of this row
    draft_valid: Optional[torch.Tensor]  # (A, draft cache length), None while every slot is valid
    ctx: Optional[_Context]  # features not yet in the draft cache; None right after a draft pass

    def select(self, keep):
        for name in ("ids", "anchor", "start", "n_new", "target_valid"):
            setattr(self, name, getattr(self, name)[keep])
        self.draft_valid = None if self.draft_valid is None else self.draft_valid[keep]
        self.ctx = None if self.ctx is None else self.ctx.select(keep)

    def context_drafted(self, draft_len: int):
        """The pending context went into the draft cache (now ``draft_len`` slots long)."""
        if self.draft_valid is not None or not bool(self.ctx.valid.all()):
            cached = self.draft_valid
            if cached is None:
                cached = self.ctx.valid.new_ones(len(self.ids), draft_len - self.ctx.valid.shape[1])
            self.draft_valid = torch.cat([cached, self.ctx.valid], dim=1)
        self.ctx = None

    def add_context(self, ctx: _Context):
        self.ctx = ctx if self.ctx is None else self.ctx.cat(ctx)


def _commit(rows, committed, new, max_new_tokens, stop_ids, chunks, out, streamer):
    """Append each row's accepted tokens, cut at its first stop token and at ``max_new_tokens``
    (by length, never by value). Returns ``(A,)`` bool: the row is done."""
    done = torch.zeros(len(rows.ids), dtype=torch.bool, device=rows.ids.device)
    budget = (max_new_tokens - rows.n_new).tolist()
    for i, (r, a, row_new) in enumerate(zip(rows.ids.tolist(), committed.tolist(), new.tolist())):
        take = row_new[: min(a, budget[i])]
        hit = next((j for j, t in enumerate(take) if t in stop_ids), None)
        if hit is not None:
            take = take[: hit + 1]
        chunks[r].append(take)
        out.row_acceptance_lengths[r].append(a)
        done[i] = hit is not None or len(take) >= budget[i]
        if streamer is not None:
            streamer.put(torch.tensor(take))
    return done


def _forward_target(target, cache_kw, cache, tokens, positions, valid):
    """Target logits ``(A, n, V)`` for ``tokens`` at ``positions``, over cache slots marked ``valid``."""
    mask = None if bool(valid.all()) else torch.cat([valid, valid.new_ones(tokens.shape)], dim=1)
    return target(input_ids=tokens, position_ids=positions, attention_mask=mask, use_cache=True,
                  **{cache_kw: cache}).logits


def _decode(draft, target, input_ids, prompt_mask, max_new_tokens, block_size, mask_token_id, sampling,
            stop_ids, features, streamer, output_timings, pad, out):
    """The speculative loop; fills ``out`` in place."""
    device, bsz = input_ids.device, input_ids.shape[0]
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    cache_kw = _cache_kwarg(target)
    target_cache, draft_cache = DynamicCache(), DynamicCache()
    stop = torch.tensor(stop_ids, dtype=torch.long, device=device)
    chunks = [[] for _ in range(bsz)]
    t0 = _sync(device) if output_timings else None

    # Prefill: each row's first token becomes its first anchor.
    positions = (prompt_mask.cumsum(1) - 1).clamp_min(0)  # true positions under left padding
    extra = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(target.forward).parameters else {}
    logits = target(input_ids=input_ids, position_ids=positions, use_cache=True, **extra,
                    attention_mask=None if bool(prompt_mask.all()) else prompt_mask,
                    **{cache_kw: target_cache}).logits
    first = sampling.first(logits[:, -1])
    out.num_target_forwards, out.num_draft_forwards = 1, 0
    rows = _Rows(ids=torch.arange(bsz, device=device), anchor=first[:, None], start=prompt_mask.sum(1),
                 n_new=torch.ones(bsz, dtype=torch.long, device=device), target_valid=prompt_mask,
                 draft_valid=None, ctx=_Context(features(), positions, prompt_mask))
    for r, token in enumerate(first.tolist()):
        chunks[r].append([token])
    if streamer is not None:
        streamer.put(first.cpu())
    t1 = _sync(device) if output_timings else None
    finished = torch.isin(first, stop) | (rows.n_new >= max_new_tokens)

    while True:
        if bool(finished.any()):  # drop finished rows from every forward pass
            keep = (~finished).nonzero()[:, 0]
            if len(keep) == 0:
                break
            for cache in (target_cache, draft_cache):
                cache.batch_select_indices(keep)
            rows.select(keep)
        b = min(block_size, int((max_new_tokens - rows.n_new).max()))
        block, q = rows.anchor, None
        if b > 1:
            logits = _draft_logits(draft, embed, head, rows.anchor, rows.ctx, draft_cache, rows.draft_valid,
                                   rows.start, b, mask_token_id)
            drafts, q = sampling.propose(logits)
            block = torch.cat([rows.anchor, drafts.to(device)], dim=1)  # (A, b)
            rows.context_drafted(draft_cache.get_seq_length())
            out.num_draft_forwards += 1
        positions = rows.start[:, None] + torch.arange(b, device=device)
        logits = _forward_target(target, cache_kw, target_cache, block, positions, rows.target_valid)
        out.num_target_forwards += 1
        accepted, next_token = sampling.verify(block[:, 1:], q, logits)
        committed = accepted + 1  # (A,) anchor + accepted drafts enter the caches; next_token is the new anchor
        new = torch.cat([block[:, 1:], next_token[:, None]], dim=1).scatter(1, accepted[:, None], next_token[:, None])
        finished = _commit(rows, committed, new, max_new_tokens, stop_ids, chunks, out, streamer)

        # Roll back: keep the committed slots; rejected ones become holes (masked) for shorter rows.
        width = int(committed.max())
        owned = (torch.arange(width, device=device)[None] < committed[:, None]).long()  # (A, width)
        kept = target_cache.get_seq_length() - b + width
        crop_cache(target_cache, kept)
        rows.target_valid = torch.cat([rows.target_valid, owned], dim=1)
        rows.add_context(_Context(features()[:, :width], positions[:, :width], owned))
        rows.start, rows.n_new, rows.anchor = rows.start + committed, rows.n_new + committed, next_token[:, None]

    _assemble(out, input_ids, chunks, pad)
    if output_timings:
        t2 = _sync(device)
        out.timings = {"prefill_s": t1 - t0, "decode_s": t2 - t1, "total_s": t2 - t0,
                       "new_tokens": sum(out.num_new_tokens)}


def _assemble(out, input_ids, chunks, pad):
    """``sequences`` = prompt as given + each row's new tokens, right padded with ``pad``."""
    rows = [sum(row, []) for row in chunks]
    width = max(len(r) for r in rows)
    new = input_ids.new_full((len(rows), width), pad)
    for i, r in enumerate(rows):
        new[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    out.sequences = torch.cat([input_ids, new], dim=1)
    out.num_new_tokens = [len(r) for r in rows]
    out.acceptance_lengths = [a for row in out.row_acceptance_lengths for a in row]


__all__ = [
    "spec_generate", "speculative_verify", "capture_target_features", "check_pairing", "crop_cache",
    "DFlashGenerateOutput",
]
