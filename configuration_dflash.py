"""Configuration of a DFlash draft model (block-diffusion drafter for speculative decoding).

A DFlash draft is a small Qwen3-style decoder (no embedding, no LM head) that drafts a block of
``block_size`` tokens in one forward pass, conditioned on hidden states captured from a few target
layers (``target_layer_ids``). See arXiv 2602.06036.

The saved ``config.json`` keeps the published z-lab / SpecForge dialect (``model_type: "qwen3"``,
``dflash_config.{target_layer_ids, mask_token_id}``, top-level ``block_size``), so engines that read
it with a plain ``Qwen3Config`` (vLLM, SGLang) keep working, and adds ``auto_map`` so that
``AutoConfig/AutoModel.from_pretrained(..., trust_remote_code=True)`` returns the classes below.
"""

import copy
import inspect
import logging
import math
import re
from typing import Optional

try:
    from transformers import PreTrainedConfig
except ImportError:  # transformers < 5 only has the old spelling
    from transformers import PretrainedConfig as PreTrainedConfig

logger = logging.getLogger(__name__)

LAYER_TYPES = ("full_attention", "sliding_attention")
ROPE_TYPES = ("default", "linear", "yarn", "llama3")

_MUSE_GLIMMER_V1 = ("the Muse Glimmer v1 assistant dialect (model_type 'muse_glimmer_assistant', weights named "
                    "'encoder.fc' / 'encoder.output_norm_enc') is not read here; load a checkpoint in the published "
                    "DFlash / DFlash 2 layout (fc, hidden_norm, layers.*)")
_REDUCED_VOCAB = ("a speculators checkpoint with a reduced draft vocabulary (d2t/t2d id maps) is not implemented; "
                  "this draft borrows the target's full head")
# Config keys whose meaning this implementation cannot honour: key -> (is it set?, the real reason).
# The ONE list of load-time refusals (notes section 2, other dialects).
REFUSED_KEYS = {
    "d2t": (lambda v: v is not None, _REDUCED_VOCAB),
    "t2d": (lambda v: v is not None, _REDUCED_VOCAB),
    "attention_sink_bias": (lambda v: bool(v), "per-head attention sink biases in the draft layers are not implemented"),
    "add_swa_attention_sink_bias": (lambda v: bool(v), "per-head attention sink biases in the draft layers are not implemented"),
    "partial_rotary_factor": (lambda v: v is not None and float(v) != 1.0,
                              "the draft applies RoPE to the whole head_dim; partial rotary (factor != 1) is not implemented"),
    "use_swa": (lambda v: bool(v), "use_swa (sliding window on every layer with bidirectional block attention, "
                                   "MiMo style) is not implemented; express windows with layer_types"),
}
REFUSED_ARCHITECTURES = {"MuseGlimmerAssistantModel": _MUSE_GLIMMER_V1, "Gemma4DSparkModel": None}
# The draft architectures this package implements: the ONE allow-list, read by the config (so every loading
# path), and the converter. Any other ``architectures`` value is refused by name (issue 34: a DeepSpec DSpark
# folder loaded as a DFlash 1 drafter, its extra tensors and keys ignored, and drafted one position off).
DRAFT_ARCHITECTURES = ("DFlashDraftModel", "DFlash2DraftModel")
# DeepSpec's Qwen3-layout DSpark / DFlash-block7 class (dspark.py): read by the loader, not yet by the converter.
DSPARK_ARCHITECTURES = ("Qwen3DSparkModel",)
# DeepSpec's top-level DSpark keys (deepspec/modeling/dspark/qwen3/config.py build_draft_config).
DSPARK_KEYS = ("num_anchors", "markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov")
_GEMMA4_DSPARK = ("DeepSpec's Gemma 4 DSpark drafter layer (Gemma 4 attention with k = v and no v_proj, layer_scalar, "
                  "four norms per layer, partial rotary 0.25, logit softcap 30, global_head_dim 512) is not implemented")
_DSPARK = ("a DSpark drafter (DeepSpec: Markov and confidence heads, its own embed_tokens / lm_head, slot k "
           "drafting position start + k + 1), not supported yet; this package implements {}")
