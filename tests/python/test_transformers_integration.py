"""hipflash.integrations.transformers: the attention function against the reference of SPEC §3 in
transformers' calling convention (left-padded batches through the varlen path, generation steps
against a cache, sliding windows, GQA) — on the CPU in CI — and, where transformers is installed,
tiny random Llama, Mistral, Qwen 2 and Gemma 2 models through attn_implementation against
transformers' eager attention."""
import importlib.util

import pytest
import torch

import hipflash
from hipflash.integrations import transformers as hf
from reference import attention_ref, check_out

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() and hipflash.gpu_available() else [])
HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None


class _Layer(torch.nn.Module):
    is_causal = True


def _case(device, batch, q_len, kv_len, hq, hkv, d, pads, seed=0):
    """transformers-layout q [B, Hq, q_len, D], k / v [B, Hkv, kv_len, D] and a left-padding mask
    [B, kv_len] (pads[b] leading positions False)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, hq, q_len, d, generator=g).to(torch.bfloat16).to(device)
    k = torch.randn(batch, hkv, kv_len, d, generator=g).to(torch.bfloat16).to(device)
    v = torch.randn(batch, hkv, kv_len, d, generator=g).to(torch.bfloat16).to(device)
    mask = torch.ones(batch, kv_len, dtype=torch.bool)
    for b, n in enumerate(pads):
        mask[b, :n] = False
    return q, k, v, mask.to(device)


def _check(out, q, k, v, mask, sliding_window=None):
    """Each sequence's valid query rows against the reference on its valid keys (bottom-right
    causal, as transformers' FlashAttention path); padded query rows are zero."""
    q_len, kv_len = q.shape[2], k.shape[2]
    for b in range(q.shape[0]):
        keys = mask[b].nonzero().flatten()
        rows = (mask[b, -q_len:] if q_len > 1 else mask[b, -1:]).nonzero().flatten()
        if rows.numel() == 0:
            continue
        qb = q[b].transpose(0, 1)[rows][None]
        kb, vb = (t[b].transpose(0, 1)[keys][None] for t in (k, v))
        window = (-1, -1)
        if sliding_window is not None and kv_len > sliding_window:
            window = (sliding_window - 1, 0)
        ref, _ = attention_ref(qb, kb, vb, causal=True, window_size=window)
        lp, _ = attention_ref(qb, kb, vb, causal=True, window_size=window, lowp=True)
        check_out(out[b, rows][None], ref, lp, f"sequence {b}")
        pad_rows = (~mask[b, -q_len:]).nonzero().flatten() if q_len > 1 else []
        for r in pad_rows:
            assert torch.count_nonzero(out[b, r]) == 0, f"sequence {b}: padded row {r} not zero"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("q_len, kv_len, pads", [
    (20, 20, (0, 5, 11)),      # prefill, left padding
    (1, 33, (0, 7, 20)),       # a generation step against the cache
    (4, 30, (2, 0, 9)),        # a few new tokens after a padded past
])
@pytest.mark.parametrize("grad", [False, True], ids=["inference", "autograd"])
def test_left_padded_batches(device, q_len, kv_len, pads, grad):
    # Generation steps read the cache in place from each sequence's pad (cache_leftpad); the
    # prefill and calls under autograd pack the batch (varlen). All give the reference on every
    # sequence.
    q, k, v, mask = _case(device, 3, q_len, kv_len, 4, 2, 64, pads)
    q.requires_grad_(grad)
    out, weights = hf.attention(_Layer(), q, k, v, mask, scaling=64 ** -0.5)
    assert weights is None and out.shape == (3, q_len, 4, 64)
    _check(out.detach(), q.detach(), k, v, mask)


