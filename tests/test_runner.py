"""The block-masked runner against references: HF generate on the same weights, HF generate on
a copy with the masked blocks physically removed, and each sequence run alone."""

from __future__ import annotations

import copy

import pytest
import torch

from server.engine import LLMEngine, Request
from server.runner import BlockRunner
from server.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=16, temperature=0)


@pytest.fixture(params=["fused", "eager"])
def fused(request):
    """Both cached paths: the fused CPU blocks (the float32 CPU default) and the eager ops."""
    from server import cpu_kernels

    if request.param == "fused" and not cpu_kernels.available():
        pytest.skip("igserve's CPU kernels are not available here")
    return request.param == "fused"


class _ZeroAttention(torch.nn.Module):
    def forward(self, hidden_states, *args, **kwargs):
        return torch.zeros_like(hidden_states), None


class _ZeroMLP(torch.nn.Module):
    def forward(self, x):
        return torch.zeros_like(x)


def remove_blocks(model, mask: torch.Tensor):
    """A copy of the HF model without the masked blocks: whole layers are deleted, a lone
    attention or FFN block is replaced by a zero branch (identity on the residual stream)."""
    pruned = copy.deepcopy(model)
    kept_layers = []
    for i, layer in enumerate(pruned.model.layers):
        keep_attn, keep_ffn = bool(mask[2 * i]), bool(mask[2 * i + 1])
        if not (keep_attn or keep_ffn):
            continue
        if not keep_attn:
            layer.self_attn = _ZeroAttention()
        if not keep_ffn:
            layer.mlp = _ZeroMLP()
        kept_layers.append(layer)
    pruned.model.layers = torch.nn.ModuleList(kept_layers)
    pruned.config.num_hidden_layers = len(kept_layers)
    if getattr(pruned.config, "layer_types", None):
        pruned.config.layer_types = pruned.config.layer_types[: len(kept_layers)]
    return pruned


def hf_greedy(model, prompt: list[int], n: int, use_cache: bool = True) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, use_cache=use_cache,
                         attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


def engine_greedy(lm, prompts, masks, max_tokens=16, max_batch=8, fused=None):
    runner = BlockRunner(lm.model, max_batch=max_batch, max_len=256, fused=fused)
    engine = LLMEngine(runner, lm.tokenizer)
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    reqs = engine.generate([Request(list(p), m, params) for p, m in zip(prompts, masks)])
    return [r.output_ids for r in reqs]


def random_prompts(n, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 49152, (length,), generator=g).tolist() for length in lengths[:n]]


def masks_for(num_blocks):
    """Masks that drop: one attention block, one FFN block, whole layers, and a 25% mix."""
    dense = torch.ones(num_blocks, dtype=torch.bool)
    out = {}
    m = dense.clone(); m[0] = False; out["attn_0"] = m
    m = dense.clone(); m[3] = False; out["ffn_1"] = m
    m = dense.clone(); m[0:2] = False; out["layer_0"] = m
    m = dense.clone(); m[2:6] = False; out["layers_1_2"] = m
    m = dense.clone(); m[[1, 4]] = False; out["mixed"] = m
    return out


# ---------------------------------------------------------------------------- dense == HF generate
def test_dense_matches_hf_generate_tiny(tiny, fused):
    prompts = random_prompts(3, [5, 17, 40])
    dense = torch.ones(2 * tiny.model.config.num_hidden_layers, dtype=torch.bool)
    ours = engine_greedy(tiny, prompts, [dense] * 3, fused=fused)
    for prompt, got in zip(prompts, ours):
        assert got == hf_greedy(tiny.model, prompt, 16)


@pytest.mark.real_model
def test_dense_matches_hf_generate_real_model(real):
    tok = real.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": "Write a long story about a dragon."}],
                                   add_generation_prompt=True, tokenize=False)
    prompt = tok(text, add_special_tokens=False)["input_ids"]
    dense = torch.ones(60, dtype=torch.bool)
    ours = engine_greedy(real, [prompt], [dense])[0]
    ref = hf_greedy(real.model, prompt, 16)
    assert len(ref) == 16
    assert ours == ref


