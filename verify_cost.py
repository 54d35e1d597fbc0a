"""What a verify step costs, for the verify-length policy (``verify_policy.py``): a [`StepCost`] in plain
target steps, resolved once per ``spec_generate`` call before its first forward, with no forward, no
``generate`` / ``spec_generate`` call and no read of the target's ``generation_config``.

Where the cost comes from ([`call_cost`]), in order:

1. the caller's ``verify_cost=``: a [`StepCost`] (from any copy of this module: the installed package or the
   remote-code copy under ``transformers_modules``), a mapping ``{"widths": [1, ...], "verify": [1.0, ...],
   "draft": 0.0}`` or any object with those attributes ([`as_step_cost`]);
2. the same JSON in ``$DFLASH_VERIFY_COST`` ([`env_cost`]);
3. a cost MODEL from the shapes ([`model_step_cost`]): the time of each forward from the models' configs
   (weights streamed per step against flops per position, attention over the keys, a fixed count of eager
   ops) priced by this device's [`DeviceSpeed`] constants.

The device constants ([`device_speed`]) are measured by a few raw torch ops (matmuls of two sizes, an
attention, a tiny op loop; about 0.1-0.5 s, never a model forward) once per device (CUDA name, or the CPU
model and ``torch.get_num_threads()``), dtype and torch version, and kept for the process and in the file
``device_speed.json`` in ``$DFLASH_HF_CACHE``, else ``$HF_HOME/dflash_hf/`` ([`speed_file`]). Rules of that file:

- the first measurement is taken under a cross-process lock (``filelock``; a threading lock where it is
  missing): a process that finds one in progress waits and then reads the stored entry;
- it is written atomically (a temporary file in the same folder, then ``os.replace``), read, changed and
  written under the lock, so processes writing at once lose no entry; created with the user's umask;
- an entry records when it was measured and the load average then; one older than 30 days, or measured
  while the load average exceeded the core count when it now does not, is measured again (one info log);
  a damaged entry is measured again with one warning; a folder that cannot be written warns once and keeps
  the constants in the process;
- a measurement that takes more than 1 s prints one line on stderr saying what it measured and where it
  is kept.

Re-measure with ``dflash-hf calibrate`` ([`calibrate`]), or delete the file. Pin the cost with
``verify_cost=`` or ``$DFLASH_VERIFY_COST`` (identical tokens across machines). Processes sharing one cache
folder share one set of constants, hence identical seeded tokens; processes on separate empty caches may
measure different constants and choose different widths. Tensor-parallel ranks take rank 0's cost
([`shared_cost`]), so every rank decides identically whatever each measured.
"""

import json
import math
import os
import platform
import sys
import threading
import time
from dataclasses import asdict, dataclass, fields
from typing import Optional

import torch
from transformers.utils import logging

COST_ENV = "DFLASH_VERIFY_COST"  # a StepCost as JSON for every call without verify_cost ([`env_cost`])
SPEED_FILE = "device_speed.json"
MAX_AGE_S = 30 * 24 * 3600  # an entry older than this is measured again
LOUD_S = 1.0  # a measurement longer than this prints one line on stderr
_STEP = 8  # modelled costs are rounded to steps of 2 ** (1 / _STEP): constants a few % apart give one table

