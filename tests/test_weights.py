"""Weight formats: the int4 layout serves the GGUF's Q4_1 groups, the quantised linears compute what
their dequantised weights say, and the runner in every format equals HF generate on the same model."""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.nn.functional as F

from server import cost, cpu_kernels, models, weights
from server.runner import BlockRunner
from tests.test_runner import engine_greedy, greedy_trace, hf_greedy, masks_for, random_prompts, remove_blocks


def _weight(n=64, k=96, seed=0):
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05


# ---------------------------------------------------------------------------- kernels
def test_q4_1_rule_round_trips():
    w = _weight()
    g = weights.quantize_q4_1(w)
    assert int(g.q.min()) == 0 and int(g.q.max()) == 15
    step = g.d.repeat_interleave(weights.GROUP, 1)
    assert (g.dequantize() - w).abs().le(step / 2 + 1e-6).all()
    again = weights.quantize_q4_1(g.dequantize())  # a Q4_1 weight re-quantises to its own groups
    assert torch.equal(again.q, g.q) and torch.equal(again.d, g.d) and torch.equal(again.m, g.m)


def test_int4_float32_is_the_q4_1_dequantisation():
    """torch's int4 kernel computes (q - 8)·scale + zero: with zero = m + 8d it is d·q + m."""
    g = weights.quantize_q4_1(_weight())
    x = torch.randn(5, 96)
    got = weights.Int4Linear(g, None, torch.float32)(x)
    torch.testing.assert_close(got, x @ g.dequantize().T, rtol=1e-5, atol=1e-5)


def test_int4_bfloat16_within_rounding():
    g = weights.quantize_q4_1(_weight())
    x = torch.randn(5, 96)
    got = weights.Int4Linear(g, None, torch.bfloat16)(x.bfloat16()).float()
    ref = x @ g.dequantize().T
    assert (got - ref).norm() / ref.norm() < 0.01


native = pytest.mark.skipif(not cpu_kernels.available(), reason="igserve's CPU kernels need AVX2/FMA/F16C and a compiler")


@native
@pytest.mark.parametrize("k", [96, 320])  # 3 groups; 10: the one-row min term's 8-group steps and tail
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 9, 17, 64])
def test_native_q4_kernel_is_the_q4_1_dequantisation(rows, k):
    """Every tile shape and tail (rows per pass, channels per pass) against the float64 product."""
    g = weights.quantize_q4_1(_weight(n=80, k=k, seed=rows))
    qs, dm = cpu_kernels.pack_q4(g.q), cpu_kernels.pack_dm(g.d, g.m)
    assert torch.equal(cpu_kernels.unpack_q4(qs), g.q.to(torch.uint8))
    assert all(torch.equal(a, b) for a, b in zip(cpu_kernels.unpack_dm(dm), (g.d, g.m)))
    x = torch.randn(rows, k)
    ref = (x.double() @ g.dequantize().double().T).float()
    torch.testing.assert_close(cpu_kernels.q4_linear(x, qs, dm), ref, rtol=1e-5, atol=1e-5)
    lin = weights.Int4Linear(g, torch.randn(80), torch.float32, native=True)
    torch.testing.assert_close(lin(x.view(rows, 1, k)), (ref + lin.bias).view(rows, 1, 80), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lin.dequantized(), g.dequantize(), rtol=0, atol=0)


