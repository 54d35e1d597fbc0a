"""Target feature taps: the outputs of chosen target layers, captured by forward hooks during the
target's own forwards (layer id ``k`` = output of decoder layer ``k``; notes sections 1 and 6). Shared
by decoding (``spec_generate``, both loops) and training (``train/features.py``).
"""

import contextlib
import threading
import weakref

try:
    from .target_families import FAMILY as _families
except ImportError:  # imported from the repository root instead of as a Hub remote-code package
    from target_families import FAMILY as _families


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


__all__ = ["capture_target_features"]