# ---- op counts and traffic factors of the cost model, fitted ONCE on the shipped pair (fp32, one CPU thread, 2-core
# AMD EPYC VM, transformers 5.25) by bench/cost_model_check.py: the old loop timing (median of 2 rounds) at batch
# 1 / 4 / 16 / 32 x context 64 / 512 / 2,048 x widths 1 / 2 / 4 / 8 / 16, least squares on seconds per step
# (relative errors) with that machine's device constants held fixed. Only two op sums are identified by the fit
# (a plain step's, about 810 ops, and a drafting step's, about 1,490); the split into layers, forward and loop
# follows an eager Qwen3 layer's count of module ops. An "op" is one ``DeviceSpeed.op_s``.
OPS_LAYER = 60.0  # a decoder layer of the target (norms, projections, rotary, attention, MLP, residuals)
OPS_FORWARD = 100.0  # a target forward outside its layers (embedding, mask, final norm, head, cache bookkeeping)
OPS_PLAIN = 350.0  # the loop's own work in a plain step (sampling, stops, commit, host syncs)
OPS_DRAFT_LAYER = 70.0  # a layer of the DFlash drafter (its attention reads the context features too)
OPS_DRAFT = 890.0  # a drafting step's extra work: draft inputs, cut, verify, acceptance, cache crop, host syncs
COMPUTE_SCALE = 0.6  # the fit's factor on the byte / flop / attention terms (fused kernels beat the raw probes)
ACT_PASSES = 12.0  # elementwise passes over a (rows, hidden) activation per layer; 3 over (rows, intermediate)
LOGIT_PASSES = 4.0  # passes over a verified (rows, vocab) logits block (softmax / argmax / compare)
ATTN_MASK_PASSES = 1.0  # passes over a (rows, keys) 4-D mask per layer

logger = logging.get_logger(__name__)


# ----------------------------------------------------------------------------- StepCost


@dataclass(frozen=True)
class StepCost:
    """What one verify step costs, in plain target steps at this batch width (a plain step: one position per
    row, no draft pass, costs 1.0).

    Attributes:
        widths: verified positions per row (anchor included) at which ``verify`` is given, increasing,
            starting at 1.
        verify: the cost of a step verifying each width (``verify[0] == 1.0``); linear in between, and past
            the last width.
        draft: one draft pass (the proposer's whole proposal), added to every step that drafts; 0 in modelled
            tables, whose ``verify`` entries above width 1 are whole drafting steps.
    """

    widths: tuple
    verify: tuple
    draft: float = 0.0

    def __post_init__(self):
        faults = [why for bad, why in (
            (len(self.widths) != len(self.verify), f"{len(self.widths)} widths but {len(self.verify)} verify costs"),
            (not self.widths or self.widths[0] != 1, "widths must start at 1"),
            (list(self.widths) != sorted(set(self.widths)), "widths must increase"),
            (not self.verify or self.verify[0] != 1.0, "verify[0] must be 1.0 (a plain step)"),
            (not all(isinstance(v, (int, float)) and v > 0 and math.isfinite(v) for v in self.verify),
             "verify costs must be positive finite numbers"),
            (not (isinstance(self.draft, (int, float)) and self.draft >= 0), "draft must be a number >= 0")) if bad]
        if faults:
            raise ValueError(f"StepCost(widths={self.widths}, verify={self.verify}, draft={self.draft}): "
                             + "; ".join(faults))

    def step(self, drafted: int) -> float:
        """Cost of a step verifying ``drafted`` drafted positions (0: a plain step, 1.0)."""
        return 1.0 if drafted <= 0 else self.draft + self.verify_cost(drafted + 1)

    def verify_cost(self, width: int) -> float:
        w, v = self.widths, self.verify
        for i in range(1, len(w)):
            if width <= w[i]:
                return v[i - 1] + (v[i] - v[i - 1]) * (width - w[i - 1]) / (w[i] - w[i - 1])
        if len(w) == 1:
            return v[0] * width
        slope = (v[-1] - v[-2]) / (w[-1] - w[-2])
        return v[-1] + slope * (width - w[-1])


_EXPECTED = ('a verify_cost.StepCost, a mapping {"widths": [1, ...], "verify": [1.0, ...], "draft": 0.0} ("draft" '
             "optional) or an object with those attributes")


