"""The contenders of the benchmark, each a callable on ONE prompt of the same target.

``run(ids (1, L) LongTensor, max_new_tokens, sampling dict) -> (new token ids, acceptance lengths or None)``.
Every contender decodes with the same target object; the benchmark times them from outside and
counts the target's forwards with a hook (steps = forwards - 1), so tau is defined the same way
for all (``bench.stats``).

* ``target.generate``: plain autoregressive decoding, the speed reference.
* ``package@b``: this package's ``spec_generate`` at block size ``b`` (also any other drafter folder
  with its own remote code, e.g. the package before a change: ``--baseline``).
* ``prompt_lookup``: transformers' prompt-lookup decoding (``prompt_lookup_num_tokens``).
* ``reference@b``: the DFlash authors' ``dflash_generate`` from a local copy of their code
  (``--reference-dir``), run as shipped under its own ``inference_mode``; on transformers 5.x
  only the positive-length ``Cache.crop`` it relies on is patched (5.x accepts negative counts only).
* ``tree@N``: ``spec_generate(tree_budget=N)``, draft trees of at most N nodes (``--tree-budgets``).
* ``ddtree@N``: DDTree's own ``ddtree_generate`` (Ringel & Romano) from a local copy of
  ``liranringel/ddtree`` (``--ddtree-dir``), its code unedited, with the same positive-crop shim as the
  authors' loop on 5.x; it samples the plain tempered distribution (no top-k).
* ``native``: transformers' own DFlash loop (``speculation_type="dflash"``, 5.24+) with the same
  drafter through a small forward-name adapter.
"""
from __future__ import annotations

import contextlib
import importlib
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch


@dataclass
class Contender:
    name: str
    run: Callable
    block_size: Optional[int] = None  # drafted block (for per-slot statistics), None: not a block drafter
    warm_every_prompt: bool = False  # warm up on every prompt at full length (the policy's per-shape cost tables)


def sampling_kwargs(sampling: dict) -> dict:
    """Decoding kwargs shared by ``generate`` and ``spec_generate`` for the bench's ``sampling`` dict: greedy
    (``{"do_sample": False}``) when its ``temperature`` is 0 or absent, else sampled at that temperature with
    top-k ``sampling["top_k"]`` (0 or absent: none) and no top-p, so every contender samples from the same
    distribution."""
    if sampling.get("temperature"):
        return {"do_sample": True, "temperature": sampling["temperature"], "top_k": sampling.get("top_k") or 0,
                "top_p": 1.0}
    return {"do_sample": False}


def generate_kwargs(target, sampling: dict) -> dict:
    """``generate`` kwargs: the target's eos/pad ids and [`sampling_kwargs`]."""
    eos = target.generation_config.eos_token_id
    pad = target.generation_config.pad_token_id
    return dict(eos_token_id=eos, pad_token_id=pad if pad is not None else eos, **sampling_kwargs(sampling))


def _new(out, ids, eos) -> list[int]:
    """New tokens of a generate output, cut after the first eos (generate pads finished rows)."""
    new = out[0, ids.shape[1]:].tolist()
    stops = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    for i, t in enumerate(new):
        if t in stops:
            return new[: i + 1]
    return new


def target_generate(target, **extra) -> Callable:
    def run(ids, max_new_tokens, sampling):
        kw = generate_kwargs(target, sampling)
        out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, **kw, **extra)
        return _new(out, ids, kw["eos_token_id"]), None
    return run


def fixed_unless_asked(options: dict) -> dict:
    """``spec_generate`` keywords of a package contender: ``adaptive_block_size=False`` (fixed blocks, what
    ``package@b`` and ``tree@N`` time) unless ``options`` set it or ask for ``tree_budget="auto"`` (the
    policy's own tree, which ``adaptive_block_size=False`` refuses)."""
    return options if options.get("tree_budget") == "auto" else {"adaptive_block_size": False, **options}


def package(draft, target, block_size: int, **options) -> Callable:
    """``draft.spec_generate`` at ``block_size``: fixed blocks (``adaptive_block_size=False``) unless ``options``
    say otherwise or ask for ``tree_budget="auto"``; ``options`` go to ``spec_generate`` as they are."""
    options = fixed_unless_asked(options)

    def run(ids, max_new_tokens, sampling):
        out = draft.spec_generate(target, ids, max_new_tokens=max_new_tokens, block_size=block_size,
                                  return_dict_in_generate=True, **sampling_kwargs(sampling), **options)
        return (out.sequences[0, ids.shape[1]:][: out.num_new_tokens[0]].tolist(), out.row_acceptance_lengths[0],
                out.row_draft_lengths[0])
    return run


# ----------------------------------------------------------------------------- the authors' loop


def load_reference(reference_dir, draft_dir, dtype, device):
    """(``dflash_generate``, their ``DFlashDraftModel`` with the drafter's weights loaded strictly).

    ``reference_dir`` is a local copy of the authors' repository (the folder that holds ``dflash/``).

    Raises:
        ValueError: the folder has no ``dflash/model.py``, or the weights do not load strictly.
    """
    reference_dir = Path(reference_dir)
    if not (reference_dir / "dflash" / "model.py").exists():
        raise ValueError(f"--reference-dir {reference_dir} must hold the authors' dflash/model.py")
    sys.path.insert(0, str(reference_dir))
    try:
        model_mod = importlib.import_module("dflash.model")
    finally:
        sys.path.remove(str(reference_dir))
    model, info = model_mod.DFlashDraftModel.from_pretrained(draft_dir, dtype=dtype, output_loading_info=True)
    bad = {k: v for k, v in info.items() if v}
    if bad:
        raise ValueError(f"the drafter's weights do not load strictly into the reference model: {bad}")
    return model_mod.dflash_generate, model.to(device).eval()


