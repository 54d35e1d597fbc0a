"""What ``spec_generate`` does with each of ``generate``'s arguments, checked before any work.

Like transformers' ``generation/configuration_utils.py``: every ``GenerationConfig`` field sits in exactly
one of ``APPLIED_KEYS`` (applied as generate applies it), ``REFUSED_KEYS`` (cannot be exact here: refused
by name) and ``NO_EFFECT_KEYS`` (accepted, without effect, with the reason); the checks of the prompt,
the mask, the numbers and the draft/target pairing raise before any forward pass.
"""

import functools
import inspect

import torch
from transformers import GenerationConfig, StopStringCriteria
from transformers.utils import logging

try:
    from .dspark import copies_difference
    from .target_cache import check_target_cache
    from .target_taps import _decoder_parts
except ImportError:  # imported from the repository root instead of as a Hub remote-code package
    from dspark import copies_difference
    from target_cache import check_target_cache
    from target_taps import _decoder_parts

logger = logging.get_logger(__name__)


class _NotPassed:
    """Default of every ``generate``-named argument: 'not passed', so an explicit ``None`` means None
    (``top_k=None`` switches top-k off, ``max_new_tokens=None`` ignores the config's value), as in generate."""

    def __repr__(self):
        return "NOT_PASSED"

    def __bool__(self):
        return False


NOT_PASSED = _NotPassed()

# Every GenerationConfig field, in exactly one of three groups (tests/test_generate_parity.py checks that
# the installed transformers has no unclassified field).
APPLIED_KEYS = frozenset({
    # length and stopping (generate's own length rule and stopping criteria)
    "max_length", "max_new_tokens", "min_length", "min_new_tokens", "max_time", "stop_strings", "eos_token_id",
    "pad_token_id",
    # decoding strategy and logits processors (generate's own list, applied to target and draft per slot)
    "do_sample", "temperature", "top_k", "top_p", "min_p", "top_h", "typical_p", "epsilon_cutoff", "eta_cutoff",
    "repetition_penalty", "encoder_repetition_penalty", "no_repeat_ngram_size", "bad_words_ids",
    "renormalize_logits", "forced_bos_token_id", "forced_eos_token_id", "remove_invalid_values",
    "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens", "sequence_bias",
    # output
    "num_return_sequences", "output_scores", "output_logits", "return_dict_in_generate",
})
# Refused by name when set to anything but their neutral value: they cannot be exact here.
REFUSED_KEYS = {
    "num_beams": (1, "beam search keeps several hypotheses; speculative decoding verifies one"),
    "num_beam_groups": (1, "group beam search"),
    "diversity_penalty": (0.0, "group beam search"),
    "constraints": (None, "constrained beam search"),
    "force_words_ids": (None, "constrained beam search"),
    "penalty_alpha": (None, "contrastive search needs the target's hidden states of every candidate"),
    "dola_layers": (None, "DoLa contrasts early-exit logits of every step"),
    "guidance_scale": (1.0, "classifier-free guidance runs a second, unconditional target pass per token"),
    "watermarking_config": (None, "watermarking processors are not verified as pure functions of the prefix"),
    "token_healing": (False, "token healing rewrites the prompt"),
    "output_attentions": (False, "the target runs on blocks: there is no per-token attention tuple"),
    "output_hidden_states": (False, "the target runs on blocks: there is no per-token hidden-state tuple"),
    "prompt_lookup_num_tokens": (None, "another speculative method (prompt lookup)"),
    "assistant_early_exit": (None, "another speculative method (self-speculation by early exit)"),
    "assistant_ensemble_weight": (None, "another speculative method (assistant ensembles)"),
    "use_mtp": (None, "another speculative method (multi-token prediction heads)"),
    "speculation_type": (None, "another speculative method; the DFlash draft here is the speculator"),
    "is_assistant": (False, "the target is not an assistant here"),
    "encoder_no_repeat_ngram_size": (0, "encoder-decoder only (generate raises for decoder-only models)"),
}
# Accepted and without effect on spec_generate, with the reason.
NO_EFFECT_KEYS = {
    "use_cache": "spec_generate always caches (a DynamicCache per model)",
    "cache_implementation": "None/'dynamic': a DynamicCache per model; 'static' selects the fixed-shape loop "
                            "of static_generate.py (batch 1), and so do 'hybrid', 'hybrid_chunked', "
                            "'sliding_window' passed in the call; other values from a generation_config and "
                            "'offloaded*' run the dynamic loop with an info log; 'quantized' in the call is "
                            "refused; generate itself is told None so that it allocates no cache",
    "cache_config": "see cache_implementation",
    "max_cache_len": "see cache_implementation",
    "return_legacy_cache": "the output holds the cache object (batch 1, cache_reuse.py), never a legacy tuple",
    "prefill_chunk_size": "the prompt is prefilled in one pass",
    "compile_config": "with cache_implementation='static' the draft and verify forwards are compiled with it; "
                      "no effect on the dynamic loop",
    "disable_compile": "spec_generate does not compile the forward",
    "continuous_batching_config": "not a continuous-batching engine",
    "low_memory": "beam/contrastive search only",
    "early_stopping": "beam search only",
    "length_penalty": "beam search only",
    "bos_token_id": "input_ids are required (no generation from an empty prompt)",
    "decoder_start_token_id": "encoder-decoder only",
    "num_assistant_tokens": "configures transformers' own assistant; the DFlash block is `block_size`",
    "num_assistant_tokens_schedule": "configures transformers' own assistant",
    "assistant_confidence_threshold": "configures transformers' own assistant",
    "max_matching_ngram_size": "configures prompt lookup",
    "assistant_lookbehind": "configures universal assisted decoding",
    "target_lookbehind": "configures universal assisted decoding",
    "_from_model_config": "metadata",
    "transformers_version": "metadata",
}


