"""Stop strings found across delta boundaries; nothing after a stop is ever emitted."""

import random

import pytest

from stopping import StopStringMatcher


def run(stops, deltas, include_stop=False):
    """Streams `deltas` through a matcher as a server would: stops feeding at the first stop,
    flushes at the end otherwise. Returns (the emitted pieces, whether a stop was found)."""
    matcher = StopStringMatcher(stops, include_stop)
    pieces = []
    for delta in deltas:
        safe, stopped = matcher.feed(delta)
        pieces.append(safe)
        if stopped:
            return pieces, True
    pieces.append(matcher.flush())
    return pieces, matcher.stopped


def truncated(text, stops, include_stop=False):
    """The offline answer: `text` cut before its first stop string (shortest at a tie)."""
    found = [(text.find(s), len(s), s) for s in stops if s and s in text]
    if not found:
        return text
    at, _, stop = min(found)
    return text[: at + len(stop)] if include_stop else text[:at]


def test_stop_split_character_by_character():
    text = "The answer is 42.\nUser: and now?"
    pieces, stopped = run(["\nUser:"], list(text))
    assert stopped
    assert "".join(pieces) == "The answer is 42."


def test_stop_inside_one_delta_and_across_two():
    assert run(["STOP"], ["hello STOP world"]) == (["hello "], True)
    pieces, stopped = run(["STOP"], ["hello ST", "OP world"])
    assert stopped and pieces == ["hello ", ""]  # "ST" was held back, then dropped with the stop


def test_held_back_text_is_released_when_it_is_not_a_stop():
    matcher = StopStringMatcher(["</answer>"])
    assert matcher.feed("x </ans") == ("x ", False)
    assert matcher.feed("wer") == ("", False)  # "</answer" could still complete
    assert matcher.feed("s>") == ("</answers>", False)  # it did not
    assert matcher.feed(" <") == (" ", False)
    assert matcher.flush() == "<"  # the end: what was held back was not a stop


def test_flush_releases_a_tail_that_looked_like_a_stop():
    pieces, stopped = run(["###"], ["abc", "#", "#"])
    assert not stopped
    assert pieces == ["abc", "", "", "##"]


def test_earliest_stop_wins():
    stops = ["world", "lo w"]
    pieces, stopped = run(stops, list("hello world"))
    assert stopped and "".join(pieces) == "hel"
    # The order of the stops list does not matter, only the position in the text.
    assert "".join(run(stops[::-1], list("hello world"))[0]) == "hel"


def test_a_later_stop_found_first_waits_for_an_earlier_one():
    # After "abc", "bc" is complete, but "abcd" would start earlier if a "d" follows.
    matcher = StopStringMatcher(["abcd", "bc"])
    assert matcher.feed("xab") == ("x", False)
    assert matcher.feed("c") == ("", False)
    assert matcher.feed("d!") == ("", True)
    matcher = StopStringMatcher(["abcd", "bc"])
    assert matcher.feed("xabc") == ("x", False)
    assert matcher.feed("e") == ("a", True)  # not "abcd" after all: "bc" at index 1 of "abce"
    # The stream ends while "bc" waits for "abcd": flush cuts at "bc".
    matcher = StopStringMatcher(["abcd", "bc"])
    assert matcher.feed("xabc") == ("x", False)
    assert matcher.flush() == "a" and matcher.stopped


def test_stop_that_is_a_prefix_of_another():
    # At the same position the shorter stop is complete first, and wins.
    assert "".join(run(["a", "ab"], list("xxabyy"))[0]) == "xx"
    assert "".join(run(["ab", "a"], list("xxabyy"), include_stop=True)[0]) == "xxa"
    # Held back while the longer one could still match; released when neither does.
    matcher = StopStringMatcher(["<end>", "<end_of_turn>"])
    assert matcher.feed("ok <en") == ("ok ", False)
    assert matcher.feed("d_of_turn>") == ("", True)
    matcher = StopStringMatcher(["<end_of_turn>", "<eot>"])
    assert matcher.feed("ok <e") == ("ok ", False)
    assert matcher.feed("nd") == ("", False)
    assert matcher.feed("!") == ("<end!", False)


def test_include_stop():
    pieces, stopped = run(["\n\n"], ["Line one.\n", "\nLine two."], include_stop=True)
    assert stopped and "".join(pieces) == "Line one.\n\n"
    pieces, stopped = run(["</s>"], list("answer</s>more"), include_stop=True)
    assert "".join(pieces) == "answer</s>"


def test_no_stops_passes_everything_through_at_once():
    for stops in ([], [""]):
        matcher = StopStringMatcher(stops)
        for delta in ["a", "", "bc\n", "#"]:
            assert matcher.feed(delta) == (delta, False)
        assert matcher.flush() == ""


def test_nothing_after_the_stop():
    matcher = StopStringMatcher(["END"])
    assert matcher.feed("a E") == ("a ", False)
    assert matcher.feed("NDb") == ("", True)
    assert matcher.feed("more text") == ("", True)
    assert matcher.feed("END") == ("", True)
    assert matcher.flush() == ""


def test_unicode_stops():
    pieces, stopped = run(["。\n"], ["你好", "。", "\n再见"])
    assert stopped and "".join(pieces) == "你好"
    pieces, stopped = run(["👩‍👩‍👧"], ["hi 👩", "\u200d", "👩\u200d👧 bye"])
    assert stopped and "".join(pieces) == "hi "


@pytest.mark.parametrize("include_stop", [False, True])
def test_random_streams_equal_the_truncated_text(include_stop):
    """Any cut of any text into deltas gives the text truncated at its first stop."""
    rng = random.Random(7)
    alphabet = "ab c\n#"
    for _ in range(500):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(0, 3))]
        cuts = sorted(rng.sample(range(len(text) + 1), rng.randint(0, len(text) + 1)))
        deltas = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]
        pieces, stopped = run(stops, deltas, include_stop)
        assert "".join(pieces) == truncated(text, stops, include_stop), (text, stops, deltas)
        assert stopped == any(s in text for s in stops)