@native
@pytest.mark.parametrize("k", [128, 320])
@pytest.mark.parametrize("rows", [1, 2, 5, 17])
def test_native_q4_kernel_with_int8_activations(rows, k):
    """q8: the product of the Q4_1 weights with the activations rounded per group of 32
    (``round_q8``), for one row (integer dot products, every channel tail) and several (float
    kernel on the rounded rows); each row's result is the same whatever rows share the call."""
    g = weights.quantize_q4_1(_weight(n=83, k=k, seed=rows))
    qs, dm = cpu_kernels.pack_q4(g.q), cpu_kernels.pack_dm(g.d, g.m)
    x = torch.randn(rows, k)
    x[:, 5] *= 30  # an outlier sets its group's scale
    rounded = cpu_kernels.round_q8(x)
    step = x.view(rows, k // 32, 32).abs().amax(-1, keepdim=True) / 127
    assert (rounded - x).view(rows, k // 32, 32).abs().le(step / 2 + 1e-6).all()
    ref = (rounded.double() @ g.dequantize().double().T).float()
    got = cpu_kernels.q4_linear(x, qs, dm, True)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    exact = cpu_kernels.q4_linear(x, qs, dm)
    assert (exact - got).abs().max() > 1e-3  # the rounding is there
    alone = torch.cat([cpu_kernels.q4_linear(x[r:r + 1], qs, dm, True) for r in range(rows)])
    torch.testing.assert_close(alone, got, rtol=1e-5, atol=1e-5)


@native
@pytest.mark.parametrize("k", [128, 320])
def test_int4q8_one_row_on_vnni_tiles_is_the_rounded_product(k):
    """int4q8's one-row calls on AVX-512 VNNI run 16-channel tiles of the same groups: the product
    of round_q8(x) with the Q4_1 weights, as the kernels without tiles compute it; a fused linear
    stacks its parts' tiles."""
    if not cpu_kernels.vnni_tiles():
        pytest.skip("no AVX-512 VNNI here")
    g = weights.quantize_q4_1(_weight(n=80, k=k, seed=k))
    lin = weights.Int4Linear(g, None, torch.float32, native=True, q8=True)
    assert lin._tiles is True and lin.tiles.shape == (5, k // 32, 320)  # made on first use
    assert cost.module_bytes(lin) == cost.module_bytes(weights.Int4Linear(g, None, torch.float32, native=True))
    x = torch.randn(1, k)
    x[0, 7] *= 30
    ref = (cpu_kernels.round_q8(x).double() @ g.dequantize().double().T).float()
    torch.testing.assert_close(lin(x), ref, rtol=1e-5, atol=1e-5)
    untiled = cpu_kernels.q4_linear(x, lin.qs, lin.dm, True)
    torch.testing.assert_close(lin(x), untiled, rtol=1e-5, atol=1e-5)
    assert (lin(x) - cpu_kernels.q4_linear(x, lin.qs, lin.dm)).abs().max() > 1e-3  # the rounding is there
    fused = weights.fuse([lin, type(lin).cat([lin])])
    assert weights.kernel_tensors(fused)[0][2].shape == (10, k // 32, 320)
    torch.testing.assert_close(fused(x), torch.cat([lin(x), lin(x)], -1), rtol=1e-6, atol=1e-6)


@native
@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_native_kernels_give_a_row_the_same_bits_in_any_batch_of_several(fmt):
    """From two rows up a row's output does not depend on the rows beside it: the register tiles
    (up to 4 rows) and the expanded-weight tiles (5 and more) accumulate in the same order."""
    w = _weight(n=80 if fmt == "int4" else 67, k=96, seed=3)  # channel tails in both tile kinds
    lin = (weights.Int4Linear(weights.quantize_q4_1(w), None, torch.float32, native=True) if fmt == "int4"
           else weights.Int8Linear(w, None, torch.float32, native=True))
    x = torch.randn(19, 96)
    whole = lin(x)
    for rows in (slice(0, 2), slice(0, 4), slice(3, 6), slice(5, 17), slice(2, 19)):
        assert torch.equal(lin(x[rows]), whole[rows]), rows


@native
@pytest.mark.parametrize("rows", [1, 4, 6, 16])
def test_native_int8_kernel_is_its_dequantised_weight(rows):
    w = _weight(n=67, k=64, seed=rows)  # 67 channels: the one-channel tail of every pass
    lin = weights.Int8Linear(w, None, torch.bfloat16, native=True)
    assert lin.scales.dtype == torch.float32
    x = torch.randn(rows, 64)
    ref = (x.double() @ lin.dequantized().double().T).float()
    torch.testing.assert_close(lin(x), ref, rtol=1e-5, atol=1e-5)


@native
@pytest.mark.parametrize("rows", [1, 2, 4, 5, 16])
def test_native_f32_kernel_is_the_float32_product(rows):
    """The fp32 format's linears in the fused blocks, and its lm_head: up to 4 rows igserve's register
    tiles (a row's bits the same in any batch of up to 4), from 5 torch's matmul."""
    w = _weight(n=67, k=96, seed=rows)  # 67 channels: the one-channel tail of every pass
    x = torch.randn(rows, 96)
    y = cpu_kernels.f32_linear(x, w)
    torch.testing.assert_close(y, (x.double() @ w.double().T).float(), rtol=1e-5, atol=1e-5)
    if rows > 4:
        assert torch.equal(y, F.linear(x, w))
    elif rows > 1:
        assert torch.equal(cpu_kernels.f32_linear(x[1:], w), y[1:])
    # shapes the tiles do not take run torch's matmul: K not a multiple of 32, a strided weight
    assert torch.equal(cpu_kernels.f32_linear(x[:, :40].contiguous(), w[:, :40]), F.linear(x[:, :40], w[:, :40]))


@native
def test_fp32_runner_heads_run_the_kernel_and_keep_gradients_and_ties(tiny):
    """With the fused blocks the fp32 lm_head is an F32Head on the tied embedding; its logits are
    F.linear's to float32 rounding, and a call that needs gradients is F.linear itself."""
    runner = BlockRunner(tiny.model, max_batch=1, max_len=64, fused=True)
    head = runner.lm_head
    assert isinstance(head, weights.F32Head) and head.weight is tiny.model.lm_head.weight
    h = torch.randn(3, head.in_features)
    torch.testing.assert_close(head(h), F.linear(h, head.weight), rtol=1e-5, atol=1e-5)
    g = h.clone().requires_grad_(True)
    head(g).sum().backward()
    torch.testing.assert_close(g.grad, head.weight.sum(0).expand_as(h), rtol=1e-4, atol=1e-3)  # a sum over the vocabulary
    assert BlockRunner(tiny.model, max_batch=1, max_len=64, fused=False).lm_head is tiny.model.lm_head


@native
def test_row_argmax_is_torch_argmax_with_the_first_index_on_ties():
    """The sampler's greedy argmax (blocks.cpp, eight lanes then the tail): torch's answer on every
    row, ties to the first index across lanes and the tail, an all -inf row to token 0."""
    x = torch.randn(6, 49157, generator=torch.Generator().manual_seed(0))
    x[1, [5, 13, 40000]] = 9.0  # a tie in two lanes and in a later block: the first index
    x[2, [49156, 7]] = 9.0  # the tail ties a lane: the lane's earlier index
    x[3, -1] = 9.0  # the largest in the tail alone
    x[4] = -math.inf
    x[5, 0] = 9.0
    assert torch.equal(cpu_kernels.argmax(x), x.argmax(-1))
    assert cpu_kernels.argmax(x).tolist()[:5] == [int(x[0].argmax()), 5, 7, 49156, 0]
    assert torch.equal(cpu_kernels.argmax(x[:, :3]), x[:, :3].argmax(-1))  # shorter than a lane
    assert torch.equal(cpu_kernels.argmax(x[:, ::2]), x[:, ::2].argmax(-1))  # not contiguous


@native
def test_native_kernels_reject_bad_shapes():
    g = weights.quantize_q4_1(_weight())
    qs, dm = cpu_kernels.pack_q4(g.q), cpu_kernels.pack_dm(g.d, g.m)
    with pytest.raises(RuntimeError, match="float32"):
        cpu_kernels.q4_linear(torch.randn(2, 64), qs, dm)
    with pytest.raises(RuntimeError, match="float32"):
        cpu_kernels.q4_linear(torch.randn(2, 96).bfloat16(), qs, dm)


def test_int8_matches_its_dequantised_weight():
    w = _weight()
    lin = weights.Int8Linear(w, None, torch.bfloat16)
    x = torch.randn(3, 96).bfloat16()
    ref = x.float() @ lin.dequantized().T
    assert (lin(x).float() - ref).norm() / ref.norm() < 0.01
    assert (lin.dequantized() - w).abs().max() <= w.abs().max() / 127  # half a step per channel, twice


@native
def test_int4bf16_switches_to_onednn_at_5_rows_with_amx_else_at_14_and_tiles_run_9_or_32():
    """The kernels' own CPU check agrees with the CPU's flags (unless IGSERVE_WIDE_ROWS overrides it)."""
    if os.environ.get("IGSERVE_WIDE_ROWS") or os.environ.get("IGSERVE_TILE_ROWS"):
        pytest.skip("IGSERVE_WIDE_ROWS or IGSERVE_TILE_ROWS is set")
    amx = "amx_bf16" in weights.cpu_flags()
    assert cpu_kernels.wide_rows() == (5 if amx else 14)
    assert cpu_kernels.tile_rows() == (9 if amx else 32)  # int4bf16's tiles, ahead of oneDNN up to 9 rows with AMX


@native
@pytest.mark.parametrize("kind", ["int4", "int8"])
@pytest.mark.parametrize("offset", [-13, -1, 0, 1, 19])
def test_wide_linears_multiply_many_rows_in_bfloat16(offset, kind):
    """int4bf16 (its int4 linears and int8 lm_head): below ``wide_rows()`` rows the float32
    kernel's exact bits (but for ``tile_rows()`` on AVX-512 VNNI, next tests), from there
    torch's bf16 matmul of the bf16-rounded dequantised weight (within bf16 rounding of the exact
    product)."""
    rows = max(1, cpu_kernels.wide_rows() + offset)  # -13: one row (14 rows without AMX, 5 with)
    w = _weight(n=80, k=96, seed=rows)
    if kind == "int4":
        g = weights.quantize_q4_1(w)
        exact = weights.Int4Linear(g, None, torch.float32, native=True)
        wide = weights.Int4Linear(g, None, torch.float32, native=True, wide=True)
    else:
        exact = weights.Int8Linear(w, None, torch.float32, native=True)
        wide = weights.Int8Linear(w, None, torch.float32, native=True, wide=True)
    assert exact.wide is None and wide.wide.dtype == torch.bfloat16
    assert cost.module_bytes(wide) == cost.module_bytes(exact)  # a one-row step reads the int4 groups only
    x = torch.randn(rows, 96)
    few_bf16 = cpu_kernels.vnni_tiles() and rows <= cpu_kernels.tile_rows()  # the tiles (next tests)
    if few_bf16:
        torch.testing.assert_close(wide(x), exact(x), rtol=2e-2, atol=5e-2)
    elif offset < 0:
        assert torch.equal(wide(x), exact(x))
    else:
        bf16 = F.linear(x.bfloat16(), exact.dequantized().bfloat16()).float()
        assert torch.equal(wide(x), bf16) and not torch.equal(wide(x), exact(x))
        torch.testing.assert_close(wide(x), exact(x), rtol=2e-2, atol=5e-2)
    fused = weights.fuse([wide, type(wide).cat([wide])])
    assert torch.equal(fused(x), torch.cat([wide(x), wide(x)], -1))
    assert weights.kernel_tensors(fused)[0][2].shape == (160, 96)


@native
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 10, 32, 33])
@pytest.mark.parametrize("k", [96, 576, 1536])
def test_few_int4bf16_rows_multiply_exact_weights_by_two_digit_x_where_the_cpu_does(k, rows):
    """Up to ``tile_rows()`` rows of an int4bf16 linear (32; 9 with AMX): on AVX-512 VNNI, integer dot
    products on 16-channel tiles, the product of x in two int8 digits per group (``round_i8x2``)
    with the exact Q4_1 weights to float32 rounding: far closer to the exact product than bf16
    rounding of x, and not the float32 kernel's bits; a row's result does not depend on the rows
    beside it (passes of 4 rows and the rest). More rows, or no VNNI: the float32 kernel's bits, or
    oneDNN's bf16 matmul from ``wide_rows()``."""
    w = _weight(n=80, k=k, seed=k)
    g = weights.quantize_q4_1(w)
    exact = weights.Int4Linear(g, None, torch.float32, native=True)
    wide = weights.Int4Linear(g, None, torch.float32, native=True, wide=True)
    assert exact.tiles is None
    x = torch.randn(rows, k) * 3
    x[:, 3] += 40  # one large value: the rest of its group keeps 2^-16 of it, not 2^-9 of itself
    if cpu_kernels.vnni_tiles() and rows <= cpu_kernels.tile_rows():
        assert wide.tiles.shape == (5, k // 32, 320)
        wd = exact.dequantized().double()
        ref = (cpu_kernels.round_i8x2(x) @ wd.T).float()
        torch.testing.assert_close(wide(x), ref, rtol=1e-5, atol=1e-5)
        assert not torch.equal(wide(x), exact(x))
        true = x.double() @ wd.T
        err, bf16_err = (wide(x) - true).abs().max(), (x.bfloat16().double() @ wd.T - true).abs().max()
        assert err < bf16_err / 10, (err, bf16_err)
        for r in range(rows):  # the same instructions for every row: the same bits
            assert torch.equal(wide(x[r:r + 1]), wide(x)[r:r + 1])
        fused = weights.fuse([wide, type(wide).cat([wide])])
        assert weights.kernel_tensors(fused)[0][3].shape == (10, k // 32, 320)
        assert torch.equal(fused(x), torch.cat([wide(x), wide(x)], -1))
    elif rows >= cpu_kernels.wide_rows():  # AMX: oneDNN's bf16 matmul from 5 rows
        assert torch.equal(wide(x), F.linear(x.bfloat16(), exact.dequantized().bfloat16()).float())
    else:
        assert torch.equal(wide(x), exact(x))


@native
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 16, 32, 33])
def test_int4bf16_lm_head_few_rows_multiply_int8_weights_by_two_digit_x_where_the_cpu_does(rows):
    """int4bf16's int8 lm_head, up to ``tile_rows()`` rows on AVX-512 VNNI: integer dot products of
    the int8 weights (+ 128, in 16-channel tiles) with x in two int8 digits per group, the offset
    taken off in int32: the product of ``round_i8x2(x)`` with the dequantised weights to float32
    rounding, far closer to the exact product than bf16 rounding of x; a row's result does not
    depend on the rows beside it. More rows, or no VNNI: as before (previous test)."""
    w = _weight(n=80, k=576, seed=rows)
    wide = weights.Int8Linear(w, None, torch.float32, native=True, wide=True)
    exact = weights.Int8Linear(w, None, torch.float32, native=True)
    assert exact.tiles is None
    x = torch.randn(rows, 576) * 3
    x[:, 5] += 40
    wd = exact.dequantized().double()
    if not cpu_kernels.vnni_tiles():
        assert wide.tiles is None
        pytest.skip("the CPU has no AVX-512 VNNI: the previous test covers the int8 lm_head")
    if rows > cpu_kernels.tile_rows():  # oneDNN's bf16 matmul, as without the tiles
        assert torch.equal(wide(x), F.linear(x.bfloat16(), exact.dequantized().bfloat16()).float())
        return
    assert wide.tiles.shape == (5, 576 // 32, 512) and wide.tiles.dtype == torch.uint8
    torch.testing.assert_close(wide(x), (cpu_kernels.round_i8x2(x) @ wd.T).float(), rtol=1e-5, atol=1e-5)
    true = x.double() @ wd.T
    err, bf16_err = (wide(x) - true).abs().max(), (x.bfloat16().double() @ wd.T - true).abs().max()
    assert err < bf16_err / 10, (err, bf16_err)
    for r in range(rows):
        assert torch.equal(wide(x[r:r + 1]), wide(x)[r:r + 1])
    fused = weights.fuse([wide, type(wide).cat([wide])])
    assert weights.kernel_tensors(fused)[0][-1].shape == (10, 576 // 32, 512)
    assert torch.equal(fused(x), torch.cat([wide(x), wide(x)], -1))


@native
@pytest.mark.parametrize("offset", [-13, -4, -1, 0, 19])
def test_bf16_linears_widen_few_rows_exactly_and_multiply_many_in_bfloat16(offset):
    """The ``bf16`` format with float32 activations: below ``wide_rows()`` rows each bf16 weight is
    widened to float32, so the result is the float32 product with the bf16 weights (to float32
    rounding, and a row's bits do not depend on the rows beside it from two rows up); from there
    oneDNN's bf16 matmul, bit-equal to torch's on x rounded to bf16, where the CPU computes in bf16
    (next test otherwise)."""
    if not weights.native_bf16():
        pytest.skip("the CPU has no bf16 arithmetic: the float32 kernel runs every row count (next test)")
    rows = max(1, cpu_kernels.wide_rows() + offset)
    w, bias = _weight(n=67, k=96, seed=rows), torch.randn(67)  # 67: the one-channel tail of every pass
    lin = weights.Bf16Linear(w, bias, native=True)
    assert lin.weight.dtype == torch.bfloat16 and lin.bias.dtype == torch.float32
    assert cost.module_bytes(lin) == 67 * 96 * 2 + 67 * 4  # a step reads the bf16 weight, not the copy
    x = torch.randn(rows, 96)
    exact = (x.double() @ lin.weight.double().T + bias.double()).float()
    if offset < 0:
        torch.testing.assert_close(lin(x), exact, rtol=1e-5, atol=1e-5)
        assert (lin(x) - F.linear(x.bfloat16(), lin.weight, bias.bfloat16()).float()).abs().max() > 1e-3
        if rows > 1:
            assert torch.equal(lin(x[1:]), lin(x)[1:])
    else:
        assert torch.equal(lin(x), F.linear(x.bfloat16(), lin.weight).float() + bias)
        torch.testing.assert_close(lin(x), exact, rtol=2e-2, atol=5e-2)
    fused = weights.fuse([lin, type(lin).cat([lin])])
    assert torch.equal(fused(x), torch.cat([lin(x), lin(x)], -1))
    tensors, fused_bias = weights.kernel_tensors(fused)
    assert tensors[0].shape == (134, 96) and tensors[1].dtype == torch.bfloat16 and fused_bias.shape == (134,)


@native
def test_bf16_linears_stay_on_the_float32_kernel_where_the_cpu_lacks_bf16(monkeypatch):
    """Without AVX-512 BF16 or AMX oneDNN would emulate bf16: every row count widens the weights."""
    monkeypatch.setattr(weights, "native_bf16", lambda: False)
    lin = weights.Bf16Linear(_weight(n=48, k=64), None, native=True)
    x = torch.randn(cpu_kernels.wide_rows() + 20, 64)
    assert lin.wide is None and weights.kernel_tensors(lin)[0] == [lin.weight]
    torch.testing.assert_close(lin(x), (x.double() @ lin.weight.double().T).float(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [(64, 32, 32), (128, 64, 64)])
@pytest.mark.parametrize("kind", ["linear", "int8", "int4", "int4-native", "int8-native", "bf16-native"])
def test_fuse_equals_the_parts(kind, rows):
    """Bit-exact, whichever way the fused linear is built: torch's int4 packing stacks rows only in
    CPU-dependent blocks (64 on AVX-512), so (64, 32, 32) exercises the unstacked path there."""
    if kind.endswith("native") and not cpu_kernels.available():
        pytest.skip("igserve's CPU kernels are not available here")
    parts = [_weight(n, 64, seed=n) for n in rows]
    if kind == "linear":
        mods = []
        for w in parts:
            m = torch.nn.Linear(64, w.shape[0], bias=True)
            m.weight.data, m.bias.data = w.clone(), torch.randn(w.shape[0])
            mods.append(m)
        dtype = torch.float32
    elif kind == "int8":
        mods, dtype = [weights.Int8Linear(w, torch.randn(w.shape[0]), torch.bfloat16) for w in parts], torch.bfloat16
    elif kind == "int8-native":
        mods, dtype = [weights.Int8Linear(w, torch.randn(w.shape[0]), torch.float32, native=True) for w in parts], torch.float32
    elif kind == "bf16-native":
        mods, dtype = [weights.Bf16Linear(w, torch.randn(w.shape[0]), native=True) for w in parts], torch.float32
    elif kind == "int4-native":
        mods, dtype = [weights.Int4Linear(weights.quantize_q4_1(w), None, torch.float32, native=True) for w in parts], torch.float32
    else:
        mods, dtype = [weights.Int4Linear(weights.quantize_q4_1(w), None, torch.bfloat16) for w in parts], torch.bfloat16
    x = torch.randn(4, 64).to(dtype)
    ref = torch.cat([m(x) for m in mods], -1)
    fused = weights.fuse(mods)
    torch.testing.assert_close(fused(x), ref, rtol=0, atol=0)
    torch.testing.assert_close(torch.cat([m(x) for m in mods], -1), ref, rtol=0, atol=0)  # parts still work


# ---------------------------------------------------------------------------- format choice, cost
def test_resolve_weights():
    assert models.resolve_weights("auto", "float32") == ("fp32", torch.float32)
    assert models.resolve_weights("auto", "bfloat16") == ("bf16", torch.bfloat16)
    assert models.resolve_weights("int4") == ("int4", weights.activation_dtype("int4"))
    assert models.resolve_weights("int4", "float32") == ("int4", torch.float32)
    assert models.resolve_weights("int8", "bfloat16") == ("int8", torch.bfloat16)
    # bf16 weights: float32 activations around igserve's kernel where it runs, else bf16 throughout
    native = cpu_kernels.available()
    assert models.resolve_weights("bf16") == ("bf16", torch.float32 if native else torch.bfloat16)
    assert models.resolve_weights("bf16", "bfloat16") == ("bf16", torch.bfloat16)
    assert models.resolve_weights("auto")[0] == weights.auto_format()
    with pytest.raises(models.ModelLoadError):
        models.resolve_weights("int3")


def test_activation_dtype_follows_the_kernels(monkeypatch):
    """float32 where igserve's kernels run (on AVX-512 BF16 too), else bf16 where the CPU has it."""
    monkeypatch.setattr(cpu_kernels, "available", lambda: False)
    monkeypatch.setattr(weights, "cpu_features", lambda: {"avx2", "fma"})
    assert weights.activation_dtype("int4") == torch.float32 and weights.auto_format() == "int4"
    monkeypatch.setattr(weights, "cpu_features", lambda: {"avx2", "avx512f", "avx512_bf16"})
    assert weights.activation_dtype("int4") == torch.bfloat16 and weights.auto_format() == "int4bf16"
    monkeypatch.setattr(cpu_kernels, "available", lambda: True)
    assert weights.activation_dtype("int4") == weights.activation_dtype("int4bf16") == torch.float32
    monkeypatch.setattr(weights, "cpu_features", lambda: {"avx2", "avx512f", "amx_bf16"})
    assert weights.auto_format() == "int4bf16"
    monkeypatch.setattr(weights, "cpu_features", lambda: {"sse4_2"})
    assert weights.auto_format() == "fp32"
    assert weights.activation_dtype("int4", "cuda") == torch.bfloat16


def test_float32_activations_pick_the_kernels(tiny_model_dir):
    """With float32 activations the quantised linears run igserve's float32 CPU kernels where the
    CPU has them, else torch's bf16 kernels (scales pinned to bf16); bf16 activations always take
    torch's. Both models agree to bf16 rounding."""
    lm32 = models.load(str(tiny_model_dir), dtype=torch.float32, weights="int4").model
    lm16 = models.load(str(tiny_model_dir), dtype=torch.bfloat16, weights="int4").model
    quantised = (weights.Int4Linear, weights.Int8Linear)
    mods32 = [m for m in lm32.modules() if isinstance(m, quantised)]
    mods16 = [m for m in lm16.modules() if isinstance(m, quantised)]
    assert mods32 and all(m.native == cpu_kernels.available() for m in mods32)
    assert not any(m.native for m in mods16)
    assert all(b.dtype == weights.KERNEL_DTYPE for m in mods16 for b in m.buffers() if b.is_floating_point())
    assert lm32.model.embed_tokens.weight.dtype == torch.float32
    ids = torch.tensor([[1, 5, 9, 12, 7]])
    a, b = lm32(ids).logits, lm16(ids).logits.float()
    assert a.dtype == torch.float32 and (a - b).norm() / b.norm() < 0.05


def test_bf16_with_float32_activations_is_the_fp32_model_on_bf16_weights(tiny_model_dir):
    """``--weights bf16`` where igserve's kernels run: every linear (lm_head included) holds bf16
    weights, activations and the embedding stay float32, the runner takes the fused blocks, and a
    forward of fewer than ``wide_rows()`` tokens is the float32 model on the bf16-rounded weights
    to float32 rounding (more tokens: within the bf16 rounding of each linear's input)."""
    if not cpu_kernels.available():
        pytest.skip("igserve's CPU kernels are not available here")
    fmt, dtype = models.resolve_weights("bf16")
    lm = models.load(str(tiny_model_dir), dtype=dtype, weights=fmt)
    linears = [m for m in lm.model.modules() if isinstance(m, (torch.nn.Linear, weights._WeightOnlyLinear))]
    assert linears and all(isinstance(m, weights.Bf16Linear) and m.native for m in linears)
    assert lm.model.model.embed_tokens.weight.dtype == torch.float32
    assert BlockRunner(lm.model, max_batch=1, max_len=64).fused is not None
    ref = weights.dequantized_copy(lm.model)
    mask = masks_for(8)["mixed"]
    for n, tol in ((max(1, cpu_kernels.wide_rows() - 1), 1e-5), (30, 3e-2)):
        ids = torch.tensor(random_prompts(1, [n], seed=2))
        with torch.no_grad():
            got = BlockRunner(lm.model, max_batch=1, max_len=64).forward(ids, mask)
            want = BlockRunner(ref, max_batch=1, max_len=64).forward(ids, mask)
        assert (got - want).norm() / want.norm() < tol, n


def test_cost_counts_params_alike_and_bytes_per_format(tiny_model_dir, tiny):
    fp32 = cost.CostModel.from_model(tiny.model)
    int4 = cost.CostModel.from_model(models.load(str(tiny_model_dir), dtype=torch.bfloat16, weights="int4").model)
    torch.testing.assert_close(fp32.block_params, int4.block_params)
    assert fp32.head_params == int4.head_params
    mask = masks_for(8)["layers_1_2"]
    assert fp32.compute_saved(mask) == pytest.approx(int4.compute_saved(mask))
    # fp32 reads 4 bytes a parameter; int4 ~0.6 in the blocks and an int8 lm_head
    assert fp32.bytes(torch.ones(8, dtype=torch.bool)) == pytest.approx(4 * fp32.params(torch.ones(8, dtype=torch.bool)))
    assert int4.block_bytes.sum() < 0.2 * fp32.block_bytes.sum()
    # blocks shrink ~6.4x in int4, the int8 lm_head 4x: skipping blocks saves a smaller share
    assert 1 < int4.ideal_speedup(mask) < fp32.ideal_speedup(mask)


def test_bench_kernels_times_every_linear_of_a_step(tiny_model_dir, tmp_path):
    """Each family is one module per layer (the lm_head once), and together their bytes are the
    weights a dense step reads, less the norms; GMAC/s and GB/s follow from the median time."""
    import json

    from server import cli

    out = tmp_path / "kernels.json"
    assert cli.main(["bench", "kernels", "--model", str(tiny_model_dir), "--weights", "int4", "--rows", "1,5",
                     "--repeats", "2", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["command"].startswith("igserve bench kernels --model") and report["cpu_flags"]
    runs = report["formats"]["int4"]["runs"]
    lm = models.load(str(tiny_model_dir), dtype=models.resolve_weights("int4")[1], weights="int4")
    layers = lm.model.config.num_hidden_layers
    assert {(r["family"], r["rows"]) for r in runs} == {(f, n) for f in ("qkv", "o", "gate_up", "down", "lm_head")
                                                        for n in (1, 5)}
    assert all(r["modules"] == (1 if r["family"] == "lm_head" else layers) for r in runs)
    step = cost.CostModel.from_model(lm.model).bytes(torch.ones(2 * layers, dtype=torch.bool))
    norms = sum(p.numel() * p.element_size() for n, p in lm.model.named_parameters() if "norm" in n)
    assert sum(r["weight_mb"] for r in runs if r["rows"] == 1) * 1e6 == pytest.approx(step - norms, rel=1e-3)
    for r in runs:
        macs = lm.model.config.vocab_size * lm.model.config.hidden_size if r["family"] == "lm_head" else None
        if macs:
            assert r["gmac_s"] == pytest.approx(macs * r["rows"] / (r["ms_per_step"] / 1000) / 1e9, rel=0.02)
        assert r["spread_ms"][0] <= r["ms_per_step"] <= r["spread_ms"][1]


# ---------------------------------------------------------------------------- runner per format
@pytest.fixture(scope="module", params=[("int8", "bfloat16"), ("int4", "bfloat16"), ("int4", "float32"),
                                        ("int4bf16", "float32"), ("bf16", "bfloat16"), ("bf16", "float32")])
def quantised(request, tiny_model_dir):
    fmt, dtype = request.param
    return models.load(str(tiny_model_dir), dtype=getattr(torch, dtype), weights=fmt)


def test_forward_equals_hf_with_blocks_removed(quantised):
    """The cache-free forward is bit-exact against HF on the same (quantised) modules."""
    ids = torch.tensor(random_prompts(1, [30], seed=2))
    runner = BlockRunner(quantised.model, max_batch=1, max_len=64)
    for mask in masks_for(8).values():
        with torch.no_grad():
            got = runner.forward(ids, mask)
            ref = remove_blocks(quantised.model, mask)(ids, use_cache=False).logits
        torch.testing.assert_close(got, ref, rtol=0, atol=0)


def test_cached_decode_equals_forward(quantised):
    """Prefill + decode through the KV cache against the cache-free forward on the same tokens.
    In bfloat16 (activations, or the quantised kernels, which always run in it) one token and a
    whole sequence round differently: a logit of magnitude ~4 may move by one or two bf16 steps
    (2^-6); a wrong mask moves logits by ~5."""
    prompt = random_prompts(1, [29], seed=2)[0]
    runner = BlockRunner(quantised.model, max_batch=2, max_len=64)
    native = weights.kernels(quantised.model) == "igserve-avx2"
    # int4bf16, bf16: the one-row decode runs the float32 kernels, the whole sequence bfloat16 matmuls
    exact = runner.dtype == torch.float32 and quantised.weights not in ("int4bf16", "bf16") \
        and (native or quantised.weights not in ("int4", "int8"))
    atol = 1e-4 if exact else 2 ** -6 * 4
    for name in ("mixed", "layers_1_2"):
        mask = masks_for(8)[name]
        logits, tokens = greedy_trace(runner, [prompt], [mask], steps=6)
        with torch.no_grad():
            full = runner.forward(torch.tensor([prompt + tokens[0, :-1].tolist()]), mask)[0, len(prompt) - 1:]
        torch.testing.assert_close(logits[0].float(), full.float(), rtol=0, atol=atol)


def test_int4_float32_greedy_equals_hf_generate(tiny_model_dir):
    lm = models.load(str(tiny_model_dir), dtype=torch.float32, weights="int4")
    prompts = random_prompts(2, [7, 23], seed=1)
    for mask in (torch.ones(8, dtype=torch.bool), masks_for(8)["mixed"]):
        ref_model = remove_blocks(lm.model, mask)
        for prompt, got in zip(prompts, engine_greedy(lm, prompts, [mask] * 2)):
            assert got == hf_greedy(ref_model, prompt, 16, use_cache=False)


def test_int4_float32_equals_the_dequantised_fp32_model(tiny_model_dir):
    """int4 with float32 activations is the fp32 model whose linears are the Q4_1 dequantisation:
    to float32 rounding with igserve's kernels, to the bf16 rounding of each kernel's input and
    output with torch's."""
    lm = models.load(str(tiny_model_dir), dtype=torch.float32, weights="int4")
    ref = weights.dequantized_copy(lm.model)
    ids = torch.tensor(random_prompts(1, [30], seed=2))
    mask = masks_for(8)["mixed"]
    with torch.no_grad():
        got = BlockRunner(lm.model, max_batch=1, max_len=64).forward(ids, mask)
        want = BlockRunner(ref, max_batch=1, max_len=64).forward(ids, mask)
        other = BlockRunner(ref, max_batch=1, max_len=64).forward(ids, masks_for(8)["layers_1_2"])
    err = (got - want).norm() / want.norm()
    assert got.dtype == torch.float32 and err < 0.03 and err < 0.1 * (other - want).norm() / want.norm()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.9
    if cpu_kernels.available():
        assert err < 1e-5


# ---------------------------------------------------------------------------- the shipped model
@pytest.mark.real_model
def test_gguf_q4_1_groups_are_the_served_fp32_weights(real):
    gguf = models._packaged_gguf(models.PACKAGED_MODELS[models.DEFAULT_MODEL])
    groups = weights.read_gguf_q4_1(gguf, real.model.config)
    state = real.model.state_dict()
    assert len(groups) == 7 * real.model.config.num_hidden_layers
    for name, g in groups.items():
        assert torch.equal(g.dequantize(), state[name + ".weight"]), name


def test_kernel_build_folder_follows_the_sources(tmp_path, monkeypatch):
    """Two versions of the kernel sources build into different folders, so checkouts sharing a
    cache never rebuild over each other's library."""
    from server import cpu_kernels

    for name in ("weight_only.cpp", "blocks.cpp", "weight_only.h"):
        (tmp_path / name).write_text(f"// {name}\n")
    monkeypatch.setattr(cpu_kernels, "SOURCE_DIR", tmp_path)
    first = cpu_kernels._source_digest()
    assert cpu_kernels._source_digest() == first
    (tmp_path / "weight_only.h").write_text("// changed\n")
    assert cpu_kernels._source_digest() != first


def test_bench_quality_appends_a_format_and_replaces_one_measured_again(tiny_model_dir, tmp_path):
    """fp32 is the reference (ppl ratio 0, agreement 1); a format run again with --append takes
    its earlier row's place instead of adding one, and its figures are measured, not copied."""
    import json

    from server import cli

    data = tmp_path / "data"
    data.mkdir()
    for domain, text in (("a", "The cat sat on the mat and looked at the dog."), ("b", "def f(x): return x * 2")):
        (data / f"{domain}.jsonl").write_text(json.dumps({"text": text}) + "\n")
    out = tmp_path / "q.json"
    common = ["--model", str(tiny_model_dir), "--data", str(data), "--docs-per-domain", "1", "--max-len", "16",
              "--prompts", "2", "--agree-tokens", "4", "--json", str(out)]
    assert cli.main(["bench", "quality", "--weights", "fp32,int4", *common]) == 0
    first = json.loads(out.read_text())
    assert [r["weights"] for r in first["formats"]] == ["fp32", "int4"]
    ref, int4 = first["formats"]
    assert ref["ppl_vs_first"] == 0 and ref["greedy_prefix_agreement"] == 1 and ref["tokens"] > 0
    assert 0 <= int4["greedy_prefix_agreement"] <= 1 and int4["ppl"] > 1
    assert cli.main(["bench", "quality", "--weights", "int8,int4", "--append", *common]) == 0
    again = json.loads(out.read_text())
    assert [r["weights"] for r in again["formats"]] == ["fp32", "int4", "int8"]
    assert again["formats"][1]["ppl"] == pytest.approx(int4["ppl"], rel=1e-3) and len(again["commands"]) == 2
    assert again["machine"] == weights.machine() and again["machine"]["cpu_flags"] == weights.cpu_flags()


@native
def test_int4bf16_builds_bf16_weights_only_for_the_linears_a_step_runs(tiny_model_dir):
    """The fused q/k/v and gate/up, o, down and the lm_head get their bf16 copy; the HF parts the
    runner fused (never called in serving) do not, until something calls them with many rows."""
    lm = models.load(str(tiny_model_dir), dtype=torch.float32, weights="int4bf16")
    runner = BlockRunner(lm.model, max_batch=1, max_len=64)
    layer = lm.model.model.layers[0]
    with torch.no_grad():
        runner.prefill([list(range(100, 100 + cpu_kernels.wide_rows() + 3))], torch.ones(1, 8, dtype=torch.bool), [0])
    assert runner.qkv[0].wide is not None and runner.gate_up[0].wide is not None
    assert layer.self_attn.o_proj._wide is not True and layer.mlp.down_proj._wide is not True
    assert layer.self_attn.q_proj._wide is True and layer.mlp.up_proj._wide is True  # not built
    assert lm.model.lm_head._wide is True  # a prefill takes the logits of its last position only
    x = torch.randn(cpu_kernels.wide_rows(), layer.self_attn.q_proj.in_features)
    layer.self_attn.q_proj(x)
    lm.model.lm_head(x)
    assert layer.self_attn.q_proj._wide is not True and lm.model.lm_head._wide is not True
