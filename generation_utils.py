"""Lossless speculative decoding with a DFlash draft: ``spec_generate`` and the decode loop.

One step (notes section 1): the draft fills the block ``[anchor, MASK x (b-1)]`` in one pass,
conditioned on the captured target features of every committed position before the anchor; the
target verifies the block in one pass. Greedy: the longest prefix of drafts equal to the target's
argmax is kept, plus the target's token at the first mismatch (the bonus token). Sampling: drafts
pass or fail the speculative-sampling test and the first failure is replaced by a residual sample
(``speculative_verify``). Both KV caches are then cut back to the committed length; in a batch,
every row commits its own count. Hybrid linear-attention targets (Qwen3.5 / Qwen3.6, Qwen3-Next)
also get their recurrent and convolution states put back at exactly the committed tokens
(``target_cache.py``: snapshot before verify, per-row replay of the committed prefix).

Arguments are resolved by ``target.generate`` itself (``custom_generate=`` with a callable runs
generate's own config merging, length rule, warnings, logits processors and stopping criteria, then
hands them to our loop), so ``spec_generate`` decides exactly what ``generate`` decides.
"""

import functools
import inspect
from dataclasses import dataclass
from typing import Optional

import torch
from transformers import CompileConfig, GenerationConfig, LogitsProcessorList, StoppingCriteriaList
from transformers.utils import logging

# The modules below hold the pieces; this one holds the public entry and the loops that orchestrate them.
# Every name of this module's `__all__` before the split stays importable from here.
try:
    from .cache_reuse import CACHE_FIELD, Resume, check_passed_cache, leave_inference_mode, pop_passed_cache
    from .decode_step import _Context, _Rows, _Run, _cache_kwarg, _commit, _forward_target
    from .decode_step import _prefill_commit, _sync, _trim_to_batch_end, compact_cache, crop_cache
    from .draft_trees import _gather_nodes, check_tree
    from .proposers import AUTO_TREE_BUDGET, BlockProposer, Proposal, check_confidence_threshold, proposer_for
    from .generation_arguments import APPLIED_KEYS, NO_EFFECT_KEYS, NOT_PASSED, REFUSED_KEYS, check_is_drafter
    from .generation_arguments import check_pairing
    from .generation_arguments import _call_options, check_draft_window, check_token_prompt, check_vocab
    from .generation_arguments import _check_int, _check_is_causal_lm, _check_refused, _eos_list, _generate_kwargs
    from .generation_arguments import _prepare_inputs, _stop_strings, _warn_unmasked_left_padding
    from .generation_output import DFlashGenerateOutput, _assemble, _empty_output, per_slot_acceptance, plot_acceptance
    from .generation_output import warn_if_not_drafting
    from .native_routes import CUSTOM_GENERATE_PY, native_acceptance_stats, write_custom_generate
    from .speculative_sampling import _History, _Sampling, speculative_verify
    from .static_generate import log_fallback, static_decode, static_unsupported_reason
    from .stopping_criteria import _Scores, _Stops
    from .target_cache import restore_linear_states
    from .target_facts import TargetFacts
    from .target_families import FAMILY as _families
    from .target_taps import capture_target_features
    from .user_processors import check_copyable, is_user_processor
    from .verify_cost import call_cost
    from .verify_policy import check_adaptive, policy_for, policy_wanted
except ImportError:  # imported from the repository root instead of as a Hub remote-code package
    from cache_reuse import CACHE_FIELD, Resume, check_passed_cache, leave_inference_mode, pop_passed_cache
    from decode_step import _Context, _Rows, _Run, _cache_kwarg, _commit, _forward_target
    from decode_step import _prefill_commit, _sync, _trim_to_batch_end, compact_cache, crop_cache
    from draft_trees import _gather_nodes, check_tree
    from proposers import AUTO_TREE_BUDGET, BlockProposer, Proposal, check_confidence_threshold, proposer_for
    from generation_arguments import APPLIED_KEYS, NO_EFFECT_KEYS, NOT_PASSED, REFUSED_KEYS, check_is_drafter
    from generation_arguments import check_pairing
    from generation_arguments import _call_options, check_draft_window, check_token_prompt, check_vocab
    from generation_arguments import _check_int, _check_is_causal_lm, _check_refused, _eos_list, _generate_kwargs
    from generation_arguments import _prepare_inputs, _stop_strings, _warn_unmasked_left_padding
    from generation_output import DFlashGenerateOutput, _assemble, _empty_output, per_slot_acceptance, plot_acceptance
    from generation_output import warn_if_not_drafting
    from native_routes import CUSTOM_GENERATE_PY, native_acceptance_stats, write_custom_generate
    from speculative_sampling import _History, _Sampling, speculative_verify
    from static_generate import log_fallback, static_decode, static_unsupported_reason
    from stopping_criteria import _Scores, _Stops
    from target_cache import restore_linear_states
    from target_facts import TargetFacts
    from target_families import FAMILY as _families
    from target_taps import capture_target_features
    from user_processors import check_copyable, is_user_processor
    from verify_cost import call_cost
    from verify_policy import check_adaptive, policy_for, policy_wanted

logger = logging.get_logger(__name__)


def _through_generate(target, input_ids, attention_mask, loop, model_inputs=None, **generate_kwargs):
    """Run ``target.generate`` up to its decoding loop, then ``loop`` instead of its own; returns what
    ``loop`` returned.

    ``generate(custom_generate=<callable>)`` (transformers >= 4.56, public) runs generate's own
    argument resolution (generation_config merging, kwargs, the default length rule and its warnings,
    special tokens, ``num_return_sequences`` expansion, the prompt to the streamer) and builds its
    logits processors and stopping criteria, then calls the callable with
    ``(model, input_ids, logits_processor, stopping_criteria, generation_config, **model_kwargs)``.
    This is the one place that relies on that contract (tested on 4.57 and 5.x). On that path
    generate drops ``tokenizer`` (see ``_stop_strings``); its result is ignored (4.57 post-processes it).
    ``model_inputs`` (multimodal inputs, ``target_families.pop_model_inputs``) go to generate as model
    kwargs; the loop gets them back as generate prepared them (expanded for ``num_return_sequences``),
    with generate's own ``position_ids`` where it built them (transformers 5.x).
    """
    result, model_inputs = {}, model_inputs or {}

    def decoding(model, input_ids, logits_processor=None, stopping_criteria=None, generation_config=None,
                 **model_kwargs):
        mask = model_kwargs.get("attention_mask")
        vision = None
        if model_inputs:
            inputs = _families.prepared_model_inputs(model_kwargs)
            full = torch.ones_like(input_ids) if mask is None else mask.to(device=input_ids.device, dtype=torch.long)
            vision = _families.vision_prompt(model, input_ids, full, inputs, model_kwargs.get("position_ids"))
        result["out"] = loop(input_ids, mask, generation_config, logits_processor, stopping_criteria, vision)
        return input_ids

    target.generate(input_ids, attention_mask=attention_mask, custom_generate=decoding, **model_inputs,
                    **generate_kwargs)
    return result["out"]