_NOT_IMPLEMENTED = "not a DFlash draft architecture this package implements (expected one of {})"
# Tensors that published drafters may carry and this package does not use: loading drops them by name with one
# note, and the converter's key map (convert/keymap.py) drops the same. Nothing else is ever dropped.
UNUSED_TENSORS = (
    # Rotary frequencies are recomputed from the config (never stored by the published drafts).
    (r"^(?:model\.)?(?:layers\.\d+\.self_attn\.)?rotary_emb\.inv_freq$", "rotary buffer, recomputed from config"),
    # Frozen copies of the target's embedding / LM head saved by some training exports: DFlash borrows
    # the target's own (notes section 1), so these are not part of the draft.
    (r"^(?:model\.)?embed_tokens\.weight$", "copy of the target's input embedding"),
    (r"^lm_head\.weight$", "copy of the target's LM head"),
)
REFUSED_MODEL_TYPES = {"muse_glimmer_assistant": _MUSE_GLIMMER_V1}
# dflash_config entries that are read (everything else there is warned about once).
NESTED_KEYS = ("target_layer_ids", "mask_token_id", "block_size", "causal", "is_causal", "input_embedding_scale",
               "output_multiplier", "final_logit_softcapping", "conv_kernel_size", "conv_group_size", "selector_rank",
               "selector_top_k")
# The DFlash 2 keys (z-lab dflash/model.py DFlash2DraftModel / CandidateSelector): all four or none.
DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
# Keys published drafter configs carry that change nothing here (engine hints, bookkeeping).
_IGNORED_KEYS = {"use_cache", "dtype", "torch_dtype", "transformers_version", "auto_map", "bos_token_id",
                 "eos_token_id", "pad_token_id", "tie_word_embeddings", "model_type", "architectures",
                 "_name_or_path", "_commit_hash", "_attn_implementation_autoset", "attn_implementation",
                 "id2label", "label2id", "return_dict", "output_hidden_states", "output_attentions",
                 "chunk_size_feed_forward", "is_encoder_decoder", "problem_type", "use_aux_hidden_state",
                 "name_or_path", "torchscript", "_attn_implementation", "_experts_implementation",
                 "draft_vocab_size", "use_return_dict"}


def refuse_unhonourable(config_dict: dict, nested: dict) -> None:
    """Raise ValueError for any key of [`REFUSED_KEYS`] (top level or in ``dflash_config``) that is
    set, or a refused architecture, naming the key, its value and what cannot be honoured."""
    refusal = architecture_refusal(config_dict.get("architectures"), accept_dspark=True)
    if refusal:
        raise ValueError(refusal)
    if config_dict.get("model_type") in REFUSED_MODEL_TYPES:
        raise ValueError(f"model_type={config_dict['model_type']!r}: {REFUSED_MODEL_TYPES[config_dict['model_type']]}")
    for where, source in (("", config_dict), ("dflash_config.", nested)):
        for key, (is_set, reason) in REFUSED_KEYS.items():
            if key in source and is_set(source[key]):
                raise ValueError(f"drafter config key {where}{key}={source[key]!r} cannot be honoured: {reason}")
    vocab, draft_vocab = config_dict.get("vocab_size"), config_dict.get("draft_vocab_size", nested.get("draft_vocab_size"))
    if draft_vocab is not None and vocab is not None and draft_vocab != vocab:
        raise ValueError(f"drafter config key draft_vocab_size={draft_vocab} != vocab_size={vocab} cannot be honoured: "
                         f"{_REDUCED_VOCAB}")


def architecture_refusal(architectures, accept_dspark: bool = False) -> Optional[str]:
    """Why a config's ``architectures`` list cannot be loaded here, naming the value, or None when every
    entry is one of [`DRAFT_ARCHITECTURES`] (or the list is empty: the SpecForge dialect may omit it).
    Refused: the Muse Glimmer v1 assistant, any DSpark name (``Qwen3DSparkModel``, ``Gemma4DSparkModel``,
    ...: "a DSpark drafter, not supported yet") and any other name (issue 34). ``accept_dspark`` (the loader):
    [`DSPARK_ARCHITECTURES`] load as DSpark drafters (issue 38); ``Gemma4DSparkModel`` stays refused by name."""
    for arch in architectures or []:
        if arch == "Gemma4DSparkModel":
            return f"architectures={list(architectures)!r}: {arch!r}: {_GEMMA4_DSPARK}"
        if accept_dspark and arch in DSPARK_ARCHITECTURES:
            continue
        if arch in REFUSED_ARCHITECTURES:
            return f"architectures={list(architectures)!r}: {REFUSED_ARCHITECTURES[arch]}"
        if arch not in DRAFT_ARCHITECTURES:
            why = _DSPARK if "dspark" in str(arch).lower() else _NOT_IMPLEMENTED
            return f"architectures={list(architectures)!r}: {arch!r} is " + why.format(list(DRAFT_ARCHITECTURES))
    return None


