"""DFlash draft model: a block-diffusion drafter for lossless speculative decoding (arXiv 2602.06036).

A small Qwen3-style decoder without embedding or LM head (it borrows the target's, frozen) drafts a whole block
``[anchor, MASK, ..., MASK]`` in one pass; target hidden states at ``config.target_layer_ids``, fused by ``fc`` +
``hidden_norm``, are extra keys/values of every draft layer ("KV injection"), queries only the block's (method
section). State-dict names are the published z-lab / SpecForge ones: they load strictly with no renaming."""

import functools
import logging
import math
import os
import sys
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.modeling_outputs import BaseModelOutputWithPast

# Module-cache repair first (why: remote_code_cache.py). The repair module itself always runs afresh.
if __package__:
    sys.modules.pop(f"{__package__}.remote_code_cache", None)
try:
    from .remote_code_cache import _HUB_KWARGS, _folder_own_class, _forget_stale_siblings, _record_sibling_sources
except ImportError:  # imported from the repository root instead of as a Hub remote-code package
    from remote_code_cache import _HUB_KWARGS, _folder_own_class, _forget_stale_siblings, _record_sibling_sources
if __package__:
    _forget_stale_siblings(__name__)
# Every flat sibling file that any remote-code file imports must be imported HERE too, with a single-dot relative
# import: transformers 4.57 copies only the modeling file's direct relative imports of a local folder into its
# module cache (tests/test_remote_code.py checks this).
try:
    from .cache_reuse import DraftContext  # noqa: F401
    from .configuration_dflash import DFlashConfig, check_loading_info
    from .custom_generate_template import generate as _custom_generate  # noqa: F401
    from .decode_step import crop_cache  # noqa: F401
    from .dspark import build_heads, dspark_propose, slot_inputs
    from .dflash2 import CODEBOOK_KEY_MAPPING, CandidateSelector, GroupedDynamicCausalConv, SelectorDraft, selector_walk
    from .generation_arguments import NOT_PASSED  # noqa: F401
    from .generation_output import DFlashGenerateOutput  # noqa: F401
    from .generation_utils import spec_generate as _spec_generate
    from .generation_utils import native_acceptance_stats, spec_generate_from_generate_arguments, write_custom_generate
    from .native_routes import CUSTOM_GENERATE_PY, assistant_usage_hint, check_native_target, NativeRouteChecks
    from .native_routes import native_dflash_available
    from .proposers import Proposal  # noqa: F401
    from .draft_trees import TreeBatch  # noqa: F401  (4.57 copies only direct imports)
    from .speculative_sampling import speculative_verify  # noqa: F401
    from .static_generate import static_decode as _static_decode  # noqa: F401
    from .stopping_criteria import _Stops  # noqa: F401
    from .target_cache import HYBRID_FAMILIES  # noqa: F401
    from .target_facts import TargetFacts  # noqa: F401
    from .target_families import draft_block_embedding, draft_logits
    from .target_taps import capture_target_features  # noqa: F401
    from .tested_versions import TESTED_TRANSFORMERS  # noqa: F401
    from .user_processors import check_copyable  # noqa: F401
    from .verify_cost import StepCost  # noqa: F401  (4.57 copies only direct imports)
    from .verify_policy import VerifyPolicy  # noqa: F401
except ImportError:  # imported from the repository root instead of as a Hub remote-code package
    from cache_reuse import DraftContext  # noqa: F401
    from configuration_dflash import DFlashConfig, check_loading_info
    from custom_generate_template import generate as _custom_generate  # noqa: F401
    from decode_step import crop_cache  # noqa: F401
    from dspark import build_heads, dspark_propose, slot_inputs
    from dflash2 import CODEBOOK_KEY_MAPPING, CandidateSelector, GroupedDynamicCausalConv, SelectorDraft, selector_walk
    from generation_arguments import NOT_PASSED  # noqa: F401
    from generation_output import DFlashGenerateOutput  # noqa: F401
    from generation_utils import spec_generate as _spec_generate
    from generation_utils import native_acceptance_stats, spec_generate_from_generate_arguments, write_custom_generate
    from native_routes import CUSTOM_GENERATE_PY, assistant_usage_hint, check_native_target, NativeRouteChecks
    from native_routes import native_dflash_available
    from proposers import Proposal  # noqa: F401
    from draft_trees import TreeBatch  # noqa: F401
    from speculative_sampling import speculative_verify  # noqa: F401
    from static_generate import static_decode as _static_decode  # noqa: F401
    from stopping_criteria import _Stops  # noqa: F401
    from target_cache import HYBRID_FAMILIES  # noqa: F401
    from target_facts import TargetFacts  # noqa: F401
    from target_families import draft_block_embedding, draft_logits
    from target_taps import capture_target_features  # noqa: F401
    from tested_versions import TESTED_TRANSFORMERS  # noqa: F401
    from user_processors import check_copyable  # noqa: F401
    from verify_cost import StepCost  # noqa: F401
    from verify_policy import VerifyPolicy  # noqa: F401
