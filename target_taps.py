"""Target feature taps: the outputs of chosen target layers, captured during the target's own forwards
(layer id ``k`` = output of decoder layer ``k``; notes sections 1 and 6). Shared by decoding
(``spec_generate``, both loops) and training (``train/features.py``).

Two ways, one convention: forward hooks on the decoder layers (any target, any version), or, when the
target's forward is compiled (``model.forward = torch.compile(model.forward, ...)``, the transformers
docs' pattern, or ``model.compile()``), the forward's own hidden states: a hook of ours inside a
compiled region breaks dynamo's graph (``fullgraph=True`` fails, otherwise the graph is cut at every
hooked layer). Forwards that should be tapped go through [`run_target`], which asks for exactly the
tapped states when a compiled capture is open (transformers >= 5.24: ``output_hidden_states`` as the
list of tapped indices; older: all of them, of which only the tapped ones are kept).
"""

import contextlib
import threading
import weakref

import torch
import transformers

try:
    from .target_families import FAMILY as _families
    from .tested_versions import warn_if_untested
except ImportError:  # imported from the repository root instead of as a Hub remote-code package
    from target_families import FAMILY as _families
    from tested_versions import warn_if_untested


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

    def _record_shape(self, module, args, kwargs=None):
        """(batch, length) of the forward's input, for the tap check (``target_families.check_tap``).

        ``kwargs`` has a default: ``register_forward_pre_hook(..., with_kwargs=True)`` fills its hook table and
        its with-kwargs set in two statements, so a forward of another thread that starts between them calls
        the hook as a plain pre-hook, without ``kwargs`` (the TypeError round 3 saw on the hybrid recording
        hook, ``target_cache._record_mixer_input``, under threads)."""
        kwargs = kwargs or {}
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


def compiled_forward(target) -> bool:
    """Whether ``target``'s forward runs under ``torch.compile``: ``target.forward`` replaced by a
    compiled function (which carries dynamo's ``_torchdynamo_orig_callable``), or ``target.compile()``
    (a compiled ``_compiled_call_impl``)."""
    forward = getattr(target, "forward", None)
    return hasattr(forward, "_torchdynamo_orig_callable") or getattr(target, "_compiled_call_impl", None) is not None


_SELECTS_STATES = tuple(int(x) for x in transformers.__version__.split(".")[:2]) >= (5, 24)


def hidden_states_request(layer_ids):
    """The ``output_hidden_states`` value that returns the taps ``layer_ids`` (HF index ``k + 1``): the list
    of those indices on transformers >= 5.24 (the others come back as None), else True (all of them)."""
    return sorted({k + 1 for k in layer_ids}) if _SELECTS_STATES else True


_LAYERS_PATCHED_PER_CALL = int(transformers.__version__.split(".")[0]) < 5
_FORWARD_LOCKS_GUARD = threading.Lock()
_FORWARD_LOCKS = weakref.WeakKeyDictionary()  # target -> threading.RLock


@contextlib.contextmanager
def forward_lock(target, states: bool = True):
    """Hold ``target``'s lock around one of our forwards on it where concurrent forwards from other threads
    would corrupt it: one at a time per target.

    Transformers 4.x collects hidden states by replacing the decoder layers' ``forward`` on the shared model
    for the duration of a call that asks for them (``check_model_inputs``, ``utils/generic.py``): any other
    thread's forward through those layers meanwhile appends its states to that call's tuple, or loses its
    own (seen with two concurrent static-loop calls on one target: IndexError on the tuple, or states of the
    other thread's prompt length). So on 4.x every forward of ours takes the lock; on 5.x, whose collection
    is a ContextVar (thread-safe except under ``torch.compile``, where its ``CompileableContextVar`` is a
    plain global), only those asking for hidden states (``states``). Uncontended it costs under a
    microsecond; forwards that run outside our calls (a user's own ``generate`` in another thread) are
    not covered."""
    if not (states or _LAYERS_PATCHED_PER_CALL):
        yield
        return
    with _FORWARD_LOCKS_GUARD:
        lock = _FORWARD_LOCKS.setdefault(target, threading.RLock())
    with lock:
        yield


