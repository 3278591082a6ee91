"""Grading with math-verify: the answer after </think>, boxed first, equivalent forms accepted."""

from __future__ import annotations

import pytest

from relay_serve.eval.grading import answer_part, extracted, is_correct, same_answer


def test_only_the_text_after_think_is_graded():
    text = "<think>maybe \\boxed{7}? no.</think>The answer is \\boxed{8}."
    assert answer_part(text) == "The answer is \\boxed{8}."
    assert is_correct(text, "8") and not is_correct(text, "7")


def test_unclosed_reasoning_is_graded_as_a_whole():
    assert answer_part("no close \\boxed{3}") == "no close \\boxed{3}"
    assert is_correct("no close \\boxed{3}", "3")


@pytest.mark.parametrize(
    ("response", "gold", "ok"),
    [
        ("</think>\\boxed{\\frac{1}{2}}", "0.5", True),
        ("</think>\\boxed{\\dfrac{3}{4}}", "\\frac34", True),
        ("</think>So it is $x = 12$.", "12", True),  # no box: math-verify's fall-backs
        ("</think>\\boxed{2\\sqrt{2}}", "\\sqrt{8}", True),
        ("</think>\\boxed{13}", "12", False),
        ("</think>I do not know.", "12", False),
        ("</think>\\boxed{18}", "18", True),  # GSM8K gold is a bare number
    ],
)
def test_math_answers(response, gold, ok):
    assert is_correct(response, gold) is ok


def test_toy_entity_answers_are_exact():
    assert is_correct("<think>e3 -> e40 .</think>So the answer is \\boxed{e40} .", "e40")
    assert not is_correct("</think>So the answer is \\boxed{e41} .", "e40")
    assert not is_correct("</think>So the answer is \\boxed{e4} .", "e40")
    assert extracted("</think>\\boxed{e40}") is not None


def test_same_answer():
    assert same_answer("</think>\\boxed{0.5}", "</think>\\boxed{\\frac{1}{2}}")
    assert not same_answer("</think>\\boxed{1}", "</think>\\boxed{2}")
    assert not same_answer("</think>nothing", "</think>nothing")