@torch.no_grad()  # inference_mode on top of it inside the loop, unless the caller opts out (`inference_mode`)
def spec_generate(
    draft,
    target,
    input_ids: Optional[torch.LongTensor] = None,
    max_new_tokens=NOT_PASSED,
    stop_token_ids=None,
    temperature=NOT_PASSED,
    *,
    do_sample=NOT_PASSED,
    top_k=NOT_PASSED,
    top_p=NOT_PASSED,
    min_p=NOT_PASSED,
    sample_draft: bool = True,
    block_size: Optional[int] = None,
    attention_mask: Optional[torch.Tensor] = None,
    generation_config: Optional[GenerationConfig] = None,
    logits_processor: Optional[LogitsProcessorList] = None,
    stopping_criteria: Optional[StoppingCriteriaList] = None,
    prefix_allowed_tokens_fn=None,
    tokenizer=None,
    generator: Optional[torch.Generator] = None,
    streamer=None,
    return_dict_in_generate=NOT_PASSED,
    output_scores=NOT_PASSED,
    output_logits=NOT_PASSED,
    output_timings: bool = False,
    mask_token_id: Optional[int] = None,
    adaptive_block_size: Optional[bool] = None,
    verify_cost=None,
    draft_window: Optional[int] = None,
    inference_mode: bool = True,
    tree_budget: Optional[int] = None,
    low_acceptance_warning=NOT_PASSED,
    confidence_threshold: float = 0.0,
    **kwargs,
):
    """Generate with ``target``, drafting blocks with ``draft``; the output is the target's own.

    Takes ``generate``'s arguments and decides what ``generate`` decides: ``target.generate`` itself
    resolves them (``generation_config`` merged with the target's, keyword arguments over it, the
    default length of 20 new tokens and its warnings) and builds its own logits processors and
    stopping criteria, which this loop applies to target AND draft logits, at every block slot with
    that slot's own prefix. Greedy (``do_sample=False`` in the merged config) equals
    ``target.generate(do_sample=False)`` token for token in fp32; sampling is exact speculative
    sampling (``speculative_verify``) on the processed distributions, so the output has the target's
    distribution under the same processors.

    Args:
        draft: a ``DFlashDraftModel``. A ``DFlash2DraftModel`` drafts each block by its candidate-selector
            walk (``dflash2.selector_walk``): logits processors act on each slot's draft logits with the
            prefix the walk chose before it, warpers on the target only, and under sampling the walk's
            ``softmax(score / temperature)`` rows are the q of the rejection test (issue 21).
        target: the causal LM the draft was trained for (any device/dtype; features are cast).
        input_ids: ``(B, prompt_len)`` integer tensor (any integer dtype); rows of different lengths are
            LEFT padded and described by ``attention_mask`` (1 = real token). Required; ``inputs_embeds``
            is refused by name, with or without it (the loop drafts and verifies token ids).
        max_new_tokens, temperature, do_sample, top_k, top_p, min_p, return_dict_in_generate,
            output_scores, output_logits, and any other ``GenerationConfig`` field as a keyword: as in
            ``generate``. Left out = "not passed" (the merged config decides); an explicit ``None`` means
            None (``top_k=None`` disables top-k, ``max_new_tokens=None`` ignores the config's value).
            ``temperature`` alone never switches sampling on. Extensions: ``temperature=0`` is greedy
            even when the config says ``do_sample=True``; ``max_new_tokens=0`` returns the prompt.
        stop_token_ids: int or list, used as ``eos_token_id``; None -> the merged config's eos; ``[]``
            -> none. A row ends right after its first stop token, even inside an accepted block.
        sample_draft: under sampling, draw draft tokens from the draft's processed distribution q
            (default) rather than taking its argmax. Acceptance is then ``sum_x min(p, q)``, which
            tends to 1 as the draft matches the target; a one-hot draft is accepted with
            ``p(argmax q) <= max p``. Both are exact. A DFlash 2 walk draws or takes its argmax alike.
        block_size: per-call block size, an integer in ``[1, draft.config.block_size]``.
        attention_mask: ``(B, prompt_len)`` 0/1, left padding only.
        generation_config: a ``GenerationConfig`` merged with ``target.generation_config`` as generate does.
        logits_processor: extra processors, as in generate. They may keep state (xgrammar's pattern):
            drafted slots are scored by per-step copies (``copy.deepcopy``), the caller's instance is called
            on committed tokens only, once per token and in order, with the whole ``(B, L)`` batch, each
            row's own prefix at its own index; rows of a batch then commit in lockstep
            (``user_processors.py``). A caller's subclass of a transformers processor counts as the caller's.
            A processor ``deepcopy`` cannot copy: ValueError.
        prefix_allowed_tokens_fn: as in generate. It is also called on drafted prefixes that may be
            rejected, and ``deepcopy`` copies a function by reference (a closure's state is shared, not
            isolated), so it must be a pure function of ``(batch_id, input_ids)``; generate assumes the same
            (beam search calls it on hypotheses it drops). Keep state in a processor object instead.
        stopping_criteria: extra criteria, as in generate, called once per committed token in order
            with that row's ``(1, L)`` prefix and ``scores=None`` (answering a bool, a bool tensor or a
            list); a row stops right after the first token at which one fires. Without an eos
            criterion, a stopped row of a batch keeps generating until every row has stopped (generate
            pads finished rows only when an eos criterion exists).
        tokenizer: needed for ``stop_strings``, as in generate.
        generator: ``torch.Generator`` (on the target's device) for reproducible sampling.
        streamer: a transformers ``BaseStreamer`` (batch size 1): gets the prompt once, then each
            committed chunk, never a token past a stop.
        output_timings: add device-synchronised wall-clock timings (seconds) to the output.
        adaptive_block_size: None (default) or True: the verify-length policy (``verify_policy.py``) chooses
            each step how many drafted positions to verify, from the draft's confidence (a DSpark drafter's
            confidence head where it has one), what the call has seen its drafts get accepted, and the modelled
            cost of a verified position on this target, device and batch width; a step may verify none (a plain
            target step without a draft pass: ``row_draft_lengths`` 0, counted apart in ``plain_steps``). The
            cut is a stopping rule, so outputs are unchanged, sampled ones included. False: every step drafts
            and verifies the whole block. The default runs the policy wherever it applies and otherwise the
            fixed blocks without a word (the static loop, an integer ``tree_budget``); True asks for it (one
            info log on the static loop, ValueError with an integer ``tree_budget``). No generation runs for
            the cost: a machine's first call measures a few raw matmuls once (under a second,
            ``verify_cost.device_speed``).
        verify_cost: the policy's cost, instead of ``$DFLASH_VERIFY_COST`` (the same as JSON) or the model
            of ``verify_cost.py``: a ``StepCost`` (from any copy of the module), a mapping ``{"widths": ...,
            "verify": ..., "draft": ...}`` or an object with those fields; pins the policy, e.g. for identical
            seeded tokens across machines.
            ValueError with ``adaptive_block_size=False``.
        draft_window: None (default: the draft attends over the whole context), or an integer N >= 1: every
            draft layer attends to at most the last N context positions before the anchor, plus the block
            (a layer with its own ``sliding_window`` W keeps it too: W - 1 context positions before the
            anchor, so the smaller one rules). Only the drafts change, never the output (the target
            verifies as always). Cost: at batch 1 without padding the draft's attention reads only those
            N + block keys; in a ragged batch and on the static loop the keys stay and the mask hides them.
            Memory: the draft's context cache keeps every position (a ``DynamicCache`` cannot drop its oldest
            entries, and a returned cache must hold the whole context): ``2 * layers * kv_heads * head_dim``
            values per position (40 MB at 2k positions for a 5-layer Qwen3-8B drafter in bf16).
            z-lab's MLX loop (``dflash/model_mlx.py``, ``sliding_window_size``) bounds the memory with a
            rotating cache instead, and its window is looser: the first draft pass sees the whole prompt,
            later ones the last N - 1 cached positions plus the step's new ones (up to N + 15).
        inference_mode: run the forwards under ``torch.inference_mode()`` (default; drafter and target
            forwards are about 10% cheaper on CPU than under ``no_grad``). The returned ``sequences``
            and cache are ordinary tensors either way (``cache_reuse.leave_inference_mode``); pass False
            when tensors made during the call must be usable by autograd afterwards (e.g. features kept
            by the caller's own forward hooks).
        mask_token_id: override of ``draft.config.mask_token_id``.
        low_acceptance_warning: accepted drafts per step (default 0.1, or the ``generation_config``'s
            ``low_acceptance_warning`` attribute) at or under which a call that ran at least 16 verify steps
            with drafted tokens (or 3 that tried 8 drafted positions) logs one warning that the drafter is not drafting, naming the figure and the
            usual causes (``generation_output.warn_if_not_drafting``; steps with no drafted token do not
            count). None: never. The output is never changed by it.
        tree_budget: None (default: each step verifies one chain of drafts), or an integer N >= 1: each step
            verifies a tree of at most N drafted nodes below the anchor in one target forward
            (``draft_trees.py``): DFlash 1 drafters get DDTree's best-first tree over the slots' raw draft
            log-probs (Ringel & Romano, arXiv 2604.12989), DFlash 2 drafters a tree over the candidate
            selector's pairwise scores (SGLang PR #36196). The walk follows the target's own argmax (greedy)
            or its own draw at each node (sampling: sample-and-match, every committed token a draw from the
            target given its own prefix), so the output is unchanged: only acceptance changes. The block
            size bounds the tree's depth (``block_size - 1`` drafted slots; clamped near the end of the call
            as the chain's block is). ``sample_draft`` has no effect on trees. ``per_slot_acceptance`` then
            counts per depth. Refused by name (ValueError): with ``adaptive_block_size=True``, the caller's own
            logits processors, hybrid linear-attention or flash-attention targets. With
            ``cache_implementation="static"`` the call runs the dynamic loop (one info log).
        confidence_threshold: DSpark drafters with a confidence head only (0, the default: the full block):
            each step's block is cut at its first slot whose sigmoid confidence is below it, as DeepSpec's
            ``build_dspark_proposal`` does (a cut at slot 0 is a plain target step). Batch 1 for now.
        pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw, token_type_ids,
            mm_token_type_ids, image_sizes, ... (keywords): a vision-language target's own inputs, any name
            its ``forward`` takes besides the prompt, as the processor returns them. They go to ``generate``
            and reach the prefill exactly as it prepares them (``target_families.pop_model_inputs``); every
            later verify forward uses the target's own positions (Qwen M-RoPE: positions after an image
            are the sequence index + a per-row delta, computed per call, ``target_families.VisionPrompt``).
        cache / past_key_values (keywords; ``cache=`` on transformers >= 5 only, as in generate): a
            ``DynamicCache`` holding the first tokens of ``input_ids`` (batch 1, no padding): only the rest is
            prefilled. It is advanced in place, as generate does (``copy.deepcopy`` it to reuse it, e.g. a
            system prompt for several conversations) and returned in the output's ``cache`` /
            ``past_key_values`` field; one that spec_generate returned also carries the draft's context
            (``cache_reuse.py``).

    ``max_time`` is checked once per verify step, after the commit: the call returns within
    ``max_time`` plus one step, and the output is a prefix of the unlimited output.

    Precision: greedy equality with ``generate`` is token for token in fp32. In bf16/fp16 the verify
    block (several tokens in one forward) and generate's one-token forwards round differently, so the
    outputs may part where two logits are nearly tied.

    ``cache_implementation``: from a generation_config, anything but "static" runs the dynamic loop
    (one info log); in the call, "static", "hybrid", "hybrid_chunked", "sliding_window" ask for the static
    loop, "offloaded*" runs the dynamic loop (one info log), "quantized" raises NotImplementedError.
    ``synced_gpus``: None/False accepted (no effect), True raises NotImplementedError.

    Returns:
        ``(B', prompt_len + new_len)`` LongTensor (``B' = B * num_return_sequences``): the prompt as
        given, then each row's new tokens, right padded with the pad token (the merged config's
        ``pad_token_id``, else the first eos, else 0) up to the longest row. Cut by length, never by
        value: tokens equal to ``mask_token_id`` are kept. Or, with ``return_dict_in_generate``, a
        [`DFlashGenerateOutput`] (a ``GenerateDecoderOnlyOutput`` with tau and per-slot acceptance, and at
        batch 1 the target's cache to continue from).

    Draft context and positions: the draft reads the target's features at every committed position,
    image and video tokens included, at 1-D positions (the sequence index with image tokens counted, as
    in its training), whatever positions the target itself uses.

    Batches: every row keeps its own true positions (``cumsum(attention_mask) - 1``) and accepts its
    own number of tokens per step. Rows share one KV cache per model; slots a row does not own
    (left padding, drafts it rejected while another row accepted more) are masked out of attention
    by the 2-D attention mask, and RoPE uses the explicit positions, so each row computes exactly
    what it computes alone, up to floating-point summation order. Finished rows are dropped from
    the caches. On sliding-window targets transformers counts the window in cache slots, which holes
    would shift, so those forwards get explicit 4-D masks counting it in true positions
    (``target_families.window_masks``); the draft's own sliding layers
    take key positions from the mask and stay exact. Linear-attention layers of hybrid targets keep
    one state per row, unaffected by left padding (transformers zeroes padded inputs in the prefill)
    and replayed per row after each verify (``target_cache.HybridCache``).

    Raises:
        TypeError: a keyword that is neither a ``GenerationConfig`` field nor an argument here.
        ValueError: a ``draft`` that is no DFlash drafter (a plain ``Qwen3Model`` loaded without
            ``trust_remote_code=True``); bad input (ids or none, ``inputs_embeds``, mask, non-integer ``block_size``/``max_new_tokens``, sampling
            values out of range, a logits processor that cannot be copied) or a draft not built for this
            target (another vocabulary size included, naming both), before any forward pass; a passed
            cache with a batch, a padded prompt, as many tokens as ``input_ids``, or the static loop.
        NotImplementedError: options that cannot be exact here (``REFUSED_KEYS``: beam search, DoLa,
            contrastive search, guidance, other speculative methods, attentions/hidden states,
            token healing), recurrent-state targets outside ``target_cache.HYBRID_FAMILIES`` (or on a
            transformers version without linear-attention cache layers, e.g. Qwen3-Next on 4.57),
            families refused by name (``target_families``), a call that would cross a ``dynamic``
            RoPE switch (no budget: any such target), or a ``longrope`` one in a batch, with padding,
            or where generate's own re-prefill is not followed (``target_families.check_rope``;
            Phi-3-style targets at batch 1 cross it exactly: blocks clamped, one re-prefill); multimodal
            inputs with the static loop, a passed cache or a longrope re-prefill, for Mllama, or for an
            M-RoPE target without ``get_rope_index`` (``target_families.vision_prompt``).
    """
    check_is_drafter(draft)
    check_token_prompt(input_ids, kwargs)
    _check_is_causal_lm(target)
    facts = TargetFacts.read(target, draft)  # what the loop needs to know about the target, read once
    vocab = facts.embed.weight.shape[0]
    check_vocab(draft.config.vocab_size, vocab)
    input_ids, prompt_mask = _prepare_inputs(input_ids, attention_mask, vocab)
    _warn_unmasked_left_padding(input_ids, attention_mask, (generation_config or target.generation_config).pad_token_id)
    trained = proposer_for(draft).verify_width(draft.config)  # DSpark: block_size drafts, one more verified
    block_size = trained if block_size is None else block_size
    _check_int("block_size", block_size, 1, trained)
    check_draft_window(draft_window)
    check_adaptive(adaptive_block_size, verify_cost, tree_budget)
    check_tree(tree_budget, adaptive=adaptive_block_size is True, facts=facts)
    if low_acceptance_warning is NOT_PASSED:
        low_acceptance_warning = getattr(generation_config or target.generation_config, "low_acceptance_warning", 0.1)
    if low_acceptance_warning is not None and (isinstance(low_acceptance_warning, bool) or not isinstance(
            low_acceptance_warning, (int, float)) or low_acceptance_warning < 0):
        raise ValueError(f"low_acceptance_warning={low_acceptance_warning!r} must be None or a number >= 0 "
                         "(accepted drafted tokens per verify step)")
    check_confidence_threshold(draft, confidence_threshold, input_ids.shape[0])
    mask_token_id = draft.config.mask_token_id if mask_token_id is None else mask_token_id
    if isinstance(mask_token_id, bool) or not isinstance(mask_token_id, int) or not 0 <= mask_token_id < vocab:
        raise ValueError(f"mask_token_id={mask_token_id!r} must be an integer in [0, {vocab}) (the target vocabulary)")
    passed = dict(max_new_tokens=max_new_tokens, temperature=temperature, do_sample=do_sample, top_k=top_k,
                  top_p=top_p, min_p=min_p, return_dict_in_generate=return_dict_in_generate,
                  output_scores=output_scores, output_logits=output_logits)
    passed_cache = pop_passed_cache(kwargs)  # cache= / past_key_values=: continue from it (cache_reuse.py)
    call_options = _call_options(kwargs, target)  # synced_gpus, use_model_defaults (generate's own parameters)
    model_inputs = _families.pop_model_inputs(target, facts.forward_params, kwargs)  # pixel_values, ...
    static = _static_request(kwargs, generation_config, target)  # before generate is told cache_implementation=None
    gen_kwargs = _generate_kwargs(passed, kwargs, stop_token_ids, generation_config, target)
    if generation_config is not None:
        _check_refused(generation_config)
    check_pairing(draft, target)
    if input_ids.shape[0] > 1 and streamer is not None:
        raise ValueError(f"streamer supports batch size 1, got batch {input_ids.shape[0]}")
    criteria = StoppingCriteriaList(stopping_criteria or [])
    stop_strings = _stop_strings(gen_kwargs, generation_config, target, tokenizer)
    if stop_strings is not None:
        criteria.append(stop_strings)

    def loop(ids, mask, config, processors, stops, vision=None):
        return _spec_loop(draft, target, ids, mask, config, processors, stops, block_size=block_size,
                          mask_token_id=mask_token_id, generator=generator, sample_draft=sample_draft,
                          streamer=streamer, output_timings=output_timings, static=static,
                          adaptive=adaptive_block_size, inference_mode=inference_mode, passed_cache=passed_cache,
                          vision=vision, draft_window=draft_window, facts=facts, tree_budget=tree_budget,
                          low_acceptance=low_acceptance_warning, confidence_threshold=confidence_threshold,
                          verify_cost=verify_cost)

    if gen_kwargs.get("max_new_tokens") == 0:  # documented extension: the prompt back (generate raises)
        if streamer is not None:
            streamer.put(input_ids[0].cpu())
            streamer.end()
        out = _empty_output(input_ids)
        wants_dict = gen_kwargs.get("return_dict_in_generate")
        if wants_dict is None:
            wants_dict = (generation_config or target.generation_config).return_dict_in_generate
        return out if wants_dict else out.sequences
    return _through_generate(target, input_ids, prompt_mask, loop, model_inputs, generation_config=generation_config,
                             logits_processor=logits_processor, stopping_criteria=criteria,
                             prefix_allowed_tokens_fn=prefix_allowed_tokens_fn, streamer=streamer, **call_options,
                             **gen_kwargs)


