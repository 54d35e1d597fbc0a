"""The routes through transformers' own ``generate``: acceptance statistics of its native DFlash loop
(``speculation_type="dflash"``, 5.x), and the Hub ``custom_generate/generate.py`` written next to every
saved drafter (``generate(custom_generate=<drafter>)``, 4.57 and 5.x).
"""

import contextlib
import inspect
import os
import sys

try:
    from .custom_generate_template import generate as _custom_generate_entry
    from .generation_arguments import check_is_drafter, check_pairing, check_vocab
    from .generation_output import DFlashGenerateOutput
    from .tested_versions import warn_if_untested
except ImportError:  # imported from the repository root instead of as a Hub remote-code package
    from custom_generate_template import generate as _custom_generate_entry
    from generation_arguments import check_is_drafter, check_pairing, check_vocab
    from generation_output import DFlashGenerateOutput
    from tested_versions import warn_if_untested


def native_dflash_available() -> bool:
    """True when this transformers has its own DFlash candidate generator (5.x), i.e. when
    ``target.generate(assistant_model=draft, speculation_type="dflash")`` exists."""
    try:
        from transformers.generation import candidate_generator
    except ImportError:
        return False
    return hasattr(candidate_generator, "DFlashTokenCandidateGenerator")


def assistant_usage_hint() -> str:
    """How to use a DFlash draft from ``generate()`` on the installed transformers version."""
    routes = ("draft.spec_generate(target, input_ids, ...), or target.generate(input_ids, "
              "custom_generate=<this drafter's folder or Hub repo>, assistant_model=draft, trust_remote_code=True)")
    if native_dflash_available():
        return ("a DFlash draft is not a generic generate() assistant: pass speculation_type=\"dflash\" with "
                f"assistant_model=draft (transformers' own DFlash path), or use {routes}")
    return ("a DFlash draft is not a generic generate() assistant, and this transformers version has no native "
            f"DFlash path (speculation_type=\"dflash\" needs transformers >= 5): use {routes}")


def check_native_pairing(draft, frame) -> None:
    """On transformers' native DFlash route, check ``draft`` against the target with the message of the other
    routes (``generation_arguments.check_pairing``: hidden size, layers, vocabulary, mask id), when transformers
    builds its ``DFlashTokenCandidateGenerator``, before the target's first forward.

    ``frame`` is the frame that read ``draft.device``: the generator's ``__init__`` reads it first, and the
    frame above it is ``target._get_candidate_generator`` (5.x), whose ``self`` is the target. Any other
    reader returns at once. Without it a drafter of another shape failed later inside transformers, with a
    raw ``IndexError`` (``target_layer_ids`` beyond the target's layers) or a matmul shape error (hidden size).

    Raises:
        ValueError: from ``check_pairing``, or naming DSpark for a DSpark drafter (``_refuse_dspark``).
    """
    if frame is None or frame.f_code.co_name != "__init__":
        return
    if type(frame.f_locals.get("self")).__name__ != "DFlashTokenCandidateGenerator" or frame.f_back is None:
        return
    target = frame.f_back.f_locals.get("self")
    warn_if_untested("native route")
    _refuse_dspark(draft.config)
    if target is not None and hasattr(target, "get_input_embeddings") and target is not draft:
        check_pairing(draft, target)


class NativeRouteChecks:
    """Mixin of ``DFlashDraftModel``: its ``device`` property, which transformers' native DFlash generator reads
    first as it is built, checks the drafter against the target there (``check_native_pairing``)."""

    @property
    def device(self):
        check_native_pairing(self, sys._getframe(1))
        return super().device


def _refuse_dspark(draft_config) -> None:
    """ValueError naming DSpark for a DSpark drafter (``draft_config.is_dspark``) on the native route."""
    if getattr(draft_config, "is_dspark", False):
        arch = (getattr(draft_config, "architectures", None) or ["DSpark"])[0]
        raise ValueError(
            f"a DSpark drafter ({arch}) does not run on transformers' native DFlash route (speculation_type="
            "\"dflash\"): that loop drafts slot k as the token at start + k from the target's head, a DSpark slot k "
            "is start + k + 1 from the drafter's own head and Markov walk. Use draft.spec_generate(target, input_ids, "
            "...) or target.generate(input_ids, custom_generate=<the drafter's folder>, assistant_model=draft, "
            "trust_remote_code=True)")


def check_native_target(draft_config, max_depth: int = 8) -> None:
    """On transformers' native DFlash route, ValueError naming both sizes unless the target's input
    embedding has ``draft_config.vocab_size`` rows (``generation_arguments.check_vocab``).

    The drafter's forward sees only the target's embeddings of its block, not the target: the caller,
    transformers' ``DFlashTokenCandidateGenerator.get_candidates`` (5.x), holds the target's embedding as
    ``main_model_input_embeddings``, found by walking up at most ``max_depth`` frames. Nothing is checked
    when no such caller is found (our own loop checks before any forward).

    Raises:
        ValueError: naming DSpark, for a DSpark drafter (``draft_config.is_dspark``): the native loop drafts
            slot k as the token at ``start + k`` from the target's head and discards slot 0, while DSpark's
            slot k is ``start + k + 1`` from its own head plus the Markov walk; only this package's loop runs it.
    """
    _refuse_dspark(draft_config)
    frame = sys._getframe(1)
    for _ in range(max_depth):
        if frame is None:
            return
        embed = getattr(frame.f_locals.get("self"), "main_model_input_embeddings", None)
        weight = getattr(embed, "weight", None)
        if weight is not None:
            check_vocab(draft_config.vocab_size, weight.shape[0])
            return
        frame = frame.f_back


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
        ValueError: ``draft`` is no DFlash drafter (``generation_arguments.check_is_drafter``); from
            ``result``, for a batch of more than one row (the native path is batch 1).
    """
    check_is_drafter(draft)
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


# The Hub `custom_generate/generate.py` written next to every saved drafter (transformers follows only
# relative imports inside custom_generate/, so it reaches the decoding loop through the loaded drafter).
# Its one source is custom_generate_template.py (valid Python, imported by modeling_dflash.py so that
# transformers copies it into its module cache too); these are that file's bytes.
_TEMPLATE_FILE = inspect.getsourcefile(_custom_generate_entry)
with open(_TEMPLATE_FILE, encoding="utf-8") as _f:
    CUSTOM_GENERATE_PY = _f.read()


def write_custom_generate(folder) -> str:
    """Write ``<folder>/custom_generate/generate.py`` (temporary name, then renamed); returns its path."""
    path = os.path.join(folder, "custom_generate", "generate.py")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(CUSTOM_GENERATE_PY)
    os.replace(tmp, path)
    return path


__all__ = ["native_acceptance_stats", "write_custom_generate", "CUSTOM_GENERATE_PY", "check_native_target",
           "check_native_pairing", "NativeRouteChecks",
           "native_dflash_available", "assistant_usage_hint"]