@contextlib.contextmanager
def positive_crop_patch():
    """Let ``DynamicCache.crop(n)`` with ``n >= 0`` mean "keep n tokens" on transformers 5.x, as on 4.x
    (the reference loop calls ``crop(start)``). Restored on exit."""
    from transformers import DynamicCache

    original = DynamicCache.crop

    def crop(self, max_length):
        if max_length >= 0:
            remove = self.get_seq_length() - max_length
            return original(self, -remove) if remove > 0 else None
        return original(self, max_length)

    DynamicCache.crop = crop
    try:
        yield
    finally:
        DynamicCache.crop = original


def reference(generate_fn, model, target, block_size: int) -> Callable:
    eos = target.generation_config.eos_token_id
    stop = None if eos is None else (eos if isinstance(eos, list) else [eos])

    def run(ids, max_new_tokens, sampling):
        with positive_crop_patch():
            out = generate_fn(model, target, ids, max_new_tokens, stop, sampling.get("temperature") or 0.0,
                              block_size=block_size)  # return_stats needs CUDA; steps come from the probe
        return out[0, ids.shape[1]:].tolist(), None
    return run


# ----------------------------------------------------------------------------- DDTree's own loop


def load_ddtree(ddtree_dir, draft_dir, dtype, device):
    """(``ddtree_generate``, DDTree's ``DFlashDraftModel`` with the drafter's weights loaded strictly).

    ``ddtree_dir`` is a local copy of ``liranringel/ddtree`` (``ddtree.py``, ``dflash.py``, ``model/``). Its
    top-level module names (``dflash``, ``model``) would shadow the authors' ``dflash`` package of
    ``--reference-dir``: they are imported with those names set aside and put back afterwards (DDTree's
    functions keep their own modules through their globals). Off CUDA its stage clock ``cuda_time`` (which
    calls ``torch.cuda.synchronize()`` unconditionally) is replaced by ``time.perf_counter`` in its module:
    a shim as the crop one, no line of its code is changed.

    Raises:
        ValueError: the folder has no ``ddtree.py``, or the weights do not load strictly.
    """
    ddtree_dir = Path(ddtree_dir)
    if not (ddtree_dir / "ddtree.py").exists():
        raise ValueError(f"--ddtree-dir {ddtree_dir} must hold DDTree's ddtree.py")
    names = ("ddtree", "dflash", "model", "model.dflash", "model.utils")
    saved = {n: sys.modules.pop(n) for n in names if n in sys.modules}
    sys.path.insert(0, str(ddtree_dir))
    try:
        module = importlib.import_module("ddtree")
        model_cls = sys.modules["model"].DFlashDraftModel
    finally:
        sys.path.remove(str(ddtree_dir))
        for n in names:
            sys.modules.pop(n, None)
        sys.modules.update(saved)
    if device.type != "cuda":
        module.cuda_time = time.perf_counter
    model, info = model_cls.from_pretrained(draft_dir, dtype=dtype, output_loading_info=True)
    bad = {k: v for k, v in info.items() if v}
    if bad:
        raise ValueError(f"the drafter's weights do not load strictly into DDTree's model: {bad}")
    return module.ddtree_generate, model.to(device).eval()


def ddtree(generate_fn, model, target, block_size: int, budget: int) -> Callable:
    eos = target.generation_config.eos_token_id
    stop = None if eos is None else (eos if isinstance(eos, list) else [eos])

    def run(ids, max_new_tokens, sampling):
        with positive_crop_patch():
            out = generate_fn(model, target, ids, model.mask_token_id, max_new_tokens, block_size, stop,
                              sampling.get("temperature") or 0.0, tree_budget=budget)
        return out.output_ids[0, ids.shape[1]:].tolist(), None
    return run


# ----------------------------------------------------------------------------- transformers' native loop


def native_supported() -> bool:
    try:
        from transformers.generation.candidate_generator import DFlashTokenCandidateGenerator  # noqa: F401
    except ImportError:
        return False
    return True


@contextlib.contextmanager
def native_names(draft):
    """Temporarily give ``draft`` the forward that transformers' ``DFlashTokenCandidateGenerator`` calls:
    ``forward(noise_embeds, context_hidden_states, position_ids, attention_mask, cache)`` returning
    an object with ``last_hidden_state``. The class is swapped back on exit."""
    from transformers.modeling_outputs import BaseModelOutput

    base = type(draft)

    class NativeNames(base):
        def forward(self, noise_embeds=None, context_hidden_states=None, position_ids=None, attention_mask=None,
                    cache=None, **kwargs):
            hidden = base.forward(self, position_ids=position_ids, noise_embedding=noise_embeds,
                                  target_hidden=context_hidden_states, past_key_values=cache, use_cache=True,
                                  attention_mask=attention_mask)
            return BaseModelOutput(last_hidden_state=hidden)

    draft.__class__ = NativeNames
    try:
        yield draft
    finally:
        draft.__class__ = base


def native(draft, target) -> Callable:
    def run(ids, max_new_tokens, sampling):
        with native_names(draft) as adapted:
            return target_generate(target, assistant_model=adapted, speculation_type="dflash")(
                ids, max_new_tokens, sampling)
    return run