def _spec_loop(draft, target, input_ids, mask, config, processors, criteria, *, block_size, mask_token_id,
               generator, sample_draft, streamer, output_timings, static=None, adaptive=None, inference_mode=True,
               passed_cache=None, vision=None, draft_window=None, facts=None, tree_budget=None, low_acceptance=None,
               confidence_threshold=0.0, verify_cost=None):
    """What runs inside ``generate`` (see ``_through_generate``): checks of the resolved call, then ``_decode``.
    ``vision``: the call's multimodal prompt (``target_families.VisionPrompt``), or None. ``facts``: the
    target's ``TargetFacts``, completed here with the prompt's (execution device, longrope switch crossed).
    ``tree_budget``: see ``spec_generate``; refused here with the caller's own logits processors.
    ``low_acceptance``: ``spec_generate``'s ``low_acceptance_warning``, resolved."""
    _check_refused(config)
    bsz = input_ids.shape[0]
    if bsz > 1 and streamer is not None:
        raise ValueError(f"streamer supports batch size 1, got batch {bsz}")
    mask = torch.ones_like(input_ids) if mask is None else mask.to(device=input_ids.device, dtype=torch.long)
    check_passed_cache(passed_cache, input_ids, mask, target, static)
    stops = _Stops(criteria, input_ids.shape[1], bsz)
    budget = stops.budget if stops.budget is not None else 1 << 40
    facts = facts.for_call(target, input_ids, mask, budget)  # the prompt's facts: device, longrope switch
    input_ids, mask = input_ids.to(facts.device), mask.to(facts.device)
    _check_vision(vision, static, passed_cache, facts.crossing)
    want_scores, want_logits = bool(config.output_scores), bool(config.output_logits)
    return_dict = bool(config.return_dict_in_generate)
    processors = processors if processors is not None else LogitsProcessorList()
    sampling = _Sampling(processors, bool(config.do_sample), generator, sample_draft,
                         want_scores=return_dict and (want_scores or want_logits),
                         user=check_copyable(processors))  # before any forward
    if tree_budget is not None and sampling.user:
        raise ValueError(f"tree_budget={tree_budget} cannot run with the caller's own logits processors "
                         f"({[type(p).__name__ for p in processors if is_user_processor(p)]}): a tree would need a copy "
                         "per branch; use the chain (tree_budget=None)")
    pad = config.pad_token_id
    if pad is None:
        pad = (_eos_list(config) or [0])[0]
    history = None
    if sampling.needs_prefix or stops.others:
        history = _History(input_ids, stops.budget, block_size, pad)
        sampling.history = history
    out = _empty_output(input_ids)
    recorder = _Scores(bsz, want_scores, want_logits) if return_dict and (want_scores or want_logits) else None
    run = _Run(out=out, chunks=[[] for _ in range(bsz)], stops=stops, history=history, streamer=streamer,
               recorder=recorder)
    static_decode = _static_loop(static, target, input_ids, mask, run, facts, block_size, adaptive, draft,
                                 tree=tree_budget is not None)
    cost = None  # the verify-length policy's StepCost, resolved before any forward of the call
    if static_decode is None and policy_wanted(adaptive, tree_budget) and block_size > 1 and budget > 1:
        cost = call_cost(target, draft, facts, input_ids, budget, block_size,
                         AUTO_TREE_BUDGET if tree_budget == "auto" else None, draft_window, verify_cost)
    with torch.inference_mode(inference_mode):
        if static_decode is not None:  # fixed-shape loop, static_generate.py
            static_decode(draft, target, input_ids, block_size, mask_token_id, sampling, output_timings, run,
                          draft_window=draft_window, facts=facts)
        else:
            with capture_target_features(target, draft.config.target_layer_ids, facts.draft_device) as features:
                _decode(draft, target, input_ids, mask, block_size, mask_token_id, sampling, features, output_timings,
                        run, facts, adaptive, passed_cache, vision, draft_window, tree_budget, confidence_threshold,
                        cost)
    if return_dict or passed_cache is not None:  # the cache reaches the user: no inference tensors in it
        leave_inference_mode(out.get(CACHE_FIELD))
    _trim_to_batch_end(run)  # no eos criterion: rows end where the batch's last row stopped
    warn_if_not_drafting(out, low_acceptance)
    _assemble(out, input_ids, run, pad)
    if streamer is not None:
        streamer.end()
    return out if return_dict else out.sequences


