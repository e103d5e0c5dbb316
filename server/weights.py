"""Weight formats for the runner's linears: fp32, bf16, int8 and int4 weight-only, int4q8 and int4bf16.

* ``int4`` serves the shipped GGUF's own Q4_1 bits: every 32-weight group keeps its fp16 scale d
  and min m (w = d·q + m, q in 0..15). torch's int4 kernels compute w = (q - 8)·scale + zero, so
  the groups go in as scale = d, zero = m + 8d. The scales/zeros tensor is in the activation
  dtype: in float32 the layer is the Q4_1 dequantisation to float rounding; in bfloat16 (the fast
  CPU path) d and m + 8d are rounded to 8 mantissa bits. A model without a GGUF is quantised with
  ggml's Q4_1 rule (m = group min, d = range / 15).
* ``int4q8``: int4 weights with each linear's input rounded to int8 per group of 32 first (not
  down_proj's, whose SiLU·up outliers lose the most), as llama.cpp pairs Q4_1 with Q8_1: a single
  row runs integer dot products (on AVX-512 VNNI over 16-channel tiles of the same groups).
  igserve's kernels only; with torch's it is ``int4``.
* ``int4bf16``: int4 whose linears (and lm_head) also carry a bfloat16 copy: calls of
  ``wide_rows()`` rows and more run oneDNN's bf16 matmuls on it; on a CPU with AVX-512 VNNI calls
  of up to ``tile_rows()`` rows of an int4 linear multiply the Q4_1 groups, in 16-channel tiles, in
  integer dot products (the weights exact, x in two int8 digits per group: 2^-16 of the group's
  largest value), and the int8 lm_head's calls its int8 weights likewise; this reaches past
  ``wide_rows()``. Without VNNI the rows below it run the float32 kernels.
* ``int8``: symmetric per-output-channel int8 (``_weight_int8pack_mm``), for 16/32-bit models.
* ``bf16``: bfloat16 weights. With float32 activations (the default where igserve's kernels run)
  every linear is a ``Bf16Linear``: few rows widen each weight to float32 exactly, ``wide_rows()``
  rows and more run oneDNN's bf16 matmul on a reordered copy, and the fused blocks take it; with
  bfloat16 activations the model is plain bf16 ``nn.Linear``s.
* The tied embedding / lm_head (Q8_0 in the GGUF) is an int8 per-channel lm_head in both
  quantised formats; the embedding lookup stays a table in the activation dtype.

Kernels: with float32 activations on a CPU that has AVX2/FMA/F16C (``native``), both formats run
igserve's own kernels (server/cpu_kernels.py), which compute in float32 on the exact stored
weights: int4 keeps d and m in fp16 as the GGUF does. ``fp32`` stays plain ``nn.Linear``s; the
fused blocks run its few-row calls, and ``native_head`` its lm_head's, in the same register
tiles. Otherwise torch's kernels run in bfloat16 (the scales' dtype). Norms, rotary, attention
and the KV cache run in the activation dtype. CUDA paths (torch's tinygemm int4 kernel; int8 as a
dequantising matmul) are untested.
"""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

FORMATS = ("auto", "fp32", "bf16", "int8", "int4", "int4q8", "int4bf16")
QUANTISED = ("int8", "int4", "int4q8", "int4bf16")
KERNEL_DTYPE = torch.bfloat16  # the quantised kernels' vectorised path, on every CPU and on CUDA
GROUP = 32  # Q4_1 block size = torch int4 group size


