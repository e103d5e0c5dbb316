"""Block-masked decoder runner for Llama-architecture models (Llama, Mistral, Qwen2-style GQA).

A model with L layers has B = 2L blocks, ordered attn_0, ffn_0, attn_1, ffn_1, ... A block is a
pre-norm sub-layer plus its residual add; a skipped block is the identity on the residual stream.
Every forward takes one gate row per sequence:

* a bool mask (serving): block j is skipped when no row keeps it. Otherwise a prefill runs it on
  the rows that keep it only; a decode step (one token per row, bound by reading the weights) runs
  it on the whole batch and rows that skip it keep their residual stream unchanged, which beats
  gathering the rows (4% less step time with 8 masks mixed in 16 rows). A row never uses the K/V
  of an attention block it skips: its decode writes at that layer stay in its own slot, unread;
* float gates (mask training): block j's output is scaled by the gate, rows whose gate is exactly
  0 are skipped, so hard masks and soft gates share this one code path.

KV lives in a static, slot-based cache (one slot per running sequence, gpt-fast style).

With float32 activations on a CPU that has igserve's kernels, cached forwards (prefill and
decode) run each block as one fused C++ call (server/csrc/blocks.cpp) on the rows that keep it:
the eager path spends most of a batch-1 decode step on per-op dispatch, not on the matmuls.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from server import cost, weights


class FusedLayer:
    """One layer's tensors in the form the fused CPU blocks take them."""

    def __init__(self, runner: "BlockRunner", i: int, linears: dict):
        layer = runner.layers[i]
        self.attn_norm, self.ffn_norm = layer.input_layernorm.weight, layer.post_attention_layernorm.weight
        self.attn_eps, self.ffn_eps = runner.eps[i]
        (self.qkv, self.qkv_bias), (self.o, self.o_bias) = linears["qkv"], linears["o"]
        (self.gate_up, self.gate_up_bias), (self.down, self.down_bias) = linears["gate_up"], linears["down"]
        self.scale = float(layer.self_attn.scaling)
        q8 = {name: bool(getattr(lin, "q8", False)) for name, lin in runner.fused_linears(i).items()}
        self.q8_attn, self.q8_ffn = (q8["qkv"], q8["o"]), (q8["gate_up"], q8["down"])


def block_names(num_layers: int) -> list[str]:
    return [f"{kind}_{i}" for i in range(num_layers) for kind in ("attn", "ffn")]