# generate()'s own parameters that are not GenerationConfig fields, as spec_generate takes them.
CALL_OPTIONS = {
    "synced_gpus": "None/False: no effect (one process decodes alone; there is no peer process to keep in "
                   "step with dummy forwards); True is refused",
    "use_model_defaults": "transformers 4.57 only (a generate() parameter there): handed to generate, which "
                          "merges generation_config with the target's by it",
}


# spec_generate's own options that generate() does not have: they reach spec_generate unchanged through
# generate(custom_generate=..., assistant_model=draft) and pipelines (spec_generate_from_generate_arguments
# keeps every name of spec_generate's signature), and are checked here before any work.
DFLASH_OPTIONS = {
    "draft_window": "None or an integer N >= 1: every draft layer sees at most the last N context positions "
                    "before the anchor, plus the block (check_draft_window); drafts change, the output does not",
}


def check_draft_window(draft_window) -> None:
    """ValueError naming ``draft_window`` unless it is None or an int >= 1 (not a bool)."""
    if draft_window is not None:
        _check_int("draft_window", draft_window, 1)


def _call_options(kwargs: dict, target) -> dict:
    """Pop ``CALL_OPTIONS`` from ``kwargs``; returns those to hand to ``generate``.

    Raises NotImplementedError for ``synced_gpus=True`` (lock-stepped multi-process decoding is not
    built), before any work; ``use_model_defaults`` is left in ``kwargs`` (a TypeError naming it) where
    the installed ``generate`` has no such parameter (transformers 5.x)."""
    synced = kwargs.pop("synced_gpus", None)
    if synced not in (None, False):
        raise NotImplementedError(
            f"synced_gpus={synced!r} is not supported by spec_generate: it decodes in one process, and keeping "
            "several processes in step (generate's dummy forwards for finished peers) is not built; leave it None/False")
    out = {}
    if "use_model_defaults" in kwargs and "use_model_defaults" in inspect.signature(target.generate).parameters:
        out["use_model_defaults"] = kwargs.pop("use_model_defaults")
    return out


def check_vocab(draft_vocab: int, target_vocab: int) -> None:
    """ValueError naming both sizes unless the target's input embedding has ``draft_vocab`` rows: a drafter
    trained with another tokenizer would borrow rows that mean other tokens (no error, wrong drafts)."""
    if draft_vocab != target_vocab:
        raise ValueError(
            f"the drafter was built for a vocabulary of {draft_vocab} tokens (config vocab_size) but the target's "
            f"input embedding has {target_vocab} rows: this draft was trained for a target with another tokenizer")


NOT_A_DRAFTER = "this is not a DFlash drafter: load it with trust_remote_code=True"