if __package__:
    _record_sibling_sources(__name__)

try:  # optional, CUDA only
    from flash_attn import flash_attn_func
except ImportError:
    flash_attn_func = None


class DFlashRMSNorm(nn.Module):
    """RMSNorm computed in fp32, as ``Qwen3RMSNorm``: ``weight * x / sqrt(mean(x^2) + eps)``."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


def _yarn_inv_freq(rope: dict, dim: int, max_position_embeddings: int):
    """YaRN (Peng et al. 2023, eq. 15-23): blend interpolated and extrapolated frequencies by a linear
    ramp over the correction range, and scale attention by ``0.1 * ln(factor) + 1`` (or the given
    ``attention_factor`` / ``mscale`` ratio). Same formulas as transformers' ``yarn`` rope init."""
    base, factor = rope["rope_theta"], rope["factor"]
    original_max = rope.get("original_max_position_embeddings") or max_position_embeddings

    get_mscale = (lambda scale, mscale=1.0: 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0)
    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = get_mscale(factor)
    beta_fast, beta_slow = rope.get("beta_fast") or 32, rope.get("beta_slow") or 1

    def correction_dim(num_rotations):
        return (dim * math.log(original_max / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high += 0.001 if low == high else 0.0
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1)
    extrapolation_weight = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_weight) + (1.0 / pos_freqs) * extrapolation_weight
    return inv_freq, float(attention_factor)


def _llama3_inv_freq(rope: dict, inv_freq: torch.Tensor):
    """Llama 3.1 frequency-dependent scaling (low frequencies divided by ``factor``, smooth blend)."""
    factor, low_ff, high_ff = rope["factor"], rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old_len = rope.get("original_max_position_embeddings", 8192)
    low_wavelen, high_wavelen = old_len / low_ff, old_len / high_ff
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low_ff) / (high_ff - low_ff)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def compute_rope_inv_freq(config: DFlashConfig):
    """Inverse frequencies ``(head_dim // 2,)`` fp32 on CPU and the attention scaling, from the DRAFT's
    own rope settings (a draft rope built from the target's config drops acceptance to ~1, notes
    section 6). Supports ``default``, ``linear``, ``yarn``, ``llama3``."""
    rope, dim = config.rope_parameters, config.head_dim
    base_inv_freq = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim))
    kind = rope["rope_type"]
    if kind == "default":
        return base_inv_freq, 1.0
    if kind == "linear":
        return base_inv_freq / rope["factor"], 1.0
    if kind == "yarn":
        return _yarn_inv_freq(rope, dim, config.max_position_embeddings)
    if kind == "llama3":
        return _llama3_inv_freq(rope, base_inv_freq), 1.0
    raise ValueError(f"unsupported rope_type {kind!r}")