@dataclass
class Q4Groups:
    """One linear weight [N, K] in Q4_1 groups along K: q [N, K] ints 0..15, d and m [N, K/32] fp32."""

    q: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        n, k = self.q.shape
        w = self.q.view(n, k // GROUP, GROUP).float() * self.d[..., None] + self.m[..., None]
        return w.view(n, k)

    def permute_rows(self, perm: torch.Tensor) -> "Q4Groups":
        return Q4Groups(self.q[perm], self.d[perm], self.m[perm])


def quantize_q4_1(w: torch.Tensor) -> Q4Groups:
    """ggml's Q4_1 rule on a float weight [N, K]: per 32-group min m, scale d = (max - min) / 15,
    both rounded to fp16 as the GGUF stores them."""
    n, k = w.shape
    if k % GROUP:
        raise ValueError(f"int4 needs in_features divisible by {GROUP}, got {k}")
    g = w.detach().float().reshape(n, k // GROUP, GROUP)
    m = g.amin(-1).half().float()
    d = ((g.amax(-1) - m) / 15).half().float()
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = ((g - m[..., None]) * inv[..., None]).round().clamp(0, 15).to(torch.uint8)
    return Q4Groups(q.view(n, k), d, m)


# ---------------------------------------------------------------------------- GGUF
def _q4_1_from_gguf(data: np.ndarray, n: int, k: int) -> Q4Groups:
    """Raw Q4_1 rows [N, K/32 * 20 bytes] -> groups. A block: fp16 d, fp16 m, 16 bytes of
    nibbles (low nibbles are elements 0..15, high nibbles 16..31)."""
    blocks = np.ascontiguousarray(data).reshape(n, k // GROUP, 20)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    qs = blocks[..., 4:]
    q = np.concatenate([qs & 15, qs >> 4], axis=-1).reshape(n, k)
    return Q4Groups(torch.from_numpy(q.copy()), torch.from_numpy(d), torch.from_numpy(m))


_GGUF_LINEARS = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                 "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                 "ffn_down": "mlp.down_proj"}


def _unpermute(n_rows: int, heads: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's q/k rotary permutation (as transformers does on load)."""
    dim = n_rows // heads // 2
    return torch.arange(n_rows).view(heads, dim, 2).transpose(1, 2).reshape(-1)


def read_gguf_q4_1(path: Path, config) -> dict[str, Q4Groups]:
    """The Q4_1 linears of a GGUF file, keyed by HF parameter name (``model.layers.0.mlp.up_proj``)."""
    import gguf

    out = {}
    for t in gguf.GGUFReader(path).tensors:
        parts = t.name.split(".")
        if t.tensor_type != gguf.GGMLQuantizationType.Q4_1 or parts[0] != "blk" or parts[2] not in _GGUF_LINEARS:
            continue
        k, n = (int(s) for s in t.shape)
        groups = _q4_1_from_gguf(t.data, n, k)
        if parts[2] == "attn_q":
            groups = groups.permute_rows(_unpermute(n, config.num_attention_heads))
        elif parts[2] == "attn_k":
            groups = groups.permute_rows(_unpermute(n, config.num_key_value_heads))
        out[f"model.layers.{parts[1]}.{_GGUF_LINEARS[parts[2]]}"] = groups
    return out


# ---------------------------------------------------------------------------- modules
class _WeightOnlyLinear(torch.nn.Module):
    """y = x W^T (+ b) with a quantised W: ``_matmul`` of the rows of x, then the bias. The kernel
    runs in the dtype of the scales (``kernel_dtype``): x is cast to it and y back to x's dtype."""

    in_features: int
    out_features: int
    bias: torch.Tensor | None

    @property
    def kernel_dtype(self) -> torch.dtype:
        raise NotImplementedError

    def forward(self, x):
        shape = x.shape
        y = self._matmul(x.reshape(-1, self.in_features).to(self.kernel_dtype))
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype).view(*shape[:-1], self.out_features)

    def _matmul(self, x2: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    @property
    def wide(self) -> torch.Tensor | None:
        """int4bf16: the weight the kernel multiplies calls of many rows with (else None), made on
        first use, so that the parts of a fused linear, which serving never calls, never hold one."""
        packed = getattr(self, "_wide", None)  # absent on stacks of torch-kernel parts
        if packed is True:
            packed = self._wide = _Packed(_wide_weight(self.dequantized()))
        return None if packed is None else packed.tensor

    @property
    def tiles(self) -> torch.Tensor | None:
        """The weights in 16-channel tiles (``_pack_tiles``) where this linear's kernel reads them (else
        None), made on first use: the parts of a fused linear never hold a copy."""
        tiles = getattr(self, "_tiles", None)
        if tiles is True:
            tiles = self._tiles = self._pack_tiles()
        return tiles

    def _pack_tiles(self) -> torch.Tensor:
        raise NotImplementedError

    def _wide_for(self, x2: torch.Tensor) -> torch.Tensor | None:
        """``wide`` for a call that multiplies in bf16 (``cpu_kernels.wide_rows()`` rows or more), else None."""
        from server import cpu_kernels

        if getattr(self, "_wide", None) is None:
            return None
        return self.wide if x2.shape[0] >= cpu_kernels.wide_rows() else None


class Int4Linear(_WeightOnlyLinear):
    """y = x W^T (+ b) with W in int4 groups of 32; ``native``: igserve's float32 CPU kernel on the
    nibbles and fp16 d, m (server/cpu_kernels.py), else torch's int4 kernel in ``dtype``. ``q8``
    (native only): the activations are rounded to int8 per group of 32 first, as llama.cpp does,
    so a single row runs integer dot products."""

    def __init__(self, groups: Q4Groups, bias: torch.Tensor | None, dtype: torch.dtype, device="cpu",
                 native: bool = False, q8: bool = False, wide: bool = False):
        super().__init__()
        n, k = groups.q.shape
        self.in_features, self.out_features = k, n
        self.cuda_kernel = str(device).startswith("cuda")
        self.native = native
        self.q8 = native and q8
        # int4bf16: the weight in bfloat16 too, for calls of many rows (an attribute, not a buffer:
        # what a one-row step reads, and so the cost model, stays the int4 groups); made on first use
        self._wide = True if native and wide else None
        if n % 16:
            raise ValueError(f"int4 needs out_features divisible by 16, got {n}")
        if native:
            from server import cpu_kernels

            self.register_buffer("qs", cpu_kernels.pack_q4(groups.q))
            self.register_buffer("dm", cpu_kernels.pack_dm(groups.d, groups.m))
            self.register_buffer("bias", None if bias is None else bias.detach().float())
            # the same groups as 16-channel tiles, for int4q8's one row and int4bf16's few rows on
            # AVX-512 VNNI (an attribute, not a buffer: a one-row step reads them instead of qs and
            # dm, as many bytes); made on first use, as ``wide``
            tiled = (self.q8 or wide) and cpu_kernels.vnni_tiles()
            self._tiles = True if tiled else None
            return
        self.register_buffer("packed", _torch_int4_pack(groups.q, device))
        zero = groups.m + 8 * groups.d
        self.register_buffer("scales_zeros", torch.stack([groups.d, zero], -1).transpose(0, 1).contiguous().to(
            device=device, dtype=dtype))  # [K/32, N, 2]
        self.register_buffer("bias", None if bias is None else bias.detach().to(device=device, dtype=dtype))

    @property
    def kernel_dtype(self) -> torch.dtype:
        return torch.float32 if self.native else self.scales_zeros.dtype

    def _pack_tiles(self) -> torch.Tensor:
        from server import cpu_kernels

        d, m = cpu_kernels.unpack_dm(self.dm)
        return cpu_kernels.pack_q4_tiles(cpu_kernels.unpack_q4(self.qs), d, m)

    def _matmul(self, x2):
        if self.native:
            from server import cpu_kernels

            return cpu_kernels.q4_linear(x2.contiguous(), self.qs, self.dm, self.q8, self._wide_for(x2), self.tiles)
        if self.cuda_kernel:
            return torch.ops.aten._weight_int4pack_mm(x2, self.packed, GROUP, self.scales_zeros)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.packed, GROUP, self.scales_zeros)

    @classmethod
    def cat(cls, parts: list["Int4Linear"]) -> torch.nn.Module:
        """Concatenate along N. igserve's layout is whole rows; torch's packs rows in blocks whose
        height depends on the CPU (64 on AVX-512), so its parts stack only where a probe of the same
        shapes packs the same as the whole; otherwise the parts run one after another."""
        if parts[0].native:
            return _stacked(cls, parts, {"qs": 0, "dm": 0, "bias": 0})
        if not _torch_int4_rows_stack(tuple(p.out_features for p in parts), parts[0].in_features,
                                      str(parts[0].packed.device)):
            return Concat(parts)
        return _stacked(cls, parts, {"packed": 0, "scales_zeros": 1, "bias": 0})

    def dequantized(self) -> torch.Tensor:
        """The float weight [N, K] this layer computes with (its scales/zeros' precision)."""
        if self.native:
            from server import cpu_kernels

            d, m = cpu_kernels.unpack_dm(self.dm)
            return Q4Groups(cpu_kernels.unpack_q4(self.qs), d, m).dequantize()
        eye = torch.eye(self.in_features, dtype=self.scales_zeros.dtype, device=self.packed.device)
        bias, self.bias = self.bias, None
        try:
            return self.forward(eye).T.float()
        finally:
            self.bias = bias


@dataclass(frozen=True)
class _Packed:
    """A read-only weight in a layout with no storage to copy (oneDNN's): copies of a model share it."""

    tensor: torch.Tensor

    def __deepcopy__(self, memo) -> "_Packed":
        return self


def _wide_weight(w: torch.Tensor) -> torch.Tensor:
    """An int4bf16 layer's weight for many rows: bfloat16, reordered once into oneDNN's blocked
    layout where torch has oneDNN (the kernels' ``wide_linear``), else plain."""
    w = w.to(torch.bfloat16).contiguous()
    if not torch.backends.mkldnn.is_available():
        return w
    return torch.ops.mkldnn._reorder_linear_weight(w, WIDE_ROWS_HINT)


WIDE_ROWS_HINT = 16  # the rows oneDNN picks the weight's layout for (any number of rows runs on it)


class Int8Linear(_WeightOnlyLinear):
    """y = (x W8^T) · s (+ b): symmetric int8 per output channel.

    ``_weight_int8pack_mm`` streams the weight once per row: it wins while a call is bound by
    reading weights (decode) and loses to a float32 matmul on a dequantised copy from ``DENSE_ROWS``
    rows up (prefill chunks, large batches; measured on AVX2)."""

    DENSE_ROWS = 32

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype, device="cpu",
                 native: bool = False, wide: bool = False):
        super().__init__()
        self.native = native
        dtype = torch.float32 if native else dtype
        w = weight.detach().float()
        self.out_features, self.in_features = w.shape
        scale = w.abs().amax(1).clamp(min=1e-12) / 127
        self.register_buffer("weight", (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8).to(device))
        self.register_buffer("scales", scale.to(device=device, dtype=dtype))
        self.register_buffer("bias", None if bias is None else bias.detach().to(device=device, dtype=dtype))
        # int4bf16's lm_head: its int8 weights in bfloat16 too, for calls of many rows, and as
        # 16-channel tiles for few rows on AVX-512 VNNI (as Int4Linear's; both made on first use)
        self._wide = True if native and wide else None
        if native and wide and self.out_features % 16 == 0:
            from server import cpu_kernels

            self._tiles = True if cpu_kernels.vnni_tiles() else None

    @property
    def kernel_dtype(self) -> torch.dtype:
        return self.scales.dtype

    def _pack_tiles(self) -> torch.Tensor:
        from server import cpu_kernels

        return cpu_kernels.pack_i8_tiles(self.weight)

    def _matmul(self, x2):
        if self.native:  # igserve's kernels for every row count (server/cpu_kernels.py)
            from server import cpu_kernels

            return cpu_kernels.i8_linear(x2.contiguous(), self.weight, self.scales, self._wide_for(x2), self.tiles)
        if x2.is_cuda:  # untested: dequantising matmul
            return F.linear(x2, self.weight.to(x2.dtype)) * self.scales
        if x2.shape[0] >= self.DENSE_ROWS:
            return F.linear(x2.float(), self.weight.float() * self.scales.float()[:, None]).to(x2.dtype)
        return torch.ops.aten._weight_int8pack_mm(x2, self.weight, self.scales)

    @classmethod
    def cat(cls, parts: list["Int8Linear"]) -> "Int8Linear":
        return _stacked(cls, parts, {"weight": 0, "scales": 0, "bias": 0})

    def dequantized(self) -> torch.Tensor:
        return self.weight.float() * self.scales.float()[:, None]


class Bf16Linear(_WeightOnlyLinear):
    """y = x W^T (+ b) with W in bfloat16 and float32 x: the ``bf16`` format where activations stay
    float32. ``native``: igserve's CPU kernel widens each weight to float32 (exact); on a CPU that
    computes in bf16 (``native_bf16``), calls of ``wide_rows()`` rows and more run oneDNN's bf16
    matmul (x rounded to bf16) on a reordered copy made on first use instead, as int4bf16 does
    (elsewhere oneDNN would emulate bf16). Otherwise torch's bf16 matmul."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, native: bool = False):
        super().__init__()
        self.native = native
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight.detach().to(torch.bfloat16).contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().float())
        self._wide = True if native and native_bf16() else None

    @property
    def kernel_dtype(self) -> torch.dtype:
        return torch.float32 if self.native else torch.bfloat16

    def _matmul(self, x2):
        if self.native:
            from server import cpu_kernels

            return cpu_kernels.bf16_linear(x2.contiguous(), self.weight, self._wide_for(x2))
        return F.linear(x2, self.weight)

    @classmethod
    def cat(cls, parts: list["Bf16Linear"]) -> "Bf16Linear":
        return _stacked(cls, parts, {"weight": 0, "bias": 0})

    def dequantized(self) -> torch.Tensor:
        return self.weight.float()


def to_bf16(model: torch.nn.Module, native: bool = False) -> torch.nn.Module:
    """Replace the decoder's linears and the lm_head with ``Bf16Linear``s, in place, on a float32
    model: the ``bf16`` format with float32 activations."""
    for name, module in list(model.named_modules()):
        if isinstance(module, torch.nn.Linear):
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, attr,
                    Bf16Linear(module.weight, module.bias, native))
    return model


def _torch_int4_pack(q: torch.Tensor, device) -> torch.Tensor:
    """torch's packed int4 weight from nibbles [N, K]."""
    if str(device).startswith("cuda"):  # untested: tinygemm wants two nibbles per byte, high nibble first
        q = q.to(torch.uint8)
        return torch.ops.aten._convert_weight_to_int4pack((q[:, ::2] << 4 | q[:, 1::2]).to(device), 8)
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)


@functools.lru_cache(maxsize=None)
def _torch_int4_rows_stack(rows: tuple[int, ...], k: int, device: str) -> bool:
    """Whether torch's packing of parts with these row counts, stacked, equals its packing of the whole."""
    q = torch.randint(0, 16, (sum(rows), k), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    stacked = torch.cat([_torch_int4_pack(part, device) for part in q.split(rows)])
    return torch.equal(stacked, _torch_int4_pack(q, device))


class Concat(torch.nn.Module):
    """``cat([l(x) for l in parts], -1)``: the fused linear where the parts' weights cannot stack."""

    def __init__(self, parts: list[torch.nn.Module]):
        super().__init__()
        self.parts = torch.nn.ModuleList(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], -1)


def _stacked(cls, parts, dims: dict[str, int]):
    out = cls.__new__(cls)
    torch.nn.Module.__init__(out)
    out.__dict__.update({k: v for k, v in vars(parts[0]).items() if not k.startswith("_") and k != "training"})
    for name, dim in dims.items():
        bufs = [getattr(p, name) for p in parts]
        out.register_buffer(name, None if bufs[0] is None else torch.cat(bufs, dim))
    out.out_features = sum(p.out_features for p in parts)
    out._wide = None if getattr(parts[0], "_wide", None) is None else True  # its own bf16 copy, made on first use
    if getattr(parts[0], "_tiles", None) is not None:  # its own tiles, made on first use
        out._tiles = True
    return out


def fuse(linears: list[torch.nn.Module]) -> torch.nn.Module:
    """One linear computing ``cat([l(x) for l in linears], -1)`` in one kernel call (q/k/v and
    gate/up). Plain linears get one concatenated weight and are re-pointed at views of it, so
    memory is shared and the HF modules stay usable."""
    first = linears[0]
    bias = None if first.bias is None else torch.cat([l.bias for l in linears])
    if isinstance(first, torch.nn.Linear):
        w = torch.cat([l.weight.detach() for l in linears])
        fused = torch.nn.Linear(w.shape[1], w.shape[0], bias=bias is not None, device=w.device, dtype=w.dtype)
        fused.weight = torch.nn.Parameter(w, requires_grad=False)
        if bias is not None:
            fused.bias = torch.nn.Parameter(bias.detach(), requires_grad=False)
        start = 0
        for l in linears:
            n = l.weight.shape[0]
            l.weight.data = w[start:start + n]
            if bias is not None:
                l.bias.data = fused.bias.data[start:start + n]
            start += n
        return fused
    return type(first).cat(linears)


# ---------------------------------------------------------------------------- conversion
def quantize(model: torch.nn.Module, fmt: str, dtype: torch.dtype = KERNEL_DTYPE,
             groups: dict[str, Q4Groups] | None = None, device="cpu", native: bool = False) -> torch.nn.Module:
    """Replace the decoder's linears (and the lm_head) with ``fmt`` modules, in place; their
    kernels run in ``dtype``, or igserve's float32 CPU kernels with ``native``. ``groups``: Q4_1
    groups read from a GGUF (int4 only); missing linears are quantised here."""
    if fmt not in QUANTISED:
        raise ValueError(f"not a quantised format: {fmt!r}")
    groups = groups or {}
    for name, module in list(model.named_modules()):
        if not isinstance(module, torch.nn.Linear) or name == "lm_head":
            continue
        if fmt != "int8":
            g = groups.get(name) or quantize_q4_1(module.weight)
            # int4q8 keeps down_proj's input in float32: its outliers (SiLU·up) lose the most to int8
            new = Int4Linear(g, module.bias, dtype, device, native,
                             q8=fmt == "int4q8" and not name.endswith("down_proj"), wide=fmt == "int4bf16")
        else:
            new = Int8Linear(module.weight, module.bias, dtype, device, native)
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, new)
    head = model.lm_head
    model.lm_head = Int8Linear(head.weight, head.bias, dtype, device, native, wide=fmt == "int4bf16")
    return model