def check_loading_info(pretrained_model_name_or_path, info: dict) -> None:
    """Refuse a load whose ``info`` (``output_loading_info``) names missing, unexpected or misshapen tensors;
    unexpected ones of ``UNUSED_TENSORS`` are dropped with one warning naming them (issue 34).

    Raises:
        ValueError: naming the folder and every missing, unexpected or misshapen tensor.
    """
    problems = {name: sorted(map(str, info.get(name) or ())) for name in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    unused = [key for key in problems["unexpected_keys"] if any(re.match(p, key) for p, _ in UNUSED_TENSORS)]
    problems["unexpected_keys"] = [key for key in problems["unexpected_keys"] if key not in unused]
    if any(problems.values()):
        raise ValueError(f"drafter checkpoint {str(pretrained_model_name_or_path)!r} does not match the model built from "
                         f"its config: {', '.join(f'{k} {v}' for k, v in problems.items() if v)}")
    if unused:
        logger.warning("%s: dropped tensors this package does not use: %s", pretrained_model_name_or_path,
                       ", ".join(unused))


def legacy_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The layer rule of the first DFlash checkpoints, used only when ``target_layer_ids`` is absent.

    n == 1 -> [L // 2]; otherwise n ids spread evenly over [1, L - 3] with Python ``round``
    (L=36, n=5 -> [1, 9, 17, 25, 33]). Source: z-lab/dflash ``build_target_layer_ids`` (notes section 2).
    """
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    span = end - start
    return [int(round(start + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


def normalize_rope(rope_theta=None, rope_scaling=None, rope_parameters=None) -> dict:
    """Merge the two published rope spellings into one ``rope_parameters`` dict.

    Accepts the transformers 4.x spelling (``rope_theta`` + ``rope_scaling`` with ``type`` or
    ``rope_type``) and the 5.x spelling (``rope_parameters`` with ``rope_type`` and ``rope_theta``).
    ``rope_parameters`` wins when both are given. Returns e.g. ``{"rope_type": "yarn",
    "rope_theta": 1e6, "factor": 4.0, ...}``.

    Raises:
        ValueError: unknown ``rope_type`` or a scaling type without its ``factor``.
    """
    if rope_parameters:
        params = dict(rope_parameters)
        if params and all(isinstance(v, dict) for v in params.values()):  # per-layer-type nesting of 5.x
            distinct = {repr(sorted(v.items())) for v in params.values()}
            if len(distinct) > 1:
                raise ValueError(
                    f"rope_parameters per layer type with differing values {params} cannot be honoured: the draft "
                    "applies one RoPE to every layer")
            params = dict(next(iter(params.values())))
    else:
        params = dict(rope_scaling or {})
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params.pop("type")
    params.pop("type", None)
    params.setdefault("rope_type", "default")
    theta = params.get("rope_theta", rope_theta)
    params["rope_theta"] = float(theta if theta is not None else 10000.0)
    if params["rope_type"] not in ROPE_TYPES:
        raise ValueError(f"rope_type={params['rope_type']!r} is not supported by the DFlash draft; expected one of {ROPE_TYPES}")
    if params["rope_type"] != "default" and "factor" not in params:
        raise ValueError(f"rope_type={params['rope_type']!r} needs a 'factor' in rope_scaling/rope_parameters, got {params}")
    return params


def _warn_unknown(kwargs: dict, nested: dict) -> None:
    """One warning naming every key this implementation neither reads nor knowingly ignores."""
    known = set(inspect.signature(DFlashConfig.__init__).parameters) | _IGNORED_KEYS | set(REFUSED_KEYS)
    unknown = sorted(k for k in kwargs if k not in known)
    unknown += sorted(f"dflash_config.{k}" for k in nested if k not in NESTED_KEYS and k not in REFUSED_KEYS)
    if unknown:
        logger.warning("DFlash config keys %s are not read by this implementation and have no effect", unknown)


class DFlashConfig(PreTrainedConfig):
    r"""Configuration of [`DFlashDraftModel`].

    DFlash fields:
        block_size (`int`): tokens per drafted block, anchor included (16 for the published b16 drafts).
        mask_token_id (`int`): id of the reserved target-vocabulary token that fills slots 1..block_size-1.
        target_layer_ids (`list[int]`): 0-based target layers whose OUTPUT is captured (HF
            ``hidden_states[k + 1]``; the last layer is post final norm). Required, unless the legacy
            ``num_target_layers`` rule applies (see [`legacy_target_layer_ids`]).
        num_target_layers (`int`, *optional*): the target's decoder layer count (pairing check, legacy rule).
        target_hidden_size (`int`, *optional*): the target's hidden size; defaults to ``hidden_size``.
        is_causal (`bool`, *optional*): overrides the per-layer rule (full layers bidirectional inside
            the block, sliding layers causal). Also read from ``dflash_config.causal``.
        target_model_id / target_revision (`str`, *optional*): the target this draft was trained for.
        vocab_size (`int`): the target's vocabulary size (the draft borrows its embedding and head).
        input_embedding_scale (`float`, *optional*): the block embedding is the RAW target embedding
            row times this; unset: ``sqrt(hidden_size)`` on Gemma 3/4 targets (Gemma's own scale, as the
            engines serve them), 1.0 otherwise (``target_families.draft_block_embedding``).
        output_multiplier / final_logit_softcapping (`float`, *optional*): draft logits are
            ``head(h) * output_multiplier``, then ``cap * tanh(logits / cap)`` (``draft_logits``).
            All three are read at top level or in ``dflash_config`` (nested wins) and saved nested.
        conv_kernel_size / conv_group_size / selector_rank / selector_top_k (`int`, *optional*): DFlash 2
            (all four, or none for DFlash 1): taps K of the grouped dynamic causal convolution, channels
            per group (divides ``hidden_size``), rank r and candidates k of the selector (``dflash2.py``).
            Read in ``dflash_config`` first, then at top level; saved nested.

    Backbone fields follow ``Qwen3Config`` (hidden_size, intermediate_size, num_hidden_layers,
    num_attention_heads, num_key_value_heads, head_dim, rms_norm_eps, attention_bias,
    max_position_embeddings, layer_types, sliding_window) and the draft's OWN rope
    (``rope_theta`` + ``rope_scaling`` or ``rope_parameters``; default, linear, yarn, llama3).

    Raises:
        ValueError: at construction, naming the bad value: any key of ``REFUSED_KEYS`` (reduced draft
            vocabularies, attention sink biases, partial rotary, ``use_swa``), an architecture not in
            ``DRAFT_ARCHITECTURES`` (DSpark, the Muse Glimmer v1 assistant...) or a refused model type, per-layer-type rope with differing values;
            a partial or invalid set of DFlash 2 keys (group size not dividing ``hidden_size``...); missing or duplicate or negative
            ``target_layer_ids``, ``mask_token_id`` outside ``[0, vocab_size)``, ``block_size < 1``,
            ``layer_types`` of the wrong length or with an unknown type, a sliding layer without window.
    """

    model_type = "qwen3"  # the published dialect; plain AutoConfig reads saved folders as Qwen3Config
    has_no_defaults_at_init = True

    def __init__(
        self,
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=5,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        hidden_act="silu",
        max_position_embeddings=40960,
        initializer_range=0.02,
        rms_norm_eps=1e-6,
        attention_bias=False,
        attention_dropout=0.0,
        rope_theta=None,
        rope_scaling=None,
        rope_parameters=None,
        layer_types=None,
        sliding_window=None,
        use_sliding_window=False,
        max_window_layers=None,
        block_size=None,
        mask_token_id=None,
        target_layer_ids=None,
        num_target_layers=None,
        target_hidden_size=None,
        is_causal=None,
        target_model_id=None,
        target_revision=None,
        input_embedding_scale=None,
        output_multiplier=None,
        final_logit_softcapping=None,
        conv_kernel_size=None,
        conv_group_size=None,
        selector_rank=None,
        selector_top_k=None,
        num_anchors=None,
        markov_rank=None,
        markov_head_type=None,
        enable_confidence_head=None,
        confidence_head_with_markov=None,
        dflash_config=None,
        **kwargs,
    ):
        nested = dict(dflash_config or {})
        refuse_unhonourable(dict(kwargs, vocab_size=vocab_size), nested)
        _warn_unknown(kwargs, nested)
        kwargs.pop("tie_word_embeddings", None)
        kwargs.pop("model_type", None)
        super().__init__(tie_word_embeddings=False, **kwargs)
        # The drafter speaks its target's tokenizer (it borrows the target's embedding and head), so it carries
        # the target's special ids when they are known; transformers' pipeline compares them with the target's
        # to decide whether the assistant needs its own tokenizer (and 5.x configs no longer define them).
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if not hasattr(self, name):
                setattr(self, name, kwargs.get(name))
        # Engine keys for targets that scale embeddings or cap logits (notes section 7), nested first.
        self.input_embedding_scale = nested.get("input_embedding_scale", input_embedding_scale)
        self.output_multiplier = nested.get("output_multiplier", output_multiplier)
        self.final_logit_softcapping = nested.get("final_logit_softcapping", final_logit_softcapping)
        # Published dialects (notes section 2): nested values first, then top level.
        block_size = nested.get("block_size", block_size)
        mask_token_id = nested.get("mask_token_id", mask_token_id)
        target_layer_ids = nested.get("target_layer_ids", target_layer_ids)
        for key in ("is_causal", "causal"):  # nested spellings first, then the top level
            if nested.get(key) is not None:
                is_causal = nested[key]
                break
        dflash2 = dict(conv_kernel_size=conv_kernel_size, conv_group_size=conv_group_size,
                       selector_rank=selector_rank, selector_top_k=selector_top_k)
        for key in DFLASH2_KEYS:
            setattr(self, key, nested.get(key, dflash2[key]))
        # DeepSpec's DSpark keys, top level only (their configs have no dflash_config), kept as written.
        self.num_anchors, self.markov_rank, self.markov_head_type = num_anchors, markov_rank, markov_head_type
        self.enable_confidence_head = enable_confidence_head
        self.confidence_head_with_markov = confidence_head_with_markov

        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads if num_key_value_heads is not None else num_attention_heads
        self.head_dim = head_dim if head_dim is not None else hidden_size // num_attention_heads
        self.hidden_act = hidden_act
        self.max_position_embeddings = max_position_embeddings
        self.initializer_range = initializer_range
        self.rms_norm_eps = rms_norm_eps
        self.attention_bias = attention_bias
        self.attention_dropout = attention_dropout
        self.rope_parameters = normalize_rope(rope_theta, rope_scaling, rope_parameters)
        self.rope_theta = self.rope_parameters["rope_theta"]
        if max_window_layers is None:
            max_window_layers = num_hidden_layers
        if layer_types is None:  # the Qwen3Config rule
            layer_types = [
                "sliding_attention" if use_sliding_window and sliding_window and i >= max_window_layers else "full_attention"
                for i in range(num_hidden_layers)
            ]
        self.layer_types = list(layer_types)
        self.sliding_window = sliding_window
        self.use_sliding_window = "sliding_attention" in self.layer_types
        self.max_window_layers = max_window_layers
        self.block_size = 16 if block_size is None else block_size
        self.mask_token_id = mask_token_id
        if target_layer_ids is None and num_target_layers is not None:
            target_layer_ids = legacy_target_layer_ids(num_target_layers, num_hidden_layers)
            logger.warning(
                "DFlash config has no target_layer_ids; using the legacy rule with num_target_layers=%d and "
                "num_hidden_layers=%d: %s",
                num_target_layers,
                num_hidden_layers,
                target_layer_ids,
            )
        self.target_layer_ids = None if target_layer_ids is None else [int(i) for i in target_layer_ids]
        self.num_target_layers = num_target_layers
        self.target_hidden_size = target_hidden_size if target_hidden_size is not None else hidden_size
        self.is_causal = is_causal
        self.target_model_id = target_model_id
        self.target_revision = target_revision
        self._validate_dflash()

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, **kwargs):
        """``PreTrainedConfig.from_pretrained``; a config this package refuses (``ValueError``) names the folder
        too, on every loading path (``AutoConfig``, ``AutoModel``, the drafters' ``from_pretrained``)."""
        try:
            return super().from_pretrained(pretrained_model_name_or_path, **kwargs)
        except ValueError as err:
            raise ValueError(f"drafter {str(pretrained_model_name_or_path)!r}: {err}") from err

    @staticmethod
    def names_dflash2(values: dict) -> bool:
        """Whether a ``config.json`` dict is a DFlash 2 one: ``architectures`` names ``DFlash2DraftModel``
        or a key of ``DFLASH2_KEYS`` is set at top level or in ``dflash_config``."""
        nested = values.get("dflash_config") or {}
        return ("DFlash2DraftModel" in (values.get("architectures") or [])
                or any(values.get(k) is not None or nested.get(k) is not None for k in DFLASH2_KEYS))

    @staticmethod
    def names_dspark(values: dict) -> bool:
        """Whether a ``config.json`` dict is a DeepSpec DSpark / DFlash-block7 one (``architectures``)."""
        return any(a in DSPARK_ARCHITECTURES for a in values.get("architectures") or [])

    @property
    def is_dspark(self) -> bool:
        """Whether this is a DeepSpec-dialect drafter ([`DSPARK_ARCHITECTURES`]): all ``block_size`` slots
        drafted, slot k predicting ``start + k + 1``, its own ``embed_tokens`` / ``lm_head``. Also after
        ``save_pretrained``, which sets the in-memory ``architectures`` to the class name (``DSparkDraftModel``):
        the model that saved itself must go on drafting as DSpark."""
        architectures = getattr(self, "architectures", None) or []
        return self.names_dspark({"architectures": architectures}) or "DSparkDraftModel" in architectures

    @property
    def is_dflash2(self) -> bool:
        """Whether this is a DFlash 2 drafter (its config sets the ``DFLASH2_KEYS``)."""
        return any(getattr(self, key, None) is not None for key in DFLASH2_KEYS)

    @property
    def num_target_features(self) -> int:
        """Number of captured target layers; ``fc`` maps ``num_target_features * target_hidden_size -> hidden_size``."""
        return len(self.target_layer_ids)

    def layer_is_causal(self, layer_idx: int) -> bool:
        """Whether draft layer ``layer_idx`` is causal inside the block (notes section 2, causality rule)."""
        if self.is_causal is not None:
            return bool(self.is_causal)
        return self.layer_types[layer_idx] == "sliding_attention"

    def layer_window(self, layer_idx: int):
        """Sliding window in tokens of draft layer ``layer_idx`` (key visible iff q_pos - k_pos < window), or None."""
        return self.sliding_window if self.layer_types[layer_idx] == "sliding_attention" else None

    def _validate_dflash2(self):
        values = {key: getattr(self, key) for key in DFLASH2_KEYS}
        given = [key for key, value in values.items() if value is not None]
        if not given:
            return
        if len(given) < len(DFLASH2_KEYS):
            missing = [key for key in DFLASH2_KEYS if key not in given]
            raise ValueError(f"a DFlash 2 config needs all of {list(DFLASH2_KEYS)}; it sets {given} but not {missing}")
        for key, value in values.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{key} must be an integer >= 1, got {value!r}")
        if self.hidden_size % self.conv_group_size:
            raise ValueError(f"conv_group_size={self.conv_group_size} does not divide hidden_size={self.hidden_size}: "
                             "the convolution's channel groups must tile the hidden state")
        if self.selector_top_k > self.vocab_size:
            raise ValueError(f"selector_top_k={self.selector_top_k} exceeds vocab_size={self.vocab_size}")

    def _validate_dspark(self):
        """The DSpark keys (DeepSpec ``Qwen3DSparkModel.__init__``'s asserts), named when they cannot be honoured."""
        rank = self.markov_rank or 0
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise ValueError(f"markov_rank must be an integer >= 0, got {self.markov_rank!r}")
        if rank and str(self.markov_head_type).lower() != "vanilla":
            raise ValueError(f"markov_head_type={self.markov_head_type!r} is not implemented (only 'vanilla', the "
                             "published DSpark drafters' head)")
        if self.enable_confidence_head and self.confidence_head_with_markov and not rank:
            raise ValueError("confidence_head_with_markov=True needs markov_rank > 0")

    def _validate_dflash(self):
        self._validate_dflash2()
        self._validate_dspark()
        for name in ("input_embedding_scale", "output_multiplier", "final_logit_softcapping"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite number > 0 (or absent), got {value!r}")
        ids = self.target_layer_ids
        if ids is None:
            raise ValueError(
                "DFlash config needs target_layer_ids (in dflash_config or at top level); got none, and no "
                "num_target_layers for the legacy rule either"
            )
        if len(ids) == 0 or len(set(ids)) != len(ids) or min(ids) < 0:
            raise ValueError(f"target_layer_ids must be distinct non-negative layer indices, got {ids}")
        if self.num_target_layers is not None and max(ids) >= self.num_target_layers:
            raise ValueError(f"target_layer_ids {ids} reach beyond num_target_layers={self.num_target_layers}")
        if self.mask_token_id is None:
            raise ValueError("DFlash config needs mask_token_id (in dflash_config or at top level); got none")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id={self.mask_token_id} must be in [0, vocab_size={self.vocab_size})")
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size must be an integer >= 1, got {self.block_size!r}")
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries but num_hidden_layers={self.num_hidden_layers}"
            )
        for t in self.layer_types:
            if t not in LAYER_TYPES:
                raise ValueError(f"unknown layer type {t!r} in layer_types; expected one of {LAYER_TYPES}")
        if "sliding_attention" in self.layer_types and not (self.sliding_window and self.sliding_window > 0):
            raise ValueError(f"sliding_attention layers need sliding_window >= 1, got {self.sliding_window!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )

    def to_dict(self):
        """The published dialect plus our fields: both rope spellings, ``dflash_config`` nested copy."""
        out = super().to_dict()
        out["model_type"] = "qwen3"
        out.setdefault("architectures", ["DFlash2DraftModel" if self.is_dflash2 else "DFlashDraftModel"])
        rope = copy.deepcopy(self.rope_parameters)
        out["rope_parameters"] = rope
        out["rope_theta"] = rope["rope_theta"]
        scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
        out["rope_scaling"] = None if scaling["rope_type"] == "default" else scaling
        out["dflash_config"] = {
            "target_layer_ids": list(self.target_layer_ids),
            "mask_token_id": self.mask_token_id,
            "block_size": self.block_size,
        }
        for name in ("input_embedding_scale", "output_multiplier", "final_logit_softcapping") + DFLASH2_KEYS:
            value = out.pop(name, None)  # engines read these in dflash_config
            if value is not None:
                out["dflash_config"][name] = value
        if self.is_causal is None:
            out.pop("is_causal", None)
        for name in DSPARK_KEYS:
            if out.get(name) is None:
                out.pop(name, None)
        # save_pretrained names the class (DSparkDraftModel); the engines route on DeepSpec's name.
        if out.get("architectures"):
            out["architectures"] = ["Qwen3DSparkModel" if a == "DSparkDraftModel" else a for a in out["architectures"]]
        if self.names_dspark(out):  # DeepSpec's dialect: top-level keys only
            out.pop("dflash_config", None)
        return out

    def to_diff_dict(self):
        """The diff dict, plus every backbone and DFlash field: serving engines read the plain Qwen3
        fields, so none may be left implicit as a default."""
        out = super().to_diff_dict()
        full = self.to_dict()
        for key in _ALWAYS_SAVED:
            if key in full:
                out[key] = full[key]
        if self.is_causal is None:
            out.pop("is_causal", None)
        for name in DSPARK_KEYS:
            if out.get(name) is None:
                out.pop(name, None)
        # save_pretrained names the class (DSparkDraftModel); the engines route on DeepSpec's name.
        if out.get("architectures"):
            out["architectures"] = ["Qwen3DSparkModel" if a == "DSparkDraftModel" else a for a in out["architectures"]]
        if self.names_dspark(out):  # DeepSpec's dialect: top-level keys only
            out.pop("dflash_config", None)
        return out


_ALWAYS_SAVED = (
    "model_type", "architectures", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings",
    "rms_norm_eps", "attention_bias", "attention_dropout", "rope_theta", "rope_scaling", "rope_parameters",
    "layer_types", "sliding_window", "use_sliding_window", "max_window_layers", "tie_word_embeddings",
    "block_size", "num_target_layers", "target_hidden_size", "dflash_config", "is_causal",
    "target_layer_ids", "mask_token_id", "target_model_id", "target_revision",
)


__all__ = ["DFLASH2_KEYS", "DRAFT_ARCHITECTURES", "DSPARK_ARCHITECTURES", "DSPARK_KEYS", "UNUSED_TENSORS", "DFlashConfig", "architecture_refusal",
           "check_loading_info", "legacy_target_layer_ids", "normalize_rope"]
