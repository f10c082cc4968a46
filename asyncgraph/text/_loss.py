"""``TextLoss``: a language model as the judge, the loss of a text graph."""

from __future__ import annotations

from typing import Any, Unpack

from asyncgraph import Variable
from asyncgraph.models import reply_tokens
from asyncgraph.text._functions import FormattedLLMCall, LLMCall
from asyncgraph.text._options import CallKeywords, LLMOptions, check_keywords
from asyncgraph.text._prompts import describe
from asyncgraph.text._registry import ModelLike, model_ref
from asyncgraph.text._reply import VERDICT_TOKENS

__all__ = ["TextLoss"]


class TextLoss:
    """An LLM judge: ``loss = await TextLoss(instruction, model=...)(answer)``.

    The judge is an LLM call whose system prompt is ``eval_system_prompt`` (a
    str, constant, or a Variable, which then gets feedback too) and whose input
    is the variable(s) under evaluation; its reply, the evaluation, is the loss.
    ``await loss.backward()`` starts from the implicit empty feedback: the
    evaluation itself is the objective, and each evaluated Variable receives
    feedback on how to change to get a better evaluation.

    - ``await loss_fn(answer)`` or ``await loss_fn(question, answer)``: the
      inputs, joined by blank lines, form the judge's user message
      (:class:`LLMCall`);
    - with ``template="Question: {question}\\nAnswer: {answer}"``:
      ``await loss_fn(question=q, answer=a)`` fills the template
      (:class:`FormattedLLMCall`).

    ``model`` and the other options (``base_url``, ``params``, ``feedback_model``,
    ``feedback_params``, ``feedback_budget``, ``response_format``, ``format_attempts``) as
    in :class:`LLMCall` (those not given come from ``use_models`` /
    ``set_default_models`` when the loss is computed); its verdict is asked for in at most
    ``VERDICT_TOKENS`` (512) tokens unless the model or ``params`` set ``max_tokens``;
    ``role`` names the loss (default: ``"evaluation of <the
    inputs' roles>"``). ``function`` picks the Function class, e.g. a subclass
    with ``dispatch = "local"``.

    Example::

        loss_fn = TextLoss("Evaluate the answer for correctness. Be terse.", model="simulated")
        loss = await loss_fn(answer)
        await loss.backward()
    """

    def __init__(
        self,
        eval_system_prompt: str | Variable,
        model: ModelLike | None = None,
        *,
        template: str | None = None,
        function: type[LLMCall] | type[FormattedLLMCall] | None = None,
        **options: Unpack[CallKeywords],
    ) -> None:
        check_keywords("TextLoss", options, LLMOptions.KEYWORDS - {"model"})
        if isinstance(eval_system_prompt, str):
            eval_system_prompt = Variable(eval_system_prompt, role="evaluation instruction")
        elif not isinstance(eval_system_prompt, Variable):
            raise TypeError(
                f"TextLoss: eval_system_prompt must be a str or a Variable, got "
                f"{eval_system_prompt!r:.80}"
            )
        self.eval_system_prompt = eval_system_prompt
        # Checked now (a bad model fails here, not at the first evaluation); a model object
        # is passed on as is, so each loss's node keeps it alive for its backward.
        given: dict[str, Any] = dict(options)
        if model is not None:  # else the default when called (see use_models)
            model_ref(model, given.get("base_url"))
            given["model"] = model
        if given.get("feedback_model") is not None:
            model_ref(given["feedback_model"], None, what="feedback_model")
        self.model: ModelLike | None = model
        self.template = template
        self.role: str | None = given.pop("role", None)
        self.options = given
        """The options each evaluation passes to its call (``model`` among them), as given."""
        if function is None:
            function = LLMCall if template is None else FormattedLLMCall
        expected = LLMCall if template is None else FormattedLLMCall
        if not (isinstance(function, type) and issubclass(function, expected)):
            raise TypeError(
                f"TextLoss: function must be {expected.__name__} or a subclass of it "
                f"({'without' if template is None else 'with'} a template), got {function!r}"
            )
        self.function = function

    def _role_for(self, inputs: list[Any]) -> str:
        if self.role is not None:
            return self.role
        roles = [describe(v.role, "") for v in inputs if isinstance(v, Variable) and v.role]
        return f"evaluation of {' and '.join(roles)}" if roles else "evaluation"

    async def __call__(self, *inputs: Variable | str, **fields: Variable | str) -> Variable:
        """Evaluate ``inputs`` (no template) or ``fields`` (with a template); returns the loss."""
        options = dict(self.options)
        if self.template is None:
            if fields or not inputs:
                raise TypeError(
                    "TextLoss without a template takes the evaluated variables positionally: "
                    "await loss_fn(answer); give template=... to use named fields"
                )
            options["role"] = self._role_for(list(inputs))
            with reply_tokens(VERDICT_TOKENS):
                out: Variable = await self.function.apply(
                    self.eval_system_prompt, *inputs, **options
                )
            return out
        if inputs or not fields:
            raise TypeError(
                f"TextLoss with a template takes its fields by name: await loss_fn(**fields) "
                f"with the fields of {self.template!r:.80}"
            )
        options["role"] = self._role_for(list(fields.values()))
        with reply_tokens(VERDICT_TOKENS):
            out = await self.function.apply(
                self.template, self.eval_system_prompt, **options, **fields
            )
        return out

    def __repr__(self) -> str:
        return f"TextLoss({self.eval_system_prompt.data!r:.60}, model={self.model!r})"
