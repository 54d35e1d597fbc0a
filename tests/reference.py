"""An independent, naive DFlash reference written from notes section 1 (no cache, recompute all).

It reads only the draft's raw state dict and config values, and the target through public
``output_hidden_states``; it never calls the project's modules, so a shared bug cannot hide.
"""

import torch


def _rms(x, w, eps):
    x32 = x.float()
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rope(x, pos, theta):
    """x (heads, n, d), pos (n,): rotate pairs (i, i + d/2) by pos * theta^(-2i/d)."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    ang = pos[:, None].float() * inv[None]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def target_features(target, ids, layer_ids):
    """(1, n, len(ids) * H): HF hidden_states[k + 1] for each captured layer k."""
    hs = target(ids, output_hidden_states=True).hidden_states
    return torch.cat([hs[k + 1] for k in layer_ids], dim=-1)


def draft_logits(sd, cfg, target, committed, block_len):
    """Draft logits (block_len - 1, V) for the block anchored at the last committed token.

    committed: (1, p + 1) tokens; the anchor is committed[:, p]; context = target features of
    positions 0..p-1 (strictly before the anchor).
    """
    p = committed.shape[1] - 1
    eps, d, theta = cfg["rms_norm_eps"], cfg["head_dim"], cfg["rope_theta"]
    n_heads, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    feats = target_features(target, committed[:, :p], cfg["target_layer_ids"])[0] if p else None
    ctx = _rms(feats @ sd["fc.weight"].T, sd["hidden_norm.weight"], eps) if p else torch.zeros(0, cfg["hidden_size"])
    emb = target.get_input_embeddings().weight
    block = [committed[0, p].item()] + [cfg["mask_token_id"]] * (block_len - 1)
    x = emb[block]  # (b, H)
    q_pos = torch.arange(p, p + block_len)
    k_pos = torch.arange(0, p + block_len)
    for i in range(cfg["num_hidden_layers"]):
        pre = f"layers.{i}."
        sliding = cfg["layer_types"][i] == "sliding_attention"
        causal = cfg.get("is_causal") if cfg.get("is_causal") is not None else sliding
        h = _rms(x, sd[pre + "input_layernorm.weight"], eps)
        kv_in = torch.cat([ctx, h], 0)
        q = (h @ sd[pre + "self_attn.q_proj.weight"].T).view(block_len, n_heads, d).transpose(0, 1)
        k = (kv_in @ sd[pre + "self_attn.k_proj.weight"].T).view(-1, n_kv, d).transpose(0, 1)
        v = (kv_in @ sd[pre + "self_attn.v_proj.weight"].T).view(-1, n_kv, d).transpose(0, 1)
        q = _rope(_rms(q, sd[pre + "self_attn.q_norm.weight"], eps), q_pos, theta)
        k = _rope(_rms(k, sd[pre + "self_attn.k_norm.weight"], eps), k_pos, theta)
        rep = n_heads // n_kv
        k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
        att = (q @ k.transpose(1, 2)) / d**0.5  # (heads, b, p + b)
        allowed = torch.ones(block_len, p + block_len, dtype=torch.bool)
        if causal:
            allowed &= k_pos[None] <= q_pos[:, None]
        if sliding:
            allowed &= q_pos[:, None] - k_pos[None] < cfg["sliding_window"]
        att = att.masked_fill(~allowed, float("-inf")).softmax(-1)
        o = (att @ v).transpose(0, 1).reshape(block_len, -1) @ sd[pre + "self_attn.o_proj.weight"].T
        x = x + o
        h = _rms(x, sd[pre + "post_attention_layernorm.weight"], eps)
        gate, up = h @ sd[pre + "mlp.gate_proj.weight"].T, h @ sd[pre + "mlp.up_proj.weight"].T
        x = x + (torch.nn.functional.silu(gate) * up) @ sd[pre + "mlp.down_proj.weight"].T
    x = _rms(x, sd["norm.weight"], eps)
    return target.get_output_embeddings()(x[1:])


@torch.no_grad()
def reference_spec_generate(draft, target, input_ids, max_new_tokens, block_size):
    """Greedy speculative decoding recomputed from scratch every step. Returns (tokens, acceptance)."""
    sd = {k: v.float() for k, v in draft.state_dict().items()}
    cfg = draft.config.to_dict()
    committed = torch.cat([input_ids, target(input_ids).logits[:, -1:].argmax(-1)], dim=1)
    prompt_len, acceptance = input_ids.shape[1], []
    while committed.shape[1] - prompt_len < max_new_tokens:
        b = min(block_size, max_new_tokens - (committed.shape[1] - prompt_len))
        drafts = draft_logits(sd, cfg, target, committed, b).argmax(-1)[None] if b > 1 else committed[:, :0]
        verify = target(torch.cat([committed, drafts], 1)).logits[0, -b:].argmax(-1)
        a = 0
        while a < b - 1 and drafts[0, a] == verify[a]:
            a += 1
        committed = torch.cat([committed, drafts[:, :a], verify[None, a : a + 1]], 1)
        acceptance.append(a + 1)
    return committed, acceptance
