"""The pairwise (Bradley-Terry) PRM loss between sibling steps, its pairs, and class balancing."""
from __future__ import annotations

import json
import math

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("pyarrow")

from reward_models.label_files import write_labels  # noqa: E402
from train.losses import PRM_LOSSES, prm_pairwise, prm_pointwise  # noqa: E402
from train.prm import positive_weight, sibling_pairs  # noqa: E402


def test_pairwise_loss_value_and_gradient_direction():
    chosen = torch.tensor([2.0, 0.0], requires_grad=True)
    rejected = torch.tensor([0.0, 1.0], requires_grad=True)
    loss = prm_pairwise(chosen, rejected)
    want = (math.log1p(math.exp(-2.0)) + math.log1p(math.exp(1.0))) / 2  # -log sigmoid(c - r)
    assert loss.item() == pytest.approx(want, rel=1e-6)
    loss.backward()
    # d/dc = -sigmoid(r - c) / P: raising the better step's logit lowers the loss, and more so
    # for the pair ranked the wrong way round
    assert chosen.grad[0].item() == pytest.approx(-1 / (1 + math.exp(2.0)) / 2, rel=1e-6)
    assert chosen.grad[1].item() == pytest.approx(-1 / (1 + math.exp(-1.0)) / 2, rel=1e-6)
    assert torch.all(chosen.grad < 0) and torch.all(rejected.grad > 0)
    assert torch.equal(chosen.grad, -rejected.grad)
    assert chosen.grad[1] < chosen.grad[0]  # the misranked pair pushes harder
    assert prm_pairwise(torch.tensor([5.0]), torch.tensor([0.0])) < prm_pairwise(
        torch.tensor([0.0]), torch.tensor([5.0]))


def test_both_losses_are_selectable_by_name():
    assert PRM_LOSSES["pairwise"] is prm_pairwise and PRM_LOSSES["pointwise"] is prm_pointwise
    assert PRM_LOSSES["pairwise"].pairs and not PRM_LOSSES["pointwise"].pairs
    with pytest.raises(ValueError, match="unknown PRM loss 'listwise'"):
        PRM_LOSSES["listwise"]


def test_pointwise_positive_weight_scales_the_positive_term():
    logits, targets = torch.tensor([[0.0, 0.0]]), torch.tensor([[1.0, 0.0]])
    mask = torch.tensor([[True, True]])
    plain = prm_pointwise(logits, targets, mask)
    weighted = prm_pointwise(logits, targets, mask, pos_weight=3.0)
    assert plain.item() == pytest.approx(math.log(2))
    assert weighted.item() == pytest.approx((3 * math.log(2) + math.log(2)) / 2)
    # 1 positive in 50 steps: the weight makes both classes weigh the same
    assert positive_weight([([], [], [1.0] + [0.0] * 49)]) == pytest.approx(49.0)
    assert positive_weight([([], [], [0.0, 0.0])]) == 1.0


def _row(task, comps, soft, terminal=False):
    return {"prompt": f"Task {task}", "completions": comps, "labels": [y >= 0.5 for y in soft],
            "soft_labels": soft, "observations": ["o"] * len(comps), "env": "toy",
            "task_id": task, "split": "train", "terminal": terminal}


def test_sibling_pairs_on_a_toy_tree():
    """root -> a (Q .8) -> {a1 (1.0), a2 (0.0)}; root -> b (Q .6); root -> c (Q .1). With margin
    0.3: (a, c), (b, c) and (a1, a2); a vs b differ by 0.2 only; a1 is not b's sibling."""
    rows = [_row("t", ["a", "a1"], [0.8, 1.0], True), _row("t", ["a", "a2"], [0.8, 0.0], True),
            _row("t", ["b"], [0.6]), _row("t", ["c"], [0.1]), _row("u", ["a"], [0.0])]
    got = {(w[0]["completions"][w[1] - 1], lo[0]["completions"][lo[1] - 1])
           for w, lo in sibling_pairs(rows, 0.3)}
    assert got == {("a", "c"), ("b", "c"), ("a1", "a2")}
    assert len(sibling_pairs(rows, 0.3)) == 3  # the shared step "a" counts once
    assert {(w[0]["completions"][w[1] - 1], lo[0]["completions"][lo[1] - 1])
            for w, lo in sibling_pairs(rows, 0.15)} == got | {("a", "b")}


def _rows(n_tasks: int):
    """Siblings: a step that 'takes' (Q 0.9) beside one that 'looks' (Q 0.1), per task."""
    rows = []
    for t in range(n_tasks):
        for good in (True, False):
            comp = "Think: the key.\nAct: take key" if good else "Think: hmm.\nAct: look"
            rows.append(_row(f"t{t}", [comp], [0.9 if good else 0.1]))
            rows[-1]["observations"] = ["ok" if good else "dark"]
    return rows


def test_train_prm_pairwise_ranks_siblings(tiny_hf_model, tmp_path, capsys):
    from omrl_search.cli import main
    from omrl_search.reward import make_reward_model
    from reward_models.inputs import Episode

    data = tmp_path / "labels"
    write_labels(_rows(12), data)
    out = tmp_path / "out"
    assert main(["train", "prm", "--data", str(data), "--base", tiny_hf_model, "--out", str(out),
                 "--loss", "pairwise", "--margin", "0.5", "--max-steps", "12", "--lr", "3e-3",
                 "--batch-size", "4", "--val-fraction", "0.25", "--device", "cpu",
                 "--dtype", "float32", "--no-progress"]) == 0
    assert "prm (pairwise): 8 examples from 16 train rows" in capsys.readouterr().err  # a pair a task
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [x["loss"] for x in lines if "loss" in x]
    assert losses[0] > 0.2 and sum(losses[-3:]) / 3 < 0.01 and losses[-1] < losses[0] / 100
    trained = make_reward_model(f"prm:{out}:device=cpu")
    good, bad = trained.score_episodes([Episode("Task room 99", ["Think: the key.\nAct: take key"], ["ok"]),
                                        Episode("Task room 99", ["Think: hmm.\nAct: look"], ["dark"])])
    assert good[0] > bad[0]


def test_train_prm_pairwise_without_pairs_is_one_error(tiny_hf_model, tmp_path, capsys):
    from omrl_search.cli import main

    data = tmp_path / "labels"
    write_labels(_rows(12), data)
    assert main(["train", "prm", "--data", str(data), "--base", tiny_hf_model, "--out",
                 str(tmp_path / "out"), "--loss", "pairwise", "--margin", "0.9", "--device", "cpu",
                 "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "0 sibling pairs (label gap >= 0.9)" in err[0]