def _check_vision(vision, static, passed_cache, rope_switch) -> None:
    """NotImplementedError naming what a multimodal call cannot combine with, before any forward."""
    if vision is None:
        return
    for given, what in ((static, "the static loop (cache_implementation='static' and its aliases)"),
                        (passed_cache, "a passed cache (cache= / past_key_values=)"),
                        (rope_switch, "crossing a longrope switch (re-prefill)")):
        if given:
            raise NotImplementedError(
                f"multimodal inputs {sorted(vision.inputs)} cannot be combined with {what} in spec_generate; "
                "drop that option (the dynamic loop prefills the images)")


# Passed in the call, these follow the static loop's rules (transformers' names for static caches with sliding
# layers); the static loop covers full-attention targets and logs why it falls back on the others.
_STATIC_ALIASES = ("static", "hybrid", "hybrid_chunked", "sliding_window")


def _static_request(kwargs, generation_config, target):
    """``(cache_implementation, compile_config)`` when the call asks for the static loop, else None (the
    dynamic loop). ``compile_config`` (a transformers ``CompileConfig`` or None: uncompiled) is the keyword,
    else the passed ``generation_config``'s, else the target's.

    ``cache_implementation`` passed in the call: ``"static"`` and its aliases (``_STATIC_ALIASES``) ask for
    the static loop (which falls back with a log where it does not apply); ``"offloaded*"`` runs the
    dynamic loop with one info log. Taken from a generation_config (the passed one, else the target's):
    anything but ``"static"`` runs the dynamic loop with one info log (Gemma 2/3 checkpoints publish
    ``"hybrid"``, which generate itself ignores since 4.56: transformers#40135).

    Raises, before any work: NotImplementedError for ``cache_implementation="quantized"`` passed in the
    call (a quantized KV cache changes the logits: not the target's own output); ValueError for another
    unknown value in the call, or a ``compile_config`` that is not a ``CompileConfig``."""
    configs = [c for c in (generation_config, target.generation_config) if c is not None]

    def pick(name):
        if kwargs.get(name) is not None:
            return kwargs[name], "the call"
        source = next((c for c in configs if getattr(c, name, None) is not None), None)
        if source is None:
            return None, None
        return getattr(source, name), ("the passed generation_config" if source is generation_config
                                       else "the target's generation_config")

    (impl, where), (compile_config, _) = pick("cache_implementation"), pick("compile_config")
    if compile_config is not None and not isinstance(compile_config, CompileConfig):
        raise ValueError(f"compile_config must be a transformers CompileConfig, got {type(compile_config).__name__}")
    if impl in (None, "dynamic"):
        return None
    if where == "the call":
        if impl == "quantized":
            raise NotImplementedError("cache_implementation='quantized' is not supported by spec_generate: a quantized "
                                      "KV cache changes the target's logits, so the output would not be the target's own")
        if impl in _STATIC_ALIASES:
            return impl, compile_config
        if not (isinstance(impl, str) and impl.startswith("offloaded")):
            raise ValueError(f"cache_implementation={impl!r} is not supported; use 'dynamic', 'static' (or "
                             f"{', '.join(repr(a) for a in _STATIC_ALIASES[1:])}) or 'offloaded'")
    elif impl == "static":
        return impl, compile_config
    _log_dynamic(impl, where, "spec_generate keeps a DynamicCache per model")
    return None


