"""igserve's own CPU kernels (server/csrc/weight_only.cpp): weight-only int4 (Q4_1) and int8
linears with float32 activations for x86 CPUs with AVX2, FMA and F16C.

torch's CPU int4 kernel runs its fast path in bfloat16 and expands the weights again for every
row, so on a CPU without native bf16 arithmetic each linear paid two casts and a batch cost
nearly its row count times one row. These kernels expand each weight group once per call and
use it for every row, in float32: the result is the Q4_1 dequantisation to float32 rounding.
With ``q8`` (format int4q8) the activations are rounded to int8 first and one row runs integer
dot products, as llama.cpp does. One row of int4q8 and up to ``tile_rows`` rows of int4bf16 (x in
two int8 digits) run on AVX-512 VNNI (``vnni_tiles``) over a copy of the groups in 16-channel tiles
(``pack_q4_tiles``), chosen at run time: the build itself needs AVX2 only.
Built on first use with torch's extension builder (cached under ``$IGSERVE_CACHE/kernels``;
the time is logged); where the CPU lacks the instructions, no compiler is found or the
build fails, ``available()`` is False and the formats use torch's kernels.
``IGSERVE_NATIVE_KERNELS=0`` turns them off (to compare).
"""

from __future__ import annotations

import functools
import logging
import os
import time
from pathlib import Path

import torch

log = logging.getLogger("igserve.kernels")

SOURCE_DIR = Path(__file__).with_name("csrc")
SOURCES = [SOURCE_DIR / name for name in ("weight_only.cpp", "blocks.cpp")]
REQUIRED_FLAGS = {"avx2", "fma", "f16c"}
CFLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp"]


@functools.cache
def available() -> bool:
    """Whether ``torch.ops.igserve`` holds the kernels (built and loaded on the first call)."""
    from server import models, weights

    if os.environ.get("IGSERVE_NATIVE_KERNELS", "1") == "0":
        return False
    missing = REQUIRED_FLAGS - weights.cpu_features()
    if missing:
        log.info("native CPU kernels off: the CPU lacks %s", ", ".join(sorted(missing)))
        return False
    from torch.utils import cpp_extension

    build = models.cache_root() / "kernels" / f"torch-{torch.__version__}-{_source_digest()}"
    build.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    try:
        cpp_extension.load(name="igserve_cpu_kernels", sources=[str(s) for s in SOURCES], extra_cflags=CFLAGS,
                           extra_ldflags=["-fopenmp"], build_directory=str(build), is_python_module=False,
                           verbose=False)
    except Exception as exc:  # no compiler, no ninja, a failed build: torch's kernels still work
        log.warning("native CPU kernels unavailable (%s); using torch's kernels", exc)
        return False
    log.info("native CPU kernels ready in %.1f s", time.perf_counter() - start)
    return True


def _source_digest() -> str:
    """Hash of the kernel sources and flags: one build folder per version, so two checkouts (or an
    upgrade beside a running server) never rebuild over each other's library."""
    import hashlib

    digest = hashlib.sha256(" ".join(CFLAGS).encode())
    for path in sorted([*SOURCE_DIR.glob("*.cpp"), *SOURCE_DIR.glob("*.h")]):
        digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()[:12]


