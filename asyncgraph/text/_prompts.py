"""Every prompt the text functions send, in one place.

The feedback prompts follow TextGrad's conventions: the variable under review is
quoted between ``<VARIABLE>`` tags (the last such span in the messages), the
call it took part in between ``<LM_SYSTEM_PROMPT>`` / ``<LM_INPUT>`` /
``<LM_OUTPUT>`` tags, and variables are named by their roles.

NOTE [Shared prefix first]: providers cache prompts by prefix (OpenAI: an identical
prefix of 1,024 tokens or more, in 128-token steps; Anthropic: up to a
``cache_control`` mark). So every request built here puts what many requests share
first (the instructions, the role, the call's system prompt, a variable that is that
system prompt) and what differs last. The request stays one system and one user
message, so a scripted model still finds the whole request in the last message; for a
model that ``marks_shared_prefix`` (``AnthropicChat(cache_prompt=True)``, which marks
the system prompt itself), a feedback request's user message is two text parts, the
shared one marked ``cache_control``.
docs/guide/benchmarks.md ("Prompt caching") measures what it saves.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "FEEDBACK_SYSTEM_PROMPT",
    "FUNCTION_FEEDBACK_SYSTEM_PROMPT",
    "describe",
    "function_feedback_messages",
    "llm_feedback_messages",
    "marks_shared_prefix",
    "summary_messages",
]

FEEDBACK_SYSTEM_PROMPT = (
    "You are the feedback engine of an optimization system that improves text variables: "
    "prompts, instructions, answers, code, or any other text. You are given how one variable "
    "was used in a call to a language model and the feedback (criticism) on that call's "
    "output. Your only job is to give feedback on the variable: explain what in it causes "
    "the problems the output feedback points out and how it should change so that the output "
    "improves. Be specific and actionable ('Adding X fixes Y because ...', 'Removing X avoids "
    "...', 'Changing X to Y ...'). Do not write a new version of the variable; the optimizer "
    "does that. Assume the variable will be used again in similar calls. If the variable "
    "already works well, say so briefly instead of inventing problems."
)

_CACHED = {"cache_control": {"type": "ephemeral"}}

_NO_FEEDBACK = (
    "No feedback was given on the output: the output itself is the objective. If it is an "
    "evaluation or a critique, the variable should change so that this evaluation becomes "
    "better (fix what it criticizes); otherwise, so that the output becomes better."
)


def describe(role: str, fallback: str) -> str:
    """``role`` as a noun phrase for prompts ("the system prompt"), ``fallback`` when empty.

    Example::

        print(describe("system prompt", "the variable"))    # the system prompt
        print(describe("", "the variable"))                 # the variable
    """
    text = " ".join(role.split()) or fallback
    lowered = text.lower()
    if lowered.startswith(("the ", "a ", "an ", "this ", "these ", "each ")):
        return text
    return f"the {text}"


FUNCTION_FEEDBACK_SYSTEM_PROMPT = (
    "You are the feedback engine of an optimization system that improves text variables. You "
    "are given a Python function's purpose, the inputs it was called with, its output, and "
    "the feedback (criticism) on that output. Your only job is to give feedback on one input: "
    "explain what in it makes the function's output draw that criticism, and how it should "
    "change so that the output improves. The function itself is fixed code: only its inputs "
    "can change. Be specific and actionable. Do not write a new version of the input; the "
    "optimizer does that. If the input already works well, say so briefly."
)


def function_feedback_messages(
    *,
    purpose: str,
    inputs: list[dict[str, Any]],
    output: str,
    output_role: str,
    variable: str,
    variable_role: str,
    feedback: str,
) -> list[dict[str, Any]]:
    """Messages asking for feedback on one input of a Python function (``PythonCall``).

    ``inputs``: every input, in order, as ``{"role": ..., "value": ...}``.
    """
    listed = "\n".join(
        f"<INPUT role={item['role']!r}>\n{item['value']}\n</INPUT>" for item in inputs
    )
    if feedback:
        about_output = (
            f"Here is the feedback on {output_role} (the output of the function):\n"
            f"<OUTPUT_FEEDBACK>\n{feedback}\n</OUTPUT_FEEDBACK>"
        )
    else:
        about_output = _NO_FEEDBACK
    user = (
        f"You will give feedback on a variable with the role <ROLE>{variable_role}</ROLE>.\n\n"
        f"It was an input of a Python function, which may be one step of a larger system.\n"
        f"<FUNCTION_PURPOSE>\n{purpose}\n</FUNCTION_PURPOSE>\n"
        f"<FUNCTION_INPUTS>\n{listed}\n</FUNCTION_INPUTS>\n"
        f"<FUNCTION_OUTPUT>\n{output}\n</FUNCTION_OUTPUT>\n\n"
        f"The output of this call is {output_role}.\n\n{about_output}\n\n"
        f"Give feedback on {variable_role}, which is the following text:\n"
        f"<VARIABLE>{variable}</VARIABLE>\n\n"
        f"Describe how {variable_role} should change to improve the output."
    )
    return [
        {"role": "system", "content": FUNCTION_FEEDBACK_SYSTEM_PROMPT},
        {"role": "user", "content": user},
    ]


def llm_feedback_messages(
    *,
    system_prompt: str | None,
    user_prompt: str,
    output: str,
    output_role: str,
    variable: str,
    variable_role: str,
    feedback: str,
    mark_shared: bool = False,
) -> list[dict[str, Any]]:
    """Messages asking for feedback on one input of an LLM call.

    What the requests of one step share comes first (see NOTE [Shared prefix first]):
    the variable's role, the call's system prompt and, when the variable is that system
    prompt, the variable; then what differs from call to call (the call's input and
    output, the feedback, a variable that is an input). ``mark_shared``: the user
    message is two text parts, the shared one marked ``cache_control`` (for a model
    that ``marks_shared_prefix``), instead of one string.
    """
    shared = variable == system_prompt
    parts = [
        f"You will give feedback on a variable with the role <ROLE>{variable_role}</ROLE>.\n\n"
        f"It was used in this call to a language model, which may be one step of a larger "
        f"system:"
    ]
    if system_prompt is not None:
        parts.append(f"<LM_SYSTEM_PROMPT>\n{system_prompt}\n</LM_SYSTEM_PROMPT>")
    give = (
        f"Give feedback on {variable_role}, which is the following text:\n"
        f"<VARIABLE>{variable}</VARIABLE>"
    )
    if shared:
        parts.append(give)
    if feedback:
        about_output = (
            f"Here is the feedback on {output_role} (the output of the call above):\n"
            f"<OUTPUT_FEEDBACK>\n{feedback}\n</OUTPUT_FEEDBACK>"
        )
    else:
        about_output = _NO_FEEDBACK
    shared_parts = len(parts)
    parts += [
        f"<LM_INPUT>\n{user_prompt}\n</LM_INPUT>\n<LM_OUTPUT>\n{output}\n</LM_OUTPUT>",
        f"The output of this call is {output_role}.",
        about_output,
    ]
    if not shared:
        parts.append(give)
    parts.append(f"Describe how {variable_role} should change to improve the output.")
    content: str | list[dict[str, Any]] = "\n\n".join(parts)
    if mark_shared:
        content = [
            {"type": "text", "text": "\n\n".join(parts[:shared_parts]), **_CACHED},
            {"type": "text", "text": "\n\n".join(parts[shared_parts:])},
        ]
    return [
        {"role": "system", "content": FEEDBACK_SYSTEM_PROMPT},
        {"role": "user", "content": content},
    ]


def marks_shared_prefix(model: Any) -> bool:
    """Whether requests to ``model`` mark their shared prefix with ``cache_control``: a
    model that says so with a ``cache_prompt`` attribute set to True (``AnthropicChat(
    cache_prompt=True)``). Any other model gets each message's content as one string."""
    return getattr(model, "cache_prompt", False) is True


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
