import random

import pytest

from relay_serve.relay.text import find_all_cues
from relay_serve.toy.world import (
    EASY_CUES,
    HARD_CUES,
    THINK_CLOSE,
    ToyWorld,
    entity_name,
    ground_truth_cues,
)


def test_the_world_is_deterministic_given_its_seed():
    a, b, c = ToyWorld(seed=0), ToyWorld(seed=0), ToyWorld(seed=1)
    assert a.map == b.map and a.map != c.map
    assert a.train_problems == b.train_problems and a.heldout_problems == b.heldout_problems
    assert [t.completion for t in a.training_traces(20, seed=3)] == [
        t.completion for t in b.training_traces(20, seed=3)
    ]
    assert a.sample_heldout(10, seed=2) == b.sample_heldout(10, seed=2) != a.sample_heldout(10, seed=3)


def test_held_out_problems_are_never_trained_on_and_every_edge_is():
    w = ToyWorld()
    assert not set(w.train_problems) & set(w.heldout_problems)
    assert len(w.heldout_problems) == 512 and len(set(w.heldout_problems)) == 512
    first_hops = {p.start for p in w.train_problems}
    assert first_hops == set(range(w.n_entities))  # every edge of the map is a first step somewhere
    with pytest.raises(ValueError, match="exceeds"):
        w.sample_heldout(513)


def test_traces_follow_the_map_and_the_cues_have_their_roles():
    w = ToyWorld()
    rng = random.Random(0)
    for p in w.sample_heldout(50, seed=1):
        t = w.trace(p, rng)
        assert t.answer == w.answer(p)
        assert (
            t.completion.startswith("<think>\n")
            and f"{THINK_CLOSE}\n\nThe answer is \\boxed{{{t.answer}}}." in t.completion
        )
        cur = entity_name(p.start)
        hops = 0
        for cue, text in t.steps:
            if cue in HARD_CUES:  # a new step: one recall not yet in context
                src, dst = text.strip(" .").split(" -> ")
                assert src == cur
                assert dst == entity_name(w.map[int(_index(src))])
                cur, hops = dst, hops + 1
            else:  # a restatement: every word of it is already in the context
                assert cue in EASY_CUES
                for word in text.strip(" .").split():
                    assert word in t.completion[: t.completion.index(cue + text)] or word in {
                        "we",
                        "are",
                        "at",
                        "the",
                        "answer",
                        "is",
                    }
        assert hops == p.hops
        # the shared cue rule finds exactly the steps' cues, in order
        assert [m.cue for m in find_all_cues(t.thinking, EASY_CUES + HARD_CUES)] == [c for c, _ in t.steps]


def _index(name: str) -> int:
    from relay_serve.toy.world import LETTERS

    return LETTERS.index(name[0]) * 16 + int(name[1:]) - 1


def test_ground_truth_labels():
    assert ground_truth_cues() == {"easy": ["Thus,", "Wait,", "Therefore,"], "hard": ["First,", "Next,", "Now,"]}
