from relay_serve.relay.text import (
    SENTENCE_STOPS,
    cue_stop_strings,
    find_all_cues,
    find_cue,
    sentence_end,
)


def test_cues_match_only_at_word_boundaries():
    assert find_cue("I know, it", ["now,"]) is None
    assert find_cue("Some things", ["So"]) is None
    assert find_cue("Also so it", ["so"]).start == 5
    assert find_cue("So it", ["So"]).start == 0
    assert find_cue("So", ["So"]) is None  # right boundary unknown yet: not a match
    assert find_cue("(Thus, x", ["Thus,"]).start == 1
    assert find_cue("Thus,x", ["Thus,"]).start == 0  # the comma is the boundary
    assert find_cue("xThus, y", ["Thus,"]) is None


def test_earliest_then_longest_cue_wins():
    m = find_cue("a Thus, so Therefore, b", ["Therefore,", "Thus,"])
    assert m.cue == "Thus," and m.start == 2
    m = find_cue("So, yes", ["So", "So,"])
    assert m.cue == "So,"
    assert [m.cue for m in find_all_cues("Thus, a. Thus, b", ["Thus,"])] == ["Thus,", "Thus,"]


def test_stop_strings_cover_every_real_occurrence():
    stops = cue_stop_strings(["So", "Thus,"])
    assert stops == ["So ", "So\n", "Thus,"]
    for text in ["So it", "ok. So\nit", "x Thus, y"]:
        m = find_cue(text, ["So", "Thus,"])
        assert m is not None and any(s in text[m.start :] for s in stops)


def test_sentence_end():
    assert sentence_end("It is 3.5 units. Then") == len("It is 3.5 units.")
    assert sentence_end("It is 3.5") is None
    assert sentence_end("Done!\nNext") == len("Done!")
    assert sentence_end("a list\n\nb") == len("a list\n\n")
    assert sentence_end("end.") is None  # no white space after it yet
    assert ". " in SENTENCE_STOPS and "\n\n" in SENTENCE_STOPS
