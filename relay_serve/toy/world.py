"""The toy reasoning world: multi-hop recall over a fixed map that the models learn in their weights.

A world is a seeded permutation ``f`` over ``n_entities`` numbered entities. A problem asks for the
entity reached from a start after ``hops`` applications of ``f``. Its reference trace is written in
reasoning-model format, one step per paragraph, each step opened by a discourse cue whose role is
known by construction:

- hard cues (``First,``, ``Next,``, ``Now,``) open a new step: the text after them holds one recall
  of ``f`` that the context does not contain;
- easy cues (``Thus,``, ``Wait,``, ``Therefore,``) open a restatement: the text after them repeats
  what is already in context (the current entity, the step just taken, the last result).

The small model learns to copy well and to recall poorly; the large model learns both. That makes
the RelayGen hand-off observable and gives cue calibration a ground truth to be checked against.

This module knows nothing of tokenizers, models or serving.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from functools import cached_property

from relay_serve.relay.text import THINK_CLOSE, THINK_OPEN  # noqa: F401 - re-exported for the toy modules

HOP_WORDS = {3: "three", 4: "four", 5: "five", 6: "six"}
HARD_CUES = ("First,", "Next,", "Now,")
EASY_CUES = ("Thus,", "Wait,", "Therefore,")
LETTERS = "bcdfghkmnprstvwz"  # no vowels: no entity name reads as a word or a math constant


def entity_name(index: int) -> str:
    """Entity ``index`` as a letter and a number (``b1`` ... ``z16``): two tokens, so that recalling
    its image is a function of a pair (hard to hold in few weights) while copying it is easy."""
    return f"{LETTERS[index // 16]}{index % 16 + 1}"


@dataclass(frozen=True)
class Problem:
    start: int
    hops: int

    @property
    def prompt(self) -> str:
        """The user message's content."""
        return f"Start at {entity_name(self.start)}. Follow the map {HOP_WORDS[self.hops]} times."

    @property
    def key(self) -> str:
        return f"{self.start}:{self.hops}"


@dataclass(frozen=True)
class Trace:
    """A reference solution: the assistant's whole turn, and the role of every step."""

    problem: Problem
    answer: str
    steps: tuple[tuple[str, str], ...]  # (cue, text after the cue) in order
    completion: str

    @property
    def thinking(self) -> str:
        return self.completion.split(THINK_CLOSE, 1)[0].removeprefix(THINK_OPEN)


class ToyWorld:
    """A fixed map plus a seeded split of its problems into training and held-out sets."""

    def __init__(self, seed: int = 0, n_entities: int = 256, p_restate: float = 0.4) -> None:
        if not 2 <= n_entities <= 16 * len(LETTERS):
            raise ValueError(f"n_entities must be in [2, {16 * len(LETTERS)}]")
        self.seed = seed
        self.n_entities = n_entities
        self.p_restate = p_restate
        rng = random.Random(f"map:{seed}")
        targets = list(range(n_entities))
        rng.shuffle(targets)
        self.map: tuple[int, ...] = tuple(targets)

    # ---- problems -------------------------------------------------------------------------------

    @cached_property
    def _split(self) -> tuple[tuple[Problem, ...], tuple[Problem, ...]]:
        """Half the hop counts of every start train, the other half are held out.

        Every start trains (so every edge of the map is a first step somewhere) and every start is
        held out with other hop counts, so a model must read the hop count, not recall the start's.
        """
        rng = random.Random(f"split:{self.seed}")
        train: list[Problem] = []
        heldout: list[Problem] = []
        hops = sorted(HOP_WORDS)
        for s in range(self.n_entities):
            order = rng.sample(hops, len(hops))
            train += [Problem(s, h) for h in order[: len(hops) // 2]]
            heldout += [Problem(s, h) for h in order[len(hops) // 2 :]]
        return tuple(train), tuple(heldout)

    @property
    def train_problems(self) -> tuple[Problem, ...]:
        return self._split[0]

    @property
    def heldout_problems(self) -> tuple[Problem, ...]:
        return self._split[1]

    def sample_heldout(self, n: int, seed: int = 0) -> list[Problem]:
        """``n`` distinct held-out problems in a seeded order."""
        pool = list(self.heldout_problems)
        if n > len(pool):
            raise ValueError(f"n={n} exceeds the {len(pool)} held-out problems of this world")
        random.Random(f"sample:{self.seed}:{seed}").shuffle(pool)
        return pool[:n]

    def answer(self, problem: Problem) -> str:
        cur = problem.start
        for _ in range(problem.hops):
            cur = self.map[cur]
        return entity_name(cur)

    # ---- traces ---------------------------------------------------------------------------------

    def trace(self, problem: Problem, rng: random.Random) -> Trace:
        """A reference trace; ``rng`` decides where restatements go and which easy cue opens them."""
        steps: list[tuple[str, str]] = []
        cur, prev_easy = problem.start, False
        for i in range(problem.hops):
            nxt = self.map[cur]
            cue = "First," if i == 0 else ("Now," if prev_easy else "Next,")
            steps.append((cue, f" {entity_name(cur)} -> {entity_name(nxt)}."))
            step_text, cur = steps[-1][1], nxt
            prev_easy = i < problem.hops - 1 and rng.random() < self.p_restate
            if prev_easy:
                if rng.random() < 0.5:
                    steps.append(("Thus,", f" we are at {entity_name(cur)}."))
                else:
                    steps.append(("Wait,", step_text))
        answer = entity_name(cur)
        steps.append(("Therefore,", f" the answer is {answer}."))
        body = "\n\n".join(cue + text for cue, text in steps)
        completion = f"{THINK_OPEN}\n{body}\n{THINK_CLOSE}\n\nThe answer is \\boxed{{{answer}}}."
        return Trace(problem, answer, tuple(steps), completion)

    def training_traces(self, n: int, seed: int) -> list[Trace]:
        rng = random.Random(f"traces:{self.seed}:{seed}")
        probs = self.train_problems
        return [self.trace(probs[rng.randrange(len(probs))], rng) for _ in range(n)]

    def corpus(self) -> list[str]:
        """Every word form the world can write, for building the tokenizer's vocabulary."""
        rng = random.Random(f"corpus:{self.seed}")
        every = [Problem(s, h) for s in range(self.n_entities) for h in sorted(HOP_WORDS)]
        return [p.prompt + "\n" + self.trace(p, rng).completion for p in every]

    def fingerprint(self) -> str:
        text = f"{self.seed}:{self.n_entities}:{self.p_restate}:{self.map}"
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def ground_truth_cues() -> dict[str, list[str]]:
    """The cue roles by construction: what ``relay-serve toy cues --json`` prints."""
    return {"easy": list(EASY_CUES), "hard": list(HARD_CUES)}