# ---------------------------------------------------------------------------- masked == blocks removed
@pytest.mark.parametrize("name", list(masks_for(8)))
def test_mask_matches_physically_removed_tiny(tiny, name, fused):
    mask = masks_for(8)[name]
    prompts = random_prompts(2, [7, 23], seed=1)
    pruned = remove_blocks(tiny.model, mask)
    ours = engine_greedy(tiny, prompts, [mask] * 2, fused=fused)
    for prompt, got in zip(prompts, ours):
        assert got == hf_greedy(pruned, prompt, 16, use_cache=False)


@pytest.mark.real_model
def test_mask_matches_physically_removed_real_model(real):
    tok = real.tokenizer
    prompt = tok("The history of the Roman Empire", add_special_tokens=False)["input_ids"]
    mask = torch.ones(60, dtype=torch.bool)
    mask[[21, 30, 40, 41, 50, 55]] = False  # FFN and attention blocks and the whole layer 20
    ours = engine_greedy(real, [prompt], [mask])[0]
    assert ours == hf_greedy(remove_blocks(real.model, mask), prompt, 16, use_cache=False)


def test_full_forward_matches_removed_logits(tiny):
    """The cache-free forward (used by mask training and eval) against the pruned HF model."""
    runner = BlockRunner(tiny.model, max_batch=1, max_len=256)
    ids = torch.tensor(random_prompts(1, [30], seed=2))
    for mask in masks_for(8).values():
        ref = remove_blocks(tiny.model, mask)(ids, use_cache=False).logits
        with torch.no_grad():
            got = runner.forward(ids, mask)
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------------------- batch == alone
def greedy_trace(runner: BlockRunner, prompts, masks, steps=8, slots=None):
    """Greedy tokens and per-step logits through the runner's prefill/decode API."""
    slots = slots or list(range(len(prompts)))
    masks = torch.stack(masks)
    logits = runner.prefill(prompts, masks, slots)
    trace, tokens = [logits], [logits.argmax(-1).tolist()]
    for s in range(steps - 1):
        pos = [len(p) + s for p in prompts]
        logits = runner.decode(tokens[-1], pos, masks, slots)
        trace.append(logits)
        tokens.append(logits.argmax(-1).tolist())
    return torch.stack(trace, 1), torch.tensor(tokens).T


def test_mixed_mask_batch_equals_alone(tiny, fused):
    runner = BlockRunner(tiny.model, max_batch=4, max_len=256, fused=fused)
    all_masks = list(masks_for(8).values())
    prompts = random_prompts(4, [3, 31, 12, 20], seed=3)
    masks = [all_masks[4], torch.ones(8, dtype=torch.bool), all_masks[2], all_masks[0]]
    batch_logits, batch_tokens = greedy_trace(runner, prompts, masks, slots=[2, 0, 3, 1])
    for i, (p, m) in enumerate(zip(prompts, masks)):
        alone_logits, alone_tokens = greedy_trace(runner, [p], [m])
        assert batch_tokens[i].tolist() == alone_tokens[0].tolist()
        torch.testing.assert_close(batch_logits[i], alone_logits[0], atol=1e-4, rtol=0)


def test_engine_batch_with_joins_equals_alone(tiny, fused):
    """Continuous batching: requests that join mid-flight and leave early match solo runs (the
    fused path runs a joining prompt in the decoding rows' forward, the eager one beside it)."""
    all_masks = list(masks_for(8).values())
    prompts = random_prompts(5, [4, 19, 9, 33, 14], seed=4)
    masks = [all_masks[i % len(all_masks)] for i in range(5)]
    max_tokens = [12, 5, 16, 7, 10]
    runner = BlockRunner(tiny.model, max_batch=3, max_len=256, fused=fused)  # fewer slots than requests
    assert runner.packs_rows == fused
    engine = LLMEngine(runner, tiny.tokenizer)
    reqs = [Request(p, m, SamplingParams(max_tokens=n, temperature=0)) for p, m, n in zip(prompts, masks, max_tokens)]
    engine.add(reqs[0])
    engine.step()
    engine.step()
    for r in reqs[1:]:
        engine.add(r)
    while engine.has_work():
        engine.step()
    for r, p, m, n in zip(reqs, prompts, masks, max_tokens):
        assert r.finish_reason == "length"
        assert r.output_ids == engine_greedy(tiny, [p], [m], max_tokens=n)[0]