class DFlashRotaryEmbedding(nn.Module):
    """Rotary embedding of the draft. Frequencies are kept as Python floats (no buffer), so loading on
    the meta device or moving the module never leaves them uninitialised; the fp32 tensor built from
    them is memoised per device (a constant of the config, so no result depends on earlier calls)."""

    def __init__(self, config: DFlashConfig):
        super().__init__()
        inv_freq, self.attention_scaling = compute_rope_inv_freq(config)
        self.inv_freq = inv_freq.tolist()
        self._inv_freq_by_device = {}

    def inv_freq_on(self, device: torch.device) -> torch.Tensor:
        """``(head_dim // 2,)`` fp32 inverse frequencies on ``device``, built once per device."""
        table = self._inv_freq_by_device.get(device)
        if table is None:
            with torch.inference_mode(False), torch.no_grad():  # a normal tensor, usable in and out of inference mode
                table = torch.tensor(self.inv_freq, dtype=torch.float32, device=device)
            self._inv_freq_by_device[device] = table
        return table

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.LongTensor):
        """position_ids ``(batch, n)`` -> ``(cos, sin)``, each ``(batch, n, head_dim)`` in ``x.dtype``."""
        freqs = position_ids[:, :, None].float() * self.inv_freq_on(position_ids.device)  # (batch, n, head_dim // 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin):
    """q ``(b, heads, q_len, d)``, k ``(b, kv_heads, n, d)``, cos/sin ``(b, n, d)`` for the n new keys
    (new context + block); the queries are the last ``q_len`` of them."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    q_len = q.shape[-2]
    q_embed = q * cos[..., -q_len:, :] + rotate_half(q) * sin[..., -q_len:, :]
    k_embed = k * cos + rotate_half(k) * sin
    return q_embed, k_embed


_SDPA_TAKES_GQA = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 5)


def sdpa_groups_keys(q: torch.Tensor) -> bool:
    """Whether sdpa attends over the un-repeated kv heads (``enable_gqa``, torch >= 2.5): on CPU, with or without
    a mask, where it is bit-identical to ``repeat_kv`` + sdpa and skips copying every cached key and value
    ``num_kv_groups`` times per layer and step (z-lab's draft skips it too). Other devices keep ``repeat_kv``:
    CUDA's fp32 and masked kernels would fall back to the math path with grouped heads."""
    return _SDPA_TAKES_GQA and q.device.type == "cpu"


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """``(b, kv_heads, n, d)`` -> ``(b, kv_heads * n_rep, n, d)`` for grouped-query attention."""
    if n_rep == 1:
        return x
    b, h, n, d = x.shape
    return x[:, :, None].expand(b, h, n_rep, n, d).reshape(b, h * n_rep, n, d)


def block_attention_mask(q_pos, k_pos, causal: bool, window: Optional[int], key_valid=None, context_from=None):
    """Boolean visibility ``(b, 1, q_len, kv_len)`` (True = attend) for block queries over [context ++ block].

    Context keys always sit at positions before the block, so they are visible to every query
    (notes section 1, visibility rule); inside the block, full-attention layers are bidirectional and
    causal layers see ``k_pos <= q_pos``; a sliding window keeps ``q_pos - k_pos < window`` (the
    transformers convention) and, in a bidirectional layer, ``k_pos - q_pos < window`` too (z-lab
    ``dflash/model.py`` ``_attention_mask``; it matters only for a window shorter than the block, as in
    non-causal sliding DFlash 2 layers). ``key_valid`` ``(b, kv_len)`` removes padding keys and cache holes.
    ``context_from`` ``(b, 1)`` (the ``draft_window`` of ``spec_generate``) hides every key at a position
    below it: with ``anchor - N`` it leaves the last N context positions before the anchor and the block
    (whose positions are all >= the anchor's); combined with ``window`` by AND, so the smaller one rules.
    Returns None when every key is visible (the fast path of sdpa).
    """
    if not causal and window is None and key_valid is None and context_from is None:
        return None
    diff = q_pos[:, :, None] - k_pos[:, None, :]  # (b, q_len, kv_len)
    mask = torch.ones_like(diff, dtype=torch.bool)
    if causal:
        mask &= diff >= 0
    if window is not None:
        mask &= diff < window
        if not causal:
            mask &= -diff < window
    if key_valid is not None:
        mask &= key_valid[:, None, :].bool()
    if context_from is not None:
        mask &= (k_pos >= context_from)[:, None, :]
    return mask[:, None]


def flash_usable(t: torch.Tensor) -> bool:
    """flash-attn runs only on CUDA in fp16/bf16; elsewhere the sdpa path with explicit masks is used."""
    return flash_attn_func is not None and t.is_cuda and t.dtype in (torch.float16, torch.bfloat16)


def eager_attention(q, k, v, mask, scaling):
    """Reference attention; softmax in fp32. ``mask`` is bool (True = attend), float additive, or None."""
    scores = torch.matmul(q, k.transpose(2, 3)) * scaling
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)


class DFlashAttention(nn.Module):
    """Qwen3 attention (q/k RMSNorm per head) whose keys/values are [fused target context ++ block]."""

    def __init__(self, config: DFlashConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.is_causal = config.layer_is_causal(layer_idx)
        self.sliding_window = config.layer_window(layer_idx)
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = DFlashRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = DFlashRMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(self, hidden_states, target_hidden, position_embeddings, attention_mask, past_key_values=None):
        """hidden_states ``(b, q_len, H)`` (block), target_hidden ``(b, ctx_len, H)`` (fused new context)."""
        bsz, q_len, _ = hidden_states.shape
        ctx_len = target_hidden.shape[1]
        q = self.q_norm(self.q_proj(hidden_states).view(bsz, q_len, -1, self.head_dim)).transpose(1, 2)
        # context and block projected apart, as z-lab: one call on their concatenation rounds differently
        # on some BLAS paths, and fp32 drafts are to be bit-identical to theirs (tests/test_dflash2.py)
        k = torch.cat([self.k_proj(target_hidden), self.k_proj(hidden_states)], dim=1)
        v = torch.cat([self.v_proj(target_hidden), self.v_proj(hidden_states)], dim=1)
        k = self.k_norm(k.view(bsz, ctx_len + q_len, -1, self.head_dim)).transpose(1, 2)  # (b, kv_heads, n, d)
        v = v.view(bsz, ctx_len + q_len, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, *position_embeddings)
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, self.layer_idx)
        out = self._attend(q, k, v, attention_mask)  # (b, heads, q_len, d)
        out = out.transpose(1, 2).reshape(bsz, q_len, -1)
        return self.o_proj(out)

    def _attend(self, q, k, v, mask):
        if mask is not None and mask.shape[-1] < k.shape[2]:  # a draft_window mask over the last keys only
            k, v = k[:, :, -mask.shape[-1]:], v[:, :, -mask.shape[-1]:]
        impl = self.config._attn_implementation
        if impl == "flash_attention_2" and mask is None and flash_usable(q):
            left = self.sliding_window - 1 if self.sliding_window else -1
            out = flash_attn_func(  # keys are contiguous positions; queries are the last q_len keys
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale=self.scaling,
                causal=self.is_causal, window_size=(left, 0 if self.is_causal else left),
            )
            return out.transpose(1, 2)
        if impl != "eager" and self.num_kv_groups > 1 and sdpa_groups_keys(q):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scaling, enable_gqa=True)
        k, v = repeat_kv(k, self.num_kv_groups), repeat_kv(v, self.num_kv_groups)
        if impl == "eager":
            return eager_attention(q, k, v, mask, self.scaling)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scaling)


class DFlashMLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        if config.hidden_act != "silu":
            raise ValueError(f"hidden_act={config.hidden_act!r} is not supported; DFlash drafts use 'silu'")

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashDecoderLayer(nn.Module):
    """Pre-norm decoder layer; only the block is normed (the context feature is normed once by
    ``hidden_norm``) and only the block goes through the MLP."""

    def __init__(self, config: DFlashConfig, layer_idx: int):
        super().__init__()
        self.self_attn = DFlashAttention(config, layer_idx)
        self.mlp = DFlashMLP(config)
        self.input_layernorm = DFlashRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = DFlashRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, target_hidden, position_embeddings, attention_mask, past_key_values=None):
        residual = hidden_states
        hidden_states = self.self_attn(
            self.input_layernorm(hidden_states), target_hidden, position_embeddings, attention_mask, past_key_values
        )
        hidden_states = residual + hidden_states
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class DFlashPreTrainedModel(PreTrainedModel):
    config_class = DFlashConfig
    base_model_prefix = "model"
    main_input_name = "noise_embedding"
    _no_split_modules = ["DFlashDecoderLayer"]
    _supports_sdpa = True
    _supports_flash_attn = True
    _supports_flash_attn_2 = True

    def _init_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            module.weight.data.normal_(mean=0.0, std=std)
            if module.bias is not None:
                module.bias.data.zero_()
        elif isinstance(module, DFlashRMSNorm):
            module.weight.data.fill_(1.0)


