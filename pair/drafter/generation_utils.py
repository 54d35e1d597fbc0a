"""Lossless speculative decoding with a DFlash draft: ``spec_generate`` and the target-feature taps.

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

import contextlib
import functools
import inspect
import os
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Optional

import torch
from transformers import (
    CompileConfig,
    DynamicCache,
    EosTokenCriteria,
    GenerationConfig,
    LogitsProcessorList,
    MaxLengthCriteria,
    MaxTimeCriteria,
    StoppingCriteriaList,
    StopStringCriteria,
)
from transformers.generation import GenerateDecoderOnlyOutput
from transformers.generation import logits_process as _lp
from transformers.utils import logging

try:
    from .target_cache import check_target_cache, new_target_cache, recording, restore_linear_states
    from .target_families import FAMILY as _families
except ImportError:  # imported from the repository root instead of as a Hub remote-code package
    from target_cache import check_target_cache, new_target_cache, recording, restore_linear_states
    from target_families import FAMILY as _families

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
                            "of static_generate.py (batch 1); generate itself is told None so that it "
                            "allocates no static cache",
    "cache_config": "see cache_implementation",
    "max_cache_len": "see cache_implementation",
    "return_legacy_cache": "the output holds no cache",
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

# Processors that act on each row's scores alone, whatever came before: applied in one batched call.
# Any other processor (repetition penalty, n-gram, lengths, bad words, a user's) sees each prefix.
_PREFIX_FREE = tuple(getattr(_lp, name) for name in (
    "TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper", "MinPLogitsWarper", "TypicalLogitsWarper",
    "EpsilonLogitsWarper", "EtaLogitsWarper", "TopHLogitsWarper", "SuppressTokensLogitsProcessor",
    "LogitNormalization", "InfNanRemoveLogitsProcessor",
) if hasattr(_lp, name))


class _Table(str):
    """A string that shows as itself (not quoted) at a notebook prompt."""

    def __repr__(self):
        return str(self)


@dataclass(repr=False)
class DFlashGenerateOutput(GenerateDecoderOnlyOutput):
    """What ``spec_generate(..., return_dict_in_generate=True)`` returns: a ``GenerateDecoderOnlyOutput``
    (``isinstance`` holds, the fields follow the installed transformers) plus the speculative statistics.

    Fields of ``generate``:
        sequences: ``(B, prompt_len + new_len)`` LongTensor, prompt first, right padded.
        scores: with ``output_scores=True``: a tuple of one ``(B, V)`` fp32 tensor per new token (the first
            from the prefill), the processed scores the token was chosen from, as generate gives them. In a
            batch, a row's entries after its last token are NaN (generate would hold scores of pad steps).
        logits: with ``output_logits=True``: the same for the raw target logits.
        attentions, hidden_states: always None (refused: the target runs on blocks).
        cache / past_key_values (the name follows the installed version): always None: the caches hold
            rejected slots and holes of other rows, so they cannot be resumed from.

    Speculative statistics (one definition, read by README, demo and benchmarks):
        acceptance_lengths: tokens each verify step committed, bonus included, all rows in row order.
            Tokens past a row's budget or stop are not counted; the prefill token is not counted.
        row_acceptance_lengths: the same, one list per row; ``sum(row) == num_new_tokens[r] - 1``.
        row_draft_lengths: drafts proposed per verify step, per row (``b - 1``, capped by the row's
            remaining budget: a slot not drafted is not a rejection).
        row_accepted_drafts: drafts the verifier accepted per step, per row (before any stop cut).
        num_new_tokens: new tokens per row.
        num_draft_forwards / num_target_forwards: forward passes (the target's include the prefill).
        timings: with ``output_timings=True``: ``prefill_s``, ``decode_s``, ``total_s`` (seconds,
            device-synchronised) and ``new_tokens``.
    Derived: [`tau`], [`row_tau`], [`slot_acceptance`], [`summary`].
    """

    acceptance_lengths: Optional[list] = None
    row_acceptance_lengths: Optional[list] = None
    row_draft_lengths: Optional[list] = None
    row_accepted_drafts: Optional[list] = None
    num_new_tokens: Optional[list] = None
    num_draft_forwards: Optional[int] = None
    num_target_forwards: Optional[int] = None
    timings: Optional[dict] = None

    @property
    def tau(self) -> Optional[float]:
        """Acceptance length pooled over rows: ``sum(new - 1) / sum(verify steps)``; None with no step."""
        steps = sum(len(r) for r in self.row_acceptance_lengths or [])
        return sum(n - 1 for n in self.num_new_tokens if n > 0) / steps if steps else None

    @property
    def row_tau(self) -> list:
        """Per row ``(new - 1) / verify steps`` (None for a row that made no verify step)."""
        return [(n - 1) / len(r) if r else None for n, r in zip(self.num_new_tokens, self.row_acceptance_lengths)]

    def slot_acceptance(self) -> list:
        """Acceptance rate of draft slot ``k = 1..K``: steps that accepted >= k drafts / steps that drafted
        slot k (all rows pooled); None for a slot no step drafted."""
        drafted = [d for row in self.row_draft_lengths or [] for d in row]
        accepted = [a for row in self.row_accepted_drafts or [] for a in row]
        rates = []
        for k in range(1, max(drafted, default=0) + 1):
            n = sum(d >= k for d in drafted)
            rates.append(sum(a >= k for a, d in zip(accepted, drafted) if d >= k) / n if n else None)
        return rates

    def summary(self) -> str:
        """A short table: rows, new tokens, verify steps, tau, per-slot acceptance, forwards, timings."""
        tau = self.tau
        lines = [f"DFlashGenerateOutput: {len(self.num_new_tokens or [])} row(s), sequences "
                 f"{tuple(self.sequences.shape) if self.sequences is not None else None}",
                 f"  tau (new - 1) / steps : {'-' if tau is None else f'{tau:.2f}'}",
                 "  row  new  steps   tau"]
        for r, (n, steps, t) in enumerate(zip(self.num_new_tokens, self.row_acceptance_lengths, self.row_tau)):
            lines.append(f"  {r:>3} {n:>4} {len(steps):>6} {'-' if t is None else f'{t:5.2f}':>5}")
        rates = self.slot_acceptance()
        if rates:
            lines.append("  slot acceptance: " + " ".join("-" if x is None else f"{x:.2f}" for x in rates))
        lines.append(f"  forwards: draft {self.num_draft_forwards}, target {self.num_target_forwards}")
        if self.timings:
            t = self.timings
            tps = t["new_tokens"] / t["total_s"] if t["total_s"] > 0 else float("nan")
            lines.append(f"  time: prefill {t['prefill_s']:.3f}s, decode {t['decode_s']:.3f}s, {tps:.1f} tok/s")
        return _Table("\n".join(lines))

    def __repr__(self):
        return str(self.summary())


# ----------------------------------------------------------------------------- target feature taps


def _decoder_parts(target):
    """(decoder layers, final norm) of a causal LM, via the public ``get_decoder()``."""
    return _families.decoder_parts(target)




class _Taps:
    """One forward hook per decoder layer (and the final norm) of one target, shared by every capture
    running on it; each hook stores the output only into the captures of the calling thread, so
    concurrent ``spec_generate`` calls from several threads see only their own forward passes."""

    def __init__(self, target):
        layers, norm = _decoder_parts(target)
        self.num_layers = len(layers)
        self.by_thread = {}  # thread id -> list of stores (dict layer id -> tensor)
        modules = [*layers[:-1], norm]  # layer id k = output of layer k; the last one after the final norm
        self.handles = [m.register_forward_hook(self._hook(k)) for k, m in enumerate(modules)]
        self.handles.append(target.register_forward_pre_hook(self._record_shape, with_kwargs=True))

    def _record_shape(self, module, args, kwargs):
        """(batch, length) of the forward's input, for the tap check (``target_families.check_tap``)."""
        for store in self.by_thread.get(threading.get_ident(), ()):
            ids = kwargs.get("input_ids", args[0] if args else None)
            ids = kwargs.get("inputs_embeds") if ids is None else ids
            store["shape"] = tuple(ids.shape[:2])

    def _hook(self, k):
        def hook(module, args, output):
            stores = self.by_thread.get(threading.get_ident())
            if stores:
                value = output[0] if isinstance(output, (tuple, list)) else output
                for store in stores:
                    if k in store["wanted"]:
                        store[k] = value
        return hook


_TAPS_LOCK = threading.Lock()
_TAPS = weakref.WeakKeyDictionary()  # target -> _Taps, only while some capture on it is open


@contextlib.contextmanager
def capture_target_features(target, layer_ids, device=None):
    """Capture the outputs of target layers ``layer_ids`` during forwards inside the ``with`` block.

    Layer id ``k`` is the OUTPUT of decoder layer ``k`` (HF ``hidden_states[k + 1]``); for the last
    layer that is the post-final-norm state, as in HF's ``hidden_states[-1]`` (notes section 1; an
    off-by-one here silently ruins acceptance, notes section 6). Only these layers are kept, never all.
    Only forwards run by the calling thread are captured: two threads decoding with one target each
    get their own features (the hooks are shared per target and removed when the last capture exits).

    Yields a callable ``get() -> (batch, seq, len(layer_ids) * hidden)`` returning the features of the
    most recent forward, concatenated in ``layer_ids`` order, each tap moved to ``device`` (the
    draft's; a target split over several devices gives taps on several devices).

    Raises:
        ValueError: a layer id outside ``[0, num_layers)``; a tap that is not ``(batch, seq, hidden)``
            with the batch and length of the forward's ``input_ids`` (raised by ``get()``).
    """
    layers, _ = _decoder_parts(target)
    bad = [k for k in layer_ids if not 0 <= k < len(layers)]
    if bad:
        raise ValueError(f"target_layer_ids {list(layer_ids)} include {bad}, but the target has {len(layers)} layers")
    store, tid = {"wanted": frozenset(layer_ids)}, threading.get_ident()
    with _TAPS_LOCK:
        taps = _TAPS.get(target)
        if taps is None:
            taps = _TAPS[target] = _Taps(target)
        taps.by_thread.setdefault(tid, []).append(store)
    try:
        yield lambda: _families.concat_taps(store, layer_ids, device)
    finally:
        with _TAPS_LOCK:
            stores = taps.by_thread[tid]
            stores[:] = [s for s in stores if s is not store]  # by identity: equal dicts are different captures
            if not stores:
                del taps.by_thread[tid]
            if not taps.by_thread:
                for h in taps.handles:
                    h.remove()
                _TAPS.pop(target, None)
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


@functools.lru_cache(maxsize=64)
def _signature_params(forward) -> frozenset:
    return frozenset(inspect.signature(forward).parameters)


def _forward_params(model) -> frozenset:
    """Parameter names of ``model.forward``, inspected once per forward function (not once per call)."""
    forward = model.forward
    return _signature_params(getattr(forward, "__func__", forward))


def _cache_kwarg(model) -> str:
    """``cache`` on transformers >= 5.24 (``past_key_values`` is deprecated there), else ``past_key_values``."""
    return "cache" if "cache" in _forward_params(model) else "past_key_values"


class _History:
    """Each row's tokens so far (padded prompt + committed new tokens), for processors and stopping
    criteria that read the sequence. ``tokens`` ``(B0, width)`` int64 over the original rows."""

    def __init__(self, input_ids, budget, block_size):
        bsz, width = input_ids.shape
        self.prompt_len = width
        self.tokens = input_ids.new_zeros(bsz, width + budget + block_size)
        self.tokens[:, :width] = input_ids

    def write(self, row: int, start: int, tokens: list):
        self.tokens[row, start: start + len(tokens)] = torch.tensor(tokens, dtype=torch.long)


def _process_at(procs, history, ids, lengths, ext, scores):
    """Apply ``procs`` to ``scores`` ``(A, V)``, row ``i`` seeing its own prefix: its first ``lengths[i]``
    history tokens followed by ``ext[i]`` ``(A, j)`` (anchor-side drafts). Returns ``(A, V)`` fp32.

    This is the call generate makes when it chooses the token after that prefix (and what transformers'
    ``DFlashTokenCandidateGenerator.get_candidates`` does slot by slot). Rows of equal prefix length go in
    one call, laid out at their original batch index in a full ``(B0, L)`` batch (other rows hold a copy),
    because some processors are per batch row (``prefix_allowed_tokens_fn(batch_id, ...)``, the 5.x
    repetition penalty's per-row prompt padding).
    """
    out = torch.empty(scores.shape, dtype=torch.float32, device=scores.device)
    bsz0 = history.tokens.shape[0]
    for length in sorted(set(lengths.tolist())):
        sel = (lengths == length).nonzero()[:, 0]
        prefix = torch.cat([history.tokens[ids[sel], :length], ext[sel]], dim=1)  # (g, length + j)
        rows = ids[sel]
        full_ids = prefix[:1].expand(bsz0, -1).clone()
        full_ids[rows] = prefix
        full_scores = scores[sel[:1]].float().expand(bsz0, -1).clone()
        full_scores[rows] = scores[sel].float()
        out[sel] = procs(full_ids, full_scores)[rows]
    return out


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
    """How tokens are chosen from logits: generate's processors, then argmax (greedy) or a sample.

    ``procs`` is generate's own ``LogitsProcessorList`` (warpers included when sampling). When every
    processor is prefix-free (``_PREFIX_FREE``), one batched call processes a whole block (the fast
    path, as cheap as before); otherwise each slot is processed with its own prefix and drafts are
    chosen slot by slot (``_process_at``).
    """

    procs: LogitsProcessorList
    do_sample: bool
    generator: Optional[torch.Generator]
    sample_draft: bool = True
    history: Optional[_History] = None  # set when some processor reads the prefix

    want_scores: bool = False  # output_scores / output_logits: return processed scores from verify

    def _lengths(self, rows) -> torch.Tensor:
        return rows.n_new + self.history.prompt_len  # (A,) history length, anchor included

    @property
    def needs_prefix(self) -> bool:
        return any(not isinstance(p, _PREFIX_FREE) for p in self.procs)

    def processed(self, logits: torch.Tensor) -> torch.Tensor:
        """Prefix-free path: ``(B, n, V)`` logits -> processed fp32 scores, one batched call."""
        b, n, v = logits.shape
        flat = logits.reshape(b * n, v).float()
        if len(self.procs):
            flat = self.procs(flat.new_zeros(b * n, 1, dtype=torch.long), flat)
        return flat.view(b, n, v)

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """``(B, n, V)`` logits -> processed probabilities, fp32 (prefix-free path)."""
        return torch.softmax(self.processed(logits), dim=-1)

    def _pick(self, scores: torch.Tensor, sample: bool) -> torch.LongTensor:
        """``(N, V)`` processed scores -> ``(N,)`` tokens: a sample or the argmax."""
        if sample:
            return torch.multinomial(torch.softmax(scores, dim=-1), 1, generator=self.generator)[:, 0]
        return scores.argmax(dim=-1)

    def first(self, logits: torch.Tensor, input_ids: torch.Tensor):
        """The prefill token ``(B,)`` and its processed scores ``(B, V)`` from the last prompt logits ``(B, V)``;
        processors see the whole prompt batch, exactly as in generate's first step."""
        scores = self.procs(input_ids, logits.float()) if len(self.procs) else logits.float()
        return self._pick(scores, self.do_sample), scores

    def propose(self, draft_logits: torch.Tensor, rows):
        """Draft tokens ``(A, n)`` and their distribution q ``(A, n, V)`` (None when greedy)."""
        if not self.needs_prefix:
            if not self.do_sample:
                scores = self.processed(draft_logits) if len(self.procs) else draft_logits
                return scores.argmax(dim=-1), None
            q = self.probs(draft_logits)
            if not self.sample_draft:
                tokens = q.argmax(dim=-1)
                return tokens, torch.nn.functional.one_hot(tokens, q.shape[-1]).to(q.dtype)
            return torch.multinomial(q.flatten(0, 1), 1, generator=self.generator).view(q.shape[:2]), q
        # slot by slot: slot j is processed given the drafts chosen before it
        a, n, _ = draft_logits.shape
        tokens = draft_logits.new_zeros(a, n, dtype=torch.long)
        qs = []
        for j in range(n):
            scores = _process_at(self.procs, self.history, rows.ids, self._lengths(rows), tokens[:, :j],
                                 draft_logits[:, j])
            tokens[:, j] = self._pick(scores, self.do_sample and self.sample_draft)
            qs.append(torch.softmax(scores, dim=-1))
        if not self.do_sample:
            return tokens, None
        q = torch.stack(qs, dim=1)
        return tokens, (q if self.sample_draft else torch.nn.functional.one_hot(tokens, q.shape[-1]).to(q.dtype))

    def target_scores(self, drafts: torch.Tensor, target_logits: torch.Tensor, rows) -> torch.Tensor:
        """Processed target scores ``(A, n + 1, V)``: slot j sees the row's prefix + the first j drafts."""
        if not self.needs_prefix:
            return self.processed(target_logits)
        return torch.stack([_process_at(self.procs, self.history, rows.ids, self._lengths(rows), drafts[:, :j],
                                        target_logits[:, j]) for j in range(target_logits.shape[1])], dim=1)

    def verify(self, drafts, q, target_logits, rows):
        """``(accepted (A,), next_token (A,), scores (A, n + 1, V) or None)``; see ``speculative_verify``.

        ``scores`` are the processed target scores (None on the greedy path without processors)."""
        if not self.do_sample:  # greedy: keep drafts equal to the target's (processed) argmax
            scores = self.target_scores(drafts, target_logits, rows) if len(self.procs) else None
            choice = (target_logits if scores is None else scores).argmax(dim=-1)  # (A, n + 1)
            accepted = (drafts == choice[:, :-1]).long().cumprod(dim=1).sum(dim=1)
            if scores is None and self.want_scores:
                scores = target_logits.float()
            return accepted, choice.gather(1, accepted[:, None])[:, 0], scores
        if self.needs_prefix:
            scores = self.target_scores(drafts, target_logits, rows)
            p = torch.softmax(scores, dim=-1)
        else:
            p = self.probs(target_logits)
            scores = self.processed(target_logits) if self.want_scores else None
        accepted, nxt = speculative_verify(drafts, p[:, :0] if q is None else q, p, self.generator)
        return accepted, nxt, scores




class _Stops:
    """generate's stopping criteria, split by how often they must be asked.

    ``EosTokenCriteria`` -> the id set ``eos``, checked per committed token (cheap); ``MaxLengthCriteria``
    -> the token budget (``max_length`` minus the padded prompt width, at least 1 as in generate);
    ``MaxTimeCriteria`` -> asked once per verify step, after the commit; every other criterion
    (``StopStringCriteria``, a user's) -> called once per committed token, in order, with that row's
    ``(1, L)`` prefix and ``scores=None``.
    """

    def __init__(self, criteria, prompt_len: int):
        self.eos, self.timers, self.others, max_length = set(), [], [], None
        for c in criteria:
            if isinstance(c, EosTokenCriteria):
                self.eos |= set(torch.as_tensor(c.eos_token_id).reshape(-1).tolist())
            elif isinstance(c, MaxTimeCriteria):
                self.timers.append(c)
            elif isinstance(c, MaxLengthCriteria):
                max_length = c.max_length if max_length is None else min(max_length, c.max_length)
            else:
                self.others.append(c)
        self.budget = max(1, max_length - prompt_len) if max_length is not None else None

    def cut(self, take: list, history: Optional[_History], row: int, start: int):
        """``take`` cut right after its first stopping token; ``(take, stopped)``. ``history`` already
        holds ``take`` from index ``start``."""
        hit = next((j for j, t in enumerate(take) if t in self.eos), None)
        if hit is not None:
            take = take[: hit + 1]
        for j in range(len(take) if self.others else 0):
            prefix = history.tokens[row: row + 1, : start + j + 1]
            if any(bool(c(prefix, None).any()) for c in self.others):
                return take[: j + 1], True
        return take, hit is not None

    def timed_out(self) -> bool:
        probe = torch.zeros(1, 1, dtype=torch.long)
        return any(bool(c(probe, None).any()) for c in self.timers)


class _Scores:
    """Per-row processed scores / raw logits of each committed token, assembled like generate's tuples."""

    def __init__(self, bsz: int, scores: bool, logits: bool):
        self.want = {"scores": scores, "logits": logits}
        self.rows = {name: [[] for _ in range(bsz)] for name, on in self.want.items() if on}

    def add(self, row: int, n: int, scores, logits):
        for name, value in (("scores", scores), ("logits", logits)):
            if name in self.rows:
                self.rows[name][row].append(value[:n].float())

    def tuples(self, width: int):
        """name -> tuple of ``width`` tensors ``(B, V)``; NaN after a row's last token."""
        out = {}
        for name, rows in self.rows.items():
            per_row = [torch.cat(r) for r in rows]
            stacked = per_row[0].new_full((len(per_row), width, per_row[0].shape[-1]), float("nan"))
            for i, r in enumerate(per_row):
                stacked[i, : len(r)] = r
            out[name] = tuple(stacked.unbind(1))
        return out


@dataclass
class _Run:
    """What one call's loop writes to, besides the rows: output, per-row chunks, history, stops, streamer."""

    out: DFlashGenerateOutput
    chunks: list
    stops: _Stops
    history: Optional[_History]
    streamer: object
    recorder: Optional[_Scores]



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
    check_target_cache(target)  # hybrid linear-attention targets: supported families only, exact rollback


def _check_is_causal_lm(target):
    """The target needs an input embedding, an output head, a generation_config and ``generate``."""
    try:
        ok = target.get_input_embeddings() is not None and target.get_output_embeddings() is not None
    except (AttributeError, NotImplementedError):
        ok = False
    if not ok or getattr(target, "generation_config", None) is None or not hasattr(target, "generate"):
        raise ValueError(f"target must be a causal LM (an AutoModelForCausalLM), got {type(target).__name__}")


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


def _generate_kwargs(passed: dict, kwargs: dict, stop_token_ids, generation_config, target) -> dict:
    """The keyword arguments handed to ``generate``: passed ``generate``-named arguments and every
    ``GenerationConfig`` field in ``kwargs`` (TypeError for any other name), ``stop_token_ids`` as
    ``eos_token_id``, ``temperature=0`` as greedy."""
    known = set(GenerationConfig().to_dict()) | set(REFUSED_KEYS) | set(NO_EFFECT_KEYS) | APPLIED_KEYS
    unknown = sorted(set(kwargs) - known)
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


def _through_generate(target, input_ids, attention_mask, loop, **generate_kwargs):
    """Run ``target.generate`` up to its decoding loop, then ``loop`` instead of its own; returns what
    ``loop`` returned.

    ``generate(custom_generate=<callable>)`` (transformers >= 4.56, public) runs generate's own
    argument resolution (generation_config merging, kwargs, the default length rule and its warnings,
    special tokens, ``num_return_sequences`` expansion, the prompt to the streamer) and builds its
    logits processors and stopping criteria, then calls the callable with
    ``(model, input_ids, logits_processor, stopping_criteria, generation_config, **model_kwargs)``.
    This is the one place that relies on that contract (tested on 4.57 and 5.x). On that path
    generate drops ``tokenizer`` (see ``_stop_strings``); its result is ignored (4.57 post-processes it).
    """
    result = {}

    def decoding(model, input_ids, logits_processor=None, stopping_criteria=None, generation_config=None,
                 **model_kwargs):
        result["out"] = loop(input_ids, model_kwargs.get("attention_mask"), generation_config,
                             logits_processor, stopping_criteria)
        return input_ids

    target.generate(input_ids, attention_mask=attention_mask, custom_generate=decoding, **generate_kwargs)
    return result["out"]


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



@torch.no_grad()  # inference_mode on top of it inside the loop, unless the caller opts out (`inference_mode`)
def spec_generate(
    draft,
    target,
    input_ids: torch.LongTensor,
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
    adaptive_block_size: bool = False,
    inference_mode: bool = True,
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
        draft: a ``DFlashDraftModel``.
        target: the causal LM the draft was trained for (any device/dtype; features are cast).
        input_ids: ``(B, prompt_len)`` integer tensor (any integer dtype); rows of different lengths are
            LEFT padded and described by ``attention_mask`` (1 = real token).
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
            ``p(argmax q) <= max p``. Both are exact.
        block_size: per-call block size, an integer in ``[1, draft.config.block_size]``.
        attention_mask: ``(B, prompt_len)`` 0/1, left padding only.
        generation_config: a ``GenerationConfig`` merged with ``target.generation_config`` as generate does.
        logits_processor: extra processors, as in generate. They and ``prefix_allowed_tokens_fn`` must
            be pure functions of ``(input_ids, scores)``: they are also called on drafted prefixes that
            are later rejected, and with a ``(B, L)`` batch in which only some rows are real.
        stopping_criteria: extra criteria, as in generate, called once per committed token in order
            with that row's ``(1, L)`` prefix and ``scores=None``; a row stops right after the first
            token at which one fires.
        tokenizer: needed for ``stop_strings``, as in generate.
        generator: ``torch.Generator`` (on the target's device) for reproducible sampling.
        streamer: a transformers ``BaseStreamer`` (batch size 1): gets the prompt once, then each
            committed chunk, never a token past a stop.
        output_timings: add device-synchronised wall-clock timings (seconds) to the output.
        adaptive_block_size: off by default. When True, each step drafts a block of twice the
            previous step's longest acceptance (anchor included), within ``[2, block_size]``: a fully
            accepted block doubles, a short acceptance shrinks the next block. Outputs are unchanged.
        inference_mode: run the forwards under ``torch.inference_mode()`` (default; drafter and target
            forwards are about 10% cheaper on CPU than under ``no_grad``). The returned ``sequences``
            are ordinary tensors either way; pass False when tensors made during the call must be
            usable by autograd afterwards (e.g. features kept by the caller's own forward hooks).
        mask_token_id: override of ``draft.config.mask_token_id``.

    ``max_time`` is checked once per verify step, after the commit: the call returns within
    ``max_time`` plus one step, and the output is a prefix of the unlimited output.

    Returns:
        ``(B', prompt_len + new_len)`` LongTensor (``B' = B * num_return_sequences``): the prompt as
        given, then each row's new tokens, right padded with the pad token (the merged config's
        ``pad_token_id``, else the first eos, else 0) up to the longest row. Cut by length, never by
        value: tokens equal to ``mask_token_id`` are kept. Or, with ``return_dict_in_generate``, a
        [`DFlashGenerateOutput`] (a ``GenerateDecoderOnlyOutput`` with tau and per-slot acceptance).

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
        ValueError: bad input (ids, mask, non-integer ``block_size``/``max_new_tokens``, sampling
            values out of range) or a draft not built for this target, before any forward pass.
        NotImplementedError: options that cannot be exact here (``REFUSED_KEYS``: beam search, DoLa,
            contrastive search, guidance, other speculative methods, attentions/hidden states,
            token healing), recurrent-state targets outside ``target_cache.HYBRID_FAMILIES`` (or on a
            transformers version without linear-attention cache layers, e.g. Qwen3-Next on 4.57),
            families refused by name (``target_families``), a call that would cross a ``dynamic``
            RoPE switch (no budget: any such target), or a ``longrope`` one in a batch, with padding,
            or where generate's own re-prefill is not followed (``target_families.check_rope``;
            Phi-3-style targets at batch 1 cross it exactly: blocks clamped, one re-prefill).
    """
    _check_is_causal_lm(target)
    _families.check_family(target)
    vocab = target.get_input_embeddings().weight.shape[0]
    input_ids, prompt_mask = _prepare_inputs(input_ids, attention_mask, vocab)
    _warn_unmasked_left_padding(input_ids, attention_mask, (generation_config or target.generation_config).pad_token_id)
    trained = draft.config.block_size
    block_size = trained if block_size is None else block_size
    _check_int("block_size", block_size, 1, trained)
    mask_token_id = draft.config.mask_token_id if mask_token_id is None else mask_token_id
    if isinstance(mask_token_id, bool) or not isinstance(mask_token_id, int) or not 0 <= mask_token_id < vocab:
        raise ValueError(f"mask_token_id={mask_token_id!r} must be an integer in [0, {vocab}) (the target vocabulary)")
    passed = dict(max_new_tokens=max_new_tokens, temperature=temperature, do_sample=do_sample, top_k=top_k,
                  top_p=top_p, min_p=min_p, return_dict_in_generate=return_dict_in_generate,
                  output_scores=output_scores, output_logits=output_logits)
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

    def loop(ids, mask, config, processors, stops):
        return _spec_loop(draft, target, ids, mask, config, processors, stops, block_size=block_size,
                          mask_token_id=mask_token_id, generator=generator, sample_draft=sample_draft,
                          streamer=streamer, output_timings=output_timings, static=static,
                          adaptive=adaptive_block_size, inference_mode=inference_mode)

    if gen_kwargs.get("max_new_tokens") == 0:  # documented extension: the prompt back (generate raises)
        if streamer is not None:
            streamer.put(input_ids[0].cpu())
            streamer.end()
        out = _empty_output(input_ids)
        wants_dict = gen_kwargs.get("return_dict_in_generate")
        if wants_dict is None:
            wants_dict = (generation_config or target.generation_config).return_dict_in_generate
        return out if wants_dict else out.sequences
    return _through_generate(target, input_ids, prompt_mask, loop, generation_config=generation_config,
                             logits_processor=logits_processor, stopping_criteria=criteria,
                             prefix_allowed_tokens_fn=prefix_allowed_tokens_fn, streamer=streamer, **gen_kwargs)


def _empty_output(input_ids):
    bsz = input_ids.shape[0]
    return DFlashGenerateOutput(
        sequences=input_ids, acceptance_lengths=[], row_acceptance_lengths=[[] for _ in range(bsz)],
        row_draft_lengths=[[] for _ in range(bsz)], row_accepted_drafts=[[] for _ in range(bsz)],
        num_new_tokens=[0] * bsz, num_draft_forwards=0, num_target_forwards=0)


def _spec_loop(draft, target, input_ids, mask, config, processors, criteria, *, block_size, mask_token_id,
               generator, sample_draft, streamer, output_timings, static=None, adaptive=False, inference_mode=True):
    """What runs inside ``generate`` (see ``_through_generate``): checks of the resolved call, then ``_decode``."""
    _check_refused(config)
    bsz = input_ids.shape[0]
    if bsz > 1 and streamer is not None:
        raise ValueError(f"streamer supports batch size 1, got batch {bsz}")
    device = _families.execution_device(target, input_ids)
    input_ids = input_ids.to(device)
    mask = torch.ones_like(input_ids) if mask is None else mask.to(device=device, dtype=torch.long)
    stops = _Stops(criteria, input_ids.shape[1])
    budget = stops.budget if stops.budget is not None else 1 << 40
    rope_switch = _families.check_rope(target, input_ids.shape[1], budget, bsz, not bool(mask.all()))
    want_scores, want_logits = bool(config.output_scores), bool(config.output_logits)
    return_dict = bool(config.return_dict_in_generate)
    sampling = _Sampling(processors if processors is not None else LogitsProcessorList(), bool(config.do_sample),
                         generator, sample_draft, want_scores=return_dict and (want_scores or want_logits))
    history = None
    if sampling.needs_prefix or stops.others:
        history = _History(input_ids, stops.budget, block_size)
        sampling.history = history
    pad = config.pad_token_id
    if pad is None:
        pad = (_eos_list(config) or [0])[0]
    out = _empty_output(input_ids)
    recorder = _Scores(bsz, want_scores, want_logits) if return_dict and (want_scores or want_logits) else None
    run = _Run(out=out, chunks=[[] for _ in range(bsz)], stops=stops, history=history, streamer=streamer,
               recorder=recorder)
    static_decode = _static_loop(static, target, input_ids, mask, run, rope_switch)
    with torch.inference_mode(inference_mode):
        if static_decode is not None:  # fixed-shape loop, static_generate.py
            static_decode(draft, target, input_ids, block_size, mask_token_id, sampling, output_timings, run)
        else:
            with capture_target_features(target, draft.config.target_layer_ids, _families.draft_device(draft)) as features:
                _decode(draft, target, input_ids, mask, block_size, mask_token_id, sampling, features, output_timings,
                        run, adaptive, rope_switch)
    _assemble(out, input_ids, run, pad)
    if streamer is not None:
        streamer.end()
    return out if return_dict else out.sequences


def _static_request(kwargs, generation_config, target):
    """``(True, compile_config)`` when the call asks for ``cache_implementation="static"`` (the keyword, else
    the passed ``generation_config``, else the target's), else None. ``compile_config`` (a transformers
    ``CompileConfig`` or None: uncompiled) is resolved the same way.

    Raises ValueError for a ``cache_implementation`` other than None, "dynamic" or "static", or a
    ``compile_config`` that is not a ``CompileConfig``, before any work."""
    configs = [c for c in (generation_config, target.generation_config) if c is not None]

    def pick(name):
        if kwargs.get(name) is not None:
            return kwargs[name]
        return next((getattr(c, name) for c in configs if getattr(c, name, None) is not None), None)

    cache_implementation, compile_config = pick("cache_implementation"), pick("compile_config")
    if compile_config is not None and not isinstance(compile_config, CompileConfig):
        raise ValueError(f"compile_config must be a transformers CompileConfig, got {type(compile_config).__name__}")
    if cache_implementation in (None, "dynamic"):
        return None
    if cache_implementation != "static":
        raise ValueError(f"cache_implementation={cache_implementation!r} is not supported; use 'dynamic' or 'static'")
    return True, compile_config


def _static_loop(static, target, input_ids, mask, run, rope_switch=None):
    """``static_generate.static_decode`` (``compile_config`` bound) when the static loop was asked for
    and applies to this call, else None: the dynamic loop, with one info log saying why (also for a
    call crossing a longrope switch, ``rope_switch`` from ``target_families.check_rope``: only the
    dynamic loop re-prefills there)."""
    if static is None:
        return None
    try:  # `from .x import` (not `from . import x`): the pattern transformers copies remote code by
        from .static_generate import log_fallback, static_decode, static_unsupported_reason
    except ImportError:  # imported from the repository root instead of as a Hub remote-code package
        from static_generate import log_fallback, static_decode, static_unsupported_reason
    reason = static_unsupported_reason(target, input_ids, mask)
    if reason is None and (run.history is not None or run.recorder is not None):
        reason = "prefix-dependent processors, custom stopping criteria and output_scores/logits are dynamic-only"
    if reason is None and rope_switch is not None:
        reason = f"crossing the longrope switch (sequence length {rope_switch + 1}) re-prefills, which is dynamic-only"
    if reason is not None:
        log_fallback(reason)
        return None
    return functools.partial(static_decode, compile_config=static[1])


def _eos_list(config) -> list:
    eos = config.eos_token_id
    if eos is None:
        return []
    return [eos] if isinstance(eos, int) else [int(t) for t in (eos.tolist() if torch.is_tensor(eos) else eos)]



# ----------------------------------------------------------------------------- the decode loop


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
    if draft_valid is not None or (ctx.valid is not None and not bool(ctx.valid.all())):  # only with holes
        cached = draft_valid if draft_valid is not None else ctx.valid.new_ones(bsz, draft_cache.get_seq_length())
        ctx_valid = ctx.valid if ctx.valid is not None else cached.new_ones(ctx.positions.shape)
        key_valid = torch.cat([cached, ctx_valid, cached.new_ones(bsz, b)], dim=1)
    kept = draft_cache.get_seq_length() + ctx.features.shape[1]
    noise_embedding = _families.draft_block_embedding(draft.config, embed, noise)
    hidden = draft(position_ids=torch.cat([ctx.positions, block_pos], dim=1), noise_embedding=noise_embedding,
                   target_hidden=ctx.features, past_key_values=draft_cache, use_cache=True, attention_mask=key_valid)
    crop_cache(draft_cache, kept)  # block K/V are thrown away
    return _families.draft_logits(draft.config, head, hidden[:, 1:])


@dataclass
class _Context:
    """Target features not yet in the draft cache: ``features (B, C, F)``, ``positions (B, C)`` and
    ``valid (B, C)`` (None while the batch has no holes: every slot is valid)."""

    features: torch.Tensor
    positions: torch.Tensor
    valid: Optional[torch.Tensor]

    def cat(self, other: "_Context") -> "_Context":
        valid = None if self.valid is None else torch.cat([self.valid, other.valid], dim=1)
        return _Context(torch.cat([self.features, other.features], dim=1),
                        torch.cat([self.positions, other.positions], dim=1), valid)

    def select(self, keep) -> "_Context":
        return _Context(self.features[keep], self.positions[keep], None if self.valid is None else self.valid[keep])


@dataclass
class _Rows:
    """Per-row state of the rows still generating (index ``i`` is original row ``ids[i]``).

    ``ids``/``n_new`` live on the device (processors read them) and are mirrored on the host
    (``host_ids``/``host_new``), filled from the one transfer per step that carries the acceptance
    decision; validity masks exist only when the batch can have holes (``holes``)."""

    ids: torch.Tensor  # (A,) original row indices
    anchor: torch.Tensor  # (A, 1) last committed token, not yet seen by the target
    start: torch.Tensor  # (A,) position of the anchor
    n_new: torch.Tensor  # (A,) new tokens committed so far
    target_valid: Optional[torch.Tensor]  # (A, target cache length) 1 = committed slot of this row; None: no holes
    draft_valid: Optional[torch.Tensor]  # (A, draft cache length), None while every slot is valid
    ctx: Optional[_Context]  # features not yet in the draft cache; None right after a draft pass
    host_ids: list = None  # (A,) host copy of ids
    host_new: list = None  # (A,) host copy of n_new
    holes: bool = True  # batch > 1 or left padding: validity bookkeeping on

    def select(self, keep: list, keep_t: torch.Tensor):
        for name in ("ids", "anchor", "start", "n_new"):
            setattr(self, name, getattr(self, name)[keep_t])
        self.host_ids, self.host_new = [self.host_ids[i] for i in keep], [self.host_new[i] for i in keep]
        self.target_valid = None if self.target_valid is None else self.target_valid[keep_t]
        self.draft_valid = None if self.draft_valid is None else self.draft_valid[keep_t]
        self.ctx = None if self.ctx is None else self.ctx.select(keep_t)

    def context_drafted(self, draft_len: int):
        """The pending context went into the draft cache (now ``draft_len`` slots long)."""
        if self.holes and (self.draft_valid is not None or not bool(self.ctx.valid.all())):
            cached = self.draft_valid
            if cached is None:
                cached = self.ctx.valid.new_ones(len(self.host_ids), draft_len - self.ctx.valid.shape[1])
            self.draft_valid = torch.cat([cached, self.ctx.valid], dim=1)
        self.ctx = None

    def add_context(self, ctx: _Context):
        self.ctx = ctx if self.ctx is None else self.ctx.cat(ctx)


def _commit(run, rows, accepted, drafted, new, scores, logits):
    """Append each row's tokens (accepted drafts + the next token, ``new`` ``(A, n + 1)``), cut at the
    row's budget (by length, never by value) and right after its first stopping token; record the
    statistics of the step. One device-to-host transfer (the acceptance decision). Returns host lists
    ``(committed (A,), done (A,))``: anchor + accepted drafts per row, and whether the row is done."""
    done, counts = [], []
    host = torch.cat([accepted[:, None], new], dim=1).tolist()  # (A, 1 + n + 1): the step's only sync
    remaining = [run.stops.budget - n for n in rows.host_new]
    n_new = rows.host_new
    for i, (r, (a, *row_new)) in enumerate(zip(rows.host_ids, host)):
        counts.append(a + 1)
        take = row_new[: min(a + 1, remaining[i])]
        start = n_new[i] + (run.history.prompt_len if run.history is not None else 0)
        if run.history is not None:
            run.history.write(r, start, take)
        take, stopped = run.stops.cut(take, run.history, r, start)
        run.chunks[r].append(take)
        run.out.row_acceptance_lengths[r].append(len(take))
        run.out.row_draft_lengths[r].append(min(drafted, remaining[i]))
        run.out.row_accepted_drafts[r].append(min(a, remaining[i]))
        if run.recorder is not None:
            run.recorder.add(r, len(take), None if scores is None else scores[i], logits[i])
        done.append(stopped or len(take) >= remaining[i])
        if run.streamer is not None:
            run.streamer.put(torch.tensor(take))
    return counts, done


def _prefill_commit(run, first, scores, logits):
    """The prefill token of every row: history, stops, statistics-free. Returns ``(B,)`` bool done."""
    done = []
    for r, token in enumerate(first.tolist()):
        start = run.history.prompt_len if run.history is not None else 0
        if run.history is not None:
            run.history.write(r, start, [token])
        take, stopped = run.stops.cut([token], run.history, r, start)
        run.chunks[r].append(take)
        if run.recorder is not None:
            run.recorder.add(r, 1, scores[r: r + 1], logits[r: r + 1])
        done.append(stopped or run.stops.budget <= 1)
    if run.streamer is not None:
        run.streamer.put(first.cpu())
    return done


def _forward_target(target, cache_kw, cache, tokens, positions, valid, windows, tokens_valid=None, record=True,
                    **extra):
    """Target logits ``(A, n, V)`` for ``tokens`` at ``positions``, over cache slots marked ``valid``
    (None: every slot is valid, no mask built and no host synchronisation).

    Slots a row does not own are masked; on sliding-window targets the mask also counts each
    window in true positions (``target_families.target_mask``), so holes never shift it. Hybrid
    targets record the linear-attention mixers' inputs for the rollback (``target_cache.recording``),
    except in the prefill (``record=False``), which is never rolled back."""
    mask = None
    if valid is not None:
        tokens_valid = torch.ones_like(tokens) if tokens_valid is None else tokens_valid
        mask = _families.target_mask(target, windows, tokens_valid, positions, valid)
    with recording(cache) if record else contextlib.nullcontext():  # hybrid: snapshot + mixer inputs
        return target(input_ids=tokens, position_ids=positions, attention_mask=mask, use_cache=True,
                      **extra, **{cache_kw: cache}).logits


def next_block_size(block_size: int, longest: int, adaptive: bool) -> int:
    """Block size of the next step. Fixed unless ``adaptive``: then twice the longest acceptance
    (``longest``, anchor included) of the step just verified, so a fully accepted block doubles and a
    short acceptance shrinks the block, clamped to ``[2, block_size]``."""
    if not adaptive:
        return block_size
    return max(2, min(block_size, 2 * longest))


def _longrope_step(switch, input_ids, target, cache_kw, target_cache, draft_cache, windows, features, b, rows, run):
    """Block size of this step on a longrope target whose call crosses ``switch`` (batch 1, no padding;
    ``target_families.check_rope``), doing what Phi-3's ``generate`` does at the switch.

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
    committed = input_ids.shape[1] + rows.host_new[0]
    if committed != switch + 1:
        return _families.longrope_block_limit(switch, committed, b)
    tokens = torch.tensor([[t for chunk in run.chunks[0] for t in chunk]], device=input_ids.device)
    tokens = torch.cat([input_ids, tokens], dim=1)  # (1, committed)
    positions = torch.arange(committed, device=input_ids.device)[None]  # (1, committed)
    crop_cache(target_cache, 0)
    crop_cache(draft_cache, 0)
    _forward_target(target, cache_kw, target_cache, tokens, positions, None, windows, record=False,
                    **_families.prefill_kwargs(target, _forward_params(target)))
    crop_cache(target_cache, committed - 1)  # the anchor is verified by this step's block, as always
    rows.ctx, rows.draft_valid = _Context(features()[:, :-1], positions[:, :-1], None), None
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
            run, adaptive=False, rope_switch=None):
    """The speculative loop; fills ``run.out`` / ``run.chunks`` in place. ``rope_switch``: the longrope
    switch this call crosses (``target_families.check_rope``), else None."""
    device, bsz, out = input_ids.device, input_ids.shape[0], run.out
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    cache_kw = _cache_kwarg(target)
    target_cache, draft_cache = new_target_cache(target), DynamicCache()
    budget = run.stops.budget
    t0 = _sync(device) if output_timings else None

    # Prefill: each row's first token becomes its first anchor.
    holes = bsz > 1 or not bool(prompt_mask.all())
    positions = (prompt_mask.cumsum(1) - 1).clamp_min(0)  # true positions under left padding
    windows = _families.layer_windows(target)
    extra = _families.prefill_kwargs(target, _forward_params(target))
    logits = _forward_target(target, cache_kw, target_cache, input_ids, positions,
                             prompt_mask[:, :0] if holes else None, windows, prompt_mask, record=False, **extra)
    first, scores = sampling.first(logits[:, -1], input_ids)
    out.num_target_forwards, out.num_draft_forwards = 1, 0
    rows = _Rows(ids=torch.arange(bsz, device=device), anchor=first[:, None], start=prompt_mask.sum(1),
                 n_new=torch.ones(bsz, dtype=torch.long, device=device), target_valid=prompt_mask if holes else None,
                 draft_valid=None, ctx=_Context(features(), positions, prompt_mask if holes else None),
                 host_ids=list(range(bsz)), host_new=[1] * bsz, holes=holes)
    finished = _prefill_commit(run, first, scores, logits[:, -1])
    t1 = _sync(device) if output_timings else None
    offsets = torch.arange(block_size, device=device)  # (block_size,) slot offsets, built once
    next_b = block_size
    longrope = rope_switch and functools.partial(_longrope_step, rope_switch, input_ids, target, cache_kw, target_cache,
                                                 draft_cache, windows, features)

    while not any(finished) or _drop_finished(rows, finished, (target_cache, draft_cache), device):
        b = min(next_b, budget - min(rows.host_new))
        if longrope:  # a longrope target crossing its switch: clamp below it, re-prefill at it
            b = longrope(b, rows, run)
        positions = rows.start[:, None] + offsets[:b]  # (A, b)
        block, q = rows.anchor, None
        if b > 1:
            logits = _draft_logits(draft, embed, head, rows.anchor, rows.ctx, draft_cache, rows.draft_valid,
                                   rows.start, b, mask_token_id)
            drafts, q = sampling.propose(logits, rows)
            block = torch.cat([rows.anchor, drafts.to(device)], dim=1)  # (A, b)
            rows.context_drafted(draft_cache.get_seq_length())
            out.num_draft_forwards += 1
        logits = _forward_target(target, cache_kw, target_cache, block, positions, rows.target_valid, windows)
        out.num_target_forwards += 1
        accepted, next_token, scores = sampling.verify(block[:, 1:], q, logits, rows)
        committed = accepted + 1  # (A,) anchor + accepted drafts enter the caches; next_token is the new anchor
        new = torch.cat([block[:, 1:], next_token[:, None]], dim=1).scatter(1, accepted[:, None], next_token[:, None])
        counts, finished = _commit(run, rows, accepted, b - 1, new, scores, logits)
        if run.stops.timed_out():  # max_time: once per verify step, after the commit
            finished = [True] * len(finished)

        # Roll back: keep the committed slots; rejected ones become holes (masked) for shorter rows.
        width = max(counts)
        next_b = next_block_size(block_size, width, adaptive)
        crop_cache(target_cache, target_cache.get_seq_length() - b + width)
        restore_linear_states(target_cache, committed)  # hybrid targets: replay each row's committed prefix
        owned = None
        if rows.holes:
            owned = (offsets[None, :width] < committed[:, None]).long()  # (A, width)
            rows.target_valid = torch.cat([rows.target_valid, owned], dim=1)
        rows.add_context(_Context(features()[:, :width], positions[:, :width], owned))
        rows.start, rows.n_new, rows.anchor = rows.start + committed, rows.n_new + committed, next_token[:, None]
        rows.host_new = [n + c for n, c in zip(rows.host_new, counts)]

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


@contextlib.contextmanager
def native_acceptance_stats(draft, target=None):
    """Collect ``spec_generate``'s acceptance statistics on transformers' native DFlash path
    (``target.generate(assistant_model=draft, speculation_type="dflash")``, batch 1), which returns none.

    Hooks on ``draft`` (and ``target``, for the forward count) read what the native generator passes:
    each draft call after the first receives the context of the tokens the previous verify step
    committed (accepted drafts + the bonus token), so those are its acceptance lengths; the last
    step's is what remains of the new tokens after the prefill token. Hooks are removed on exit.

    Yields a callable ``result(sequences, prompt_len) -> DFlashGenerateOutput`` with ``sequences``,
    ``acceptance_lengths`` (so ``mean = (new_tokens - 1) / verify steps``, the one tau definition),
    ``row_acceptance_lengths``, ``num_new_tokens``, ``num_draft_forwards``, ``num_target_forwards``
    (None without ``target``) and ``block_size``, ready for ``plot_acceptance``.

    Raises:
        ValueError: from ``result``, for a batch of more than one row (the native path is batch 1).
    """
    contexts, block, target_calls = [], [], [0]

    def draft_hook(module, args, kwargs):
        if kwargs.get("context_hidden_states") is not None:
            contexts.append(int(kwargs["context_hidden_states"].shape[1]))
            block.append(int(kwargs["noise_embeds"].shape[1]))

    def target_hook(module, args, output):
        target_calls[0] += 1

    handles = [draft.register_forward_pre_hook(draft_hook, with_kwargs=True)]
    if target is not None:
        handles.append(target.register_forward_hook(target_hook))

    def result(sequences, prompt_len):
        if sequences.shape[0] != 1:
            raise ValueError(f"the native DFlash path is batch 1, got {sequences.shape[0]} rows")
        new = int(sequences.shape[1]) - int(prompt_len)
        steps = contexts[1:]  # what each step committed, known at the next draft call
        # Near max_length the generator stops drafting; the target then commits one token per step.
        plain = max(target_calls[0] - 1 - len(contexts), 0) if target is not None else 0
        if contexts:
            steps.append(max(new - 1 - sum(steps) - plain, 1))
        steps += [1] * plain
        drafted = [max(block) - 1 if block else 0] * (len(steps) - plain) + [0] * plain
        out = DFlashGenerateOutput(
            sequences=sequences, acceptance_lengths=list(steps), row_acceptance_lengths=[list(steps)],
            row_draft_lengths=[drafted], row_accepted_drafts=[[a - 1 for a in steps]],
            num_new_tokens=[new], num_draft_forwards=len(contexts),
            num_target_forwards=target_calls[0] if target is not None else None,
        )
        out.block_size = max(block) if block else None  # plain attribute, read by plot_acceptance
        return out

    try:
        yield result
    finally:
        for h in handles:
            h.remove()


def per_slot_acceptance(acceptance_lengths, block_size: int) -> list:
    """Acceptance of each draft slot ``k = 1..block_size-1``: steps that accepted at least ``k``
    drafts / steps (every step drafts the full block except near ``max_new_tokens``). A step with
    acceptance length ``a`` (bonus included) accepted ``a - 1`` drafts."""
    n = max(len(acceptance_lengths), 1)
    return [sum(a - 1 >= k for a in acceptance_lengths) / n for k in range(1, block_size)]


def plot_acceptance(result, block_size: Optional[int] = None):
    """Plot per-slot acceptance and the histogram of acceptance lengths of a ``spec_generate`` (or
    ``native_acceptance_stats``) result. Needs matplotlib (optional; imported here, any backend).

    Args:
        result: has ``acceptance_lengths`` (tokens per verify step, bonus included).
        block_size: slots to show; default the result's block size if it records one, else the
            longest acceptance length seen.

    Returns:
        A ``matplotlib.figure.Figure`` with two axes: bars of per-slot acceptance (slot 1..b-1, in
        [0, 1]) and a histogram of acceptance lengths (1..b) with tau marked.

    Raises:
        ImportError: matplotlib is not installed (``pip install matplotlib``).
        ValueError: the result holds no verify steps.
    """
    lengths = list(result.acceptance_lengths or [])
    if not lengths:
        raise ValueError("the result holds no verify steps (nothing was drafted): nothing to plot")
    try:
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator
    except ImportError as err:
        raise ImportError("plot() needs matplotlib: pip install matplotlib") from err
    b = int(block_size or getattr(result, "block_size", None) or max(lengths))
    tau = getattr(result, "tau", None) or sum(lengths) / len(lengths)
    rates = result.slot_acceptance() if hasattr(result, "slot_acceptance") else per_slot_acceptance(lengths, b)
    rates = [0.0 if r is None else r for r in rates][: b - 1]
    rates += [0.0] * (b - 1 - len(rates))  # slots no step drafted
    fig = Figure(figsize=(10, 3.5), layout="constrained")
    slots, hist = fig.subplots(1, 2)
    slots.bar(range(1, b), rates, color="tab:blue")
    slots.set(xlabel="draft slot k", ylabel="share of steps accepting slot k", ylim=(0, 1),
              title="per-slot acceptance")
    hist.hist(lengths, bins=[x - 0.5 for x in range(1, b + 2)], color="tab:green", rwidth=0.85)
    hist.axvline(tau, color="black", linestyle="--", label=f"tau = {tau:.2f}")
    hist.set(xlabel="acceptance length (tokens per verify step)", ylabel="verify steps",
             title=f"acceptance lengths ({len(lengths)} steps)")
    hist.yaxis.set_major_locator(MaxNLocator(integer=True))
    hist.legend()
    return fig


DFlashGenerateOutput.plot = plot_acceptance


# The Hub `custom_generate/generate.py` written next to every saved drafter (transformers follows only
# relative imports inside custom_generate/, so it reaches the decoding loop through the loaded drafter).
CUSTOM_GENERATE_PY = '''"""DFlash speculative decoding behind ``generate()`` (transformers' Hub ``custom_generate`` entry).

    draft = AutoModel.from_pretrained(DRAFTER, trust_remote_code=True)
    out = target.generate(input_ids, custom_generate=DRAFTER, trust_remote_code=True,
                          assistant_model=draft, max_new_tokens=256)

DRAFTER is this drafter's Hub repo id or local folder. transformers gives this function the target and
generate()'s arguments but not the repo it was loaded from, so the loaded drafter comes in as
``assistant_model``. The arguments go to ``draft.spec_generate`` unchanged (greedy output equals
``target.generate``; sampling is exact speculative sampling). Written by ``DFlashDraftModel.save_pretrained``.
"""


def generate(model, assistant_model=None, **generate_arguments):
    """``model``: the target causal LM; ``assistant_model``: the loaded DFlash drafter."""
    if not hasattr(assistant_model, "spec_generate_from_generate_arguments"):
        raise ValueError(
            "custom_generate with a DFlash drafter needs the loaded drafter as assistant_model=: "
            "draft = AutoModel.from_pretrained(<drafter repo or folder>, trust_remote_code=True), then "
            f"generate(..., assistant_model=draft); got assistant_model={type(assistant_model).__name__}"
        )
    return assistant_model.spec_generate_from_generate_arguments(model, **generate_arguments)
'''


def write_custom_generate(folder) -> str:
    """Write ``<folder>/custom_generate/generate.py`` (temporary name, then renamed); returns its path."""
    path = os.path.join(folder, "custom_generate", "generate.py")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(CUSTOM_GENERATE_PY)
    os.replace(tmp, path)
    return path


def _assemble(out, input_ids, run, pad):
    """``sequences`` = prompt as given + each row's new tokens, right padded with ``pad``; scores/logits."""
    rows = [sum(row, []) for row in run.chunks]
    width = max(len(r) for r in rows)
    new = input_ids.new_full((len(rows), width), pad)
    for i, r in enumerate(rows):
        new[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    out.sequences = torch.cat([input_ids, new], dim=1)
    out.num_new_tokens = [len(r) for r in rows]
    out.acceptance_lengths = [a for row in out.row_acceptance_lengths for a in row]
    if run.recorder is not None:
        for name, value in run.recorder.tuples(width).items():
            out[name] = value  # ModelOutput: item and attribute


__all__ = [
    "spec_generate", "speculative_verify", "capture_target_features", "check_pairing", "crop_cache",
    "DFlashGenerateOutput", "NOT_PASSED", "APPLIED_KEYS", "REFUSED_KEYS", "NO_EFFECT_KEYS",
    "native_acceptance_stats", "per_slot_acceptance", "plot_acceptance",
    "spec_generate_from_generate_arguments", "write_custom_generate", "CUSTOM_GENERATE_PY",
]