def test_engine_copies_the_shared_prefix_of_a_mask_into_a_slot_exactly(tiny, fused):
    """A request whose slot holds the shared prefix under another mask gets the K/V its own mask
    computed earlier copied in, and generates what it generates alone."""
    prefix, a, b, c = random_prompts(4, [10, 3, 4, 5], seed=7)
    mask = masks_for(8)["mixed"]
    runner = BlockRunner(tiny.model, max_batch=1, max_len=256, fused=fused)
    engine = LLMEngine(runner, tiny.tokenizer, shared_prefix=prefix)
    params = SamplingParams(max_tokens=8, temperature=0)
    dense = torch.ones(8, dtype=torch.bool)
    reqs = [Request(prefix + a, mask, params), Request(prefix + b, dense, params), Request(prefix + c, mask, params)]
    for r in reqs:  # one slot: each overwrites what the one before left
        engine.generate([r])
    assert [r.num_cached for r in reqs] == [0, 0, len(prefix)]
    assert reqs[2].output_ids == engine_greedy(tiny, [prefix + c], [mask], max_tokens=8)[0]


# ---------------------------------------------------------------------------- soft gates
def test_soft_gates_share_the_hard_mask_path(tiny):
    runner = BlockRunner(tiny.model, max_batch=1, max_len=256)
    ids = torch.tensor(random_prompts(2, [16, 16], seed=5))
    mask = masks_for(8)["mixed"]
    with torch.no_grad():
        hard = runner.forward(ids, mask)
        soft = runner.forward(ids, mask.float())
        half = runner.forward(ids, torch.full((8,), 0.5))
    torch.testing.assert_close(soft, hard)
    assert not torch.allclose(half, hard, atol=1e-3)
    gates = torch.full((2, 8), 0.7, requires_grad=True)
    runner.forward(ids, gates).logsumexp(-1).mean().backward()
    assert gates.grad is not None and gates.grad.abs().sum() > 0


