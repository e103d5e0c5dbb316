"""Generation-quality measures against dense, on the tiny random model."""

from __future__ import annotations

import pytest
import torch

from masks.quality import common_prefix, cut, greedy, measure, teacher_forced


def test_dense_agrees_with_itself_and_a_mask_does_not(tiny):
    from server.runner import BlockRunner

    runner = BlockRunner(tiny.model, max_batch=3, max_len=64)
    prompts = [tiny.tokenizer(t)["input_ids"] for t in ("def add(a, b):", "The capital of France is", "1 2 3")]
    ones = torch.ones(3, runner.num_blocks, dtype=torch.bool)
    answers = greedy(runner, prompts, ones, 6)
    for p, a in zip(prompts, answers):  # the cached greedy loop equals argmax over full forwards
        seq = list(p)
        for _ in range(6):
            seq.append(int(runner.forward(torch.tensor([seq]), ones[0])[0, -1].argmax()))
        assert seq[len(p):] == a
    logp, agree, kl = teacher_forced(runner, prompts, answers, ones)
    assert agree == [1.0] * 3 and kl == pytest.approx([0.0] * 3, abs=1e-5)
    dense = {"answers": answers, "logp": logp}
    same = measure(runner, prompts, ones, dense, 6, end_id=-1)
    assert same["top1_agreement"] == 1.0 and same["exact_answer_share"] == 1.0 and same["common_prefix"] == 1.0
    masked = ones.clone()
    masked[:, [1, 3, 5]] = False
    other = measure(runner, prompts, masked, dense, 6, end_id=-1)
    assert other["top1_agreement"] < 1.0 and other["kl"] > 0


def test_answers_end_at_the_end_of_turn():
    assert cut([5, 6, 2, 7], 2) == [5, 6, 2] and cut([5, 6], 2) == [5, 6]
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2 and common_prefix([], [1]) == 0