def pin_kernel_dtype(model: torch.nn.Module, dtype: torch.dtype = KERNEL_DTYPE) -> torch.nn.Module:
    """Put the quantised modules' scales (and biases) back in the kernel dtype after a
    ``model.to(activation dtype)``: float32 activations around a bf16 kernel is the fast path on
    CPUs without native bf16 arithmetic."""
    for module in model.modules():
        if isinstance(module, (Int4Linear, Int8Linear)) and not module.native:
            for name, buf in module.named_buffers(recurse=False):
                if buf is not None and buf.is_floating_point():
                    setattr(module, name, buf.to(dtype))
    return model


def native_kernels(device: str, dtype: torch.dtype) -> bool:
    """Whether quantised linears run igserve's CPU kernels: float32 activations on a CPU that has them."""
    from server import cpu_kernels

    return str(device) == "cpu" and dtype == torch.float32 and cpu_kernels.available()


def kernel_tensors(linear: torch.nn.Module) -> tuple[list[torch.Tensor], torch.Tensor | None] | None:
    """(weight tensors, bias) as igserve's fused CPU blocks take a linear (server/csrc/blocks.cpp):
    [qs, dm] for native int4, [q, scales] for native int8, [weight] for native bf16 (then the copy for
    oneDNN's bf16 matmul where there is one, and int4's tiles), [weight] for float32; None otherwise."""
    if isinstance(linear, torch.nn.Linear) and linear.weight.dtype == torch.float32:
        return [linear.weight.detach()], None if linear.bias is None else linear.bias.detach()
    if isinstance(linear, Int4Linear) and linear.native:
        extra = [t for t in (linear.wide, linear.tiles) if t is not None]
        return [linear.qs, linear.dm] + extra, linear.bias
    if isinstance(linear, Int8Linear) and linear.native:
        extra = [t for t in (linear.wide, linear.tiles) if t is not None]
        return [linear.weight, linear.scales] + extra, linear.bias
    if isinstance(linear, Bf16Linear) and linear.native:
        return [linear.weight] + ([] if linear.wide is None else [linear.wide]), linear.bias
    return None


