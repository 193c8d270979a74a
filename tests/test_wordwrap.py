"""Word wrapping of streamed text for `ferry run`."""

from __future__ import annotations

from ferry.wordwrap import WordWrapper


def _wrap(pieces: list[str], width: int) -> str:
    out: list[str] = []
    wrapper = WordWrapper(width, out.append)
    for piece in pieces:
        wrapper.feed(piece)
    wrapper.flush()
    return "".join(out)


def test_words_move_to_the_next_line_whole_however_the_text_is_cut():
    text = "the quick brown fox jumps over the lazy dog"
    expected = "the quick\nbrown fox\njumps over\nthe lazy\ndog"
    assert _wrap([text], 10) == expected
    assert _wrap(list(text), 10) == expected


def test_newlines_reset_the_column_and_long_words_stand_alone():
    assert _wrap(["ab cd\nef gh"], 10) == "ab cd\nef gh"
    assert _wrap(["a " + "x" * 15 + " b"], 10) == "a\n" + "x" * 15 + "\nb"