def _log_dynamic(impl, where, reason):
    logger.info(f"cache_implementation={impl!r} (from {where}) runs spec_generate's dynamic loop: {reason}")


def _static_loop(static, target, input_ids, mask, run, facts, block_size=1, adaptive=False, draft=None, tree=False):
    """``static_generate.static_decode`` (``compile_config`` bound) when the static loop was asked for
    and applies to this call, else None: the dynamic loop, with one info log saying why (also for a
    call crossing a longrope switch, ``facts.crossing`` from ``target_families.check_rope``: only the
    dynamic loop re-prefills there; for a call whose full blocks would pass a RoPE switch:
    ``target_families.rope_reach_reason``; for ``adaptive_block_size``, which only the dynamic
    loop does; and for a drafter whose proposer the fixed-shape loop does not run (``static_loop``
    False: a DFlash 2 selector walk); for draft trees (``tree``))."""
    if static is None:
        return None
    reason = static_unsupported_reason(target, input_ids, mask)
    if reason is None and (run.history is not None or run.recorder is not None):
        reason = "prefix-dependent processors, custom stopping criteria and output_scores/logits are dynamic-only"
    if reason is None and not proposer_for(draft).static_loop:
        reason = f"the {proposer_for(draft).__name__} walk (a DFlash 2 selector, a DSpark Markov head) is dynamic-only"
    if reason is None and facts.crossing is not None:
        reason = f"crossing the longrope switch (sequence length {facts.crossing + 1}) re-prefills, which is dynamic-only"
    if reason is None:  # a full last block past a RoPE switch generate never reaches
        reason = _families.rope_reach_reason(facts.rope, input_ids.shape[1], run.stops.budget or 1 << 40, block_size)
    if reason is None and tree:
        reason = "draft trees (tree_budget) run in the dynamic loop"
    if reason is None and adaptive is True:  # the default (None) runs the fixed blocks here silently
        reason = "adaptive_block_size=True chooses the verified width every step; the fixed-shape loop verifies one size"
    if reason is not None:
        if static[0] == "static":
            log_fallback(reason)
        else:
            _log_dynamic(static[0], "the call", reason)
        return None
    return functools.partial(static_decode, compile_config=static[1])