@pytest.mark.parametrize("device", DEVICES)
def test_right_and_inner_padding_take_the_varlen_path(device):
    q, k, v, mask = _case(device, 3, 12, 12, 4, 2, 64, (0, 0, 0))
    mask[0, 9:] = False      # right padding
    mask[1, 3:5] = False     # a hole
    assert hf._left_pads(mask) is None
    out, _ = hf.attention(_Layer(), q, k, v, mask, scaling=64 ** -0.5)
    for b in range(3):  # each sequence's valid rows against the reference on its valid keys
        rows = mask[b].nonzero().flatten()
        sub = [t[b:b + 1, :, rows] for t in (q, k, v)]
        _check(out[b:b + 1, rows], *sub, torch.ones(1, rows.numel(), dtype=torch.bool,
                                                     device=device))


@pytest.mark.parametrize("device", DEVICES)
def test_no_mask_is_the_dense_call(device):
    q, k, v, mask = _case(device, 2, 16, 16, 4, 4, 64, (0, 0))
    out, _ = hf.attention(_Layer(), q, k, v, None, scaling=64 ** -0.5)
    want = hipflash.flash_attn_func(*(t.transpose(1, 2) for t in (q, k, v)), causal=True)
    assert torch.equal(out, want)
    _check(out, q, k, v, mask)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("masked", [False, True])
def test_sliding_window_covers_the_last_keys(device, masked):
    q, k, v, mask = _case(device, 2, 24, 24, 2, 1, 64, (0, 6))
    out, _ = hf.attention(_Layer(), q, k, v, mask if masked else None, scaling=64 ** -0.5,
                          sliding_window=8)
    _check(out, q, k, v, mask if masked else torch.ones_like(mask), sliding_window=8)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("via", ["position_ids", "cu_seq_lens"])
def test_padding_free_batches_keep_documents_apart(device, via):
    # One row of three documents (lengths 5, 8, 3): each attends only to itself.
    lens = [5, 8, 3]
    q, k, v, _ = _case(device, 1, 16, 16, 4, 2, 64, (0,))
    pos = torch.cat([torch.arange(n) for n in lens])[None].to(device)
    cu = torch.tensor([0, 5, 13, 16], dtype=torch.int32, device=device)
    kw = dict(position_ids=pos) if via == "position_ids" else dict(
        cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=8, max_length_k=8)
    out, _ = hf.attention(_Layer(), q, k, v, None, scaling=64 ** -0.5, **kw)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        doc = [t[:, :, a:b] for t in (q, k, v)]
        mask = torch.ones(1, b - a, dtype=torch.bool, device=device)
        _check(out[:, a:b], *doc, mask)


@pytest.mark.parametrize("device", DEVICES)
def test_padding_free_batches_of_several_rows(device):
    # transformers flattens the batch's rows before the varlen call: the bounds count tokens
    # over both rows, and a document may run from one row into the next.
    q, k, v, _ = _case(device, 2, 8, 8, 4, 2, 64, (0, 0))
    cu = torch.tensor([0, 5, 11, 16], dtype=torch.int32, device=device)
    out, _ = hf.attention(_Layer(), q, k, v, None, scaling=64 ** -0.5, cu_seq_lens_q=cu,
                          cu_seq_lens_k=cu, max_length_q=6, max_length_k=6)
    assert out.shape == (2, 8, 4, 64)
    rows = lambda t: t.transpose(1, 2).flatten(0, 1)  # noqa: E731  [2 * 8, heads, dim]
    flat = [rows(t).transpose(0, 1)[None] for t in (q, k, v)]  # [1, heads, 16, dim]
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        doc = [t[:, :, a:b] for t in flat]
        mask = torch.ones(1, b - a, dtype=torch.bool, device=device)
        _check(out.flatten(0, 1)[None, a:b], *doc, mask)


def test_incomplete_varlen_arguments_are_not_a_packed_batch():
    # transformers packs only when all four varlen arguments are given; so does the integration.
    q, k, v, _ = _case("cpu", 1, 8, 8, 2, 2, 64, (0,))
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    out, _ = hf.attention(_Layer(), q, k, v, None, scaling=64 ** -0.5, cu_seq_lens_q=cu,
                          cu_seq_lens_k=cu)
    want, _ = hf.attention(_Layer(), q, k, v, None, scaling=64 ** -0.5)
    assert torch.equal(out, want)


