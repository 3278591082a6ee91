"""Candidate cues: common discourse words of reasoning traces (the paper's candidate pool), each
with and without a comma and in both cases."""

from __future__ import annotations

DISCOURSE_WORDS = (
    "So",
    "Thus",
    "Therefore",
    "Hence",
    "But",
    "However",
    "Wait",
    "Hmm",
    "Now",
    "Next",
    "First",
    "Then",
    "Also",
    "Alternatively",
    "Actually",
    "Okay",
    "Well",
    "Finally",
    "Similarly",
    "Again",
    "Maybe",
    "Perhaps",
    "Instead",
)


def default_candidates() -> list[str]:
    forms: list[str] = []
    for word in DISCOURSE_WORDS:
        for w in (word, word.lower()):
            forms += [w, w + ","]
    return forms