@dataclass
class _Loop:
    """What every step of one call's dynamic loop reads, set once per call (the loop keeps no other state
    besides the rows): the target and its facts, the caches, the proposer, the taps, the run record."""

    target: torch.nn.Module
    facts: TargetFacts
    sampling: _Sampling
    proposer: BlockProposer  # one of proposers.py's kinds, chosen once (proposers.proposer_for)
    resume: Resume  # the caches and the cached length (cache_reuse.Resume)
    features: object  # capture_target_features' get(): the last forward's taps (B, T, F)
    run: _Run
    vision: object  # target_families.VisionPrompt or None
    offsets: torch.Tensor  # (block_size,) slot offsets, built once

    @property
    def caches(self) -> tuple:
        return self.resume.target_cache, self.resume.draft_cache

    def forward(self, tokens, positions, valid, **extra):
        """The target's logits ``(A, n, V)`` for ``tokens`` at ``positions`` over the call's target cache."""
        return _forward_target(self.target, self.facts, self.resume.target_cache, tokens, positions, valid, **extra)


def _prefill(loop, input_ids, prompt_mask):
    """The prefill forward and its commit: ``(rows, finished (B,))``; each row's first token is its first anchor.
    With a passed cache only its uncached tokens run (``cache_reuse.Resume``); a multimodal prompt runs the
    model's own prefill (its inputs and positions, generate's 2-D mask)."""
    n, bsz, vision = loop.resume.cached, input_ids.shape[0], loop.vision
    padded = not bool(prompt_mask.all())  # the call's only host check of a mask; masked slots are tracked on the host
    holes = bsz > 1 or padded
    positions = (prompt_mask.cumsum(1) - 1).clamp_min(0)  # true positions under left padding
    if vision is None:
        logits = loop.forward(input_ids[:, n:], positions[:, n:], prompt_mask[:, :0] if padded else None,
                              tokens_valid=prompt_mask, record=False, **loop.facts.prefill)
    else:
        logits = loop.forward(input_ids, positions, None, record=False, rope=vision.prefill_positions,
                              attention_mask=prompt_mask, **loop.facts.prefill, **vision.inputs)
    first, scores = loop.sampling.first(logits[:, -1], input_ids)
    loop.run.out.num_target_forwards, loop.run.out.num_draft_forwards = 1, 0
    device = input_ids.device
    ctx = loop.resume.context(_Context(loop.features(), positions[:, n:], prompt_mask if padded else None))
    rows = _Rows(ids=torch.arange(bsz, device=device), anchor=first[:, None], start=prompt_mask.sum(1),
                 n_new=torch.ones(bsz, dtype=torch.long, device=device), target_valid=prompt_mask if holes else None,
                 draft_valid=None, ctx=ctx, host_ids=list(range(bsz)), host_new=[1] * bsz, holes=holes, masked=padded)
    return rows, _prefill_commit(loop.run, first, scores, logits[:, -1])