@pytest.mark.parametrize("how", ["argument", "environment", "default"])
def test_deterministic_reaches_the_call(monkeypatch, how):
    # transformers' `deterministic` (the call's, else FLASH_ATTENTION_DETERMINISTIC=1) asks
    # FlashAttention for bitwise-repeatable gradients: the integration passes it on.
    seen = []

    def spy(*args, **kw):
        seen.append(kw["deterministic"])
        return real(*args, **kw)

    real = hipflash.flash_attn_func
    monkeypatch.setattr(hipflash, "flash_attn_func", spy)
    monkeypatch.delenv("FLASH_ATTENTION_DETERMINISTIC", raising=False)
    kw = {}
    if how == "argument":
        kw["deterministic"] = True
    elif how == "environment":
        monkeypatch.setenv("FLASH_ATTENTION_DETERMINISTIC", "1")
    q, k, v, _ = _case("cpu", 1, 4, 4, 2, 2, 64, (0,))
    hf.attention(_Layer(), q.requires_grad_(), k, v, None, scaling=64 ** -0.5, **kw)
    assert seen == [how != "default"]


def test_fp32_inputs_run_in_the_layers_weight_dtype():
    # transformers' FlashAttention path: fp32 states (from fp32 layer norms) run in the dtype of
    # the layer's first Linear, here float16.
    q, k, v, mask = _case("cpu", 2, 8, 8, 2, 2, 64, (0, 3))
    layer = _Layer()
    layer.proj = torch.nn.Linear(4, 4).half()
    out, _ = hf.attention(layer, q.float(), k.float(), v.float(), mask, scaling=64 ** -0.5)
    want, _ = hf.attention(_Layer(), *(t.float().half() for t in (q, k, v)), mask,
                           scaling=64 ** -0.5)
    assert out.dtype == torch.float32 and torch.equal(out, want.float())


def test_fp32_inputs_run_in_bf16_and_come_back_fp32():
    q, k, v, mask = _case("cpu", 2, 8, 8, 2, 2, 64, (0, 3))
    out, _ = hf.attention(_Layer(), q.float(), k.float(), v.float(), mask, scaling=64 ** -0.5)
    want, _ = hf.attention(_Layer(), q, k, v, mask, scaling=64 ** -0.5)
    assert out.dtype == torch.float32 and torch.equal(out, want.float())


def test_a_4d_mask_is_refused_with_a_clear_error():
    q, k, v, _ = _case("cpu", 1, 4, 4, 2, 2, 64, (0,))
    with pytest.raises(ValueError, match="2-D"):
        hf.attention(_Layer(), q, k, v, torch.ones(1, 1, 4, 4, dtype=torch.bool))


def test_refuses_what_hipflash_lacks():
    q, k, v, mask = _case("cpu", 1, 4, 4, 2, 2, 64, (0,))
    layer = _Layer().train()
    with pytest.raises(NotImplementedError, match="dropout"):
        hf.attention(layer, q, k, v, mask, dropout=0.1)