class KVCache:
    """Static per-layer K/V buffers: [max_batch + 1, kv_heads, max_len, head_dim], one slot per
    sequence of a batch."""

    def __init__(self, num_layers: int, max_batch: int, kv_heads: int, max_len: int, head_dim: int, dtype, device):
        shape = (max_batch + 1, kv_heads, max_len, head_dim)  # + a scratch slot for padding writes
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.dtype = dtype
        self.max_batch = max_batch
        self.scratch = max_batch
        self.max_len = max_len

    def write(self, layer: int, slots: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Store k, v [n, T, kv_heads, head_dim] at (slots [n, T], positions [n, T])."""
        self.k[layer][slots, :, positions] = k.to(self.dtype)
        self.v[layer][slots, :, positions] = v.to(self.dtype)

    def read(self, layer: int, slots: torch.Tensor, length: int, run: bool | None = None):
        """K and V of ``slots`` [n] up to ``length``; views when the slots are one ascending run
        (``run``: that check, done once per step by the caller)."""
        return _take(self.k[layer], slots, length, run), _take(self.v[layer], slots, length, run)

    def copy_prefix(self, src: int, dsts: list[int], length: int) -> None:
        """Copy the first ``length`` positions of slot src into dsts (a shared prompt prefix)."""
        index = torch.tensor(dsts, dtype=torch.long, device=self.k[0].device)  # a list index is ~500x slower
        for ck, cv in zip(self.k, self.v):
            ck[index, :, :length] = ck[src, :, :length]
            cv[index, :, :length] = cv[src, :, :length]

    def save(self, slot: int, length: int) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
        """A copy of the first ``length`` positions of slot at every layer, for ``load``; None if
        they hold a non-finite value (what a failing request may leave)."""
        k = [ck[slot, :, :length].clone() for ck in self.k]
        v = [cv[slot, :, :length].clone() for cv in self.v]
        return (k, v) if all(bool(t.isfinite().all()) for t in k + v) else None

    def load(self, saved: tuple[list[torch.Tensor], list[torch.Tensor]], slot: int) -> None:
        """Write a ``save``d prefix into the first positions of slot."""
        for ck, cv, k, v in zip(self.k, self.v, *saved):
            ck[slot, :, :k.shape[1]] = k
            cv[slot, :, :v.shape[1]] = v


class BlockRunner:
    """Runs a frozen HF causal LM block by block under per-row masks or gates."""

    def __init__(self, model: torch.nn.Module, max_batch: int = 8, max_len: int | None = None,
                 fused: bool | None = None, kv_dtype: torch.dtype | str | None = None):
        """``fused``: run cached forwards through the fused CPU blocks; None uses them wherever
        they apply (``fused_blocks``), True requires them. ``kv_dtype``: the K/V cache's; None: the
        activations'; "auto": float16 where the fused blocks run (half the memory and what attention
        reads, as llama.cpp's default cache), else the activations'."""
        cfg = model.config
        base = model.model
        self.model = model
        self.config = cfg
        self.embed = base.embed_tokens
        self.layers = base.layers
        self.norm = base.norm
        self.rotary = base.rotary_emb
        self.lm_head = model.lm_head
        self.num_layers = cfg.num_hidden_layers
        self.num_blocks = 2 * self.num_layers
        self.block_names = block_names(self.num_layers)
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.device = self.embed.weight.device
        self.dtype = self.embed.weight.dtype
        self.max_len = min(max_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        self.cost = cost.CostModel.from_model(model)
        # q/k/v and gate/up as one matmul each; the HF modules keep views of the fused weights.
        self.qkv = [weights.fuse([l.self_attn.q_proj, l.self_attn.k_proj, l.self_attn.v_proj]) for l in self.layers]
        self.gate_up = [weights.fuse([l.mlp.gate_proj, l.mlp.up_proj]) for l in self.layers]
        self.act = self.layers[0].mlp.act_fn
        self.eps = [(l.input_layernorm.variance_epsilon, l.post_attention_layernorm.variance_epsilon)
                    for l in self.layers]
        self.final_eps = self.norm.variance_epsilon
        # Rotary cos/sin for every position, computed once by the model's own rotary module.
        with torch.no_grad():
            probe = torch.zeros(1, dtype=self.dtype, device=self.device)
            positions = max(self.max_len, self.config.max_position_embeddings)  # cache-free forwards may be longer
            cos, sin = self.rotary(probe, torch.arange(positions, device=self.device)[None])
        self.cos, self.sin = cos[0].contiguous(), sin[0].contiguous()  # [max_len, head_dim]
        self.fused = self._fused_layers() if fused is not False else None
        if self.fused is not None:
            self.lm_head = weights.native_head(self.lm_head)
        if fused and self.fused is None:
            raise ValueError("the fused CPU blocks need float32 on a CPU with igserve's kernels and SiLU FFNs")
        if kv_dtype == "auto":
            kv_dtype = torch.float16 if self.fused is not None else None
        if self.fused is not None and kv_dtype not in (None, torch.float32, torch.float16):
            raise ValueError(f"the fused CPU blocks read a float32 or float16 KV cache, not {kv_dtype}")
        self.cache = KVCache(self.num_layers, max_batch, self.num_kv_heads, self.max_len, self.head_dim,
                             kv_dtype or self.dtype, self.device)
        self.stack = self._fused_stack() if self.fused is not None else None

    @property
    def kernels(self) -> str:
        """Which kernels run (in /health and reports): "igserve-avx2" where the fused blocks do (every
        format they take, fp32's plain linears included) or the linears are igserve's, else "torch"."""
        return "igserve-avx2" if self.fused is not None else weights.kernels(self.model)

    @property
    def packs_rows(self) -> bool:
        """Cached forwards cost what their real tokens cost, not the padded chunk length (the fused
        blocks gather the real tokens), so decode rows and prefill chunks can share one forward."""
        return self.fused is not None

    def fused_linears(self, i: int) -> dict[str, torch.nn.Module]:
        """Layer i's four linears as the fused blocks run them (q/k/v and gate/up fused)."""
        layer = self.layers[i]
        return {"qkv": self.qkv[i], "o": layer.self_attn.o_proj, "gate_up": self.gate_up[i],
                "down": layer.mlp.down_proj}

    def _fused_layers(self) -> list[FusedLayer] | None:
        """The layers as the fused blocks take them, or None where those do not apply."""
        from server import cpu_kernels

        if (self.device.type != "cpu" or self.dtype != torch.float32 or self.config.hidden_act != "silu"
                or self.head_dim % 8 or self.config.intermediate_size % 8 or not cpu_kernels.available()):
            return None
        out = []
        for i in range(len(self.layers)):
            tensors = {name: weights.kernel_tensors(lin) for name, lin in self.fused_linears(i).items()}
            if any(t is None for t in tensors.values()):
                return None
            out.append(FusedLayer(self, i, tensors))
        return out

    def _fused_stack(self):
        """The fused layers and this runner's cache, handed to C++ once (blocks.cpp, FusedStack)."""
        stack = torch.classes.igserve.FusedStack(self.cos, self.sin, self.norm.weight, self.final_eps,
                                                 self.num_heads, self.num_kv_heads)
        for i, f in enumerate(self.fused):
            stack.add_layer(f.attn_norm, f.attn_eps, list(f.qkv), f.qkv_bias, list(f.o), f.o_bias, self.cache.k[i],
                            self.cache.v[i], f.scale, *f.q8_attn, f.ffn_norm, f.ffn_eps, list(f.gate_up),
                            f.gate_up_bias, list(f.down), f.down_bias, *f.q8_ffn)
        return stack

    # ------------------------------------------------------------------ cost model
    def params_per_token(self, mask: torch.Tensor) -> float:
        """Parameters touched per token by a bool mask of length B (lm_head included)."""
        return self.cost.params(mask)

    def ideal_speedup(self, mask: torch.Tensor) -> float:
        return self.cost.ideal_speedup(mask)

    # ------------------------------------------------------------------ core forward
    def _attention(self, i: int, x, cos, sin, attn_mask, cache_rows):
        """Self-attention of layer i on normed rows x [n, T, H]. With ``cache_rows`` = (read slots
        [n], write slots [n, T], write positions [n, T], read slots form one run), new K/V go into
        the cache and the rows attend over their cached prefix; without it they attend over x
        alone (the cache-free full forward)."""
        n, t, _ = x.shape
        hq, hk, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv[i](x).view(n, t, hq + 2 * hk, d)
        qk, v = qkv[:, :, : hq + hk], qkv[:, :, hq + hk:]
        qk = qk * cos + _rotate_half(qk) * sin  # q and k rotated in one pass
        q, k = qk[:, :, :hq].transpose(1, 2), qk[:, :, hq:]
        if cache_rows is not None:
            slots, write_slots, write_pos, run = cache_rows
            self.cache.write(i, write_slots, write_pos, k, v)
            k, v = (c.to(q.dtype) for c in self.cache.read(i, slots, attn_mask.shape[-1], run))
        else:
            k, v = k.transpose(1, 2), v.transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=self.layers[i].self_attn.scaling,
                                             enable_gqa=hk != hq)
        return self.layers[i].self_attn.o_proj(out.transpose(1, 2).reshape(n, t, hq * d))

    def _ffn(self, i: int, x):
        g, u = self.gate_up[i](x).chunk(2, dim=-1)
        return self.layers[i].mlp.down_proj(self.act(g) * u)

    def _forward(self, ids, positions, gates, attn_mask, cache_rows=None, streams: list | None = None):
        """Hidden states after the final norm, [B, T, H]; ``streams`` collects the residual stream
        entering each block and the final norm (block influence)."""
        h = self.embed(ids)
        cos, sin = self.cos[positions].unsqueeze(2), self.sin[positions].unsqueeze(2)  # [B, T, 1, D]
        hard = gates.dtype == torch.bool
        keep = gates if hard else gates != 0
        counts = keep.sum(0).tolist()
        batch = ids.shape[0]
        blend = hard and ids.shape[1] == 1 and cache_rows is not None  # decode: see the module docstring
        for j, count in enumerate(counts):
            if streams is not None:
                streams.append(h)
            if count == 0:
                continue
            rows = None if count == batch or blend else keep[:, j].nonzero().squeeze(1)
            i, layer = j // 2, self.layers[j // 2]
            x = h if rows is None else h.index_select(0, rows)
            if j % 2 == 0:
                x = _rms_norm(x, layer.input_layernorm.weight, self.eps[i][0])
                if rows is None:
                    out = self._attention(i, x, cos, sin, attn_mask, cache_rows)
                else:
                    sub = None
                    if cache_rows is not None:
                        sub = (*(c[rows] for c in cache_rows[:3]), None)
                    out = self._attention(i, x, cos[rows], sin[rows], attn_mask[rows], sub)
            else:
                out = self._ffn(i, _rms_norm(x, layer.post_attention_layernorm.weight, self.eps[i][1]))
            if not hard:
                g = gates[:, j] if rows is None else gates[rows, j]
                out = out * g.to(out.dtype)[:, None, None]
            if rows is not None:
                h = h.index_add(0, rows, out)
            elif count < batch:  # blended decode: rows that skip block j keep their residual stream
                h = torch.where(keep[:, j, None, None], h + out, h)
            else:
                h = h + out
        if streams is not None:
            streams.append(h)
        return _rms_norm(h, self.norm.weight, self.final_eps)

    # ------------------------------------------------------------------ public entry points
    def _gates(self, masks: torch.Tensor) -> torch.Tensor:
        if masks.dim() == 1:
            masks = masks.unsqueeze(0)
        if masks.shape[-1] != self.num_blocks:
            raise ValueError(f"mask has {masks.shape[-1]} entries, model has {self.num_blocks} blocks")
        return masks.to(self.device)

    def forward(self, input_ids: torch.Tensor, gates: torch.Tensor, attention_mask: torch.Tensor | None = None):
        """Full-sequence logits [B, T, V] without the cache (mask training and evaluation).
        ``attention_mask`` [B, T] marks real tokens of right-padded rows."""
        return self.lm_head(self.hidden(input_ids, gates, attention_mask))

    def hidden(self, input_ids: torch.Tensor, gates: torch.Tensor, attention_mask: torch.Tensor | None = None,
               streams: list | None = None):
        """Final-norm hidden states [B, T, H] without the cache (``streams``: see ``_forward``)."""
        input_ids = input_ids.to(self.device)
        b, t = input_ids.shape
        positions = torch.arange(t, device=self.device).expand(b, t)
        return self._forward(input_ids, positions, self._gates(gates).expand(b, -1),
                             _prefill_mask(attention_mask, b, t, self.device), streams=streams)

    @torch.inference_mode()
    def extend(self, chunks: list[list[int]], starts: list[int], masks: torch.Tensor, slots: list[int]) -> torch.Tensor:
        """Append each row's chunk to its cache slot, whose first ``start`` positions are already
        filled; logits of each chunk's last token [B, V]. Prefill and decode are both this call."""
        h = self.extend_hidden(chunks, starts, masks, slots)
        if all(len(c) == h.shape[1] for c in chunks):  # every row ends at the last position (decode)
            return self.lm_head(h[:, -1])
        lengths = torch.tensor([len(c) for c in chunks], device=self.device)
        return self.lm_head(h[torch.arange(len(chunks), device=self.device), lengths - 1])

    @torch.inference_mode()
    def extend_scoring(self, chunks: list[list[int]], starts: list[int], masks: torch.Tensor, slots: list[int],
                       rows: list[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """``extend``, plus the logits of every chunk position [length, V] of ``rows`` (prompt
        scoring); the vocabulary projection runs at those positions only."""
        h = self.extend_hidden(chunks, starts, masks, slots)
        lengths = torch.tensor([len(c) for c in chunks], device=self.device)
        last = self.lm_head(h[torch.arange(len(chunks), device=self.device), lengths - 1])
        return last, [self.lm_head(h[i, :len(chunks[i])]) for i in rows]

    @torch.inference_mode()
    def extend_hidden(self, chunks: list[list[int]], starts: list[int], masks: torch.Tensor,
                      slots: list[int]) -> torch.Tensor:
        """``extend`` returning the final-norm hidden states of every chunk position [B, T, H]
        (right-padded), for callers that need logits at some positions only (scoring)."""
        dev = self.device
        lengths = torch.tensor([len(c) for c in chunks], device=dev)
        start_t = torch.tensor(starts, dtype=torch.long, device=dev)
        t = int(lengths.max())
        kv_len = int((start_t + lengths).max())
        if kv_len > self.max_len:
            raise ValueError(f"sequence of {kv_len} tokens exceeds the runner's context of {self.max_len}")
        if t == 1:
            ids = torch.tensor(chunks, dtype=torch.long, device=dev)
        else:
            ids = torch.zeros(len(chunks), t, dtype=torch.long, device=dev)
            for i, c in enumerate(chunks):
                ids[i, : len(c)] = torch.tensor(c, dtype=torch.long)
        slot_t = torch.tensor(slots, dtype=torch.long, device=dev)
        gates = self._gates(masks)
        if self.fused is not None and gates.dtype == torch.bool:
            return self._forward_fused(ids, start_t, lengths, gates, slot_t)
        positions = start_t[:, None] + torch.arange(t, device=dev)
        # Padding tokens of short rows write their K/V to the scratch slot, never over real entries.
        valid = torch.arange(t, device=dev)[None, :] < lengths[:, None]
        write_slots = torch.where(valid, slot_t[:, None], self.cache.scratch)
        write_pos = torch.where(valid, positions, 0)
        attn_mask = (torch.arange(kv_len, device=dev)[None, None, :] <= positions[:, :, None])[:, None]
        run = _is_run(slots)
        return self._forward(ids, positions, gates, attn_mask, (slot_t, write_slots, write_pos, run))

    def _forward_fused(self, ids, starts, lengths, keep, slots) -> torch.Tensor:
        """``_forward`` with the cache: one C++ call runs every block on the rows that keep it and the
        final norm (a block no row keeps costs nothing)."""
        h = self.embed(ids)
        self.stack.forward(h, keep.t().contiguous(), slots, starts, lengths)
        return h

    def prefill(self, prompts: list[list[int]], masks: torch.Tensor, slots: list[int]) -> torch.Tensor:
        """Run prompts from position 0 into their cache slots; logits of each last token [B, V]."""
        return self.extend(prompts, [0] * len(prompts), masks, slots)

    def decode(self, tokens: list[int], positions: list[int], masks: torch.Tensor, slots: list[int]) -> torch.Tensor:
        """One token per row at the given positions (= tokens already cached); logits [B, V]."""
        return self.extend([[tok] for tok in tokens], positions, masks, slots)

    def copy_slot(self, src: int, dsts: list[int], length: int) -> None:
        """Share a cached prefix: copy the first ``length`` positions of slot src into dsts."""
        self.cache.copy_prefix(src, dsts, length)

    def save_prefix(self, slot: int, length: int):
        """The K/V of slot's first ``length`` positions, to be written into another slot later
        (None if not finite)."""
        return self.cache.save(slot, length)

    def load_prefix(self, saved, slot: int) -> None:
        self.cache.load(saved, slot)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's Llama RMSNorm in one call: normalise in float32, round to x's dtype, then scale."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    return weight * F.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _is_run(slots: list[int]) -> bool:
    return all(b == a + 1 for a, b in zip(slots, slots[1:]))


def _take(cache: torch.Tensor, slots: torch.Tensor, length: int, run: bool | None = None) -> torch.Tensor:
    """cache[slots, :, :length], as a view when the slots are one ascending run."""
    if run is None:
        run = _is_run(slots.tolist())
    if run:
        first = int(slots[0])
        return cache[first : first + slots.numel(), :, :length]
    return cache[slots, :, :length]


def _prefill_mask(valid: torch.Tensor | None, b: int, t: int, device) -> torch.Tensor:
    """[B, 1, T, T] causal mask that also hides right-padding keys."""
    causal = torch.ones(t, t, dtype=torch.bool, device=device).tril()
    if valid is None:
        return causal.expand(b, 1, t, t)
    return causal[None, None] & valid.to(device=device, dtype=torch.bool)[:, None, None, :]