class DFlashDraftModel(NativeRouteChecks, DFlashPreTrainedModel):
    """The DFlash drafter: ``fc`` + ``hidden_norm`` feature fusion, KV injection into every layer,
    Qwen3-style layers, final ``norm``. No embedding or LM head: use the target's.

    Attributes ``block_size``, ``mask_token_id`` and ``target_layer_ids`` mirror the config (the
    public surface of the z-lab implementation). Generate with [`spec_generate`].

    Raises:
        ValueError: the config is a DFlash 2 one (build [`DFlash2DraftModel`]; ``from_pretrained`` does).
    """

    decoder_layer_class = DFlashDecoderLayer
    _is_dflash2_class = False
    _is_dspark_class = False

    def __init__(self, config: DFlashConfig):
        if config.is_dspark != self._is_dspark_class:
            raise ValueError(f"{type(self).__name__} cannot be built from the config of architectures="
                             f"{config.architectures}; use {'DSpark' if config.is_dspark else 'DFlash'}DraftModel")
        if config.is_dflash2 != self._is_dflash2_class:
            raise ValueError(f"{type(self).__name__} cannot be built from a DFlash {'2' if config.is_dflash2 else '1'} config "
                             f"(conv_kernel_size={config.conv_kernel_size}, selector_rank={config.selector_rank}); use "
                             f"{'DFlash2DraftModel' if config.is_dflash2 else 'DFlashDraftModel'}")
        super().__init__(config)
        self.layers = nn.ModuleList([self.decoder_layer_class(config, i) for i in range(config.num_hidden_layers)])
        self.fc = nn.Linear(config.num_target_features * config.target_hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = DFlashRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.norm = DFlashRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = DFlashRotaryEmbedding(config)
        # (is_causal, sliding window, layer type) per layer: fixed by the config, computed once
        self._layer_kinds = [(config.layer_is_causal(i), config.layer_window(i), config.layer_types[i])
                             for i in range(config.num_hidden_layers)]
        self.post_init()

    def get_input_embeddings(self):  # quantizers ask: None (DFlash reads the target's), DSpark's own table
        return getattr(self, "embed_tokens", None)

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def mask_token_id(self) -> int:
        return self.config.mask_token_id

    @property
    def target_layer_ids(self) -> list:
        return self.config.target_layer_ids

    # No generation_config: `generate(assistant_model=draft)` without speculation_type="dflash" would build the
    # generic assistant, which reads one; the AttributeError names the working routes (hasattr() stays False).
    @property
    def generation_config(self):
        raise AttributeError(assistant_usage_hint())

    @generation_config.setter
    def generation_config(self, value):
        """``PreTrainedModel.__init__`` stores None here for models that cannot generate."""
        if value is not None:
            raise ValueError(f"a DFlash draft has no generation_config (got {type(value).__name__}); "
                             "set generation options on the target")

    def __getattr__(self, name):
        if name == "generation_config":  # the property's AttributeError lands here
            raise AttributeError(assistant_usage_hint())
        return super().__getattr__(name)

    def forward(
        self,
        position_ids: torch.LongTensor,
        noise_embedding: Optional[torch.Tensor] = None,
        target_hidden: Optional[torch.Tensor] = None,
        past_key_values=None,
        use_cache: bool = False,
        attention_mask: Optional[torch.Tensor] = None,
        *,
        noise_embeds: Optional[torch.Tensor] = None,
        context_hidden_states: Optional[torch.Tensor] = None,
        cache=None,
        draft_window: Optional[int] = None,
        **kwargs,
    ):
        """Draft one block (or, in training, many packed blocks) in one pass.

        Two spellings of the same call. Ours (``noise_embedding``, ``target_hidden``,
        ``past_key_values``; used by ``spec_generate``, training and the z-lab loop) returns the
        hidden-state tensor. transformers' own DFlash candidate generator (>= 5.x,
        ``generate(assistant_model=draft, speculation_type="dflash")``) calls
        ``forward(noise_embeds=, context_hidden_states=, position_ids=, attention_mask=, cache=)`` and
        reads ``.last_hidden_state``: called with those names, the same computation is returned as a
        ``BaseModelOutputWithPast``. The two spellings cannot be mixed (ValueError).

        Args:
            position_ids: ``(b, ctx_len + q_len)`` absolute positions of the NEW context entries
                followed by the block; cached keys are taken to sit at positions ``0..past_len-1``.
            noise_embedding: ``(b, q_len, H)`` target embeddings of ``[anchor, MASK, ...]``.
            target_hidden: ``(b, ctx_len, n_feat * target_hidden_size)`` raw concatenation of the
                captured target layers for the new context positions (cast to the draft's dtype here).
            past_key_values: a transformers ``Cache`` (e.g. ``DynamicCache``) holding context K/V; it
                is updated in place with the new context AND the block (crop the block off after).
            use_cache: accepted for compatibility; caching happens whenever ``past_key_values`` is given.
            attention_mask: None (built from positions), a ``(b, kv_len)`` key-validity mask
                (1 = real key, positions then taken as ``cumsum - 1``), a ``(b, 1, q_len, kv_len)``
                bool/additive mask used by every layer, or a dict ``{"full_attention": m,
                "sliding_attention": m}`` of such masks (packed training blocks).
            **kwargs: ignored (the z-lab loop passes ``is_causal=False``; causality is per layer, from
                the config: full-attention layers bidirectional, sliding layers causal).

            noise_embeds, context_hidden_states, cache: the native names of ``noise_embedding``,
                ``target_hidden`` and ``past_key_values`` (same shapes; ``attention_mask`` is then the
                ``(b, past + ctx_len + q_len)`` key mask the native generator builds).
            draft_window: None (default), or N >= 1: every layer sees only the context positions
                ``anchor - N .. anchor - 1`` (the anchor = the block's first position) and the block;
                a layer's own ``sliding_window`` applies too, so the smaller one rules (see
                ``spec_generate``). Not with a 4-D or per-layer-kind ``attention_mask`` (ValueError).

        Returns:
            ``(b, q_len, H)`` final-normed hidden states; logits = target head of these. With the
            native names, ``BaseModelOutputWithPast(last_hidden_state=<that tensor>)``.
        """
        native = noise_embeds is not None or context_hidden_states is not None or cache is not None
        if native:
            if noise_embedding is not None or target_hidden is not None or past_key_values is not None:
                raise ValueError("pass either noise_embedding/target_hidden/past_key_values or the native "
                                 "noise_embeds/context_hidden_states/cache, not both")
            check_native_target(self.config)  # a target with another vocabulary: named, not silently run
            hidden = self.forward(position_ids, noise_embeds, context_hidden_states, cache, use_cache, attention_mask)
            return BaseModelOutputWithPast(last_hidden_state=hidden)
        if noise_embedding is None or target_hidden is None:
            raise ValueError("forward needs noise_embedding (b, q_len, H) and target_hidden (b, ctx_len, n_feat * H_t)")
        dtype = self.hidden_norm.weight.dtype  # the compute dtype (a bitsandbytes fc.weight is int8)
        hidden_states = noise_embedding.to(device=self.fc.weight.device, dtype=dtype)
        target_hidden = self.hidden_norm(self.fc(target_hidden.to(device=hidden_states.device, dtype=dtype)))
        position_ids = position_ids.to(hidden_states.device)
        q_len = hidden_states.shape[1]
        past_len = past_key_values.get_seq_length() if past_key_values is not None else 0
        masks = self._layer_masks(position_ids, q_len, past_len, attention_mask, draft_window)
        position_embeddings = self.rotary_emb(hidden_states, position_ids)
        options = self._layer_options(attention_mask)
        for layer, mask in zip(self.layers, masks):
            hidden_states = layer(hidden_states, target_hidden, position_embeddings, mask, past_key_values, **options)
        return self.norm(hidden_states)

    def _layer_options(self, attention_mask) -> dict:
        """Extra keyword arguments of every decoder layer call (none for DFlash 1)."""
        return {}

    def _layer_masks(self, position_ids, q_len, past_len, attention_mask, draft_window=None):
        """One mask per layer (shared between layers of the same kind); see [`block_attention_mask`].

        With ``draft_window`` and no key-validity mask (contiguous keys: the cache at ``0..past_len-1``,
        then the new context up to the anchor, then the block) the masks cover only the last
        ``min(N, anchor) + q_len`` keys, the visible ones, and attention reads only those keys
        (``DFlashAttention._attend``): a step costs O(N) instead of O(context). With holes (a ragged
        batch, the static loop's fixed-width context) the keys stay and the mask hides them."""
        cfg, kinds = self.config, self._layer_kinds
        if draft_window is not None and (isinstance(attention_mask, dict) or (
                attention_mask is not None and attention_mask.dim() == 4)):
            raise ValueError(f"draft_window={draft_window!r} needs the mask built here (None or a (b, kv_len) key "
                             "mask), not a 4-D or per-layer-kind attention_mask")
        if isinstance(attention_mask, dict):
            return [attention_mask[t] for _, _, t in kinds]
        if attention_mask is not None and attention_mask.dim() == 4:
            return [attention_mask] * len(kinds)
        bsz = position_ids.shape[0]
        q_pos = position_ids[:, -q_len:]
        key_valid = None
        if attention_mask is not None:  # (b, kv_len) key validity
            key_valid = attention_mask.to(position_ids.device).bool()
            k_pos = key_valid.long().cumsum(-1) - 1
        elif draft_window is None and all(not causal and window is None for causal, window, _ in kinds):
            return [None] * len(kinds)  # every key visible to every query: no mask, no key positions needed
        else:
            past = torch.arange(past_len, device=position_ids.device).expand(bsz, past_len)
            k_pos = torch.cat([past, position_ids], dim=1)
            if draft_window is not None:  # keys past the window are never read: cut them here
                k_pos = k_pos[:, -(min(draft_window, k_pos.shape[1] - q_len) + q_len):]
        context_from = None if draft_window is None else q_pos[:, :1] - draft_window  # (b, 1)
        cache = {}
        masks = []
        for causal, window, _ in kinds:
            if (causal, window) not in cache:
                cache[(causal, window)] = block_attention_mask(q_pos, k_pos, causal, window, key_valid, context_from)
            masks.append(cache[(causal, window)])
        # flash-attn takes `causal`/`window_size` itself and needs no mask when keys are contiguous
        if (cfg._attn_implementation == "flash_attention_2" and key_valid is None and draft_window is None
                and flash_usable(self.fc.weight)):
            masks = [None] * len(masks)
        return masks

    # Bound when the class is created: transformers 4.57 re-executes this module in place when a
    # folder with other code is loaded, and a global lookup would then reach the newer folder's loop.
    _spec_generate = staticmethod(_spec_generate)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        """``PreTrainedModel.from_pretrained``, run by the folder's own remote code (see [`_folder_own_class`]),
        strict: every tensor of the model must be in the folder, with its shape, and every tensor of the folder
        must be the model's (issue 34: a folder without ``fc.weight`` ran with a random ``fc``, silently).
        Tensors of ``UNUSED_TENSORS`` (published copies of the target's embedding / head, rotary buffers)
        are dropped with one warning naming them. A DFlash 2 folder (``architectures`` names
        ``DFlash2DraftModel`` or the config sets the DFlash 2 keys) loads as a [`DFlash2DraftModel`] (one info log).

        Raises:
            ValueError: before any forward, naming the folder and the missing, unexpected or (with
                ``ignore_mismatched_sizes=True``) misshapen tensors; or (from ``DFlashConfig``) an
                ``architectures`` value this package does not implement (DSpark...).
            RuntimeError: transformers' own, naming a misshapen tensor (``size mismatch for fc.weight``).
        """
        own = _folder_own_class(cls, pretrained_model_name_or_path, kwargs)
        if own is not cls:
            return own.from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)
        if not cls._is_dspark_class and _folder_is(DFlashConfig.names_dspark, cls, pretrained_model_name_or_path, kwargs):
            logging.getLogger(__name__).info("%s is a DeepSpec drafter: loading it as DSparkDraftModel",
                                             pretrained_model_name_or_path)
            return cls._dspark_class.from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)
        if not cls._is_dflash2_class and _folder_is(DFlashConfig.names_dflash2, cls, pretrained_model_name_or_path, kwargs):
            logging.getLogger(__name__).info("%s is a DFlash 2 drafter: loading it as DFlash2DraftModel",
                                             pretrained_model_name_or_path)
            return cls._dflash2_class.from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)
        wants_info = kwargs.pop("output_loading_info", False)
        model, info = super().from_pretrained(pretrained_model_name_or_path, *model_args, output_loading_info=True, **kwargs)
        check_loading_info(pretrained_model_name_or_path, info)
        return (model, info) if wants_info else model

    @functools.wraps(_spec_generate.__func__)  # help() shows the full signature (less ``draft``) and docstring
    def spec_generate(self, *args, **kwargs):
        return self._spec_generate(self, *args, **kwargs)

    _from_generate_arguments = staticmethod(spec_generate_from_generate_arguments)
    _native_acceptance_stats = staticmethod(native_acceptance_stats)
    _write_custom_generate = staticmethod(write_custom_generate)

    def spec_generate_from_generate_arguments(self, target, **generate_arguments):
        """``spec_generate`` from ``target.generate()``'s arguments: the entry of the Hub
        ``custom_generate/generate.py``; see ``generation_utils.spec_generate_from_generate_arguments``."""
        return self._from_generate_arguments(self, target, **generate_arguments)

    def native_acceptance_stats(self, target=None):
        """Context manager collecting acceptance statistics on transformers' native DFlash path; see
        ``generation_utils.native_acceptance_stats``."""
        return self._native_acceptance_stats(self, target)

    def save_pretrained(self, save_directory, *args, **kwargs):
        """``PreTrainedModel.save_pretrained``, plus ``custom_generate/generate.py`` (so that
        ``target.generate(..., custom_generate=<this folder or its Hub repo>, assistant_model=draft,
        trust_remote_code=True)`` runs ``spec_generate``)."""
        super().save_pretrained(save_directory, *args, **kwargs)
        if kwargs.get("is_main_process", True):
            self._write_custom_generate(save_directory)


