"""hipflash as a Hugging Face transformers attention implementation.

    import hipflash.integrations.transformers as hf
    name = hf.register()                       # "hipfa"
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=name)

register() adds `attention` to transformers' AttentionInterface and FlashAttention's mask
function under the same name to its AttentionMaskInterface, so that the layers get a 2-D padding
mask (or None) as transformers' own FlashAttention path does; it returns the name. The name has
no "flash" in it: transformers 5.x treats any such name as a FlashAttention build or hub kernel
to load. Layouts, masks and windows follow transformers' FlashAttention integration
(modeling_flash_attention_utils): each generation step of a left-padded batch reads the KV
cache in place (FlashAttention's cache_leftpad; CPU tensors and NVIDIA GPUs); other padded
calls (prefill, other masks, autograd) turn the batch into packed sequences (varlen); padding-free
(packed) batches run each document on its own, over the batch's rows taken in order; a call's
`deterministic` (else FLASH_ATTENTION_DETERMINISTIC=1) makes the gradients bitwise repeatable, as
transformers asks of FlashAttention; sliding windows cover the last `sliding_window`
keys; GQA runs natively; fp32 inputs run in the 16-bit dtype transformers' FlashAttention path
picks (the autocast dtype, a quantized model's, the layer's weights'; else bfloat16). Gemma 2's
logit softcapping and gpt-oss's attention sinks (s_aux: hipflash's `sinks`) run on CPU tensors
and NVIDIA GPUs, forward and backward. Refused with NotImplementedError: attention dropout
during training.
"""
import os

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


def _autocast_dtype(device_type):
    """The autocast dtype when autocast is on for the device type, else None."""
    if device_type == "cuda" and torch.is_autocast_enabled():
        get = getattr(torch, "get_autocast_dtype", None)
        return get("cuda") if get else torch.get_autocast_gpu_dtype()
    return None


def _target_dtype(module, device_type):
    """The 16-bit dtype fp32 inputs run in, as transformers' FlashAttention path picks it (fp32
    layer norms hand the attention fp32 states): the autocast dtype, else a quantized model's
    original dtype, else the layer's first Linear's weight dtype; bfloat16 where that is not a
    16-bit dtype (transformers would pass fp32 on, which FlashAttention refuses)."""
    target = _autocast_dtype(device_type)
    if target is None:
        target = getattr(getattr(module, "config", None), "_pre_quantization_dtype", None)
    if target is None and isinstance(module, torch.nn.Module):
        linear = next((m for m in module.modules() if isinstance(m, torch.nn.Linear)), None)
        target = linear.weight.dtype if linear is not None else None
    return target if target in (torch.float16, torch.bfloat16) else torch.bfloat16


def _packed_bounds(position_ids, length):
    """cu_seqlens of a padding-free batch (batch 1, positions restarting at 0 at each
    document), or None when the positions do not restart (transformers' _is_packed_sequence)."""
    if position_ids is None or position_ids.dim() != 2 or position_ids.shape[0] != 1 or \
            position_ids.shape[1] != length:
        return None
    pos = position_ids[0]
    if bool((pos[1:] >= pos[:-1]).all()):
        return None
    starts = torch.nonzero(pos == 0, as_tuple=False).flatten().to(torch.int32)
    if starts.numel() == 0 or int(starts[0]) != 0:
        raise ValueError("packed position_ids must start each document at 0")
    cu = torch.cat([starts, torch.tensor([length], dtype=torch.int32, device=pos.device)])
    return cu, int((cu[1:] - cu[:-1]).max())


def _left_pads(mask):
    """Each row's count of leading False positions (int32), when every row of the [batch, len]
    bool mask is False then True (left padding, what generation batches are); else None."""
    pads = mask.shape[1] - mask.sum(dim=-1, dtype=torch.int32)
    left = torch.arange(mask.shape[1], device=mask.device) >= pads[:, None]
    return pads if bool(torch.equal(mask, left)) else None


# One forward step's layers share its mask (the same tensor): what they derive from it is made
# once per step. [mask, its version, {what: value}].
_last_mask = [None, None, {}]


def _of_step(attention_mask, what, make):
    """make(), once per step: the value the step's first layer made for `what`."""
    mask, version, memo = _last_mask
    if mask is not attention_mask or version != attention_mask._version:
        memo = {}
        _last_mask[:] = attention_mask, attention_mask._version, memo
    if what not in memo:
        memo[what] = make()
    return memo[what]


def _left_pads_of_step(attention_mask):
    """_left_pads of the step's mask, on the host: the mask is copied back once per step (the one
    wait for the GPU a decode step makes), and the pads, a CPU tensor, let the kvcache call check
    them without waiting."""
    return _of_step(attention_mask, "pads",
                    lambda: _left_pads(attention_mask.to("cpu", torch.bool)))


def _lengths_of_step(attention_mask, pads, kv_len, device):
    """The kvcache read's lengths for the step's layers with kv_len cached keys: (cache_seqlens,
    their host values, cache_leftpad, its host values), the device tensors made once per step
    from the host values (the layers' calls then upload nothing and wait for nothing)."""
    return _of_step(attention_mask, ("lengths", kv_len, device),
                    lambda: hipflash._held_lengths(kv_len, len(pads), device)
                    + hipflash._held_upload(pads, device))