def as_step_cost(value) -> StepCost:
    """``value`` as this module's [`StepCost`]: a StepCost of any copy of this module (the installed
    ``dflash_hf.verify_cost`` or the remote-code copy), a mapping with the keys ``widths``, ``verify`` and
    optionally ``draft``, or any object with those attributes.

    Raises:
        TypeError: naming the value, when it is none of these.
        ValueError: naming the value, when its fields do not make a StepCost (unknown or missing keys,
            widths not starting at 1, ...).
    """
    if isinstance(value, StepCost):
        return value
    if isinstance(value, (str, bytes)) or not (hasattr(value, "keys") or hasattr(value, "widths")):
        raise TypeError(f"verify_cost={value!r} ({type(value).__name__}) must be {_EXPECTED}")
    try:
        if hasattr(value, "keys"):
            return _from_json(dict(value))
        return StepCost(tuple(int(w) for w in value.widths), tuple(float(v) for v in value.verify),
                        float(getattr(value, "draft", 0.0)))
    except (ValueError, TypeError, AttributeError) as e:
        raise ValueError(f"verify_cost={value!r} must be {_EXPECTED}: {type(e).__name__}: {e}") from None


def env_cost() -> Optional[StepCost]:
    """The [`StepCost`] in ``$DFLASH_VERIFY_COST`` (JSON ``{"widths": [1, ...], "verify": [1.0, ...], "draft":
    0.0}``; ``draft`` optional), or None when it is unset or empty. It pins the policy of every call without
    ``verify_cost``, with no device measurement (a CI run, seeded sampling across machines). Read at each call.

    Raises:
        ValueError: naming the variable and its value, when it is not such a JSON object.
    """
    text = os.environ.get(COST_ENV, "").strip()
    if not text:
        return None
    try:
        return _from_json(json.loads(text))
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise ValueError(f"{COST_ENV}={text!r} must be a JSON object like "
                         f'{{"widths": [1, 16], "verify": [1.0, 2.5], "draft": 0.0}} (a verify_cost.StepCost; '
                         f'"draft" optional, 0 by default): {type(e).__name__}: {e}') from None


def _from_json(value) -> StepCost:
    """A [`StepCost`] from its JSON object.

    Raises:
        ValueError: not an object, a key other than widths / verify / draft, or a key missing.
        TypeError: a value of the wrong type.
    """
    if not isinstance(value, dict):
        raise ValueError(f"expected a JSON object, got {type(value).__name__}")
    unknown, missing = set(value) - {"widths", "verify", "draft"}, {"widths", "verify"} - set(value)
    if unknown or missing:
        raise ValueError(f"unknown keys {sorted(unknown)}" if unknown else f"missing keys {sorted(missing)}")
    return StepCost(tuple(int(w) for w in value["widths"]), tuple(float(v) for v in value["verify"]),
                    float(value.get("draft", 0.0)))


# ----------------------------------------------------------------------------- the device's constants


@dataclass(frozen=True)
class DeviceSpeed:
    """One device's speed at one dtype (all in seconds).

    Attributes:
        op_s: per eager op as a model pays it: one call of a tiny ``nn.Linear(8, 8)`` module (Python module
            dispatch + one kernel launch).
        byte_s: per byte streamed by a one-row matmul (the weights of a step at small batch).
        flop_s: per flop of a many-row matmul.
        attn_flop_s: per flop of ``scaled_dot_product_attention`` with a 16-position query.
    """

    op_s: float
    byte_s: float
    flop_s: float
    attn_flop_s: float

    def matmul(self, k_in: int, n_out: int, rows: int, nbytes: int) -> float:
        """Seconds of ``(rows, k_in) @ (k_in, n_out)``, op overhead excluded: weights streamed or flops."""
        return max(k_in * n_out * nbytes * self.byte_s, 2.0 * rows * k_in * n_out * self.flop_s)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _per_call(fn, device, floor: float = 0.01, most: int = 4096, runs: int = 5) -> float:
    """Seconds per ``fn()``: run once (warm-up), then ``n`` calls with ``n`` doubled until they take
    ``floor``; the best of ``runs`` such batches (the least disturbed by the rest of a busy machine)."""
    fn()
    _sync(device)
    n = 1
    while True:
        t = time.perf_counter()
        for _ in range(n):
            fn()
        _sync(device)
        best = (time.perf_counter() - t) / n
        if best * n >= floor or n >= most:
            break
        n *= 2
    for _ in range(runs - 1):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        _sync(device)
        best = min(best, (time.perf_counter() - t) / n)
    return best


