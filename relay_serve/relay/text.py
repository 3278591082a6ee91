"""Cue and sentence rules on plain text, shared by the router's policies and the calibration job.

- A cue matches only at a word boundary: the character before it is not a letter or digit, and a
  cue that ends in a letter or digit must be followed by white space ("So" never fires inside
  "Some", "now," never inside "know,"). The paper's reference code matches raw substrings.
- A sentence ends at terminal punctuation followed by a space or a newline, or at a blank line. The
  dot in "3.5" is not a sentence end, nor one followed by a tab or a no-break space: the sentence-end
  stop strings (``SENTENCE_STOPS``) and the rule (:func:`sentence_end`) agree.

Engines match stop strings as raw substrings; :func:`cue_stop_strings` turns cues into stop strings
that can only over-match, and :func:`find_cue` is the check that decides whether a stop was real.
Knows nothing of tokens, models or serving.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"  # the reasoning markers (Qwen3's, the toy pair's)
TERMINALS = ".!?"
SENTENCE_SPACES = (" ", "\n")  # what follows terminal punctuation at a sentence end
# The stop strings and the rule are one definition: a stop the engine reports is the first sentence
# end the rule finds, so taking back tokens after it never deletes text already streamed.
SENTENCE_STOPS = tuple(f"{p}{ws}" for p in TERMINALS for ws in SENTENCE_SPACES) + ("\n\n",)
_SENTENCE_END = re.compile(rf"[{re.escape(TERMINALS)}](?=[{''.join(SENTENCE_SPACES)}])|\n\n")


def is_word_char(ch: str) -> bool:
    """A letter, digit or underscore: what a cue's word boundary is made of (here, in the engines'
    pause tokens, ``engine/stops.py``, and at a stop: one definition)."""
    return ch.isalnum() or ch == "_"


def needs_right_boundary(cue: str) -> bool:
    return bool(cue) and is_word_char(cue[-1])


def cue_stop_strings(cues: list[str] | tuple[str, ...]) -> list[str]:
    """Stop strings that fire on every occurrence of every cue (and on some non-occurrences)."""
    stops: list[str] = []
    for cue in cues:
        forms = [cue + " ", cue + "\n"] if needs_right_boundary(cue) else [cue]
        stops += [f for f in forms if f not in stops]
    return stops


@dataclass(frozen=True)
class CueMatch:
    cue: str
    start: int  # offset of the cue's first character
    end: int  # offset just after the cue


def _at_boundary(text: str, cue: str, start: int) -> bool:
    if start > 0 and is_word_char(text[start - 1]) and is_word_char(cue[0]):
        return False
    end = start + len(cue)
    if needs_right_boundary(cue):
        return end < len(text) and text[end].isspace()
    return True


def find_cue(text: str, cues: list[str] | tuple[str, ...], start: int = 0, end: int | None = None) -> CueMatch | None:
    """The earliest cue that starts in ``text[start:end]`` at a word boundary; the longest on ties."""
    best: CueMatch | None = None
    stop = len(text) if end is None else end
    for cue in cues:
        pos = text.find(cue, start)
        while pos != -1 and pos < stop:
            if _at_boundary(text, cue, pos):
                cand = CueMatch(cue, pos, pos + len(cue))
                if best is None or (cand.start, -len(cue)) < (best.start, -len(best.cue)):
                    best = cand
                break
            pos = text.find(cue, pos + 1)
    return best


def find_all_cues(text: str, cues: list[str] | tuple[str, ...]) -> list[CueMatch]:
    """Every non-overlapping cue occurrence at a word boundary, left to right."""
    found: list[CueMatch] = []
    pos = 0
    while (m := find_cue(text, cues, pos)) is not None:
        found.append(m)
        pos = m.end
    return found


def sentence_end(text: str, start: int = 0) -> int | None:
    """Offset just after the first sentence end at or after ``start`` (after the punctuation, or
    after the blank line), or None when the text holds none yet."""
    m = _SENTENCE_END.search(text, start)
    return None if m is None else m.end()
