"""What one verify step of either loop (the dynamic ``generation_utils._decode`` and the fixed-shape
``static_generate.static_decode``) is made of, below both: the per-call run record, committing a
step's tokens (budget, stops, statistics, streamer), cache cropping, the target's verify forward and the
per-row state of the dynamic loop.
"""

import contextlib
import functools
import inspect
import time
from dataclasses import dataclass
from typing import Optional

import torch

try:
    from .generation_output import DFlashGenerateOutput
    from .speculative_sampling import _History
    from .stopping_criteria import _Scores, _Stops
    from .target_cache import recording
    from .target_taps import run_target
except ImportError:  # imported from the repository root instead of as a Hub remote-code package
    from generation_output import DFlashGenerateOutput
    from speculative_sampling import _History
    from stopping_criteria import _Scores, _Stops
    from target_cache import recording
    from target_taps import run_target


def crop_cache(cache, length: int) -> None:
    """Cut a transformers cache back to ``length`` tokens, on 4.57 and 5.x alike.

    Only ever calls ``crop`` with a negative count: 5.x rejects positive lengths, and on 4.57
    ``crop(0)`` empties the cache (notes section 3). Nothing is called when nothing is removed.
    """
    remove = cache.get_seq_length() - length
    if remove > 0:
        cache.crop(-remove)


def compact_cache(cache, nodes: int, path: torch.Tensor) -> None:
    """Keep, of the last ``nodes`` entries of every layer of ``cache`` (the verified tree, anchor first), the
    ``path`` ``(A, W)`` nodes in path order, and drop the rest: the cache then ends as after a chain step that
    committed those tokens. In place (``index``-gathered rows copied over the tree's first ``W`` slots, then
    one crop), on the layers' own devices; DDTree ``compact_dynamic_cache`` does the same at batch 1 (``draft_trees.py``).
    Every layer of transformers' ``DynamicCache`` (4.57 and 5.x) holds ``keys``/``values`` ``(A, H, L, D)``."""
    length = cache.get_seq_length()
    width = path.shape[1]
    for layer in cache.layers:
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            if t is None or t.dim() != 4 or t.shape[-2] < nodes:
                continue
            index = path.to(t.device)[:, None, :, None].expand(t.shape[0], t.shape[1], width, t.shape[-1])
            tail = t.narrow(-2, t.shape[-2] - nodes, nodes).gather(-2, index)  # (A, H, W, D), a new tensor
            t.narrow(-2, t.shape[-2] - nodes, width).copy_(tail)
    crop_cache(cache, length - nodes + width)


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


@dataclass
class _Run:
    """What one call's loop writes to, besides the rows: output, per-row chunks, history, stops, streamer."""

    out: DFlashGenerateOutput
    chunks: list
    stops: _Stops
    history: Optional[_History]
    streamer: object
    recorder: Optional[_Scores]


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


@dataclass
class _Context:
    """Target features not yet in the draft cache: ``features (B, C, F)``, ``positions (B, C)`` and
    ``valid (B, C)`` (None when every slot is valid; the loop sets it only when some slot is not, known
    on the host, so no device check is needed)."""

    features: torch.Tensor
    positions: torch.Tensor
    valid: Optional[torch.Tensor]

    @staticmethod
    def join(parts: list) -> "_Context":
        """The contexts ``parts`` one after another along the context axis (one copy of each)."""
        valid = None
        if any(c.valid is not None for c in parts):
            valid = torch.cat([c.valid if c.valid is not None else c.positions.new_ones(c.positions.shape)
                               for c in parts], dim=1)
        return _Context(torch.cat([c.features for c in parts], dim=1), torch.cat([c.positions for c in parts], dim=1),
                        valid)

    def cat(self, other: "_Context") -> "_Context":
        return _Context.join([self, other])

    def select(self, keep) -> "_Context":
        return _Context(self.features[keep], self.positions[keep], None if self.valid is None else self.valid[keep])