class DFlash2DecoderLayer(DFlashDecoderLayer):
    """DFlash 2 layer: the DFlash layer with a grouped dynamic causal convolution around each sublayer.

    ``h = x + finish_a(attn(prepare_a(ln1(x))))``, ``out = h + finish_m(mlp(prepare_m(ln2(h))))``: each
    ``prepare`` takes the NORMED sublayer input (both sides' coefficients come from it) and returns
    the convolved input for the sublayer; the block's keys/values are taken from that convolved input.
    Source: z-lab ``dflash/model.py`` ``Qwen3DFlashDecoderLayer.forward`` with ``attention_conv`` /
    ``mlp_conv`` set by ``DFlash2DraftModel.__init__``; the convolution is in ``dflash2.py``.
    """

    def __init__(self, config: DFlashConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.attention_conv = GroupedDynamicCausalConv(config.hidden_size, config.conv_kernel_size, config.conv_group_size)
        self.mlp_conv = GroupedDynamicCausalConv(config.hidden_size, config.conv_kernel_size, config.conv_group_size)

    def forward(self, hidden_states, target_hidden, position_embeddings, attention_mask, past_key_values=None,
                block_length=None):
        """hidden_states ``(b, q_len, H)``: one block per row, or (``block_length``, training's packed
        form) ``q_len / block_length`` blocks per row, each convolved alone."""
        block_input, post = self.attention_conv.prepare(self.input_layernorm(hidden_states), block_length)
        attended = self.self_attn(block_input, target_hidden, position_embeddings, attention_mask, past_key_values)
        hidden_states = hidden_states + self.attention_conv.finish(attended, post, block_length)
        block_input, post = self.mlp_conv.prepare(self.post_attention_layernorm(hidden_states), block_length)
        return hidden_states + self.mlp_conv.finish(self.mlp(block_input), post, block_length)


NATIVE_DFLASH2_WARNING = (
    "transformers' native DFlash loop (speculation_type=\"dflash\") runs this DFlash 2 drafter without its "
    "candidate selector: each slot drafts from its own logits (still lossless; acceptance is the backbone's). "
    "The selector walk runs in draft.spec_generate(target, ...) and target.generate(..., custom_generate=<drafter "
    "folder or repo>, assistant_model=draft, trust_remote_code=True)")


class DFlash2DraftModel(DFlashDraftModel):
    """DFlash 2 drafter: the DFlash backbone with [`DFlash2DecoderLayer`] layers, plus the
    ``candidate_selector`` that walks the top-k candidates of each mask slot (``dflash2.py``).

    ``forward`` is the DFlash one (final-normed states ``(b, q_len, H)``, the whole block, anchor
    first; one block per row, or training's packed blocks). [`selector_inputs`] gives the selector's
    inputs for a drafted block and [`propose`] drafts its tokens and ``q``. Source: z-lab
    ``dflash/model.py`` ``DFlash2DraftModel``.
    A fresh model (or missing DFlash 2 weights) is the identity: it drafts greedily exactly as its
    DFlash 1 backbone.

    Raises:
        ValueError: the config is not a DFlash 2 one.
    """

    decoder_layer_class = DFlash2DecoderLayer
    _is_dflash2_class = True
    _no_split_modules = ["DFlash2DecoderLayer"]

    def __init__(self, config: DFlashConfig):
        super().__init__(config)
        self.candidate_selector = CandidateSelector(config.hidden_size, config.vocab_size, config.selector_rank,
                                                    config.selector_top_k, init_std=config.initializer_range)
        self.post_init()  # initialises the selector only: the backbone is marked initialised already

    def forward(self, *args, **kwargs):
        """[`DFlashDraftModel.forward`]. Called with transformers' native names (its DFlash candidate
        generator, ``generate(assistant_model=draft, speculation_type="dflash")``, 5.x), which drafts each
        slot from its logits alone: the first such call logs one warning that the selector is not used
        there (still lossless) and names the two routes that run it."""
        native = ("noise_embeds", "context_hidden_states", "cache")
        if not self._native_warned and any(kwargs.get(k) is not None for k in native):
            self._native_warned = True
            logging.getLogger(__name__).warning(NATIVE_DFLASH2_WARNING)
        return super().forward(*args, **kwargs)

    _native_warned = False

    def _layer_options(self, attention_mask) -> dict:
        """Training's packed form (a dict of masks, ``train/blocks.py``) holds ``q_len / block_size`` blocks
        per row: each layer then convolves every ``block_size`` positions alone."""
        return {"block_length": self.config.block_size} if isinstance(attention_mask, dict) else {}

    def _init_weights(self, module):
        """The DFlash init, then the identity for the DFlash 2 parts, leaving loaded parameters alone."""
        super()._init_weights(module)
        if isinstance(module, (GroupedDynamicCausalConv, CandidateSelector)):
            module.reset_to_identity(keep=lambda param: getattr(param, "_is_hf_initialized", False))

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        """[`DFlashDraftModel.from_pretrained`] (strict: a missing codebook would otherwise be re-initialised
        with only a warning). Codebooks stored as ``...codebook.weight`` are read as the published names.

        Raises:
            ValueError: naming the folder and the missing, unexpected or misshapen tensors.
        """
        kwargs.setdefault("key_mapping", dict(CODEBOOK_KEY_MAPPING))
        loaded = super().from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)
        model = loaded[0] if isinstance(loaded, tuple) else loaded
        if getattr(model, "_weight_conversions", None):  # transformers 5 would save the renamed keys renamed back
            model._weight_conversions = []
        return loaded

    def selector_inputs(self, hidden_states: torch.Tensor, head):
        """The selector's inputs for a drafted block.

        Args:
            hidden_states: ``(B, b, H)`` [`forward`] output for ``[anchor, MASK x (b - 1)]``.
            head: the target's output head.

        Returns:
            ``(slot_hidden (B, b - 1, H), logits (B, b - 1, V))``: the mask slots' states and their draft
            logits ``head(h) * output_multiplier``, soft-capped (``target_families.draft_logits``; z-lab
            ``compute_logits``). Run per-slot-independent processors on ``logits``, then [`selector_walk`].
        """
        slot_hidden = hidden_states[:, 1:]
        return slot_hidden, draft_logits(self.config, head, slot_hidden)

    def propose(self, hidden_states: torch.Tensor, anchor_ids: torch.Tensor, head, **walk_options) -> SelectorDraft:
        """Draft a block's tokens: [`selector_inputs`] then ``dflash2.selector_walk`` (``walk_options``:
        ``do_sample``, ``temperature``, ``generator``, ``top_k``, ``process``). z-lab ``DFlash2DraftModel.propose``."""
        slot_hidden, logits = self.selector_inputs(hidden_states, head)
        return selector_walk(self.candidate_selector, slot_hidden, logits, anchor_ids, **walk_options)