def warm_output_capture(target, layer_ids) -> None:
    """Run transformers' first-use setup of hidden-state outputs eagerly, before a compiled forward asks
    for them: transformers 5.x installs its output-capturing hooks lazily, under a ``threading.Lock``,
    inside the first forward that requests hidden states, and dynamo cannot enter a lock ("Unsupported
    context manager"), so a cold target fails under ``fullgraph=True``. One one-token forward through
    the CLASS's forward (the uncompiled function; no cache), once per call of ours; cheap and harmless
    where nothing is lazy (4.57). Source: issue "targets as users run them", items 4 and 5."""
    ids = torch.zeros(1, 1, dtype=torch.long, device=_input_device(target))
    with torch.no_grad(), forward_lock(target):
        type(target).forward(target, input_ids=ids, use_cache=False, output_hidden_states=hidden_states_request(layer_ids))


def _input_device(target):
    weight = target.get_input_embeddings().weight
    return weight.device if weight.device.type != "meta" else torch.device("cpu")


class _OutputTaps:
    """This target's captures that read the forward's own hidden states, per thread (compiled targets)."""

    def __init__(self):
        self.by_thread = {}


_OUTPUTS = weakref.WeakKeyDictionary()  # target -> _OutputTaps, only while some compiled capture on it is open


def run_target(target, **kwargs):
    """``target(**kwargs)``, filling the calling thread's open captures on ``target`` from the forward's
    own hidden states when they read outputs (compiled targets); a plain call otherwise (hooks fill them).
    Returns the forward's output, its ``hidden_states`` dropped when we asked for them."""
    outputs = _OUTPUTS.get(target)
    stores = outputs.by_thread.get(threading.get_ident()) if outputs is not None else None
    if not stores:
        with forward_lock(target, states=False):
            return target(**kwargs)
    wanted = sorted(set().union(*(store["wanted"] for store in stores)))
    with forward_lock(target):
        out = target(**kwargs, output_hidden_states=hidden_states_request(wanted))
    states, ids = out.hidden_states, kwargs.get("input_ids", kwargs.get("inputs_embeds"))
    for store in stores:
        store["shape"] = tuple(ids.shape[:2])
        for k in store["wanted"]:
            store[k] = states[k + 1]
    out.hidden_states = None
    return out


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
    On a compiled target ([`compiled_forward`]) no hook is installed: the forwards must go through
    [`run_target`], which reads the taps from the forward's hidden states (module docstring).

    Yields a callable ``get() -> (batch, seq, len(layer_ids) * hidden)`` returning the features of the
    most recent forward, concatenated in ``layer_ids`` order, each tap moved to ``device`` (the
    draft's; a target split over several devices gives taps on several devices).

    Raises:
        ValueError: a layer id outside ``[0, num_layers)``; a tap that is not ``(batch, seq, hidden)``
            with the batch and length of the forward's ``input_ids`` (raised by ``get()``).
    """
    warn_if_untested("taps")
    layers, _ = _decoder_parts(target)
    bad = [k for k in layer_ids if not 0 <= k < len(layers)]
    if bad:
        raise ValueError(f"target_layer_ids {list(layer_ids)} include {bad}, but the target has {len(layers)} layers")
    store, tid = {"wanted": frozenset(layer_ids)}, threading.get_ident()
    compiled = compiled_forward(target)
    if compiled:
        warm_output_capture(target, layer_ids)
    with _TAPS_LOCK:
        if compiled:
            taps = _OUTPUTS.get(target)
            if taps is None:
                taps = _OUTPUTS[target] = _OutputTaps()
        else:
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
                for h in getattr(taps, "handles", ()):
                    h.remove()
                (_OUTPUTS if compiled else _TAPS).pop(target, None)
        store.clear()


__all__ = ["capture_target_features", "compiled_forward", "forward_lock", "hidden_states_request", "run_target",
           "warm_output_capture"]