def test_extend_with_shared_prefix_equals_full_forward(tiny, fused):
    """A context prefilled once, copied to other slots and extended by different continuations
    (as zero-shot scoring does) gives the logits of the full cache-free forward."""
    runner = BlockRunner(tiny.model, max_batch=4, max_len=256, fused=fused)
    mask = masks_for(8)["mixed"]
    context, *conts = random_prompts(4, [21, 3, 7, 5], seed=6)
    runner.prefill([context], mask[None], [0])
    runner.copy_slot(0, [1, 2], len(context))
    with torch.no_grad():
        got = runner.lm_head(runner.extend_hidden(conts, [len(context)] * 3, mask.expand(3, -1), [0, 1, 2]))
    for i, cont in enumerate(conts):
        with torch.no_grad():
            ref = runner.forward(torch.tensor([context + cont]), mask)[0, len(context):]
        torch.testing.assert_close(got[i, : len(cont)], ref, atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------------------- fused blocks == eager ops
def _trace_chunked(runner, prompts, masks, slots, steps=6):
    """Logits of a prefill split in two chunks (the second starts mid-sequence), then decode steps."""
    half = [len(p) // 2 for p in prompts]
    runner.extend([p[:h] for p, h in zip(prompts, half)], [0] * len(prompts), masks, slots)
    logits = runner.extend([p[h:] for p, h in zip(prompts, half)], half, masks, slots)
    trace, tokens = [logits], logits.argmax(-1).tolist()
    for s in range(steps):
        logits = runner.decode(tokens, [len(p) + s for p in prompts], masks, slots)
        trace.append(logits)
        tokens = logits.argmax(-1).tolist()
    return torch.stack(trace, 1)


HEAD_DIM_96 = {"hidden_size": 96, "num_attention_heads": 1, "num_key_value_heads": 1}


@pytest.mark.parametrize("fmt,heads", [(f, {}) for f in ("fp32", "bf16", "int8", "int4", "int4q8", "int4bf16")]
                         + [(f, HEAD_DIM_96) for f in ("fp32", "int8", "int4")],
                         ids=["fp32", "bf16", "int8", "int4", "int4q8", "int4bf16", "fp32-head_dim96",
                              "int8-head_dim96", "int4-head_dim96"])
def test_fused_blocks_equal_eager_ops(tiny_model_dir, tmp_path, fmt, heads):
    """Every weight format the fused blocks take, with q/k/v/o biases, mixed masks, ragged and
    chunked prefill and decode: the same logits and K/V as the eager path. Head size 96 takes
    the attention's 64-wide pass over the values and its 8-wide rest; not in int4q8, whose int8
    rounding of activations turns a last-bit difference from the attention into a whole step
    (only a lucky shape agrees to these tolerances)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from server import cpu_kernels, models

    if not cpu_kernels.available():
        pytest.skip("igserve's CPU kernels are not available here")
    config = LlamaConfig.from_pretrained(tiny_model_dir)
    config.attention_bias = True
    for key, value in heads.items():
        setattr(config, key, value)
    config.head_dim = config.hidden_size // config.num_attention_heads
    torch.manual_seed(1)
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tiny_model_dir / f).exists():
            (tmp_path / f).write_bytes((tiny_model_dir / f).read_bytes())
    lm = models.load(str(tmp_path), weights=fmt)
    assert lm.model.model.layers[0].self_attn.q_proj.bias is not None
    fused = BlockRunner(lm.model, max_batch=4, max_len=128, fused=True)
    eager = BlockRunner(lm.model, max_batch=4, max_len=128, fused=False)
    q8 = fmt == "int4q8"  # int8-rounded activations everywhere but down_proj's input
    assert (fused.fused[0].q8_attn, fused.fused[0].q8_ffn) == ((q8, q8), (q8, False))
    all_masks = list(masks_for(8).values())
    masks = torch.stack([all_masks[4], torch.ones(8, dtype=torch.bool), all_masks[2], all_masks[0]])
    prompts = random_prompts(4, [3, 31, 12, 20], seed=7)
    slots = [2, 0, 3, 1]
    got, want = _trace_chunked(fused, prompts, masks, slots), _trace_chunked(eager, prompts, masks, slots)
    # bf16 and int4bf16 round a call's inputs to bf16 from a row count on (wide_rows(); int4bf16:
    # above tile_rows(), whose tiles keep x to 2^-16 of its group's largest value), and the fused
    # blocks run only the tokens that keep a block where the eager path runs all padded rows: one
    # path's call can fall on each side of it (float32 or two-digit x against bf16-rounded x; without
    # the bf16 matmul the tolerances below hold for both). So int4bf16's two paths are each checked
    # against the exact int4 product too: the fused path no further from it than the eager one.
    tol = dict(atol=2e-4, rtol=1e-4)
    if fmt in ("int4bf16", "bf16"):
        tol = dict(atol=6e-2, rtol=1e-2)
    torch.testing.assert_close(got, want, **tol)
    if fmt == "int4bf16":
        exact = _trace_chunked(BlockRunner(models.load(str(tmp_path), weights="int4").model, max_batch=4, max_len=128,
                                           fused=False), prompts, masks, slots)
        assert (got - exact).abs().max() <= 1.1 * (want - exact).abs().max()
    # K/V of each row at a layer whose attention it runs is the eager path's, to the same rounding as
    # the logits: a projection's input in bf16 on one side of the switch, float32 or two int8 digits
    # on the other (a wrong slot, position or mask would move whole rows)
    kv_tol = {"int4bf16": dict(atol=5e-2, rtol=1e-2), "bf16": dict(atol=2e-2, rtol=1e-2)}.get(
        fmt, dict(atol=1e-5, rtol=1e-5))
    for row, slot in enumerate(slots):
        for layer in range(4):
            if masks[row, 2 * layer]:
                n = len(prompts[row]) + 5
                torch.testing.assert_close(fused.cache.k[layer][slot, :, :n], eager.cache.k[layer][slot, :, :n],
                                           **kv_tol)
                torch.testing.assert_close(fused.cache.v[layer][slot, :, :n], eager.cache.v[layer][slot, :, :n],
                                           **kv_tol)


def test_float16_kv_cache_fused_equals_eager_and_stays_close_to_float32(tiny):
    """A float16 cache: both cached paths read the same rounded K/V (the fused blocks convert with
    F16C, the eager path with torch), so they agree as closely as with float32; against the float32
    cache the logits move by the rounding only. ``auto`` picks it where the fused blocks run."""
    from server import cpu_kernels

    if not cpu_kernels.available():
        pytest.skip("igserve's CPU kernels are not available here")
    fused = BlockRunner(tiny.model, max_batch=4, max_len=128, fused=True, kv_dtype="auto")
    eager = BlockRunner(tiny.model, max_batch=4, max_len=128, fused=False, kv_dtype=torch.float16)
    exact = BlockRunner(tiny.model, max_batch=4, max_len=128, fused=True)
    assert fused.cache.dtype == torch.float16 and fused.cache.k[0].element_size() == 2
    assert BlockRunner(tiny.model, max_batch=1, max_len=8, fused=False, kv_dtype="auto").cache.dtype == torch.float32
    with pytest.raises(ValueError, match="float16 KV cache"):
        BlockRunner(tiny.model, max_batch=1, max_len=8, fused=True, kv_dtype=torch.bfloat16)
    all_masks = list(masks_for(8).values())
    masks = torch.stack([all_masks[4], torch.ones(8, dtype=torch.bool), all_masks[2], all_masks[0]])
    prompts = random_prompts(4, [3, 31, 12, 20], seed=7)
    slots = [2, 0, 3, 1]
    half = _trace_chunked(fused, prompts, masks, slots)
    torch.testing.assert_close(half, _trace_chunked(eager, prompts, masks, slots), atol=2e-4, rtol=1e-4)
    full = _trace_chunked(exact, prompts, masks, slots)
    assert 0 < (half - full).abs().max() < 0.05 * full.abs().max()
    assert torch.equal(half.argmax(-1), full.argmax(-1))


def test_fused_blocks_need_float32_cpu(tiny):
    bf16 = copy.deepcopy(tiny.model).to(torch.bfloat16)
    assert BlockRunner(bf16, max_batch=1, max_len=32).fused is None
    with pytest.raises(ValueError, match="float32"):
        BlockRunner(bf16, max_batch=1, max_len=32, fused=True)


def test_fused_blocks_reject_mismatched_rows(tiny):
    """The C++ blocks check their inputs: a wrong row count is an error, not a write out of bounds."""
    from server import cpu_kernels

    if not cpu_kernels.available():
        pytest.skip("igserve's CPU kernels are not available here")
    runner = BlockRunner(tiny.model, max_batch=2, max_len=32, fused=True)
    f, h = runner.fused[0], torch.zeros(2, 1, tiny.model.config.hidden_size)
    keep, one = torch.ones(2, dtype=torch.bool), torch.ones(2, dtype=torch.long)
    with pytest.raises(RuntimeError, match="one int64 per row"):
        torch.ops.igserve.attn_block(h, keep, f.attn_norm, f.attn_eps, f.qkv, f.qkv_bias, f.o, f.o_bias,
                                     runner.cos, runner.sin, runner.cache.k[0], runner.cache.v[0],
                                     torch.zeros(3, dtype=torch.long), one, one, runner.num_heads,
                                     runner.num_kv_heads, f.scale)
    with pytest.raises(RuntimeError, match="one entry per row"):
        torch.ops.igserve.ffn_block(h, keep[:1], f.ffn_norm, f.ffn_eps, f.gate_up, f.gate_up_bias, f.down,
                                    f.down_bias, one)
