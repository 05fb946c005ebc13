"""Incremental detokenisation (`runtime/output.py`): token by token, the text is always a prefix of
the whole output's decode, never half a character, and at the end it is the whole decode; stop
strings cut at their first occurrence even when they span tokens."""

from __future__ import annotations

import pytest

from dserve.models.tiny import train_tokenizer
from dserve.runtime.output import TextTracker
from dserve.scheduler.request import Request, SamplingParams

TEXT = "Paged KV: 页表 → décodage ✓ 🚀 done. Then more words after the stop mark ### and beyond."


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(512)


def feed(tokenizer, ids, stop=None):
    """Append `ids` one by one as the engine does; (texts after each token, stop matched, tracker)."""
    req = Request("r", [1], SamplingParams(stop=stop))
    tracker, texts, matched = TextTracker(tokenizer, req), [], None
    for token in ids:
        req.output_ids.append(token)
        matched = tracker.update()
        texts.append(tracker.text)
        if matched is not None:
            break
    req.finish("stop" if matched else "length", matched)
    return texts, matched, tracker


def test_text_grows_by_whole_characters_and_ends_as_the_full_decode(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    full = tokenizer.decode(ids)
    assert full == TEXT and len(ids) > 40  # multi-byte characters span several byte-level tokens
    texts, matched, tracker = feed(tokenizer, ids)
    assert matched is None and tracker.text == full
    held = 0
    for i, text in enumerate(texts):
        assert full.startswith(text) and "\ufffd" not in text
        # mid-character: the partial decode shows U+FFFD
        held += text != tokenizer.decode(ids[: i + 1])
    assert held > 0


def test_a_request_ending_mid_character_keeps_the_replacement_character(tokenizer):
    ids = tokenizer.encode("ok 🚀", add_special_tokens=False)
    cut = ids[:-1]
    texts, _, tracker = feed(tokenizer, cut)
    assert tracker.text == tokenizer.decode(cut) and tracker.text.endswith("\ufffd")


@pytest.mark.parametrize("stop", [["###"], ["done.", "###"], ["never there", "→ d"]])
def test_stop_strings_cut_at_their_first_occurrence(tokenizer, stop):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    _, matched, tracker = feed(tokenizer, ids, stop)
    first = min((TEXT.find(s), s) for s in stop if s in TEXT)
    assert matched == first[1] and tracker.text == TEXT[: first[0]]