class F32Head(torch.nn.Module):
    """A bias-free float32 linear (the fp32 format's lm_head) whose inference calls on rows run
    igserve's kernel (``cpu_kernels.f32_linear``: register tiles up to 4 rows, torch's matmul
    above); calls that need gradients, or on other shapes, stay ``F.linear``."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.weight = linear.weight  # shared: tied to the embedding as before
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x):
        if x.dim() == 2 and x.dtype == torch.float32 and not (torch.is_grad_enabled() and x.requires_grad):
            from server import cpu_kernels

            return cpu_kernels.f32_linear(x.contiguous(), self.weight)
        return F.linear(x, self.weight)


def native_head(lm_head: torch.nn.Module) -> torch.nn.Module:
    """The lm_head as runners with igserve's fused blocks call it: a plain float32 one as an
    ``F32Head``; every other format's already runs igserve's kernels or torch's, as chosen at load."""
    if type(lm_head) is torch.nn.Linear and lm_head.bias is None and lm_head.weight.dtype == torch.float32:
        return F32Head(lm_head)
    return lm_head


def kernels(model: torch.nn.Module) -> str:
    """Which kernels the linears run (in /health and reports): "igserve-avx2" or "torch"."""
    native = any(getattr(m, "native", False) for m in model.modules() if isinstance(m, _WeightOnlyLinear))
    return "igserve-avx2" if native else "torch"


