"""Every prompt TGD sends, in one place (TextGrad's tag conventions)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = [
    "retry_message",
    "summary_messages",
    "update_messages",
    "update_system_prompt",
]


def update_system_prompt(open_tag: str, close_tag: str) -> str:
    return (
        "You are part of an optimization system that improves text (the variable) using "
        "feedback, like a gradient step. You are given the variable's role, its current value "
        "and feedback on it, and possibly earlier versions with the feedback they got and "
        "constraints the variable must satisfy. Rewrite the variable so that it addresses the "
        "feedback while keeping what already works; make the changes the feedback calls for, "
        "not unrelated ones. The text you put between the tags replaces the variable verbatim, "
        f"so send the complete improved variable between {open_tag} and {close_tag} and put "
        "nothing else between them."
    )


def update_messages(
    *,
    role: str,
    value: str,
    feedback: str,
    history: Sequence[dict[str, Any]],
    constraints: Sequence[str],
    open_tag: str,
    close_tag: str,
    system_prompt: str | None,
    examples: Sequence[str] = (),
) -> list[dict[str, Any]]:
    """The request for one parameter's improved value."""
    parts = [
        f"Here is the role of the variable you will improve: <ROLE>{role}</ROLE>.",
        f"The variable is the text between these tags:\n<VARIABLE>{value}</VARIABLE>",
        f"Here is the feedback on the variable:\n<FEEDBACK>\n{feedback}\n</FEEDBACK>",
    ]
    if history:
        iterations = "\n".join(
            f'<ITERATION index="{i}">\n<PAST_VALUE>{item.get("value", "")}</PAST_VALUE>\n'
            f"<PAST_FEEDBACK>\n{item.get('feedback', '')}\n</PAST_FEEDBACK>\n</ITERATION>"
            for i, item in enumerate(history, 1)
        )
        parts.append(
            "Here are earlier versions of the variable and the feedback each one got, oldest "
            "first. Keep improving in a consistent direction and do not bring back problems "
            f"that were fixed:\n<PAST_ITERATIONS>\n{iterations}\n</PAST_ITERATIONS>"
        )
    if constraints:
        listed = "\n".join(f"- {c}" for c in constraints)
        parts.append(
            f"The improved variable must satisfy these constraints:\n<CONSTRAINTS>\n{listed}\n"
            f"</CONSTRAINTS>"
        )
    if examples:
        listed = "\n".join(f"<EXAMPLE>\n{example}\n</EXAMPLE>" for example in examples)
        parts.append(
            f"Here are examples to guide the improved variable (good values of it, or of what "
            f"it should lead to); follow their lead where the feedback allows:\n<EXAMPLES>\n"
            f"{listed}\n</EXAMPLES>"
        )
    parts.append(
        f"Improve the variable ({role}) using the feedback. Send the complete improved "
        f"variable between {open_tag} and {close_tag}."
    )
    return [
        {"role": "system", "content": system_prompt or update_system_prompt(open_tag, close_tag)},
        {"role": "user", "content": "\n\n".join(parts)},
    ]


def retry_message(role: str, open_tag: str, close_tag: str, empty: bool) -> dict[str, Any]:
    problem = (
        f"the text between {open_tag} and {close_tag} was empty"
        if empty
        else f"it did not contain the improved variable between {open_tag} and {close_tag}"
    )
    return {
        "role": "user",
        "content": (
            f"Your reply could not be used: {problem}. Reply again with the complete improved "
            f"variable ({role}) between {open_tag} and {close_tag}."
        ),
    }


def summary_messages(
    *, role: str, feedback: str, entries: int, max_tokens: int, summaries: bool = False
) -> list[dict[str, Any]]:
    """The request that condenses one chunk of over-long feedback before an update.

    ``entries``: how many pieces ``feedback`` holds; ``summaries``: whether they are
    summaries made by earlier requests (a later round of the map-reduce) rather than
    feedback as the backward produced it.
    """
    words = max(1, max_tokens * 3 // 4)
    if summaries:
        what = (
            f"{entries} summaries of feedback, each condensed from several sources,"
            if entries > 1
            else "a summary of feedback from several sources"
        )
    else:
        what = f"feedback from {entries} sources" if entries > 1 else "feedback from one source"
    return [
        {
            "role": "system",
            "content": (
                "You condense feedback for an optimization system. Keep every distinct, "
                "actionable point; merge points that repeat; keep points that conflict and "
                "say that they conflict; drop everything else. Reply with the condensed "
                "feedback only."
            ),
        },
        {
            "role": "user",
            "content": (
                f"Below is {what} on a variable with the role <ROLE>{role}</ROLE>. It is too "
                f"long to use as is. Condense it into at most about {words} words "
                f"({max_tokens} tokens).\n<FEEDBACK>\n{feedback}\n</FEEDBACK>"
            ),
        },
    ]
