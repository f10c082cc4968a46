"""Every prompt TGD and ParetoSearch send, in one place (TextGrad's tag conventions)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "ValueForm",
    "merge_messages",
    "merge_system_prompt",
    "retry_message",
    "update_messages",
    "update_system_prompt",
]


@dataclass(frozen=True)
class ValueForm:
    """How a rewritten value comes back: between ``open_tag`` and ``close_tag``, or, with
    ``field``, as that string of a JSON object (sent with ``response_format``)."""

    open_tag: str
    close_tag: str
    field: str | None = None

    @property
    def send(self) -> str:
        """Where the prompts say to put the value."""
        if self.field is None:
            return f"between {self.open_tag} and {self.close_tag}"
        return f'as the "{self.field}" string of a JSON object'

    @property
    def reply(self) -> str:
        """The reply's shape, for the last line of a request."""
        if self.field is None:
            return f"between {self.open_tag} and {self.close_tag}"
        # No placeholder value in it: a small model copies "..." as the value.
        return f'as a JSON object whose one field, "{self.field}", holds it'

    def schema(self) -> dict[str, Any]:
        """The JSON schema of the reply in ``field`` form."""
        field = self.field or "value"
        return {
            "title": field,
            "type": "object",
            "properties": {field: {"type": "string"}},
            "required": [field],
            "additionalProperties": False,
        }


def update_system_prompt(open_tag: str, close_tag: str, form: ValueForm | None = None) -> str:
    form = form or ValueForm(open_tag, close_tag)
    if form.field is not None:
        return (
            "You are part of an optimization system that improves text (the variable) using "
            "feedback, like a gradient step. You are given the variable's role, its current "
            "value and feedback on it, and possibly earlier versions with the feedback they got "
            "and constraints the variable must satisfy. Rewrite the variable so that it "
            "addresses the feedback while keeping what already works; make the changes the "
            "feedback calls for, not unrelated ones. Your text replaces the variable verbatim, "
            f"so send the complete improved variable {form.send}, and nothing else in it."
        )
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
    form: ValueForm | None = None,
) -> list[dict[str, Any]]:
    """The request for one parameter's improved value (``form``: how it comes back;
    default: between ``open_tag`` and ``close_tag``).

    What stays the same from step to step comes first (the role, the constraints, the
    examples), then the value, its feedback and its history (see NOTE [Shared prefix
    first] in ``asyncgraph.text._prompts``).
    """
    parts = [f"Here is the role of the variable you will improve: <ROLE>{role}</ROLE>."]
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
    parts += [
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
    form = form or ValueForm(open_tag, close_tag)
    parts.append(
        f"Improve the variable ({role}) using the feedback. Send the complete improved "
        f"variable {form.reply}."
    )
    system = system_prompt or update_system_prompt(open_tag, close_tag, form)
    return [
        {"role": "system", "content": system},
        {"role": "user", "content": "\n\n".join(parts)},
    ]


def retry_message(
    role: str, open_tag: str, close_tag: str, empty: bool, form: ValueForm | None = None
) -> dict[str, Any]:
    form = form or ValueForm(open_tag, close_tag)
    if form.field is not None:
        problem = (
            f'its "{form.field}" was empty'
            if empty
            else f'it was not a JSON object with the improved variable as "{form.field}"'
        )
    elif empty:
        problem = f"the text between {open_tag} and {close_tag} was empty"
    else:
        problem = f"it did not contain the improved variable between {open_tag} and {close_tag}"
    return {
        "role": "user",
        "content": (
            f"Your reply could not be used: {problem}. Reply again with the complete improved "
            f"variable ({role}) {form.reply}."
        ),
    }


def merge_system_prompt(open_tag: str, close_tag: str, form: ValueForm | None = None) -> str:
    form = form or ValueForm(open_tag, close_tag)
    intro = (
        "You are part of an optimization system that improves text (the variable). Two "
        "versions of the variable were found, each of which works best on different examples. "
        "Combine them into one version that keeps what makes each of them work; where they "
        "contradict each other, keep the one that matters for more examples. "
    )
    if form.field is not None:
        return (
            f"{intro}Your text replaces the variable verbatim, so send the complete merged "
            f"variable {form.send}, and nothing else in it."
        )
    return (
        f"{intro}The text you put between the tags replaces the variable verbatim, so send the "
        f"complete merged variable between {open_tag} and {close_tag} and put nothing else "
        "between them."
    )


def merge_messages(
    *,
    role: str,
    first: str,
    second: str,
    ancestor: str | None,
    open_tag: str,
    close_tag: str,
    form: ValueForm | None = None,
) -> list[dict[str, Any]]:
    """The request to merge two versions of one parameter (``ParetoSearch``'s merges)."""
    form = form or ValueForm(open_tag, close_tag)
    parts = [f"Here is the role of the variable: <ROLE>{role}</ROLE>."]
    if ancestor is not None:
        parts.append(f"Both versions descend from this one:\n<ANCESTOR>{ancestor}</ANCESTOR>")
    parts += [
        f"The first version:\n<VARIABLE_A>{first}</VARIABLE_A>",
        f"The second version:\n<VARIABLE_B>{second}</VARIABLE_B>",
        f"Merge the two versions ({role}) into one. Send the complete merged variable "
        f"{form.reply}.",
    ]
    return [
        {"role": "system", "content": merge_system_prompt(open_tag, close_tag, form)},
        {"role": "user", "content": "\n\n".join(parts)},
    ]