def activation_dtype(fmt: str, device: str = "cpu") -> torch.dtype:
    """Activations (residual stream, norms, attention, KV cache) for a quantised format: bfloat16
    on CUDA; on a CPU float32 wherever igserve's kernels run (they compute in it, and beat torch's
    bf16 int4 kernel at decode on AVX-512 BF16 too: README, "Weight formats"), else bfloat16 where
    the CPU computes in it (AVX-512 BF16, AMX), else float32: on AVX2 a bf16 attention over a long
    cache is several times slower than float32."""
    from server import cpu_kernels

    if device.startswith("cuda"):
        return torch.bfloat16
    if cpu_kernels.available() or not native_bf16():
        return torch.float32
    return torch.bfloat16


def native_bf16() -> bool:
    """Whether this CPU computes in bfloat16 (AVX-512 BF16 or AMX) rather than emulating it."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_features())


def dequantized_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A float32 copy of a quantised model whose linears hold the weights the quantised kernels
    compute with: the reference the quantised runner is tested against."""
    import copy

    ref = copy.deepcopy(model)
    for name, module in list(ref.named_modules()):
        if isinstance(module, _WeightOnlyLinear):
            lin = torch.nn.Linear(module.in_features, module.out_features, bias=module.bias is not None)
            lin.weight = torch.nn.Parameter(module.dequantized(), requires_grad=False)
            if module.bias is not None:
                lin.bias = torch.nn.Parameter(module.bias.float(), requires_grad=False)
            parent, _, attr = name.rpartition(".")
            setattr(ref.get_submodule(parent) if parent else ref, attr, lin)
    return ref.float()


