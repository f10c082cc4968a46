from __future__ import annotations

import pytest

import asyncgraph.optim
import asyncgraph.text
from asyncgraph import Variable
from asyncgraph.text import approx_tokens, feedback_entries, render_feedback


def test_single_entry_renders_as_is() -> None:
    assert render_feedback(Variable("Be shorter.")) == "Be shorter."
    assert render_feedback("Be shorter.") == "Be shorter."


def test_several_entries_are_numbered_in_order_and_separated() -> None:
    text = render_feedback(Variable(["first point", "second point"]))
    assert text == ("--- feedback 1 of 2 ---\nfirst point\n\n--- feedback 2 of 2 ---\nsecond point")


def test_empty_feedback_renders_as_empty_text() -> None:
    assert render_feedback(None) == ""
    assert render_feedback(Variable("")) == ""
    assert render_feedback(["", "  "]) == ""


def test_entries_drop_empty_feedback_and_keep_order() -> None:
    assert feedback_entries(Variable(["", "b", " a ", ""])) == ["b", "a"]
    assert feedback_entries(Variable(["x", "x"])) == ["x", "x"]  # two paths, two entries


def test_approx_tokens_is_four_characters_per_token_rounded_up() -> None:
    assert approx_tokens("") == 0
    assert approx_tokens("abcd") == 1
    assert approx_tokens("abcde") == 2
    assert approx_tokens("x" * 4000) == 1000


@pytest.mark.parametrize("module", [asyncgraph.text, asyncgraph.optim])
def test_every_public_name_is_importable_documented_and_sorted(module: object) -> None:
    names = module.__all__  # type: ignore[attr-defined]
    assert names == sorted(names)
    for name in names:
        obj = getattr(module, name)
        if callable(obj) and not isinstance(obj, type(int | str)):
            assert getattr(obj, "__doc__", None), f"{module.__name__}.{name} has no docstring"  # type: ignore[attr-defined]