def check_is_drafter(draft) -> None:
    """Refuse a model that is not one of this package's drafters where a drafter belongs: typically the
    plain ``Qwen3Model`` that ``AutoModel.from_pretrained(drafter_folder)`` builds without
    ``trust_remote_code=True`` (it loads with ``fc`` / ``hidden_norm`` unexpected and then cannot draft).

    Raises:
        ValueError: ``draft`` has no drafter class (no ``spec_generate``), naming its class and [`NOT_A_DRAFTER`].
    """
    if not callable(getattr(type(draft), "spec_generate_from_generate_arguments", None)):
        raise ValueError(f"got a {type(draft).__name__} where the DFlash drafter belongs: {NOT_A_DRAFTER} "
                         "(AutoModel.from_pretrained(<drafter folder or repo>, trust_remote_code=True))")


def check_pairing(draft, target):
    """Raise ValueError unless ``draft`` was built for ``target`` (hidden size, layers, vocab). A DSpark drafter
    whose own ``embed_tokens`` / ``lm_head`` differ from the target's is accepted with one warning naming the
    largest difference (``dspark.copies_difference``)."""
    cfg = draft.config
    layers, _ = _decoder_parts(target)
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    t_hidden, t_vocab = embed.weight.shape[1], embed.weight.shape[0]
    check_vocab(cfg.vocab_size, t_vocab)
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
    check_target_cache(target)  # hybrid linear-attention targets: supported families only, exact rollback
    differs = copies_difference(draft, embed, head) if getattr(cfg, "is_dspark", False) else None
    if differs:
        logger.warning(differs)


def _check_is_causal_lm(target):
    """The target needs an input embedding, an output head, a generation_config and ``generate``."""
    try:
        ok = target.get_input_embeddings() is not None and target.get_output_embeddings() is not None
    except (AttributeError, NotImplementedError):
        ok = False
    if not ok or getattr(target, "generation_config", None) is None or not hasattr(target, "generate"):
        raise ValueError(f"target must be a causal LM (an AutoModelForCausalLM), got {type(target).__name__}")


def check_token_prompt(input_ids, kwargs: dict) -> None:
    """Refuse ``inputs_embeds`` by name (with or without ``input_ids``) and a call without ``input_ids``,
    before any forward. The loop prefills, drafts and verifies token ids, so embeddings would be ignored
    or wrong silently; issue 34: ``generate(inputs_embeds=..., custom_generate=<drafter>)`` raised
    ``TypeError: spec_generate() missing ... 'input_ids'``, which did not name ``inputs_embeds``.

    Raises:
        ValueError: ``kwargs["inputs_embeds"]`` is not None (its shape named), or ``input_ids`` is None.
    """
    embeds = kwargs.get("inputs_embeds")
    if embeds is not None:
        raise ValueError(f"inputs_embeds (shape {tuple(getattr(embeds, 'shape', ()))}) is not supported by DFlash "
                         "speculative decoding, with or without input_ids: pass the prompt as token ids (input_ids)")
    if input_ids is None:
        raise ValueError("spec_generate needs input_ids, the prompt's token ids (batch, prompt_len); got none")


def _prepare_inputs(input_ids, attention_mask, vocab_size):
    """Validate ``input_ids`` ``(B, L)`` (any integer dtype, returned as int64) and the left-padding
    ``attention_mask``; returns ``(input_ids, mask)``."""
    if not torch.is_tensor(input_ids) or input_ids.dim() != 2:
        raise ValueError(f"input_ids must be a (batch, prompt_len) LongTensor, got {getattr(input_ids, 'shape', input_ids)}")
    if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
        raise ValueError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
    input_ids = input_ids.long()
    if input_ids.shape[1] == 0:
        raise ValueError("the prompt is empty: spec_generate needs at least one input token")
    low, high = int(input_ids.min()), int(input_ids.max())
    if low < 0 or high >= vocab_size:
        raise ValueError(f"input_ids hold ids in [{low}, {high}], outside the target vocabulary [0, {vocab_size})")
    if attention_mask is None:
        return input_ids, torch.ones_like(input_ids)
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
    return input_ids, mask