def measure_speed(device, dtype) -> DeviceSpeed:
    """Measure [`DeviceSpeed`] on ``device`` at ``dtype`` with raw torch ops (no model forward): a tiny
    ``nn.Linear(8, 8)`` call (op), a one-row matmul over a 16 MiB (CPU) / 256 MiB (CUDA) weight (bytes), a 256-row
    matmul (flops) and a 16-query attention over 1,024 keys (attention flops). About 0.1-0.5 s."""
    device = torch.device(device)
    big = device.type == "cuda"
    with torch.inference_mode():
        tiny = torch.nn.Linear(8, 8).to(device=device, dtype=dtype)  # a module call: dispatch as models pay it
        a = torch.ones(1, 8, device=device, dtype=dtype)
        op_s = _per_call(lambda: tiny(a), device)
        slow = not big and dtype != torch.float32  # CPU half types: no fast kernels, smaller shapes keep it short
        k = 8192 if big else 1024 if slow else 2048
        n = k * 4 // torch.empty((), dtype=dtype).element_size()
        w = torch.randn(k, n, device=device).to(dtype)
        x = torch.randn(1, k, device=device).to(dtype)
        byte_s = max(_per_call(lambda: x @ w, device) - op_s, 1e-12) / (k * n * w.element_size())
        rows, d = (4096, 8192) if big else (64, 256) if slow else (256, 512)
        m = torch.randn(rows, d, device=device).to(dtype)
        wm = torch.randn(d, d, device=device).to(dtype)
        flop_s = max(_per_call(lambda: m @ wm, device) - op_s, 1e-12) / (2.0 * rows * d * d)
        b, h, q, keys, hd = (32, 32, 16, 4096, 128) if big else (1, 6, 16, 512, 32) if slow else (4, 6, 16, 1024, 32)
        qt = torch.randn(b, h, q, hd, device=device).to(dtype)
        kt = torch.randn(b, h, keys, hd, device=device).to(dtype)
        attn = torch.nn.functional.scaled_dot_product_attention
        attn_s = _per_call(lambda: attn(qt, kt, kt), device)
        attn_flop_s = max(attn_s - op_s, 1e-12) / (4.0 * b * h * q * keys * hd)
    return DeviceSpeed(op_s, byte_s, flop_s, attn_flop_s)


def device_name(device) -> str:
    """The device as the speed file keys it: the CUDA device's name, or the CPU's model and thread count."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    name = ""
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    name = name or platform.processor() or platform.machine() or "cpu"
    return f"{device.type}:{name}:{torch.get_num_threads()}t"


def speed_key(device, dtype) -> str:
    return f"{device_name(device)}|{str(dtype).replace('torch.', '')}|torch {torch.__version__}"


def cache_folder() -> str:
    """The folder the package keeps its files in: ``$DFLASH_HF_CACHE``, else ``$HF_HOME/dflash_hf``."""
    root = os.environ.get("DFLASH_HF_CACHE")
    if root:
        return root
    hf_home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    return os.path.join(hf_home, "dflash_hf")


def speed_file() -> str:
    """The JSON file the device constants are kept in across processes."""
    return os.path.join(cache_folder(), SPEED_FILE)


_SPEEDS: dict = {}  # this process's constants, by speed_key
_LOCK = threading.RLock()  # around _SPEEDS, and the in-process stand-in for the file lock
_WARNED: set = set()  # folders already warned about


def _load_avg() -> Optional[float]:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def _file_lock(path: str):
    """A cross-process lock for ``path`` (``filelock``), or the process's own lock without it."""
    try:
        from filelock import FileLock
    except ImportError:
        return _LOCK
    return FileLock(path + ".lock", timeout=300)


