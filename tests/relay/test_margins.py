import math

import pytest

from relay_serve.calibration.margins import group_margins, margin_from_logprobs


def test_margin_from_logprobs():
    assert margin_from_logprobs([math.log(0.7), math.log(0.2)]) == pytest.approx(0.5)
    assert margin_from_logprobs([math.log(0.1), math.log(0.6), math.log(0.3)]) == pytest.approx(0.3)
    with pytest.raises(ValueError):
        margin_from_logprobs([0.0])


def test_group_margins_takes_the_tokens_after_the_cue_to_the_sentence_end():
    text = "Thus, we are. Next, a b.\n\nThus, x"
    # tokens: "Thus" "," " we" " are" "." " Next" "," " a" " b" "." "\n\n" "Thus" "," " x"
    pieces = ["Thus", ",", " we", " are", ".", " Next", ",", " a", " b", ".", "\n\n", "Thus", ",", " x"]
    spans, pos = [], 0
    for p in pieces:
        spans.append((pos, pos + len(p)))
        pos += len(p)
    assert "".join(pieces) == text
    margins = [float(i) for i in range(len(pieces))]
    g = group_margins(text, spans, margins, ["Thus,", "Next,"])
    assert g.by_cue["Thus,"] == [pytest.approx((2 + 3 + 4) / 3), 13.0]  # the last sentence runs to the end
    assert g.by_cue["Next,"] == [pytest.approx((7 + 8 + 9) / 3)]
    assert g.all_tokens == margins
