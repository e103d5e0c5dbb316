"""Block-masked decoder runner for Llama-architecture models (Llama, Mistral, Qwen2-style GQA).

A model with L layers has B = 2L blocks, ordered attn_0, ffn_0, attn_1, ffn_1, ... A block is a
pre-norm sub-layer plus its residual add; a skipped block is the identity on the residual stream.
Every forward takes one gate row per sequence:

* a bool mask (serving): block j runs only on the rows that keep it, and not at all when no row
  does; a skipped attention block neither writes nor reads KV for that row;
* float gates (mask training): block j's output is scaled by the gate, rows whose gate is exactly
  0 are skipped, so hard masks and soft gates share this one code path.

KV lives in a static, slot-based cache (one slot per running sequence, gpt-fast style).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def block_names(num_layers: int) -> list[str]:
    return [f"{kind}_{i}" for i in range(num_layers) for kind in ("attn", "ffn")]


def _param_count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


class KVCache:
    """Static per-layer K/V buffers: [slots, kv_heads, max_len, head_dim]."""

    def __init__(self, num_layers: int, slots: int, kv_heads: int, max_len: int, head_dim: int, dtype, device):
        shape = (slots, kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.slots = slots
        self.max_len = max_len


class BlockRunner:
    """Runs a frozen HF causal LM block by block under per-row masks or gates."""

    def __init__(self, model: torch.nn.Module, max_slots: int = 8, max_len: int | None = None):
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
        # Parameters touched per token by each block and by the always-run parts (lm_head).
        self.block_params = torch.tensor(
            [_param_count(norm) + _param_count(part)
             for layer in self.layers
             for norm, part in ((layer.input_layernorm, layer.self_attn), (layer.post_attention_layernorm, layer.mlp))],
            dtype=torch.float64,
        )
        self.head_params = _param_count(self.lm_head) + _param_count(self.norm)
        self.cache = KVCache(self.num_layers, max_slots, self.num_kv_heads, self.max_len, self.head_dim,
                             self.dtype, self.device)

    # ------------------------------------------------------------------ cost model
    def params_per_token(self, mask: torch.Tensor) -> float:
        """Parameters touched per token by a bool mask of length B (lm_head included)."""
        return float(self.block_params[mask.cpu()].sum()) + self.head_params

    def ideal_speedup(self, mask: torch.Tensor) -> float:
        dense = torch.ones(self.num_blocks, dtype=torch.bool)
        return self.params_per_token(dense) / self.params_per_token(mask)

    # ------------------------------------------------------------------ core forward
    def _attention(self, layer_idx: int, x, cos, sin, attn_mask, slots, write_pos, kv_len):
        """Self-attention on rows x [n, T, H]. With slots, K/V go to (and, in decode, come
        from) the cache; write_pos is None for a prefill from position 0."""
        attn = self.layers[layer_idx].self_attn
        n, t, _ = x.shape
        q = attn.q_proj(x).view(n, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = attn.k_proj(x).view(n, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = attn.v_proj(x).view(n, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        if slots is not None:
            ck, cv = self.cache.k[layer_idx], self.cache.v[layer_idx]
            if write_pos is None:  # prefill: this row's sequence starts at position 0
                ck[slots, :, :t] = k
                cv[slots, :, :t] = v
            else:  # decode: one new token per row, then attend over the cached prefix
                ck[slots, :, write_pos] = k[:, :, 0]
                cv[slots, :, write_pos] = v[:, :, 0]
                k, v = _take(ck, slots, kv_len), _take(cv, slots, kv_len)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=attn.scaling,
                                             enable_gqa=self.num_kv_heads != self.num_heads)
        return attn.o_proj(out.transpose(1, 2).reshape(n, t, self.num_heads * self.head_dim))

    def _forward(self, ids, positions, gates, attn_mask, slots=None, write_pos=None, kv_len=0):
        """Hidden states after the final norm, [B, T, H]."""
        h = self.embed(ids)
        cos, sin = self.rotary(h, positions)
        hard = gates.dtype == torch.bool
        keep = gates if hard else gates != 0
        counts = keep.sum(0).tolist()
        batch = ids.shape[0]
        for j, count in enumerate(counts):
            if count == 0:
                continue
            rows = None if count == batch else keep[:, j].nonzero().squeeze(1)
            layer = self.layers[j // 2]
            x = h if rows is None else h.index_select(0, rows)
            if j % 2 == 0:
                pick = (lambda t: t) if rows is None else (lambda t: None if t is None else t[rows])
                out = self._attention(j // 2, layer.input_layernorm(x), pick(cos), pick(sin),
                                      pick(attn_mask), pick(slots), pick(write_pos), kv_len)
            else:
                out = layer.mlp(layer.post_attention_layernorm(x))
            if not hard:
                g = gates[:, j] if rows is None else gates[rows, j]
                out = out * g.to(out.dtype)[:, None, None]
            h = h + out if rows is None else h.index_add(0, rows, out)
        return self.norm(h)

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

    def hidden(self, input_ids: torch.Tensor, gates: torch.Tensor, attention_mask: torch.Tensor | None = None):
        """Final-norm hidden states [B, T, H] without the cache."""
        input_ids = input_ids.to(self.device)
        b, t = input_ids.shape
        positions = torch.arange(t, device=self.device).expand(b, t)
        return self._forward(input_ids, positions, self._gates(gates).expand(b, -1),
                             _prefill_mask(attention_mask, b, t, self.device))

    @torch.inference_mode()
    def prefill(self, prompts: list[list[int]], masks: torch.Tensor, slots: list[int]) -> torch.Tensor:
        """Run prompts from position 0 into their cache slots; logits of each last token [B, V]."""
        lengths = torch.tensor([len(p) for p in prompts], device=self.device)
        t = int(lengths.max())
        if t > self.max_len:
            raise ValueError(f"prompt of {t} tokens exceeds the runner's context of {self.max_len}")
        ids = torch.zeros(len(prompts), t, dtype=torch.long, device=self.device)
        for i, p in enumerate(prompts):
            ids[i, : len(p)] = torch.tensor(p, dtype=torch.long)
        valid = torch.arange(t, device=self.device)[None, :] < lengths[:, None]
        positions = torch.arange(t, device=self.device).expand(len(prompts), t)
        slot_t = torch.tensor(slots, dtype=torch.long, device=self.device)
        h = self._forward(ids, positions, self._gates(masks), _prefill_mask(valid, len(prompts), t, self.device),
                          slots=slot_t)
        last = h[torch.arange(len(prompts), device=self.device), lengths - 1]
        return self.lm_head(last)

    @torch.inference_mode()
    def decode(self, tokens: list[int], positions: list[int], masks: torch.Tensor, slots: list[int]) -> torch.Tensor:
        """One token per row at the given positions (= tokens already cached); logits [B, V]."""
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        kv_len = int(pos.max()) + 1
        if kv_len > self.max_len:
            raise ValueError(f"position {kv_len - 1} is past the runner's context of {self.max_len}")
        ids = torch.tensor(tokens, dtype=torch.long, device=self.device)[:, None]
        attn_mask = (torch.arange(kv_len, device=self.device)[None, :] <= pos[:, None])[:, None, None, :]
        slot_t = torch.tensor(slots, dtype=torch.long, device=self.device)
        h = self._forward(ids, pos[:, None], self._gates(masks), attn_mask, slots=slot_t, write_pos=pos,
                          kv_len=kv_len)
        return self.lm_head(h[:, 0])


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _take(cache: torch.Tensor, slots: torch.Tensor, length: int) -> torch.Tensor:
    """cache[slots, :, :length], as a view when the slots are one ascending run."""
    first = int(slots[0])
    n = slots.numel()
    if int(slots[-1]) - first == n - 1 and (n == 1 or bool((slots.diff() == 1).all())):
        return cache[first : first + n, :, :length]
    return cache[slots, :, :length]


def _prefill_mask(valid: torch.Tensor | None, b: int, t: int, device) -> torch.Tensor:
    """[B, 1, T, T] causal mask that also hides right-padding keys."""
    causal = torch.ones(t, t, dtype=torch.bool, device=device).tril()
    if valid is None:
        return causal.expand(b, 1, t, t)
    return causal[None, None] & valid.to(device=device, dtype=torch.bool)[:, None, None, :]