def _read(path: str) -> dict:
    try:
        with open(path) as f:
            entries = json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        logger.warning(f"{path} cannot be read ({type(e).__name__}: {e}); measuring the device again")
        return {}
    return entries if isinstance(entries, dict) else {}


def _write(path: str, entries: dict) -> None:
    """``entries`` into ``path`` atomically: a temporary file in the same folder (the user's umask), then
    renamed over it."""
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(entries, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _usable(key: str, entry, path: str, quiet: bool = False) -> Optional[DeviceSpeed]:
    """The stored constants of ``entry`` if they may be used now, else None (absent, damaged: one warning;
    expired or measured under load that has passed: one info log; ``quiet``: no log, the caller looks again
    under the lock)."""
    say = (lambda *a: None) if quiet else None
    if entry is None:
        return None
    try:
        speed = DeviceSpeed(**{f.name: float(entry[f.name]) for f in fields(DeviceSpeed)})
        if not all(math.isfinite(v) and v > 0 for v in asdict(speed).values()):
            raise ValueError("constants must be positive finite numbers")
        measured_at, load = float(entry["measured_at"]), entry.get("load")
    except (KeyError, TypeError, ValueError) as e:
        (say or logger.warning)(f"{path}: the device constants {key} are damaged ({type(e).__name__}: {e}); "
                                "measuring again")
        return None
    if time.time() - measured_at > MAX_AGE_S:
        (say or logger.info)(f"{path}: the device constants {key} are over 30 days old; measuring again")
        return None
    cores, now = os.cpu_count() or 1, _load_avg()
    if load is not None and now is not None and float(load) > cores >= now:
        (say or logger.info)(f"{path}: the device constants {key} were measured under load {load:.1f} on {cores} cores "
                    f"(now {now:.1f}); measuring again")
        return None
    return speed


def _measured(key: str, device, dtype, path: str) -> tuple:
    """``(constants, entry)`` measured now; one line on stderr when it took longer than [`LOUD_S`]."""
    start = time.perf_counter()
    speed = measure_speed(device, dtype)
    took = time.perf_counter() - start
    if took > LOUD_S:
        print(f"dflash-hf: measured this device's speed ({key}) for the verify cost in {took:.1f} s, kept in {path} "
              "(dflash-hf calibrate measures it again)", file=sys.stderr)
    return speed, {**asdict(speed), "measured_at": time.time(), "load": _load_avg(), "cores": os.cpu_count(),
                   "seconds": took}


def _store(key: str, device, dtype, force: bool) -> DeviceSpeed:
    """From the file, else measured and stored, under the file's lock (a process that finds the lock held
    waits, then reads what the holder stored). An unwritable folder: one warning, measured, not stored."""
    path = speed_file()
    if not force and os.path.exists(path):  # the common case: read without the lock (the file is replaced whole)
        speed = _usable(key, _read(path).get(key), path, quiet=True)
        if speed is not None:
            return speed
    measured = None
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with _file_lock(path):
            entries = _read(path)
            speed = None if force else _usable(key, entries.get(key), path)
            if speed is not None:
                return speed
            measured = _measured(key, device, dtype, path)
            entries[key] = measured[1]
            _write(path, entries)
            return measured[0]
    except OSError as e:  # a read-only home: the constants stay in this process
        folder = os.path.dirname(path)
        if folder not in _WARNED:
            _WARNED.add(folder)
            logger.warning(f"cannot keep the device speed constants in {path} ({type(e).__name__}: {e}): they stay "
                           f"in this process, and a new process measures them again; set DFLASH_HF_CACHE to a "
                           f"writable folder, or pin the cost with {COST_ENV}")
        return (measured or _measured(key, device, dtype, path))[0]


def device_speed(device, dtype) -> DeviceSpeed:
    """This device's [`DeviceSpeed`] at ``dtype``: from this process, else from [`speed_file`], else
    measured now ([`measure_speed`]) and kept in both (the rules in the module docstring)."""
    key = speed_key(device, dtype)
    with _LOCK:
        if key not in _SPEEDS:
            _SPEEDS[key] = _store(key, device, dtype, force=False)
        return _SPEEDS[key]


def calibrate(device="cpu", dtype=torch.float32) -> DeviceSpeed:
    """Measure this device's constants again and store them, replacing the entry (``dflash-hf calibrate``)."""
    key = speed_key(device, dtype)
    with _LOCK:
        _SPEEDS[key] = _store(key, device, dtype, force=True)
        return _SPEEDS[key]


# ----------------------------------------------------------------------------- the cost model


def _attr(config, name: str):
    """``config.<name>`` as a number, or None. A heterogeneous config (transformers 5.24's per-layer configs,
    Gemma 4) raises on a global read of a per-layer attribute (``AmbiguousGlobalPerLayerAttributeError``, not an
    AttributeError): then the largest over its layers; a per-layer list gives its largest entry."""
    try:
        value = getattr(config, name, None)
    except Exception:  # noqa: BLE001  (the per-layer refusal is a RuntimeError subclass of a private module)
        try:
            layers = list(getattr(config, "per_layer_config", None) or [])
        except Exception:  # noqa: BLE001
            layers = []
        value = max((v for v in (_attr(layer, name) for layer in layers) if v), default=None)
    if isinstance(value, (list, tuple)):
        value = max((v for v in value if isinstance(v, (int, float)) and not isinstance(v, bool)), default=None)
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _shape(config) -> dict:
    """The numbers a forward's time is computed from, read through ``get_text_config()`` where it exists."""
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    get = lambda *names, default=None: next((_attr(config, n) for n in names if _attr(config, n)), default)
    hidden = get("hidden_size", "d_model", "n_embd")
    heads = get("num_attention_heads", "n_head", default=1)
    experts = get("num_local_experts", "num_experts", "n_routed_experts", default=0)
    return {"layers": get("num_hidden_layers", "n_layer", default=1), "hidden": hidden,
            "inter": get("intermediate_size", "ffn_dim", default=4 * hidden), "heads": heads,
            "kv": get("num_key_value_heads", default=heads), "head_dim": get("head_dim", default=hidden // heads),
            "vocab": get("vocab_size", default=0), "experts": experts,
            "active": get("num_experts_per_tok", "top_k", "moe_topk", default=0) if experts else 0,
            "moe_inter": get("moe_intermediate_size", default=0) or get("intermediate_size", default=4 * hidden),
            "shared": get("n_shared_experts", default=0)}


def _layers_seconds(s: dict, speed: DeviceSpeed, batch: int, q: int, keys: int, nbytes: int, ops: float,
                    kv_rows: Optional[int] = None) -> float:
    """Seconds of ``s["layers"]`` decoder layers at ``batch`` rows of ``q`` new positions over ``keys`` keys
    per row (``kv_rows``: positions per row projected to keys and values, ``q`` by default)."""
    rows, kv_rows = batch * q, batch * (q if kv_rows is None else kv_rows)
    h, hd = s["hidden"], s["head_dim"]
    attn_w = (speed.matmul(h, s["heads"] * hd, rows, nbytes) + 2 * speed.matmul(h, s["kv"] * hd, kv_rows, nbytes)
              + speed.matmul(s["heads"] * hd, h, rows, nbytes))
    if s["experts"]:
        read = min(s["experts"], rows * s["active"]) + s["shared"]  # experts whose weights a step reads
        mlp = max(3 * h * s["moe_inter"] * read * nbytes * speed.byte_s,
                  2.0 * 3 * h * s["moe_inter"] * rows * (s["active"] + s["shared"]) * speed.flop_s)
        mlp += speed.matmul(h, s["experts"], rows, nbytes)  # router
    else:
        mlp = 3 * speed.matmul(h, s["inter"], rows, nbytes)
    attention = max(2 * batch * keys * s["kv"] * hd * nbytes * speed.byte_s,
                    4.0 * rows * s["heads"] * keys * hd * speed.attn_flop_s)
    traffic = (rows * (ACT_PASSES * h + 3 * s["inter"]) + ATTN_MASK_PASSES * rows * keys) * nbytes * speed.byte_s
    return s["layers"] * (COMPUTE_SCALE * (attn_w + mlp + attention + traffic) + ops * speed.op_s)


def _head_seconds(s: dict, speed: DeviceSpeed, rows: int, nbytes: int) -> float:
    return COMPUTE_SCALE * (speed.matmul(s["hidden"], s["vocab"], rows, nbytes) + LOGIT_PASSES * rows * s["vocab"] * nbytes * speed.byte_s)


def step_seconds(target, draft, speed: DeviceSpeed, batch: int, context: int, width: int, block_size: int,
                 tree_nodes: Optional[int] = None, draft_window: Optional[int] = None, nbytes: Optional[int] = None
                 ) -> float:
    """Modelled seconds of one step of the loop at ``batch`` rows and ``context`` committed positions per row,
    verifying ``width`` positions per row (anchor included; 1: a plain step, no draft pass).

    A plain step: one target forward of 1 position per row + [`OPS_PLAIN`] ops. A drafting step: the draft
    pass (DFlash 1: a forward of the drafter over its block per row, keys and values also for the about
    ``width / 2`` committed positions it has not seen yet, over ``min(context, draft_window)`` keys; the
    target's head over the block's drafted slots) + the target forward over ``width`` positions (logits at
    each) + [`OPS_DRAFT`] ops. The drafted block is ``width`` for a chain (the policy drafts about what it
    verifies) and ``block_size`` for trees (``tree_nodes`` given). A forward's layers:
    [`DeviceSpeed.matmul`] per projection, attention ``max(key bytes, flops)``, elementwise traffic, and
    [`OPS_LAYER`] ops each."""
    t, d = _shape(target.config), _shape(draft.config)
    if nbytes is None:
        nbytes = next((p.element_size() for p in target.parameters() if p.is_floating_point()), 4)
    target_s = (_layers_seconds(t, speed, batch, width, context + width, nbytes, OPS_LAYER)
                + _head_seconds(t, speed, batch * width, nbytes) + OPS_FORWARD * speed.op_s)
    if width <= 1:
        return target_s + OPS_PLAIN * speed.op_s
    block = block_size if tree_nodes is not None else width
    unseen = max(1, width // 2)  # committed positions the draft has not seen: about the accepted ones + 1
    d_keys = (context if draft_window is None else min(context, draft_window)) + unseen + block
    taps = len(getattr(draft.config, "target_layer_ids", None) or [1])
    draft_s = (_layers_seconds(d, speed, batch, block, d_keys, nbytes, OPS_DRAFT_LAYER, kv_rows=block + unseen)
               + COMPUTE_SCALE * speed.matmul(taps * t["hidden"], d["hidden"], batch * unseen, nbytes)  # fc
               + _head_seconds(t, speed, batch * (block - 1), nbytes))  # the target's head over the drafted slots
    return target_s + draft_s + OPS_DRAFT * speed.op_s


def _widths(width: int) -> tuple:
    points, k = {1, width}, 2
    while k < width:
        points.add(k)
        k *= 2
    return tuple(sorted(points))


def _rounded(ratio: float) -> float:
    return 2.0 ** (round(math.log2(max(ratio, 1e-6)) * _STEP) / _STEP)


def model_step_cost(target, draft, speed: DeviceSpeed, batch: int, context: int, width: int, block_size: int,
                    tree_nodes: Optional[int] = None, draft_window: Optional[int] = None,
                    nbytes: Optional[int] = None) -> StepCost:
    """The modelled [`StepCost`] at widths 1, 2, 4, ... up to ``width`` (verified positions per row, anchor
    included): [`step_seconds`] at each width over that of a plain step (so ``draft`` is 0), rounded to
    steps of 2^(1/8), never decreasing with the width. ``context``: committed positions per row."""
    widths = _widths(max(1, width))
    plain = step_seconds(target, draft, speed, batch, context, 1, block_size, tree_nodes, draft_window, nbytes)
    costs = [1.0]
    for w in widths[1:]:
        ratio = step_seconds(target, draft, speed, batch, context, w, block_size, tree_nodes, draft_window, nbytes)
        costs.append(max(costs[-1], 1.0, _rounded(ratio / plain)))
    return StepCost(widths, tuple(costs), 0.0)


# ----------------------------------------------------------------------------- a call's cost


def _tp_group(target):
    """The process group a sharded (tensor-parallel) target runs over, or None: transformers sets
    ``_tp_size`` / ``_device_mesh`` when it shards; a model merely run in several processes has neither."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return None
    mesh = getattr(target, "_device_mesh", None)
    if (getattr(target, "_tp_size", None) or 1) <= 1 and mesh is None:
        return None
    if mesh is not None and "tp" in (getattr(mesh, "mesh_dim_names", None) or ()):
        return mesh.get_group("tp")
    return dist.group.WORLD


def shared_cost(cost: StepCost, group=None) -> StepCost:
    """Rank 0's ``cost`` on every rank of ``group`` (``torch.distributed.broadcast_object_list``), so that
    tensor-parallel ranks choose the same widths at every step whatever each measured."""
    dist = torch.distributed
    box = [{"widths": list(cost.widths), "verify": list(cost.verify), "draft": cost.draft}]
    src = dist.get_global_rank(group, 0) if group not in (None, dist.group.WORLD) else 0
    dist.broadcast_object_list(box, src=src, group=group)
    return _from_json(box[0])


def call_cost(target, draft, facts, input_ids, budget: int, block_size: int, tree_nodes, draft_window,
              given) -> StepCost:
    """The [`StepCost`] of a ``spec_generate`` call, before its first forward: ``given`` (``verify_cost``, through
    [`as_step_cost`]), else [`env_cost`], else [`model_step_cost`] at the call's batch, context (prompt + half
    the budget, at most 256 more) and widths (up to ``block_size``, or ``tree_nodes + 1`` for an ``"auto"``
    tree) on [`device_speed`] of the target's device and dtype; a tensor-parallel target's ranks take rank 0's
    ([`shared_cost`]). Makes no forward and reads no ``generation_config``."""
    if given is not None:
        return as_step_cost(given)
    pinned = env_cost()
    if pinned is not None:
        return pinned
    width = block_size if tree_nodes is None else tree_nodes + 1
    context = input_ids.shape[1] + min(budget, 512) // 2
    dtype = facts.mask_dtype or next((p.dtype for p in target.parameters() if p.is_floating_point()), torch.float32)
    device = facts.device if facts.device is not None else input_ids.device
    speed = device_speed(device, dtype)
    cost = model_step_cost(target, draft, speed, input_ids.shape[0], context, width, block_size, tree_nodes,
                           draft_window, nbytes=torch.empty((), dtype=dtype).element_size())
    group = _tp_group(target)
    return cost if group is None else shared_cost(cost, group)


__all__ = ["COST_ENV", "DeviceSpeed", "StepCost", "as_step_cost", "cache_folder", "calibrate", "call_cost",
           "device_name", "device_speed", "env_cost", "measure_speed", "model_step_cost", "shared_cost",
           "speed_file", "speed_key", "step_seconds"]