def _block_size(loop, rows, next_b: int, input_ids) -> int:
    """This step's block: ``next_b`` cut to the budget (``target_families.verify_budget``), and on a longrope
    target crossing its switch clamped below it / re-prefilled at it (``_longrope_step``)."""
    b = min(next_b, _families.verify_budget(rows.host_new, loop.run.stops.budget, loop.facts.rope_bounded))
    if loop.facts.crossing:
        b = _longrope_step(loop, input_ids, b, rows)
    return b


def _propose(loop, rows, b: int) -> Proposal:
    """The step's proposal: ``b - 1`` drafted nodes after each anchor (none for a block of 1)."""
    positions = rows.start[:, None] + loop.offsets[:b]  # (A, b)
    if b == 1:
        return Proposal.anchor_only(rows.anchor, positions)
    return loop.proposer.propose(rows, b, positions)


def _verify_forward(loop, rows, proposal: Proposal):
    """The target's logits ``(A, n + 1, V)`` over ``[anchor, proposal's nodes]``, masking the slots a row does
    not own once some slot is masked; a multimodal target takes its own positions (``VisionPrompt.rope``).
    A tree's nodes see the context and their own ancestors only (``TargetFacts.tree_mask``)."""
    block = torch.cat([rows.anchor, proposal.tokens], dim=1)  # (A, n + 1)
    positions = proposal.positions
    rope = None if loop.vision is None else loop.vision.rope(positions, rows.ids)
    if proposal.tree is None:
        return loop.forward(block, positions, rows.target_valid if rows.masked else None, rope=rope)
    mask = loop.facts.tree_mask(rows.target_valid if rows.holes else None, loop.resume.target_cache.get_seq_length(),
                                positions, proposal.tree.visible)
    return loop.forward(block, positions, None, rope=rope, attention_mask=mask)


def _keep_committed(loop, rows, b: int, committed, counts: list, next_token, path=None) -> None:
    """Roll back after a verify of ``b`` slots: both caches keep each row's ``committed`` ``(A,)`` slots (anchor
    + accepted drafts; hybrid targets replay each row's prefix), rejected ones become holes (masked) for rows
    that committed fewer than the widest; the committed slots' taps become draft context; ``next_token``
    ``(A,)`` is each row's new anchor. A tree's ``path`` ``(A, W)`` (``draft_trees.Verdict``): its nodes are
    the committed slots, compacted into place (``decode_step.compact_cache``)."""
    target_cache = loop.resume.target_cache
    width = max(counts)
    if path is None:
        crop_cache(target_cache, target_cache.get_seq_length() - b + width)
    else:
        compact_cache(target_cache, b, path[:, :width])
    restore_linear_states(target_cache, committed)  # hybrid targets: replay each row's committed prefix
    owned = None
    if rows.holes:
        owned = (loop.offsets[None, :width] < committed[:, None]).long()  # (A, width)
        rows.target_valid = torch.cat([rows.target_valid, owned], dim=1)
        if min(counts) < width:  # a row committed fewer slots than the widest: holes from here on
            rows.masked = True
        else:
            owned = None  # every new slot is valid: no mask for this context
    features = loop.features()[:, :width] if path is None else _gather_nodes(loop.features(), path[:, :width])
    rows.add_context(_Context(features, rows.start[:, None] + loop.offsets[:width], owned))
    rows.start, rows.n_new, rows.anchor = rows.start + committed, rows.n_new + committed, next_token[:, None]
    rows.host_new = [n + c for n, c in zip(rows.host_new, counts)]


def _longrope_step(loop, input_ids, b: int, rows) -> int:
    """Block size of this step on a longrope target whose call crosses ``loop.facts.crossing`` (batch 1, no
    padding; ``target_families.check_rope``), doing what Phi-3's ``generate`` does at the switch.

    Below it, the block is clamped (``target_families.longrope_block_limit``) so that no verify runs
    short-factor positions with long factors. At committed length ``switch + 1`` (reached exactly, by
    the clamp; generate drops its cache there and re-prefills the whole sequence with long factors),
    the target cache is rebuilt by one forward over every committed token (anchor included, so its
    longest position selects long factors as generate's re-prefill does) and cut back to the tokens
    before the anchor; the draft's context becomes that forward's taps (positions ``0 .. n-2``) over
    an emptied draft cache, so the draft sees the hidden states the target now computes.

    Returns the block size ``b`` to verify with. Source: issue "Dynamic-RoPE targets" (silent
    divergence past the switch).
    """
    switch, run = loop.facts.crossing, loop.run
    committed = input_ids.shape[1] + rows.host_new[0]
    if committed != switch + 1:
        return _families.longrope_block_limit(switch, committed, b)
    tokens = torch.tensor([[t for chunk in run.chunks[0] for t in chunk]], device=input_ids.device)
    tokens = torch.cat([input_ids, tokens], dim=1)  # (1, committed)
    positions = torch.arange(committed, device=input_ids.device)[None]  # (1, committed)
    target_cache, draft_cache = loop.caches
    crop_cache(target_cache, 0)
    crop_cache(draft_cache, 0)
    loop.forward(tokens, positions, None, record=False, **loop.facts.prefill)
    crop_cache(target_cache, committed - 1)  # the anchor is verified by this step's block, as always
    rows.ctx, rows.draft_valid, rows.parts = _Context(loop.features()[:, :-1], positions[:, :-1], None), None, None
    run.out.num_target_forwards += 1
    return b


