"""What one render of a chat template may spend: loop steps, and the size of what it builds.

A chat template is code from a model's files. The sandbox keeps it away from Python's insides but
not from looping 10^10 times (loops nested over `range`) or building a string of gigabytes
(`'a' * 10**10`). Every `for` loop here counts its steps against the render's budget, `*`, `+`
and `**` refuse results past it, and nothing but literals is computed at compile time (Jinja's
optimiser and code generator would evaluate `{{ 'a' | center(10**10) }}` where the template is
compiled: in the router, as a model starts). What no count catches (a filter asked for a string
of a gigabyte) the worker process's memory limit and the pool's deadline do
(router/inputs/template_pool.py).
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import jinja2.nodes
from jinja2.compiler import CodeGenerator
from jinja2.runtime import LoopContext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from router.errors import TemplateError

# a number a template may compute with `**`: enough for any arithmetic a prompt needs
_MAX_POWER_BITS = 4096


@dataclass(frozen=True, slots=True)
class RenderBudget:
    """One render's limits, besides the pool's time and memory (RenderLimits)."""

    max_steps: int = 1_000_000  # loop iterations, all loops together
    max_chars: int = 8_000_000  # characters (or items) of the prompt and of a built value


class TemplateBudgetError(TemplateError):
    """A render went over its budget: the template's own doing, remembered by the pool."""


class _BudgetCodeGenerator(CodeGenerator):
    """Jinja's code generator, counting each `for` loop's steps and computing nothing itself.

    Jinja writes an output expression it can evaluate at compile time (`{{ 'a' | center(10**10) }}`)
    as its value: here only literals are; the rest is computed as the template renders, under
    its budget, in the pool's worker."""

    def visit_For(self, node: jinja2.nodes.For, frame) -> None:
        counter = jinja2.nodes.EnvironmentAttribute("count_steps", lineno=node.lineno)
        counted = jinja2.nodes.Call(counter, [node.iter], [], None, None, lineno=node.lineno)
        super().visit_For(jinja2.nodes.For(node.target, counted, node.body, node.else_, node.test,
                                           node.recursive, lineno=node.lineno,
                                           environment=node.environment), frame)

    def _output_child_to_const(self, node: jinja2.nodes.Expr, frame, finalize) -> str:
        if not isinstance(node, (jinja2.nodes.TemplateData, jinja2.nodes.Const)):
            raise jinja2.nodes.Impossible()
        return super()._output_child_to_const(node, frame, finalize)

    def visit_EvalContextModifier(self, node: jinja2.nodes.EvalContextModifier, frame) -> None:
        # Jinja evaluates `{% autoescape <expression> %}` as it compiles; no chat template needs
        # more than a literal there
        for keyword in node.options:
            if not isinstance(keyword.value, jinja2.nodes.Const):
                self.fail("autoescape takes a literal (true or false) in a chat template",
                          node.lineno)
        super().visit_EvalContextModifier(node, frame)


class BudgetedEnvironment(ImmutableSandboxedEnvironment):
    """The immutable sandbox, holding each render to a RenderBudget.

    One render at a time per environment (start_render resets the count): the router's pool gives
    each worker process its own.
    """

    code_generator_class = _BudgetCodeGenerator
    intercepted_binops = frozenset({"*", "+", "**"})

    def __init__(self, budget: RenderBudget = RenderBudget(), **options):
        super().__init__(optimized=False, **options)
        self.budget = budget
        self.steps_left = budget.max_steps

    def start_render(self) -> None:
        self.steps_left = self.budget.max_steps

    def count_steps(self, iterable: Iterable) -> Iterator:
        for item in iterable:
            self.steps_left -= 1
            if self.steps_left < 0:
                raise TemplateBudgetError(f"the chat template looped more than "
                                          f"{self.budget.max_steps:,} times")
            yield item

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - Jinja's signature
        if isinstance(__obj, LoopContext) and args:  # a recursive loop's next level: counted too
            args = (__self.count_steps(args[0]), *args[1:])
        return super().call(__context, __obj, *args, **kwargs)

    def call_binop(self, context, operator: str, left, right):
        size = _result_size(operator, left, right)
        if size > self.budget.max_chars:
            raise TemplateBudgetError(f"the chat template built a value of {size:,} characters "
                                      f"or items, over its limit of {self.budget.max_chars:,}")
        if operator == "**" and _power_bits(left, right) > _MAX_POWER_BITS:
            raise TemplateBudgetError(f"the chat template computed a number of more than "
                                      f"{_MAX_POWER_BITS} bits")
        return super().call_binop(context, operator, left, right)


def _result_size(operator: str, left, right) -> int:
    """The length of a sequence `*` or `+` would build; 0 for anything else."""
    sized = (str, list, tuple)
    if operator == "*":
        for sequence, count in ((left, right), (right, left)):
            if isinstance(sequence, sized) and isinstance(count, int):
                return len(sequence) * max(count, 0)
    if operator == "+" and isinstance(left, sized) and isinstance(right, sized):
        return len(left) + len(right)
    return 0


def _power_bits(base, exponent) -> float:
    if not (isinstance(base, int) and isinstance(exponent, int)) or exponent <= 0:
        return 0  # floats overflow to an error on their own; negative powers are fractions
    if abs(base) <= 1:
        return 0
    return exponent * math.log2(abs(base))