@dataclass
class _Rows:
    """Per-row state of the rows still generating (index ``i`` is original row ``ids[i]``).

    ``ids``/``n_new`` live on the device (processors read them) and are mirrored on the host
    (``host_ids``/``host_new``), filled from the one transfer per step that carries the acceptance
    decision; validity masks exist only when the batch can have holes (``holes``) and are passed to the
    target only once some slot is masked (``masked``, a host flag: left padding, or a step where rows
    committed different counts), so a step checks no mask on the device."""

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
    masked: bool = True  # some cache slot is masked (sticky; host bookkeeping, never read from the device)
    parts: list = None  # contexts added after ``ctx``, concatenated once when read ([`context`])

    def select(self, keep: list, keep_t: torch.Tensor):
        for name in ("ids", "anchor", "start", "n_new"):
            setattr(self, name, getattr(self, name)[keep_t])
        self.host_ids, self.host_new = [self.host_ids[i] for i in keep], [self.host_new[i] for i in keep]
        self.target_valid = None if self.target_valid is None else self.target_valid[keep_t]
        self.draft_valid = None if self.draft_valid is None else self.draft_valid[keep_t]
        ctx = self.context()
        self.ctx = None if ctx is None else ctx.select(keep_t)

    def context_drafted(self, draft_len: int):
        """The pending context went into the draft cache (now ``draft_len`` slots long)."""
        if self.holes and (self.draft_valid is not None or self.ctx.valid is not None):
            n_ctx, cached, valid = self.ctx.positions.shape[1], self.draft_valid, self.ctx.valid
            if valid is None:
                valid = cached.new_ones(len(self.host_ids), n_ctx)
            if cached is None:
                cached = valid.new_ones(len(self.host_ids), draft_len - n_ctx)
            self.draft_valid = torch.cat([cached, valid], dim=1)
        self.ctx = None

    def add_context(self, ctx: _Context):
        """Queue ``ctx`` after the pending context: plain steps add one position each, and concatenating
        then would copy the whole pending context every step."""
        if self.ctx is None:
            self.ctx = ctx
        else:
            self.parts = (self.parts or []) + [ctx]

    def context(self) -> Optional[_Context]:
        """The pending context (features not yet in the draft cache), its queued parts concatenated once."""
        if self.parts:
            self.ctx, self.parts = _Context.join([self.ctx, *self.parts]), None
        return self.ctx


def _commit(run, rows, accepted, drafts, next_token, scores, logits, drafted=None):
    """Append each row's tokens (its ``accepted`` ``(A,)`` first ``drafts`` ``(A, n)``, then ``next_token``
    ``(A,)``), cut at the row's budget (by length, never by value) and right after its first stopping token;
    record the statistics of the step. One device-to-host transfer (the acceptance decision, the drafts and
    the next token together). ``drafted``: per-row drafted depth (a tree's, ``draft_trees.Verdict``), else
    every row drafted ``drafts.shape[1]``. Returns host lists ``(committed (A,), done (A,))``: anchor +
    accepted drafts per row, and whether the row is done."""
    done, counts, totals = [], [], []
    drafted = [drafts.shape[1]] * drafts.shape[0] if drafted is None else drafted
    host = torch.cat([accepted[:, None], drafts, next_token[:, None]], dim=1).tolist()  # the step's only sync
    remaining = [run.stops.budget - n for n in rows.host_new]
    for i, (r, (a, *row)) in enumerate(zip(rows.host_ids, host)):
        counts.append(a + 1)
        take, finished = _commit_row(run, r, rows.host_new[i], (row[:a] + row[-1:])[: min(a + 1, remaining[i])],
                                     remaining[i], None if scores is None else scores[i], logits[i])
        totals.append(rows.host_new[i] + len(take))
        run.out.row_acceptance_lengths[r].append(len(take))
        run.out.row_draft_lengths[r].append(min(drafted[i], remaining[i]))
        run.out.row_accepted_drafts[r].append(min(a, remaining[i]))
        done.append(finished)
        if run.streamer is not None:
            run.streamer.put(torch.tensor(take))
    return counts, _batch_done(run, done, totals)


def _commit_row(run, r, n_before: int, take: list, remaining: int, scores, logits):
    """Row ``r``'s committed tokens ``take`` (host ints, already cut to the budget; the row had ``n_before``
    new tokens and ``remaining`` of its budget): the one per-token rule of the prefill token and of every
    verify step. Written to the history, cut right after the first stopping token (without an eos
    criterion in a batch the stop is only recorded and the row keeps every token, ``_Stops.keep_generating``),
    the history padded after a stop, appended to ``run.chunks[r]``, its scores ``(>= len(take), V)``
    recorded. Returns ``(take, done)``.

    Source: issue 34 item 1: the prefill's commit skipped ``keep_generating``, so an eos-less batch row
    stopped at its first token was padded and the other rows ran to ``max_new_tokens``."""
    start = n_before + (run.history.prompt_len if run.history is not None else 0)
    if run.history is not None:
        run.history.write(r, start, take)
    cut, stopped = run.stops.cut(take, run.history, r, start)
    take, stopped = run.stops.keep_generating(r, n_before, take, cut, stopped)
    if stopped and run.history is not None:
        run.history.pad_from(r, start + len(take))  # generate pads a finished row (processors see it)
    run.chunks[r].append(take)
    if run.recorder is not None:
        run.recorder.add(r, len(take), scores, logits)
    return take, stopped or len(take) >= remaining


