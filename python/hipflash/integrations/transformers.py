"""hipflash as a Hugging Face transformers attention implementation.

    import hipflash.integrations.transformers as hf
    name = hf.register()                       # "hipfa"
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=name)

register() adds `attention` to transformers' AttentionInterface and FlashAttention's mask
function under the same name to its AttentionMaskInterface, so that the layers get a 2-D padding
mask (or None) as transformers' own FlashAttention path does; it returns the name. The name has
no "flash" in it: transformers 5.x treats any such name as a FlashAttention build or hub kernel
to load. Layouts, masks and windows follow transformers' FlashAttention integration
(modeling_flash_attention_utils): a padding mask turns the batch into packed sequences (varlen),
left padding and generation with a KV cache included; sliding windows cover the last
`sliding_window` keys; GQA runs natively. Refused with NotImplementedError: attention dropout
during training, softcap (Gemma 2) and attention sinks, until hipflash has them (issue 42).
"""
import torch

import hipflash

NAME = "hipfa"

__all__ = ["NAME", "attention", "register"]


def register(name=NAME):
    """Registers hipflash with transformers under `name` and returns it (for
    attn_implementation=). Call it before from_pretrained."""
    if "flash" in name or "sdpa" in name or "flex_attention" in name or "/" in name:
        raise ValueError(f"{name!r}: transformers reserves names containing 'flash', 'sdpa', "
                         "'flex_attention' or '/' for its own attention paths")
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS["flash_attention_2"])
    return name


def _unpad(mask):
    """(flat row indices, cu_seqlens int32, max length) of a [batch, len] bool mask's True rows."""
    lens = mask.sum(dim=-1, dtype=torch.int32)
    idx = torch.nonzero(mask.flatten(), as_tuple=False).flatten()
    cu = torch.nn.functional.pad(torch.cumsum(lens, 0, dtype=torch.int32), (1, 0))
    return idx, cu, int(lens.max().item()) if lens.numel() else 0


def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
              sliding_window=None, softcap=None, is_causal=None, s_aux=None, **kwargs):
    """transformers' attention-function contract: query [batch, heads, q_len, head_dim], key and
    value [batch, kv_heads, kv_len, head_dim] (the cache's past included), attention_mask a 2-D
    [batch, kv_len] bool padding mask or None. Returns (out [batch, q_len, heads, head_dim],
    None)."""
    if dropout and module.training:
        raise NotImplementedError(f"hipflash: attention dropout ({dropout}) is not supported; "
                                  "set the config's attention_dropout to 0.0")
    if softcap:
        raise NotImplementedError("hipflash: attention softcap (attn_logit_softcapping) is not "
                                  "supported yet")
    if s_aux is not None:
        raise NotImplementedError("hipflash: attention sinks (s_aux) are not supported")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # [batch, len, heads, dim]
    batch, q_len, heads, dim = q.shape
    kv_len = k.shape[1]
    window = (-1, -1)
    if sliding_window is not None and kv_len > sliding_window:
        # The last `sliding_window` keys (transformers' kv_idx > q_idx - sliding_window).
        window = (sliding_window - 1, -1 if causal else sliding_window - 1)
    kw = dict(softmax_scale=scaling, causal=bool(causal), window_size=window)

    if attention_mask is None:
        return hipflash.flash_attn_func(q, k, v, **kw), None
    mask = attention_mask.to(torch.bool)
    if mask.shape[1] < kv_len:  # a static cache longer than the mask: its first positions
        k, v, kv_len = k[:, :mask.shape[1]], v[:, :mask.shape[1]], mask.shape[1]
    idx_k, cu_k, max_k = _unpad(mask)
    k_rows = k.reshape(batch * kv_len, *k.shape[2:]).index_select(0, idx_k)
    v_rows = v.reshape(batch * kv_len, *v.shape[2:]).index_select(0, idx_k)
    if q_len == kv_len:
        idx_q, cu_q, max_q = idx_k, cu_k, max_k
    elif q_len == 1:
        idx_q = torch.arange(batch, device=q.device)
        cu_q = torch.arange(batch + 1, dtype=torch.int32, device=q.device)
        max_q = 1
    else:  # new tokens after a left-padded past: the mask's last q_len columns
        idx_q, cu_q, max_q = _unpad(mask[:, -q_len:])
    q_rows = q.reshape(batch * q_len, heads, dim).index_select(0, idx_q)
    out_rows = hipflash.flash_attn_varlen_func(q_rows, k_rows, v_rows, cu_q, cu_k, max_q, max_k,
                                               **kw)
    out = out_rows.new_zeros(batch * q_len, heads, dim).index_copy(0, idx_q, out_rows)
    return out.view(batch, q_len, heads, dim), None
