import pytest

from relay_serve.calibration.candidates import default_candidates
from relay_serve.calibration.cues import SelectionRule
from relay_serve.calibration.select import cue_stats, select_cues
from relay_serve.toy.world import EASY_CUES, HARD_CUES


def test_candidate_pool():
    pool = default_candidates()
    assert 85 <= len(pool) <= 100 and len(set(pool)) == len(pool)
    for form in ("Thus", "Thus,", "thus", "thus,", "Wait,", "Hmm,"):
        assert form in pool
    assert set(EASY_CUES + HARD_CUES) <= set(pool)


def test_stats_and_interval():
    s = cue_stats("x", [0.9, 0.92, 0.94], 0.95)
    assert s.count == 3 and s.mean == pytest.approx(0.92)
    assert s.ci_low < 0.92 < s.ci_high and s.ci_high - s.ci_low == pytest.approx(2 * 4.303 * 0.02 / 3**0.5, rel=1e-3)
    assert cue_stats("y", [], 0.95).count == 0 and cue_stats("y", [], 0.95).mean is None


def test_our_rule_is_stricter_than_the_papers():
    margins = {
        "Sure,": [0.99] * 50,  # reliably above
        "Maybe,": [0.80, 0.99, 0.99, 0.80, 0.99, 0.80],  # mean above, interval not
        "Below,": [0.5] * 40,
        "Rare,": [0.99] * 3,  # too few
    }
    candidates = ["Sure,", "Maybe,", "Below,", "Rare,", "Never,"]
    overall = 0.88
    table, ours = select_cues(margins, candidates, overall, SelectionRule(min_occurrences=5))
    _, papers = select_cues(margins, candidates, overall, SelectionRule(rule="mean-above-overall", min_occurrences=5))
    assert ours == ["Sure,"] and papers == ["Sure,", "Maybe,"]
    assert [s.cue for s in table] == candidates and table[-1].count == 0