def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
              sliding_window=None, softcap=None, is_causal=None, s_aux=None, **kwargs):
    """transformers' attention-function contract: query [batch, heads, q_len, head_dim], key and
    value [batch, kv_heads, kv_len, head_dim] (the cache's past included), attention_mask a 2-D
    [batch, kv_len] bool padding mask or None. Padding-free (packed) batches come as
    cu_seq_lens_q / _k and max_length_q / _k, or as position_ids restarting per document.
    Returns (out [batch, q_len, heads, head_dim] in query's dtype, None)."""
    if dropout and module.training:
        raise NotImplementedError(f"hipflash: attention dropout ({dropout}) is not supported; "
                                  "set the config's attention_dropout to 0.0")
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ValueError(f"hipflash: expected a 2-D [batch, kv_len] padding mask, got shape "
                         f"{tuple(attention_mask.shape)}: register() the implementation (it "
                         "registers FlashAttention's mask function beside it)")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    dtype = query.dtype
    if dtype not in (torch.float16, torch.bfloat16):
        target = _target_dtype(module, query.device.type)
        query, key, value = (t.to(target) for t in (query, key, value))
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # [batch, len, heads, dim]
    batch, q_len, heads, dim = q.shape
    kv_len = k.shape[1]
    window = (-1, -1)
    if sliding_window is not None and kv_len > sliding_window:
        # The last `sliding_window` keys (transformers' kv_idx > q_idx - sliding_window).
        window = (sliding_window - 1, -1 if causal else sliding_window - 1)
    # Bitwise-repeatable gradients as transformers asks FlashAttention for them: the call's
    # `deterministic`, else FLASH_ATTENTION_DETERMINISTIC=1 (_process_flash_attention_kwargs).
    deterministic = kwargs.get("deterministic")
    if deterministic is None:
        deterministic = os.environ.get("FLASH_ATTENTION_DETERMINISTIC", "0") == "1"
    # Gemma 2's attn_logit_softcapping.
    kw = dict(softmax_scale=scaling, causal=bool(causal), window_size=window,
              softcap=float(softcap or 0.0), deterministic=bool(deterministic))

    # gpt-oss's attention sinks: a logit per query head (hipflash's `sinks`).
    if s_aux is not None:
        kw["sinks"] = s_aux

    def done(out):
        return out.to(dtype), None

    # Padding-free batches: the documents' bounds over the batch's rows taken in order (the
    # four varlen arguments all given, as transformers requires), or one row's documents from
    # its restarting position_ids.
    varlen = [kwargs.get(n) for n in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q",
                                      "max_length_k")]
    packed = None
    if attention_mask is None and all(a is not None for a in varlen):
        packed = (varlen[0].to(torch.int32), varlen[1].to(torch.int32), int(varlen[2]),
                  int(varlen[3]))
    elif attention_mask is None and batch == 1 and q_len == kv_len:
        bounds = _packed_bounds(kwargs.get("position_ids"), q_len)
        if bounds is not None:
            packed = (bounds[0], bounds[0], bounds[1], bounds[1])
    if packed is not None:  # each document on its own
        out = hipflash.flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1),
                                              *packed, **kw)
        return done(out.view(batch, q_len, heads, out.shape[-1]))
    if attention_mask is None:
        return done(hipflash.flash_attn_func(q, k, v, **kw))
    if attention_mask.shape[1] < kv_len:  # a static cache longer than the mask: its first rows
        kv_len = attention_mask.shape[1]
        k, v = k[:, :kv_len], v[:, :kv_len]
    no_grad = not hipflash._wants_grad(q, k, v, *([s_aux] if s_aux is not None else []))
    if causal and q_len < kv_len and torch.version.hip is None and no_grad:
        # A generation step against the cache, left-padded: read in place from each sequence's
        # pad by the decode kernels (the varlen path below would copy every cached row out, per
        # layer and step). Prefill (q_len == kv_len) keeps the varlen path: its copies are
        # linear in the length, the attention quadratic, and the dense-query kernels run it.
        # AMD GPUs read no KV cache yet.
        pads = _left_pads_of_step(attention_mask)
        if pads is not None:
            lengths = _lengths_of_step(attention_mask, pads, kv_len, q.device)
            read_kw = {n: a for n, a in kw.items() if n != "deterministic"}  # no gradients
            return done(hipflash._kvcache_read(q, k, v, *lengths, **read_kw))
    # The packed rows' indices and bounds: once per step (_unpad waits for the GPU).
    idx_k, cu_k, max_k = _of_step(attention_mask, "unpad",
                                  lambda: _unpad(attention_mask.to(torch.bool)))
    k_rows = k.reshape(batch * kv_len, *k.shape[2:]).index_select(0, idx_k)
    v_rows = v.reshape(batch * kv_len, *v.shape[2:]).index_select(0, idx_k)
    if q_len == kv_len:
        idx_q, cu_q, max_q = idx_k, cu_k, max_k
    elif q_len == 1:
        idx_q = torch.arange(batch, device=q.device)
        cu_q = torch.arange(batch + 1, dtype=torch.int32, device=q.device)
        max_q = 1
    else:  # new tokens after a left-padded past: the mask's last q_len columns
        idx_q, cu_q, max_q = _of_step(attention_mask, ("unpad_q", q_len),
                                      lambda: _unpad(attention_mask[:, -q_len:].to(torch.bool)))
    q_rows = q.reshape(batch * q_len, heads, dim).index_select(0, idx_q)
    out_rows = hipflash.flash_attn_varlen_func(q_rows, k_rows, v_rows, cu_q, cu_k, max_q, max_k,
                                               **kw)
    out = out_rows.new_zeros(batch * q_len, heads, dim).index_copy(0, idx_q, out_rows)
    return done(out.view(batch, q_len, heads, dim))
