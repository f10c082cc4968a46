"""Textual gradients: Functions whose forward calls a language model and whose
backward asks it for feedback.

- :class:`LLMCall`, :class:`FormattedLLMCall`: call a model (system prompt plus
  inputs, or a template with named fields); backward asks the model how each
  input should change, all inputs' requests at once. ``dispatch = "remote"``.
- :func:`concat`: join texts; backward hands the feedback on unchanged, no
  model call. ``dispatch = "local"``.
- :class:`TextLoss`: an LLM judge whose evaluation is the loss.
- :func:`exact_match`, :class:`Metric`: non-differentiable metrics.
- :class:`LLMOptions`: the options of one model call, resolved, as a frozen record; a
  node keeps it as ``ctx.options`` (a ``PythonCall`` node keeps its own kind).
- :class:`PythonCall`: a Python function on text (TextGrad's
  StringBasedFunction); backward asks the feedback model about each input.
  ``dispatch = "remote"``.
- :class:`DeterministicEvaluator`: a metric in code returning a score and an
  explanation, the explanation being the feedback (no LLM judge).
- :func:`render_feedback`: a gradient (feedback from every path, in graph
  order) as one text; :func:`feedback_entries`, :func:`approx_tokens`.
- :func:`use_models` (a block, this task) and :func:`set_default_models` (the
  process): default models and params, so calls need no ``model=``.
- :func:`register_model`, :func:`resolve_model`: how a model spec stored in a
  ctx (``"simulated"``, ``"openai:gpt-4o-mini"``, a registered name) becomes a
  model in this process, on a worker too. A node keeps such a reference (its
  ``portable`` is False for a model *object* passed to a text function).

**For a distributed backward, pass models as spec strings** (or names that the
app and every worker register): a model object is known to this process only,
and a worker cannot resolve it. :func:`check_portable` finds such nodes in a
graph before the backward starts.

Example::

    from asyncgraph import Parameter, Variable
    from asyncgraph.text import TextLoss, llm_call, render_feedback

    prompt = Parameter("Answer the question.", role="system prompt")
    answer = await llm_call(prompt, Variable("6 * 7?", role="question"), model="simulated")
    loss = await TextLoss("Evaluate the answer; be critical.", model="simulated")(answer)
    await loss.backward()
    print(render_feedback(prompt.grad))
"""

from asyncgraph._exceptions import UnknownModelError
from asyncgraph.text._budget import (
    condense_feedback,
    set_feedback_budget,
    truncate_to_tokens,
    use_feedback_budget,
)
from asyncgraph.text._concurrency import run_all
from asyncgraph.text._content import image
from asyncgraph.text._defaults import (
    current_models,
    feedback_defaults,
    set_default_models,
    use_models,
)
from asyncgraph.text._feedback import approx_tokens, feedback_entries, render_feedback
from asyncgraph.text._functions import (
    FormattedLLMCall,
    LLMCall,
    Metric,
    chat_call,
    check_portable,
    concat,
    exact_match,
    formatted_llm_call,
    llm_call,
)
from asyncgraph.text._loss import TextLoss
from asyncgraph.text._options import LLMOptions
from asyncgraph.text._prompts import describe
from asyncgraph.text._pyfunc import (
    DeterministicEvaluator,
    PythonCall,
    deterministic_evaluator,
    python_call,
)
from asyncgraph.text._registry import (
    register_model,
    resolve_model,
    unregister_model,
)
from asyncgraph.text._structured import StructuredOutputError, json_schema_of

# Not public names: how asyncgraph.optim asks for structured replies and sizes its own.
from asyncgraph.text._fit import fit_for as fit_for  # isort: skip
from asyncgraph.text._reply import update_tokens as update_tokens  # isort: skip
from asyncgraph.text._structured import ask_json as ask_json  # isort: skip
from asyncgraph.text._structured import check_structured as check_structured  # isort: skip
from asyncgraph.text._structured import parse_structured as parse_structured  # isort: skip
from asyncgraph.text._structured import uses_structured as uses_structured  # isort: skip

__all__ = [
    "DeterministicEvaluator",
    "FormattedLLMCall",
    "LLMCall",
    "LLMOptions",
    "Metric",
    "PythonCall",
    "StructuredOutputError",
    "TextLoss",
    "UnknownModelError",
    "approx_tokens",
    "chat_call",
    "check_portable",
    "concat",
    "condense_feedback",
    "current_models",
    "describe",
    "deterministic_evaluator",
    "exact_match",
    "feedback_defaults",
    "feedback_entries",
    "formatted_llm_call",
    "image",
    "json_schema_of",
    "llm_call",
    "python_call",
    "register_model",
    "render_feedback",
    "resolve_model",
    "run_all",
    "set_default_models",
    "set_feedback_budget",
    "truncate_to_tokens",
    "unregister_model",
    "use_feedback_budget",
    "use_models",
]
