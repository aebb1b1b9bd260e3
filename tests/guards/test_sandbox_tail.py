"""A child's output tail in a verdict starts at a line, never mid-word (helper-25, session 22)."""

from __future__ import annotations

from guards.sandbox import tail_lines


def test_tail_starts_at_a_line_and_says_it_was_cut():
    text = "".join(f"line {i}: Traceback detail number {i}\n" for i in range(200))
    out = tail_lines(text, 300)
    assert len(out) <= 300 and out.startswith("...\nline ") and out.endswith("number 199\n")
    assert text.endswith(out[4:])  # the kept lines are whole


def test_short_text_is_kept_and_one_long_line_is_cut_at_a_space():
    assert tail_lines("RuntimeError: boom", 300) == "RuntimeError: boom"
    long = "word " * 100 + "end"
    out = tail_lines(long, 50)
    assert len(out) <= 50 and out.startswith("... word") and out.endswith("end")
    assert tail_lines("x" * 100, 20) == "... " + "x" * 16  # no space to cut at: the characters as they are
