"""Pause token ids come from an index of the vocabulary, and are exactly what a scan of every token
text against the rules finds (the oracle below applies the rules of engine/stops.py's docstring to
one token at a time, for the splits the index chose to look ahead), on random vocabularies and stop
lists and on a vocabulary of Qwen3's size. That any choice of splits finds every stop where vLLM
would is tests/engine/test_session.py's ``test_stops_agree_with_vllm_stop_strings``."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from relay_serve.engine.stops import PauseTokens, scan_pause_ids
from relay_serve.toy.vocab import QWEN3_VOCAB_SIZE, SPECIAL_TOKENS, synthetic_vocab


def _word_char(ch: str) -> bool:
    return ch.isalnum() or ch == "_"


def must_pause(text: str, stops: tuple[str, ...], word_stops: frozenset[str], ahead) -> bool:
    """Whether a request with these stops must pause after a token whose text alone is ``text``,
    when the splits ``ahead[s]`` of each stop ``s`` are caught by looking ahead and the others by
    completion."""
    if not text:
        return False
    if any(not s.isascii() for s in stops) and "\ufffd" in text:
        return True  # a piece of a multi-byte character: what it completes is not known yet
    for s in stops:
        if s in text:
            return True  # it completes a stop on its own
        word = s in word_stops and _word_char(s[0])
        for j in range(1, len(s)):
            if j in ahead.get(s, ()):  # caught by looking one token ahead
                head = s[:j]
                before = text[: len(text) - j]
                if text.endswith(head) and not (word and before and _word_char(before[-1])):
                    return True  # it may end the start of the stop
                if any(text == s[i:j] for i in range(1, j)):
                    return True  # it may continue a start spread over several tokens
            elif text.startswith(s[j:]):
                return True  # it may complete a stop begun before it
    return False


def scan(texts, stops, word_stops=frozenset(), ahead=None) -> frozenset[int]:
    return frozenset(i for i, t in enumerate(texts) if must_pause(t, stops, word_stops, ahead or {}))


def found_and_scanned(pauses: PauseTokens, texts, stops, word_stops):
    """The index's pause ids, and the scan's for the splits the index looked ahead, which must be:
    the last (a rest of one character) for a stop that ends in white space or is a word stop; any
    other where fewer than half as many texts end with the prefix as start with the rest."""
    found = pauses.ids(stops, word_stops)
    longest = max(map(len, texts))

    def looked_ahead(s: str, j: int) -> bool:
        if j == len(s) - 1:
            return s[-1].isspace() or s in word_stops
        return 2 * sum(t.endswith(s[:j]) for t in texts if t) < sum(t.startswith(s[j:]) for t in texts)

    for s in stops:
        chosen = [j for j in range(1, len(s)) if len(s) - j <= longest and looked_ahead(s, j)]
        assert list(found.ahead.get(s, ())) == chosen, s
    assert set(found.ahead) <= set(stops)
    return found, scan(texts, stops, word_stops, found.ahead)


ALPHABET = "ab ,.\nTh\ufffdé_"
texts_st = st.lists(st.text(alphabet=ALPHABET, min_size=0, max_size=5), min_size=1, max_size=60)
stop_st = st.text(alphabet=ALPHABET, min_size=1, max_size=6)


@settings(max_examples=400, deadline=None)
@given(
    texts=texts_st,
    stops=st.lists(stop_st, min_size=1, max_size=4),
    word=st.lists(st.booleans(), min_size=4, max_size=4),
)
def test_the_index_finds_what_a_scan_finds(texts, stops, word):
    word_stops = frozenset(s for s, w in zip(stops, word, strict=False) if w)
    found, expected = found_and_scanned(PauseTokens(texts), texts, tuple(stops), word_stops)
    assert found == expected
    assert scan_pause_ids(texts, tuple(stops), word_stops, found.ahead) == expected  # the bench's reference


long_text = st.text(alphabet="ab ,", min_size=6, max_size=11)


@settings(max_examples=300, deadline=None)
@given(
    texts=st.lists(st.text(alphabet="ab ,", min_size=1, max_size=11), min_size=1, max_size=80),
    inner=st.lists(long_text, min_size=1, max_size=3),
    around=st.lists(
        st.tuples(st.text(alphabet="ab ,", min_size=1, max_size=3), st.text(alphabet="ab ,", max_size=3)),
        min_size=3,
        max_size=3,
    ),
    word=st.lists(st.booleans(), min_size=3, max_size=3),
)
def test_the_index_finds_what_a_scan_finds_with_long_tokens_and_stops(texts, inner, around, word):
    """Texts and stops longer than the index's short prefixes (``SHORT``): the lookups past them
    bisect the sorted texts. Each stop holds a long token of the vocabulary strictly inside it
    (a piece of a start spread over several tokens) and ends in a space or is a word stop, so
    that the rule which finds such pieces is exercised past ``SHORT`` characters."""
    texts = texts + inner
    stops = tuple(head + t + tail + ("" if w else " ") for t, (head, tail), w in zip(inner, around, word, strict=False))
    word_stops = frozenset(s for s, w in zip(stops, word, strict=False) if w)
    found, expected = found_and_scanned(PauseTokens(texts), texts, stops, word_stops)
    assert found == expected


def test_a_vocabulary_of_qwen3s_size_is_shaped_like_a_byte_level_bpe():
    texts = synthetic_vocab()
    assert len(texts) == QWEN3_VOCAB_SIZE and texts[-len(SPECIAL_TOKENS) :] == SPECIAL_TOKENS
    assert texts[:256].count("\ufffd") > 100  # bytes that are pieces of multi-byte characters
    sample = texts[256 : -len(SPECIAL_TOKENS)]
    spaced = [t for t in sample if t.startswith(" ") and t[1:].isalpha()]
    bare = [t for t in sample if t.isalpha() and t.isascii()]
    assert len(spaced) > 30_000 and len(bare) > 20_000  # words with and without a leading space
    assert any(t.endswith(",") and t[:-1].strip().isalpha() for t in sample)  # punctuation glued to words
    assert {"\n", "\n\n", ".\n\n", " ", ",", "0", "9"} <= set(texts)
    assert any(not t.isascii() and "\ufffd" not in t and len(t) > 1 for t in sample)  # words with multi-byte characters
    assert len(set(sample)) == len(sample)


def test_on_a_vocabulary_of_qwen3s_size_too():
    texts = synthetic_vocab()
    pauses = PauseTokens(texts)
    rng = random.Random(0)
    words = [t.strip() for t in rng.sample(texts[300:-30], 8)]
    cases = [
        (("Thus,", "Therefore,", "Wait,", "</think>"), frozenset({"Thus,", "Therefore,", "Wait,"})),
        ((". ", "\n\n", "so "), frozenset({"so "})),
        (tuple(w + ", " for w in words), frozenset()),
        (("é.", "中文", "</answer>"), frozenset()),
    ]
    for stops, word_stops in cases:
        found, expected = found_and_scanned(pauses, texts, stops, word_stops)
        assert found == expected, stops


def test_a_stop_list_never_seen_is_found_off_the_event_loop_and_then_cached():
    import asyncio
    import threading

    texts = ["a", "b", ",", "Thus", "Thus,", " so", "so"]
    pauses = PauseTokens(texts)
    threads = []
    found_by = pauses._ids

    def recording(stops, word_stops):
        threads.append(threading.current_thread())
        return found_by(stops, word_stops)

    pauses._ids = recording

    async def main():
        first = await pauses.lookup(("Thus,",), frozenset({"Thus,"}))
        again = await pauses.lookup(("Thus,",), frozenset({"Thus,"}))
        return first, again

    first, again = asyncio.run(main())
    assert first is again and len(threads) == 1 and threads[0] is not threading.main_thread()
    assert first == scan(texts, ("Thus,",), frozenset({"Thus,"}), first.ahead)


def test_pause_ids_are_a_sorted_set():
    texts = ["x", ",", "a,", " b", "c,", ", ", " d", " e", " f", " g", " h", " i"]
    found = PauseTokens(texts).ids((", ",))  # it ends in a space: its last split is looked ahead
    assert found.ordered == [1, 2, 4, 5] and found.ahead == {", ": (1,)}
    assert found == frozenset(found.ordered) == scan(texts, (", ",), ahead=found.ahead)
    assert 1 in found and 3 not in found and "1" not in found and len(found) == len(set(found))
    assert PauseTokens(texts).ids(()) == frozenset()


def test_the_cache_keeps_the_newest_lists():
    pauses = PauseTokens(["a", "b", "ab"], cache_size=2)
    for stops in (("a",), ("b",), ("ab",)):
        pauses.ids(stops)
    assert list(pauses._cache) == [(("b",), frozenset()), (("ab",), frozenset())]


def test_a_split_is_caught_the_way_that_pauses_on_fewer_tokens():
    """Stops like a client's ``"word, "``: a look-ahead at every split would pause after every
    token that ends with the word's first letter; completing the early splits (the few tokens that
    start with ``"ord, "``) and looking ahead at the late ones (after ``"word,"``, not before every
    token that starts with a space) pauses on far fewer."""
    texts = synthetic_vocab()
    pauses = PauseTokens(texts)
    words = [t.strip() for t in random.Random(3).sample(texts[1000:-100], 12)]
    stops = tuple(w + ", " for w in words)
    found = pauses.ids(stops)
    every_split_ahead = {s: range(1, len(s)) for s in stops}
    assert len(found) * 5 < len(scan_pause_ids(texts, stops, ahead=every_split_ahead))
    assert all(js[-1] == len(s) - 1 for s, js in found.ahead.items())  # the split before the space is looked ahead


def _ends_prefix(text: str, prefix: str, word_start: bool) -> bool:
    """``text`` ends with ``prefix``, at a word start if ``word_start``."""
    before = text[: len(text) - len(prefix)][-1:] or " "
    return text.endswith(prefix) and not (word_start and _word_char(before))


@settings(max_examples=300, deadline=None)
@given(
    texts=texts_st,
    stops=st.lists(stop_st, min_size=1, max_size=4),
    word=st.lists(st.booleans(), min_size=4, max_size=4),
    spare=st.lists(st.booleans(), min_size=60, max_size=60),
)
def test_with_spare_ids_every_way_to_complete_a_stop_is_still_caught(texts, stops, word, spare):
    """With spare ids (tokens the model never writes) some stops are looked ahead inside the engine
    (``PauseIds.swaps``): after a token that can end a stop's prefix (a trigger), each token that can
    complete it is drawn as a stand-in the request stops on. Every pair of a token ``t`` that can
    end a split's prefix and a token ``c`` that starts its rest must still be caught: ``c`` is a
    pause id, or it has a stand-in after ``t``, or ``t`` is a pause id and the split is looked ahead
    at the pause. Stand-ins are spare ids, one per completing token, and pause ids themselves."""
    word_stops = frozenset(s for s, w in zip(stops, word, strict=False) if w)
    spare_ids = [i for i, (t, sp) in enumerate(zip(texts, spare, strict=False)) if sp]
    found = PauseTokens(texts, spare_ids=spare_ids).ids(tuple(stops), word_stops)
    real = [i for i, t in enumerate(texts) if t and i not in spare_ids]
    for s in stops:
        assert not any(s in texts[i] for i in real) or all(i in found for i in real if s in texts[i])
        wordish = s in word_stops and _word_char(s[0])
        for j in range(1, len(s)):
            ends = [
                t
                for t in real
                if _ends_prefix(texts[t], s[:j], wordish) or any(texts[t] == s[i:j] for i in range(1, j))
            ]
            starts = [c for c in real if texts[c].startswith(s[j:])]
            for t in ends:
                for c in starts:
                    caught = (
                        c in found
                        or any(c == x for x, _ in found.swaps.get(t, ()))
                        or (t in found and j in found.ahead.get(s, ()))
                    )
                    assert caught, (s, j, texts[t], texts[c])
    standins = [sid for pairs in found.swaps.values() for _, sid in pairs]
    assert set(standins) <= set(spare_ids) and all(sid in found for sid in standins)
    assert all(found.real[sid] == c for pairs in found.swaps.values() for c, sid in pairs)
    assert len(set(found.real)) == len({c for pairs in found.swaps.values() for c, _ in pairs})  # one each
    assert not set(found.swaps) & set(spare_ids)
