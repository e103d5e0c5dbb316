"""`--router learned|centroid` and `--budget`: which router a server uses, where it says so, and the
startup errors for a bank that cannot serve the choice."""

from __future__ import annotations

import argparse
import socket

import httpx
import openai
import pytest
from conftest import TINY_BANK_TEXTS, lm_routed_bank, routed_bank

from masks.bank import BankError, MaskBank
from router.router import METHODS, Router
from server import config, loading


def test_flags_parse_into_the_config():
    parser = argparse.ArgumentParser()
    config.add_arguments(parser)
    cfg = config.from_args(parser.parse_args([]))
    assert (cfg.router, cfg.budget, cfg.adaptive_depth, cfg.adaptive_depth_queue) == (None, None, False, 8)
    cfg = config.from_args(parser.parse_args(["--router", "centroid", "--budget", "0.125", "--adaptive-depth",
                                              "--adaptive-depth-queue", "4"]))
    assert (cfg.router, cfg.budget, cfg.adaptive_depth, cfg.adaptive_depth_queue) == ("centroid", 0.125, True, 4)
    assert config.from_args(parser.parse_args(["--no-adaptive-depth"])).adaptive_depth is False
    with pytest.raises(SystemExit):
        parser.parse_args(["--router", "random"])
    assert config.ROUTERS == METHODS


def test_a_server_routes_a_bank_that_reads_the_lm_token_table(serve_tiny, live_server, tiny_bank, tiny, tmp_path):
    """The served LM's own token table feeds a format-3 bank's router: each centroid text gets the
    mask the planted losses say (the global mask for code and chat, where nearest centroid differs)."""
    bank, table = lm_routed_bank(tiny_bank, tiny)
    path = tmp_path / "lm.json"
    bank.save(path)
    client = serve_tiny(bank=str(path)).client()
    reference = Router(MaskBank.load(path), lm=table)
    for domain, text in TINY_BANK_TEXTS.items():
        info = client.completions.create(model=tiny.name, prompt=text, max_tokens=2).model_extra["igserve"]
        assert info["mask"] == reference.route([text])[0].mask_id == ("math@0.25" if domain == "math" else "global@0.25")
        assert info["router"] == "learned" and info["predicted_loss"] is not None


def test_learned_and_centroid_servers_choose_differently_where_the_labels_say_so(serve_tiny, live_server,
                                                                                   routed_bank_file, tiny):
    """On the routed tiny bank the planted losses make the global mask best for the code and chat
    texts and the math mask best for the math text: the default (learned) server follows them, a
    `--router centroid` server takes each text's nearest cluster; both agree on math."""
    bank = MaskBank.load(routed_bank_file)
    servers = {"learned": serve_tiny(bank=str(routed_bank_file)),
               "centroid": serve_tiny(bank=str(routed_bank_file), router="centroid")}
    expect = {"learned": {"code": "global@0.25", "math": "math@0.25", "chat": "global@0.25"},
              "centroid": {"code": "code@0.25", "math": "math@0.25", "chat": "chat@0.25"}}
    for method, server in servers.items():
        health = httpx.get(server.base_url + "/health").json()
        assert health["router"] == method and health["default_budget"] == 0.25 and "adaptive_depth" not in health
        reference = Router(bank, method=method)
        client = server.client()
        for domain, text in TINY_BANK_TEXTS.items():
            info = client.completions.create(model=tiny.name, prompt=text, max_tokens=2).model_extra["igserve"]
            assert info["mask"] == expect[method][domain] == reference.route([text])[0].mask_id
            assert info["router"] == method and info["budget"] == 0.25
            assert (info["predicted_loss"] is None) == (method == "centroid")
        forced = client.completions.create(model=tiny.name, prompt="x", max_tokens=1,
                                           extra_body={"igserve": {"mask": "dense"}}).model_extra["igserve"]
        assert forced["router"] is None
    with pytest.raises(openai.BadRequestError) as exc:  # no predicted loss without the learned router
        servers["centroid"].client().completions.create(model=tiny.name, prompt="x", max_tokens=1,
                                                        extra_body={"igserve": {"max_loss": 0.5}})
    assert exc.value.body["param"] == "igserve.max_loss" and "nearest centroid" in exc.value.body["message"]
    # a format-1 bank routes by centroid by default
    assert httpx.get(live_server.base_url + "/health").json()["router"] == "centroid"


def test_centroid_router_on_a_format_2_bank_has_no_predictor(tiny_bank):
    bank = routed_bank(tiny_bank)[0]
    centroid = Router(bank, method="centroid")
    assert centroid.predictor is None and Router(bank).predictor is not None
    with pytest.raises(ValueError, match="learned router"):
        centroid.check(max_loss=0.5)
    routes = centroid.route(list(TINY_BANK_TEXTS.values()), budgets=[0.125] * 3)
    assert [r.mask_id for r in routes] == [f"{d}@0.125" for d in TINY_BANK_TEXTS]
    assert Router(bank, default_budget=0.125).route([TINY_BANK_TEXTS["code"]])[0].mask_id == "global@0.125"


def test_learned_router_on_a_format_1_bank_is_a_startup_error(tiny_model_dir, tiny_bank, tmp_path, capsys):
    from server import cli

    path = tmp_path / "format1.json"
    MaskBank(**dict(vars(tiny_bank), format_version=1)).save(path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = cli.main(["serve", "--model", str(tiny_model_dir), "--bank", str(path), "--port", str(port),
                     "--router", "learned", "--log-level", "warning"])
    assert code == 1
    err = capsys.readouterr().err
    assert f"error: mask bank {path}: router method 'learned' not available" in err
    assert "centroids only (format 1" in err and "Traceback" not in err


@pytest.mark.parametrize("overrides, match", [
    ({"budget": 0.5}, "default budget: budget 0.5 is not in this mask bank; available: 0.125, 0.25"),
    ({"adaptive_depth": True}, "needs a budget sparser than the default 0.25"),
    ({"budget": 0.125, "adaptive_depth": True, "adaptive_depth_queue": 0}, "at least 1"),
    ({"budget": 0.125, "adaptive_depth": True, "adaptive_depth_budget": 0.125}, "--adaptive-depth-budget 0.125 is not"),
    ({"budget": 0.125, "adaptive_depth_budget": 0.25}, "--adaptive-depth-budget needs --adaptive-depth"),
])
def test_options_the_bank_cannot_serve_are_startup_errors(tiny_model_dir, routed_bank_file, overrides, match):
    cfg = config.ServeConfig(model=str(tiny_model_dir), bank=str(routed_bank_file), max_model_len=256,
                             **overrides)
    with pytest.raises(BankError, match=match):
        loading.load_served(cfg)


def test_routing_flags_without_a_bank_are_startup_errors(tiny_model_dir, tmp_path):
    cfg = config.ServeConfig(model=str(tiny_model_dir), bank=str(tmp_path / "missing.json"), router="centroid",
                             adaptive_depth=True, max_model_len=256)
    with pytest.raises(BankError, match="--router, --adaptive-depth need a mask bank"):
        loading.load_served(cfg)