DFlashDraftModel._dflash2_class = DFlash2DraftModel  # bound here, not looked up at call time (module re-execution)


class DSparkDraftModel(DFlashDraftModel):
    """DeepSpec's Qwen3 DSpark drafter (``Qwen3DSparkModel``; DFlash block7 baselines: ``markov_rank`` 0): the
    DFlash backbone, its own ``embed_tokens`` / ``lm_head``, the Markov and confidence heads of ``dspark.py``;
    every ``block_size`` slot drafted, slot k predicting ``start + k + 1`` (DeepSpec ``qwen3/modeling.py``)."""

    _is_dspark_class = True

    def __init__(self, config: DFlashConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.markov_head, self.confidence_head = build_heads(config)
        self.post_init()

    propose, selector_inputs = dspark_propose, slot_inputs  # dspark.py: a block's draft; the loop's draft-pass seam

DFlashDraftModel._dspark_class = DSparkDraftModel


def _folder_is(names, cls, pretrained_model_name_or_path, kwargs) -> bool:
    """Whether ``names`` (``DFlashConfig.names_dflash2`` / ``names_dspark``) holds for the folder's config."""
    config = kwargs.get("config")
    if config is not None and not isinstance(config, (str, os.PathLike)):
        return bool(names(config.to_dict()))
    hub = {k: kwargs[k] for k in _HUB_KWARGS + ("subfolder",) if kwargs.get(k) is not None}
    return names(cls.config_class.get_config_dict(config or pretrained_model_name_or_path, **hub)[0])


DFlashConfig.register_for_auto_class()
DFlashDraftModel.register_for_auto_class("AutoModel")
DFlash2DraftModel.register_for_auto_class("AutoModel")
DSparkDraftModel.register_for_auto_class("AutoModel")

__all__ = ["DFlash2DraftModel", "DFlashDraftModel", "DSparkDraftModel", "DFlashPreTrainedModel", "DFlashConfig", "draft_block_embedding",
           "draft_logits", "selector_walk"]