def pack_q4(q: torch.Tensor) -> torch.Tensor:
    """Q4_1 values q [N, K] (0..15) -> the kernel's nibble layout [N, K/2] uint8: in every group of
    32, byte j of half h holds element 16h + j (low nibble) and 16h + 8 + j (high nibble)."""
    n, k = q.shape
    g = q.to(torch.uint8).view(n, k // 32, 2, 2, 8)
    return (g[:, :, :, 0] | (g[:, :, :, 1] << 4)).reshape(n, k // 2).contiguous()


def unpack_q4(qs: torch.Tensor) -> torch.Tensor:
    """Inverse of ``pack_q4``: [N, K/2] uint8 -> [N, K] values 0..15."""
    n, half = qs.shape
    b = qs.view(n, half // 16, 2, 1, 8)
    return torch.cat([b & 15, b >> 4], dim=3).reshape(n, half * 2)


def pack_dm(d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Per-group scale d and min m [N, K/32] -> int32 words holding fp16 d (low half) and fp16 m
    (high half): exact for GGUF groups, which store both in fp16."""
    pair = torch.stack([d.half(), m.half()], -1).contiguous()  # [N, G, 2] fp16
    return pair.view(torch.int32).view(d.shape).contiguous()


def unpack_dm(dm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    pair = dm.contiguous().view(torch.float16).view(*dm.shape, 2).float()
    return pair[..., 0], pair[..., 1]


def q4_linear(x2: torch.Tensor, qs: torch.Tensor, dm: torch.Tensor, q8: bool = False,
              wide: torch.Tensor | None = None, tiles: torch.Tensor | None = None) -> torch.Tensor:
    """x2 [R, K] float32 @ W^T for Q4_1 W in the packed layout -> [R, N] float32; ``q8``: x2
    rounded to int8 per group of 32 first (``round_q8``); ``wide``: W in bfloat16 [N, K], which
    calls of ``wide_rows()`` rows and more multiply in bfloat16 instead; ``tiles``: the groups
    as ``pack_q4_tiles`` lays them out, where ``vnni_tiles()``: for one row of ``q8`` and, without
    ``q8``, for up to ``tile_rows()`` rows (x in two int8 digits per group, weight_only.cpp)."""
    return torch.ops.igserve.q4_linear(x2, qs, dm, q8, wide, tiles)


@functools.cache
def wide_rows() -> int:
    """Rows from which an int4bf16 linear multiplies in bfloat16 (5 with AMX, else 14; weight_only.cpp)."""
    return torch.ops.igserve.wide_rows()


@functools.cache
def tile_rows() -> int:
    """Rows up to which an int4bf16 linear runs its tiles where ``vnni_tiles()``, past
    ``wide_rows()`` (9 with AMX, else 32; weight_only.cpp)."""
    return torch.ops.igserve.tile_rows()


def int4bf16_rows() -> dict:
    """int4bf16's row thresholds on this CPU, for reports (None where igserve's kernels are off)."""
    on = available()
    return {"int4bf16_wide_rows": wide_rows() if on else None, "int4bf16_tile_rows": tile_rows() if on else None}


@functools.cache
def vnni_tiles() -> bool:
    """Whether this CPU runs int4q8's one-row calls and int4bf16's calls of a few rows (``tile_rows()``)
    on VNNI tiles (AVX-512 VNNI; ``pack_q4_tiles``)."""
    return torch.ops.igserve.vnni_tiles()


# the order of a group's 32 elements in the kernels' int8-rounded activations (weight_only.cpp, q8_row)
Q8_ORDER = [*range(0, 8), *range(16, 24), *range(8, 16), *range(24, 32)]


def pack_q4_tiles(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Q4_1 groups (q [N, K] in 0..15, d and m [N, K/32]) as 16-channel tiles, uint8 [N/16, K/32, 320]:
    per 16 channels and group, 256 bytes of nibbles (byte 4c + i of block j: position 4j + i of
    ``Q8_ORDER`` low, 4j + i + 16 high), then the 16 channels' fp16 d and fp16 m (weight_only.cpp,
    q8_tile_row and q4_tile_bf16)."""
    n, k = q.shape
    t, g = n // 16, k // 32
    q = q.to(torch.uint8).view(t, 16, g, 32)[..., Q8_ORDER]
    lo = q[..., :16].reshape(t, 16, g, 4, 4).permute(0, 2, 3, 1, 4)  # [t, g, j, c, i]
    hi = q[..., 16:].reshape(t, 16, g, 4, 4).permute(0, 2, 3, 1, 4)
    nibbles = (lo | (hi << 4)).reshape(t, g, 256)
    scales = [v.to(torch.float16).view(t, 16, g).permute(0, 2, 1).contiguous().view(torch.uint8) for v in (d, m)]
    return torch.cat([nibbles, *scales], -1).contiguous()


def pack_i8_tiles(q: torch.Tensor) -> torch.Tensor:
    """int8 weights q [N, K] as 16-channel tiles, uint8 [N/16, K/32, 512]: per 16 channels and group,
    eight 64-byte blocks, byte 4c + i of block j holding q + 128 at position 4j + i of ``Q8_ORDER``
    (weight_only.cpp, i8_tile_i8x2)."""
    n, k = q.shape
    t, g = n // 16, k // 32
    u = (q.to(torch.int16) + 128).to(torch.uint8).view(t, 16, g, 32)[..., Q8_ORDER]
    return u.reshape(t, 16, g, 8, 4).permute(0, 2, 3, 1, 4).reshape(t, g, 512).contiguous()


def round_q8(x2: torch.Tensor) -> torch.Tensor:
    """The reference of the kernels' activation rounding: per row and group of 32, scale d =
    absmax / 127 and x -> d * round(x / d) (ties to even)."""
    g = x2.float().view(x2.shape[0], -1, 32)
    d = g.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    return (torch.round(g * inv) * d).view_as(x2)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """Each row's first index of its largest value, for [B, V] logits: blocks.cpp's one pass for
    float32 on a CPU with these kernels (torch's CPU argmax is a slow reduction at a 49k
    vocabulary), torch's otherwise. A NaN counts as no value there (the sampler zeroes a
    non-finite row first)."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and x.shape[1] and available():
        return torch.ops.igserve.argmax_rows(x.contiguous())
    return x.argmax(-1)


def round_i8x2(x2: torch.Tensor) -> torch.Tensor:
    """The reference of int4bf16's few-row activations (weight_only.cpp, i8x2_rows), float64: per row
    and group of 32, unit u = absmax / 127, a = round(x / u), b = round(256 (x - a u) / u) within
    int8, x -> u a + (u / 256) b (float32 steps as the kernel rounds them; ties to even)."""
    g = x2.float().view(x2.shape[0], -1, 32)
    unit = g.abs().amax(-1, keepdim=True) / 127
    ia = torch.where(unit > 0, 1 / unit, torch.zeros_like(unit))
    ib = torch.where(unit > 0, 256 / unit, torch.zeros_like(unit))
    a = torch.round(g * ia)
    rest = (g.double() - a.double() * unit.double()).float()  # one rounding, as the kernel's FMA
    b = torch.round(rest * ib).clamp(-128, 127)
    return (unit.double() * a.double() + (unit / 256).double() * b.double()).view_as(x2)


def i8_linear(x2: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, wide: torch.Tensor | None = None,
              tiles: torch.Tensor | None = None) -> torch.Tensor:
    """x2 [R, K] float32 @ (q * scales[:, None])^T -> [R, N] float32; ``wide`` as for ``q4_linear``;
    ``tiles``: q as ``pack_i8_tiles`` lays it out, for up to ``tile_rows()`` rows where
    ``vnni_tiles()`` (x in two int8 digits per group, as int4bf16's linears)."""
    return torch.ops.igserve.i8_linear(x2, q, scales, wide, tiles)


def bf16_linear(x2: torch.Tensor, w: torch.Tensor, wide: torch.Tensor | None = None) -> torch.Tensor:
    """x2 [R, K] float32 @ W^T for a bfloat16 W [N, K] -> [R, N] float32: each weight widened to float32
    (exact), so the product is the float32 one with W's values; ``wide`` as for ``q4_linear``."""
    return torch.ops.igserve.bf16_linear(x2, w, wide)


def f32_linear(x2: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x2 [R, K] float32 @ W^T for a float32 W [N, K]: the register tiles for up to 4 rows (one read
    of each weight, where BLAS's one-row product is slower on some CPUs), torch's matmul above."""
    return torch.ops.igserve.f32_linear(x2, w)