def cpu_features() -> set[str]:
    """Every flag of the CPU (/proc/cpuinfo; empty where there is none)."""
    return set(_cpuinfo("flags").split())


def cpu_flags() -> list[str]:
    """The SIMD/matrix flags that pick kernels, recorded with every measurement."""
    keep = ("avx", "amx", "sse4", "fma", "f16c")
    return sorted(f for f in cpu_features() if f.startswith(keep) or "vnni" in f or "bf16" in f)


def cpu_model() -> str:
    return _cpuinfo("model name") or platform.processor() or platform.machine()


def machine() -> dict:
    """The machine a measurement ran on, as the reports record it."""
    return {"cpu": cpu_model(), "cpus": os.cpu_count(), "cpu_flags": cpu_flags()}


def _cpuinfo(field: str) -> str:
    """The value of the first ``field`` line of /proc/cpuinfo, or ""."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    for line in text.splitlines():
        if line.startswith(field):
            return line.split(":", 1)[1].strip()
    return ""


def auto_format(device: str = "cpu") -> str:
    """The format ``auto`` serves (table and measurements in the README): int4 wherever torch's
    CPU int4 kernel is vectorised (AVX2 and up: AVX-512, AMX), where it is the fastest format at
    every batch size measured and serves the GGUF's own bits; int4bf16 where the CPU also computes
    in bfloat16 (AVX-512 BF16, AMX): one-row decode, prefill and batched decode on bf16 dot
    products; fp32 otherwise."""
    if device.startswith("cuda"):
        return "bf16"  # quantised CUDA paths are untested
    flags = cpu_features()
    if {"avx2", "avx512f", "amx_bf16"} & flags:
        return "int4bf16" if native_bf16() else "int4"
    return "fp32"
