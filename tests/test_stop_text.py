"""Stop strings in the answer's text as OpenAI and vLLM give it (dflash_runtime/stop_text.py): against a direct
search of the whole text, over random texts cut into random streamed deltas."""
from __future__ import annotations

import random

from dflash_runtime.stop_text import StopText


def first_stop(text: str, stops) -> tuple[int, int] | None:
    """(start, end) of the stop string that ends first in `text`: where the engine stops."""
    found = [(text.find(s) + len(s), text.find(s)) for s in stops if s in text]
    return (min(found)[1], min(found)[0]) if found else None


def stream(deltas, stops, include, stopped):
    stop_text = StopText(stops, include)
    sent = [stop_text.push(d) for d in deltas[:-1]]
    return sent, stop_text.push(deltas[-1], final=True, stopped=stopped)


def test_streamed_text_equals_the_whole_text_cut_at_the_stop_string_and_never_shows_it_early():
    rng = random.Random(0)
    for case in range(3000):
        text = "".join(rng.choice("ab c") for _ in range(rng.randint(1, 40)))
        stops = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 8))))
        deltas = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        hit = first_stop(text, stops)
        if hit:  # the engine ends the answer with the delta that completes the stop string
            upto = next(i for i, end in enumerate([*cuts, len(text)]) if end >= hit[1])
            deltas = deltas[:upto + 1]
        for include in (False, True):
            sent, last = stream(deltas, stops, include, stopped=hit is not None)
            whole = "".join(sent) + last
            expected = text[:hit[1] if include else hit[0]] if hit else "".join(deltas)
            assert whole == expected, (case, text, stops, deltas, include)
            if hit and not include:
                assert len("".join(sent)) <= hit[0]  # nothing of the stop string before the end


def test_a_stream_holds_back_only_what_may_begin_a_stop_string():
    stop_text = StopText(["5."])
    assert stop_text.push("1, 2, 3, 4, ") == "1, 2, 3, 4, "
    assert stop_text.push("5") == ""
    assert stop_text.push(".\n", final=True, stopped=True) == ""
    stop_text = StopText(["5"], include_stop_str=True)
    assert stop_text.push("1, 2, ") == "1, 2, "
    assert stop_text.push("3, 4, 5, 6", final=True, stopped=True) == "3, 4, 5"


def test_an_answer_ended_by_a_stop_token_or_its_length_keeps_all_its_text():
    for stopped in (True, False):
        stop_text = StopText(["x", "yz"])
        assert stop_text.push("abc y") == "abc "
        assert stop_text.push("y", final=True, stopped=stopped) == "yy"
    assert StopText([]).push("anything", final=True, stopped=True) == "anything"