def _check_int(name, value, low, high=None):
    """ValueError naming ``name`` unless ``value`` is an int (not a bool) in ``[low, high]``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        if high is not None:
            raise ValueError(f"{name} must be in [{low}, {high}] (an integer), got {value!r}")
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


def _check_sampling_values(kwargs):
    """Out-of-range sampling values, named before any work (generate would raise later or ignore them)."""
    t, k, p, m = (kwargs.get(n) for n in ("temperature", "top_k", "top_p", "min_p"))
    for name, value in (("temperature", t), ("top_k", k)):
        if value is not None and value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    if p is not None and not 0 < p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {p}")
    if m is not None and not 0 <= m <= 1:
        raise ValueError(f"min_p must be in [0, 1], got {m}")


def _check_refused(generation_config, where="generation_config"):
    """NotImplementedError naming the first option that spec_generate cannot apply exactly."""
    for name, (neutral, why) in REFUSED_KEYS.items():
        value = generation_config.get(name) if isinstance(generation_config, dict) else getattr(
            generation_config, name, None)
        if value is not None and value is not False and value != neutral:
            raise NotImplementedError(
                f"{name}={value!r} is not supported by spec_generate ({why}); "
                f"leave it at {neutral!r} (set in {where})"
            )


@functools.lru_cache(maxsize=1)
def _known_keys() -> frozenset:
    """Every keyword ``spec_generate`` takes through ``**kwargs``: the ``GenerationConfig`` fields of the installed
    transformers and ours. Built once per process (a ``GenerationConfig().to_dict()`` deep-copies every field)."""
    return frozenset(GenerationConfig().to_dict()) | frozenset(REFUSED_KEYS) | frozenset(NO_EFFECT_KEYS) | APPLIED_KEYS


def _generate_kwargs(passed: dict, kwargs: dict, stop_token_ids, generation_config, target) -> dict:
    """The keyword arguments handed to ``generate``: passed ``generate``-named arguments and every
    ``GenerationConfig`` field in ``kwargs`` (TypeError for any other name), ``stop_token_ids`` as
    ``eos_token_id``, ``temperature=0`` as greedy."""
    unknown = sorted(set(kwargs) - _known_keys())
    if unknown:
        raise TypeError(f"spec_generate() got unexpected keyword argument(s) {unknown}: not GenerationConfig "
                        "fields nor spec_generate arguments")
    out = {k: v for k, v in passed.items() if v is not NOT_PASSED}
    out.update(kwargs)
    if stop_token_ids is not None:
        ids = [stop_token_ids] if isinstance(stop_token_ids, int) else [
            int(t) for t in (stop_token_ids.tolist() if torch.is_tensor(stop_token_ids) else stop_token_ids)]
        out["eos_token_id"] = ids or None
    if out.get("temperature") == 0:  # documented extension: temperature 0 is greedy, whatever do_sample says
        del out["temperature"]
        out["do_sample"] = False
    if "max_new_tokens" in out and out["max_new_tokens"] is not None:
        _check_int("max_new_tokens", out["max_new_tokens"], 0)
    _check_sampling_values(out)
    _check_refused(out, where="the call")
    configs = [c for c in (generation_config, target.generation_config) if c is not None]
    if out.get("cache_implementation") is not None or any(getattr(c, "cache_implementation", None) for c in configs):
        out["cache_implementation"] = None  # no effect here; keeps generate from allocating a static cache
    return out


def _stop_strings(gen_kwargs, generation_config, target, tokenizer):
    """The stop strings in effect (the passed value, else the passed config's, else the target's) as a
    ``StopStringCriteria``, or None. Built here because generate drops ``tokenizer`` on the
    ``custom_generate`` path; ``gen_kwargs['stop_strings']`` is then set to None for generate."""
    if "stop_strings" in gen_kwargs:
        strings = gen_kwargs["stop_strings"]
    else:
        strings = next((c.stop_strings for c in (generation_config, target.generation_config)
                        if c is not None and getattr(c, "stop_strings", None) is not None), None)
    if strings is None:
        return None
    gen_kwargs["stop_strings"] = None
    if tokenizer is None:
        raise ValueError("stop_strings need the tokenizer: pass tokenizer= to spec_generate, as to generate")
    return StopStringCriteria(tokenizer=tokenizer, stop_strings=strings)


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


def _eos_list(config) -> list:
    eos = config.eos_token_id
    if eos is None:
        return []
    return [eos] if isinstance(eos, int) else [int(t) for t in (eos.tolist() if torch.is_tensor(eos) else eos)]


__all__ = ["NOT_PASSED", "APPLIED_KEYS", "REFUSED_KEYS", "NO_EFFECT_KEYS", "CALL_OPTIONS", "DFLASH_OPTIONS",
           "check_draft_window", "check_pairing", "check_vocab"]