def _batch_done(run, done: list, totals: list) -> list:
    """``done`` (host bools, one per row) with every row that reached the batch end (``totals``: its new
    tokens) set: no eos criterion, so stopped rows run on until every row has stopped."""
    end = run.stops.batch_end()
    if end is None:
        return done
    return [d or total >= end for d, total in zip(done, totals)]


def _prefill_commit(run, first, scores, logits):
    """The prefill token ``first`` ``(B,)`` of every row, through ``_commit_row`` (no statistics: it is no
    verify step); ``scores``/``logits`` ``(B, V)`` or None. Returns ``(B,)`` host bools: done."""
    done = [_commit_row(run, r, 0, [token], run.stops.budget, None if scores is None else scores[r: r + 1],
                        logits[r: r + 1])[1] for r, token in enumerate(first.tolist())]
    if run.streamer is not None:
        run.streamer.put(first.cpu())
    return _batch_done(run, done, [1] * len(done))


def _trim_to_batch_end(run) -> None:
    """Cut a batch without an eos criterion at its end (the last row's first stop, ``_Stops.batch_end``):
    each row's chunks, and with them its recorded scores/logits, its per-step statistics (the step cut is
    capped as the budget caps a step: drafts and accepted drafts at most the tokens it keeps; later steps
    dropped) and the timings' token count, so ``sum(row_acceptance_lengths[r]) == num_new_tokens[r] - 1``.

    Source: issue 34 item 5: only the chunks were cut, so ``output_scores`` raised ``RuntimeError`` (more
    scores than tokens) after the whole generation and the statistics counted the dropped tokens."""
    out = run.out
    for r, (k, n) in run.stops.trim(run.chunks).items():
        if run.recorder is not None:
            run.recorder.trim(r, k, n)
        stats = (out.row_acceptance_lengths[r], out.row_draft_lengths[r], out.row_accepted_drafts[r])
        kept = ([n], [min(stats[1][k - 1], n)], [min(stats[2][k - 1], n)]) if k else ([], [], [])
        for stat, last in zip(stats, kept):  # step k - 1 made chunk k (chunk 0 is the prefill token)
            stat[max(k - 1, 0):] = last
    if out.timings is not None:
        out.timings["new_tokens"] = sum(len(sum(c, [])) for c in run.chunks)


def _forward_target(target, facts, cache, tokens, positions, valid, tokens_valid=None, record=True, rope=None,
                    **extra):
    """Target logits ``(A, n, V)`` for ``tokens`` at ``positions``, over cache slots marked ``valid``
    (None: every slot is valid, no mask built; given: the caller knows some slot or token is masked, so
    the mask is built without checking it on the device, which would be a host synchronisation).
    ``rope``: the target's own position ids of the tokens where they differ from the 1-D ``positions``
    (vision-language targets, ``target_families.VisionPrompt``); ``extra`` may hold the prefill's own
    ``attention_mask``.

    ``facts``: the call's ``target_facts.TargetFacts`` (cache keyword, windows, mask dtype).

    Slots a row does not own are masked; on sliding-window targets the mask also counts each
    window in true positions (``target_families.target_mask``), so holes never shift it. Hybrid
    targets record the linear-attention mixers' inputs for the rollback (``target_cache.recording``),
    except in the prefill (``record=False``), which is never rolled back."""
    mask = None
    if valid is not None:
        tokens_valid = torch.ones_like(tokens) if tokens_valid is None else tokens_valid
        mask = facts.mask(tokens_valid, positions, valid)
    extra.setdefault("attention_mask", mask)
    with recording(cache) if record else contextlib.nullcontext():  # hybrid: snapshot + mixer inputs
        return run_target(target, input_ids=tokens, position_ids=positions if rope is None else rope, use_cache=True,
                          **extra, **{facts.cache_kw: cache}).logits  # run_target: taps of a compiled target


__all__ = ["compact_cache", "crop_cache"]