def _sinks_ref(q, k, v, mask, sinks, scale):
    """gpt-oss's eager attention with sinks, fp32: each row's causal softmax over its valid keys
    and a sink logit per head (attending to nothing). q [B, H, Sq, D], k / v [B, Hkv, Sk, D],
    mask [B, Sk] (True: a key), bottom-right causal."""
    q, k, v = q.float(), k.float(), v.float()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = q @ k.transpose(-1, -2) * scale
    sq, sk = s.shape[-2:]
    causal = torch.arange(sk)[None, :] <= torch.arange(sq)[:, None] + (sk - sq)
    s = s.masked_fill(~(causal[None, None] & mask[:, None, None, :].cpu()).to(s.device),
                      float("-inf"))
    logits = torch.cat([s, sinks.float().view(1, -1, 1, 1).expand(*s.shape[:3], 1)], -1)
    p = torch.softmax(logits, -1)[..., :-1]
    return (p @ v).transpose(1, 2)  # [B, Sq, H, D]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("q_len, kv_len, pads, masked", [
    (12, 12, (0, 0), False),   # dense
    (12, 12, (0, 5), True),    # padded prefill (varlen)
    (1, 20, (0, 7), True),     # a generation step against the cache
    (3, 20, (2, 0), True),     # new tokens after a padded past (varlen)
])
@pytest.mark.parametrize("grad", [False, True], ids=["inference", "autograd"])
def test_attention_sinks(device, q_len, kv_len, pads, masked, grad):
    # gpt-oss's s_aux: a sink logit per query head in every row's softmax (hipflash's sinks),
    # on every path of the integration; under autograd the sinks' gradient too.
    q, k, v, mask = _case(device, 2, q_len, kv_len, 4, 2, 64, pads)
    sinks = torch.tensor([-1.0, 0.5, 2.0, 8.0], device=device, requires_grad=grad)
    q.requires_grad_(grad)
    with torch.set_grad_enabled(grad):
        out, _ = hf.attention(_Layer(), q, k, v, mask if masked else None, scaling=64 ** -0.5,
                              s_aux=sinks)
    ref_sinks = sinks.detach().clone().requires_grad_(grad)
    with torch.set_grad_enabled(grad):
        want = _sinks_ref(q.detach(), k, v, mask, ref_sinks, 64 ** -0.5)
    rows = mask[:, -q_len:] if q_len > 1 else torch.ones(2, 1, dtype=torch.bool, device=device)
    err = (out.detach().float() - want.detach())[rows].abs().max().item()
    assert err < 2e-2, err
    if grad:  # the padded rows' outputs are not the model's: only the valid ones' loss
        out.float()[rows].sum().backward()
        want[rows].sum().backward()
        torch.testing.assert_close(sinks.grad, ref_sinks.grad, rtol=2e-2, atol=2e-2)


def test_register_refuses_names_transformers_reserves():
    with pytest.raises(ValueError, match="flash"):
        hf.register("hipflash")


# Model families with what each adds: Mistral a sliding window, Qwen 2 biased projections,
# Gemma 2 alternating sliding / global layers, logit softcapping and a head dim of its own,
# gpt-oss attention sinks (and a mixture of experts, kept small).
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 16}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               {"sliding_window": 16, "attn_logit_softcapping": 50.0, "head_dim": 64,
                "query_pre_attn_scalar": 64, "final_logit_softcapping": None}),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",
                {"sliding_window": 16, "head_dim": 64, "num_local_experts": 4,
                 "num_experts_per_tok": 2}),
}


def model_level(test):
    """A model-level test: every family on every device, where transformers is installed."""
    for mark in (pytest.mark.parametrize("device", DEVICES),
                 pytest.mark.parametrize("family", list(FAMILIES)),
                 pytest.mark.skipif(not HAS_TRANSFORMERS, reason="transformers is not installed "
                                    "here (it is on the GPU machine: scripts/gpu-check test runs "
                                    "this)")):
        test = mark(test)
    return test


def _tiny(family):
    """(model class, config) of a tiny random model of the family (2 layers, hidden 256, GQA
    4 / 2); the test skips where this transformers lacks the family."""
    import transformers
    cfg_name, model_name, extra = FAMILIES[family]
    if not hasattr(transformers, model_name):
        pytest.skip(f"this transformers ({transformers.__version__}) has no {model_name}")
    cfg = getattr(transformers, cfg_name)(
        vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, **extra)
    return getattr(transformers, model_name), cfg


@model_level
def test_tiny_models_match_eager(device, family):
    # A tiny random model of each family through attn_implementation against transformers' own
    # eager attention (the one every feature of these families runs on: Gemma 2's softcap too),
    # on a left-padded batch longer than the sliding windows, then greedy generation.
    model_cls, cfg = _tiny(family)
    name = hf.register()
    assert name == hf.NAME
    torch.manual_seed(0)
    ref_model = model_cls._from_config(cfg, attn_implementation="eager").to(device, torch.bfloat16)
    ours = model_cls._from_config(cfg, attn_implementation=name)
    ours.load_state_dict(ref_model.state_dict())
    ours, ref_model = ours.to(device, torch.bfloat16).eval(), ref_model.eval()
    ids = torch.randint(0, 128, (2, 24), device=device)
    mask = torch.ones_like(ids)
    mask[1, :7] = 0  # left padding
    with torch.no_grad():
        a = ours(input_ids=ids, attention_mask=mask).logits
        b = ref_model(input_ids=ids, attention_mask=mask).logits
    valid = mask.bool()
    assert (a[valid].float() - b[valid].float()).abs().max().item() < 0.1, family
    gen_a = ours.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    gen_b = ref_model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    assert gen_a.shape == gen_b.shape