def _drop_finished(rows, done: list, caches, device) -> bool:
    """Drop the finished rows from every cache and row state; False when none is left."""
    keep = [i for i, d in enumerate(done) if not d]
    if keep:
        keep_t = torch.tensor(keep, device=device)
        for cache in caches:
            cache.batch_select_indices(keep_t)
        rows.select(keep, keep_t)
    return bool(keep)


def _decode(draft, target, input_ids, prompt_mask, block_size, mask_token_id, sampling, features, output_timings,
            run, facts, adaptive=False, passed_cache=None, vision=None, draft_window=None, tree_budget=None,
            confidence_threshold=0.0, cost=None):
    """The speculative loop; fills ``run.out`` / ``run.chunks`` in place. One verify step after another: the
    block size, the drafter's proposal (whatever its kind: ``proposers.py``), the target's verify forward,
    the acceptance rule, the commit, the roll-back. ``facts``: the call's ``TargetFacts``.
    ``passed_cache``: a target cache holding the first tokens of ``input_ids`` (batch 1), continued in place
    (``cache_reuse.Resume``). ``vision``: a multimodal prompt (``target_families.VisionPrompt``): its inputs,
    the target's positions and generate's 2-D mask go to the prefill, and every verify forward takes the
    target's positions (``vision.rope``); the draft keeps 1-D positions and the features of every position.
    ``draft_window``, ``tree_budget``: see ``spec_generate`` (a tree is proposed, verified and kept through the
    same steps: ``draft_trees.py``)."""
    device, out = input_ids.device, run.out
    resume = Resume(target, draft, passed_cache, input_ids.shape[0], facts.crossing)  # the caches; cached length
    proposer = proposer_for(draft)(resume.draft(draft), facts, resume.draft_cache, sampling, mask_token_id,
                                   draft_window, tree_budget,
                                   **({"confidence_threshold": confidence_threshold} if confidence_threshold else {}))
    loop = _Loop(target, facts, sampling, proposer, resume, features, run, vision,
                 offsets=torch.arange(block_size, device=device))
    policy = policy_for(loop.proposer, block_size, cost)
    budget = run.stops.budget if run.stops.budget is not None else 1 << 40
    t0 = _sync(device) if output_timings else None
    rows, finished = _prefill(loop, input_ids, prompt_mask)
    t1 = _sync(device) if output_timings else None
    verifies, drafts_run = 0, 0  # forwards counted on the host (`out` is a ModelOutput)

    while not any(finished) or _drop_finished(rows, finished, loop.caches, device):
        b = _block_size(loop, rows, policy.plan([budget - n for n in rows.host_new], rows.host_ids), input_ids)
        proposal = policy.cut(_propose(loop, rows, b))
        logits = _verify_forward(loop, rows, proposal)
        verifies, drafts_run = verifies + 1, drafts_run + (b > 1)
        verdict = sampling.verify(proposal, logits, rows)  # draft_trees.Verdict
        counts, finished = _commit(run, rows, verdict.accepted, verdict.drafts, verdict.next_token, verdict.scores,
                                   verdict.logits, verdict.drafted)
        sampling.advance(rows, counts, logits, finished)  # the caller's processors: replay the committed slots
        nodes, accepted, next_token, path = logits.shape[1], verdict.accepted, verdict.next_token, verdict.path
        del logits, verdict, proposal  # (A, n + 1, V) each: freed before the next draft pass allocates
        committed, counts = resume.kept(run, accepted + 1, counts, finished)  # a returned cache ends at the output
        if run.stops.timed_out():  # max_time: once per verify step, after the commit
            finished = [True] * len(finished)
        policy.record([c - 1 for c in counts])
        _keep_committed(loop, rows, nodes, committed, counts, next_token, path)

    out.num_target_forwards += verifies
    out.num_draft_forwards += drafts_run
    resume.finish(out, rows, resume.draft_cache)
    if output_timings:
        t2 = _sync(device)
        out["timings"] = {"prefill_s": t1 - t0, "decode_s": t2 - t1, "total_s": t2 - t0,
                          "new_tokens": sum(len(sum(c, [])) for c in run.chunks)}


# ----------------------------------------------------------------------------- generate() entry points

# Hub download options of the custom_generate repo itself (generate() reads them too): never for spec_generate.
_LOADING = ("revision", "token", "cache_dir", "force_download", "local_files_only", "proxies", "subfolder")


def spec_generate_from_generate_arguments(draft, target, **arguments):
    """``spec_generate`` driven by the arguments of ``target.generate(...)``, as transformers hands them
    to a Hub ``custom_generate/generate.py`` function (and pipelines hand them to ``generate``).

    ``inputs`` -> ``input_ids``; everything else passes through unchanged (``spec_generate`` resolves
    generate's arguments as generate does, and refuses what it cannot do exactly, naming it), except
    ``assistant_model`` (the drafter itself), the Hub options of the custom_generate repo (``revision``,
    ``token``, ...), generate's own parameters left at None (transformers passes them all) and
    all-zero ``token_type_ids`` (decoder-only targets ignore them).

    Raises:
        ValueError: ``inputs`` and ``input_ids`` both given; whatever ``spec_generate`` raises.
    """
    check_is_drafter(draft)
    params = inspect.signature(spec_generate).parameters
    inputs = arguments.pop("inputs", None)
    if inputs is not None:
        if arguments.get("input_ids") is not None:
            raise ValueError("pass the prompt as `inputs` or as `input_ids`, not both")
        arguments["input_ids"] = inputs
    call = {}
    for name, value in arguments.items():
        if name in ("draft", "target", "assistant_model") or name in _LOADING:
            continue
        if name not in params and (value is None or (name == "token_type_ids" and not bool(value.any()))):
            continue
        call[name] = value
    return spec_generate(draft, target, **call)


__all__ = [
    "spec_generate", "speculative_verify", "capture_target_features", "check_pairing", "crop_cache",
    "DFlashGenerateOutput", "NOT_PASSED", "APPLIED_KEYS", "REFUSED_KEYS", "NO_EFFECT_KEYS",
    "native_acceptance_stats", "per_slot_acceptance", "plot_acceptance",
    "spec_generate_from_generate_arguments", "write_custom_generate", "CUSTOM_GENERATE_PY",
]