def _teacher_forced_logits(model, ids, mask, steps):
    """The logits of batched, left-padded generation with a KV cache: the prompt's at its
    non-padded positions, then one row per sequence for each of `steps` decoding steps fed the
    given tokens (ids[:, -steps:] after the prompt), as generate() calls the model."""
    prompt, forced = ids[:, :-steps], ids[:, -steps:]
    mask = mask.clone()
    with torch.no_grad():
        out = model(input_ids=prompt, attention_mask=mask,
                    position_ids=(mask.cumsum(-1) - 1).clamp(min=0), use_cache=True)
        logits = [out.logits[mask.bool()].float()]
        past = out.past_key_values
        for t in range(steps):
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            out = model(input_ids=forced[:, t:t + 1], attention_mask=mask,
                        position_ids=mask.sum(-1, keepdim=True) - 1, past_key_values=past,
                        use_cache=True)
            logits.append(out.logits[:, -1].float())
            past = out.past_key_values
    return torch.cat(logits)


@model_level
def test_generation_error_within_one_percent_of_sdpa(device, family):
    # Issue 42's rule: a bf16 model with hipflash's attention, against the same weights in
    # fp32, errs on the logits of batched, left-padded generation (prefill and 8 steps against
    # the cache) by at most SDPA's mean error + 1%.
    model_cls, cfg = _tiny(family)
    name = hf.register()
    torch.manual_seed(0)
    models = {}
    for impl, dtype in (("eager", torch.float32), ("sdpa", torch.bfloat16), (name, torch.bfloat16)):
        m = model_cls._from_config(cfg, attn_implementation=impl)
        if models:
            m.load_state_dict(models["eager"].state_dict())
        else:  # the reference holds the bf16 weights, widened
            m = m.to(torch.bfloat16).float()
        models[impl] = m.to(device, dtype).eval()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 128, (4, 40), generator=g).to(device)
    mask = torch.ones(4, 32, dtype=torch.long, device=device)
    for b, pad in enumerate((0, 5, 13, 21)):  # left padding, past Mistral's / Gemma 2's window
        mask[b, :pad] = 0
    ref = _teacher_forced_logits(models["eager"], ids, mask, 8)
    err = {impl: (_teacher_forced_logits(models[impl], ids, mask, 8) - ref).abs().mean().item()
           for impl in ("sdpa", name)}
    assert err[name] <= 1.01 * err["sdpa"], f"{family}: {err}"


def test_left_pads_are_computed_once_per_step_and_follow_in_place_changes():
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    first = hf._left_pads_of_step(mask)
    assert first.tolist() == [2, 0] and hf._left_pads_of_step(mask) is first  # the next layer
    mask[1, 0] = 0  # changed in place (a new step's mask may reuse the tensor)
    assert hf._left_pads_of_step(mask).tolist() == [2, 1]
    assert hf._left_pads_of_step(torch.tensor([[1, 0, 1, 1]])) is None  # not left padding
    # The varlen path's packed-row indices: made by the step's first layer, reused by the next.
    q, k, v, mask = _case("cpu", 3, 6, 6, 4, 2, 64, [2, 0, 5])
    first, _ = hf.attention(_Layer(), q, k, v, mask, scaling=64 ** -0.5)
    unpad = hf._last_mask[2]["unpad"]
    second, _ = hf.attention(_Layer(), q, k, v, mask, scaling=64 ** -0.5)
    assert hf._last_mask[2]["unpad"] is unpad and torch.equal(first, second)
