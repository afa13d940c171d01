"""A model's chat template rendered with bounded time and size.

A chat template comes with the model's files: jinja in transformers' sandbox, which keeps it from
the system but not from looping for ever or building gigabytes (nested loops that never returned
blocked `hd serve`'s event loop; one template built a string of gigabytes).
render() runs it in a copy of transformers' own sandboxed environment (its filters, globals and
extensions, so the text is apply_chat_template's character for character) that enforces a Budget:

  seconds    wall time of the render, checked at every call, attribute or item, operator, loop
             iteration and output expression: a loop with nothing in it is bounded too
  max_chars  characters the template outputs (in all, buffers of macros and `set` blocks
             included), and the size of every string, list or dict it makes (a list counts its
             items and the characters of the strings in it). Operators and calls that multiply
             sizes (*, **, +, %, widths and counts given to calls and filters, join, replace,
             indent) are checked before they allocate; the result of any other call, filter or
             `~` right after
  steps      loop iterations in all (max_chars of them)

What a render can hold at once is so a few values of at most max_chars each (4 Mi characters by
default, plus twice the messages'), not a process's memory; a list nested in a list counts only
as an item, its growth bounded by steps and time alone. jinja's `lipsum` global is left out (it
writes paragraphs by the count asked for); no chat template uses it.

Every failure (does not parse, raise_exception, a sandbox violation, a bound hit, any error while
rendering) is a TemplateError naming the template and the cause in one line.
"""
from __future__ import annotations

import contextvars
import functools
import re
import time
from dataclasses import dataclass, field

from ...errors import HdError

TEMPLATE_SECONDS = 5.0         # wall time of one render
TEMPLATE_CHARS = 1 << 22       # characters a render may output or hold in one value, beyond 2x its messages'


class TemplateError(HdError):
    """The chat template failed or hit a bound; the message is one line naming it."""


class _Bound(Exception):
    """A bound hit inside the template (raised through jinja, turned into TemplateError)."""


@dataclass
class Budget:
    seconds: float
    max_chars: int
    deadline: float = 0.0
    output: int = 0
    steps: int = 0
    started: float = field(default_factory=time.monotonic)

    def __post_init__(self):
        self.deadline = self.started + self.seconds

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise _Bound(f"ran over its time limit of {self.seconds:g} s")

    def step(self) -> None:
        self.steps += 1
        if self.steps > self.max_chars:
            raise _Bound(f"ran over {self.max_chars} loop iterations")
        self.tick()

    def emit(self, n: int) -> None:
        self.output += n
        if self.output > self.max_chars:
            raise _Bound(f"output over {self.max_chars} characters")

    def allow(self, n: int, what: str = "a value") -> None:
        if n > self.max_chars:
            raise _Bound(f"would make {what} of {n} characters or items, over the limit of {self.max_chars}")

    def check(self, value):
        self.allow(size(value))
        return value


_BUDGET: contextvars.ContextVar[Budget | None] = contextvars.ContextVar("hd_template_budget", default=None)


def _budget() -> Budget:
    b = _BUDGET.get()
    if b is None:   # compiled or called outside render(): nothing is unbounded for that
        raise _Bound("was used outside a bounded render")
    return b


def size(value) -> int:
    """Characters or items a value holds: a string's length; a container's items plus the
    characters of the strings directly in it; an int's decimal digits, roughly."""
    if isinstance(value, (str, bytes)):
        return len(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return value.bit_length() // 3
    if isinstance(value, dict):
        return len(value) + sum(len(v) for v in value.values() if isinstance(v, str))
    if isinstance(value, (list, tuple, set, frozenset)):
        return len(value) + sum(len(v) for v in value if isinstance(v, str))
    return 0


_NUMBER = re.compile(r"\d+")


def _widths(fmt: str, budget: Budget) -> None:
    """A format string's widths and precisions (any number in it) must not exceed the bound."""
    for m in _NUMBER.finditer(fmt):
        if len(m.group()) > 12 or int(m.group()) > budget.max_chars:
            raise _Bound(f"would format a width of {m.group()}, over the limit of {budget.max_chars}")


def _numbers(args, kwargs, budget: Budget) -> None:
    """Widths and counts given to a call (ints) must not exceed the bound."""
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, int) and not isinstance(a, bool) and abs(a) > budget.max_chars:
            raise _Bound(f"was given the number {a}, over the limit of {budget.max_chars}")


def _lines(s) -> int:
    return s.count("\n") + 1 if isinstance(s, str) else 1


def _before_call(func, args, kwargs, budget: Budget) -> None:
    """What a str method would allocate, where it can be far more than its inputs; numbers
    given to any other call (widths, counts) are bounded."""
    owner = getattr(func, "__self__", None)
    name = getattr(func, "__name__", "")
    if isinstance(owner, str) and name in ("format", "format_map"):
        _widths(owner, budget)
        if re.search(r"\{[^{}]*:[^{}]*\{", owner):   # a width taken from the arguments
            _numbers(args, kwargs, budget)
        return
    _numbers(args, kwargs, budget)
    if isinstance(owner, str) and name == "replace" and len(args) >= 2 and all(isinstance(a, str) for a in args[:2]):
        hits = owner.count(args[0]) if args[0] else len(owner) + 1
        budget.allow(len(owner) + hits * len(args[1]))
    elif isinstance(owner, str) and name == "join" and args and isinstance(args[0], list):
        budget.allow(sum(size(x) for x in args[0]) + len(owner) * len(args[0]))


def _before_filter(name: str, args, kwargs, budget: Budget) -> None:
    """What a filter would allocate, where it can be far more than its inputs."""
    value, rest = (args[0], args[1:]) if args else (None, ())
    _numbers(rest, kwargs, budget)
    if name == "indent" and isinstance(value, str):
        width = rest[0] if rest else kwargs.get("width", 4)
        budget.allow(len(value) + (size(width) if isinstance(width, str) else int(width)) * _lines(value))
    elif name == "replace" and len(rest) >= 2 and isinstance(value, str):
        old, new = str(rest[0]), str(rest[1])
        budget.allow(len(value) + (value.count(old) if old else len(value) + 1) * len(new))
    elif name == "format" and isinstance(value, str):
        _widths(value, budget)
    elif name in ("join", "wordwrap") and isinstance(value, (str, list, tuple)):
        glue = sum(size(a) for a in list(rest) + list(kwargs.values()) if isinstance(a, str))
        budget.allow(size(value) + glue * (len(value) + 1))
    elif name == "tojson":
        indent = kwargs.get("indent", rest[0] if rest else None)
        if isinstance(indent, int) and indent > 0:
            budget.allow((size(value) + 1) * 8 * indent)


def _bounded_filter(name: str, func):
    @functools.wraps(func)
    def bounded(*args, **kwargs):
        budget = _budget()
        budget.tick()
        _before_filter(name, args, kwargs, budget)
        return budget.check(func(*args, **kwargs))
    return bounded


def _steps(iterable):
    """An iterable's items, one budget step each (every `for` loop goes through it)."""
    budget = _budget()
    for item in iterable:
        budget.step()
        yield item


def _environment_class():
    import operator

    from jinja2 import nodes
    from jinja2.compiler import CodeGenerator
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generator(CodeGenerator):
        def visit_Concat(self, node, frame):   # `~`: its result is checked
            self.write("environment.checked(")
            super().visit_Concat(node, frame)
            self.write(")")

        def visit_For(self, node, frame):      # every loop takes its items through _steps
            node.iter = nodes.Call(nodes.EnvironmentAttribute("steps"), [node.iter], [], None, None)
            super().visit_For(node, frame)

    class Bounded(ImmutableSandboxedEnvironment):
        code_generator_class = Generator
        intercepted_binops = frozenset(["*", "**", "+", "%"])
        steps = staticmethod(_steps)

        @staticmethod
        def checked(value):
            return _budget().check(value)

        @staticmethod
        def concat(pieces):
            budget, out = _budget(), []
            for piece in pieces:
                budget.tick()
                out.append(piece)
            text = "".join(out)
            budget.allow(len(text), "an output")
            return text

        @staticmethod
        def finalize(value):   # every {{ expression }}, in the output or in a buffer
            budget = _budget()
            budget.emit(len(value) if isinstance(value, str) else 1)
            return value

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - jinja's signature
            budget = _budget()
            budget.tick()
            if getattr(__obj, "__name__", "") == "join" and isinstance(getattr(__obj, "__self__", None), str) and args:
                args = (list(args[0]),) + args[1:]   # counted before it is joined
            _before_call(__obj, args, kwargs, budget)
            return budget.check(super().call(__context, __obj, *args, **kwargs))

        def getattr(self, obj, attribute):
            _budget().tick()
            return super().getattr(obj, attribute)

        def getitem(self, obj, argument):
            _budget().tick()
            return super().getitem(obj, argument)

        def call_binop(self, context, op, left, right):
            budget = _budget()
            budget.tick()
            if op in ("*", "+") and all(isinstance(x, int) for x in (left, right)):
                budget.allow((abs(left).bit_length() + abs(right).bit_length()) // 3, "a number")
            elif op == "*" and isinstance(right, int) and size(left):
                budget.allow(size(left) * right)
            elif op == "*" and isinstance(left, int) and size(right):
                budget.allow(size(right) * left)
            elif op == "+" and not isinstance(left, (int, float)):
                budget.allow(size(left) + size(right))
            elif op == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1:
                budget.allow(max(right, 0) * left.bit_length() // 3, "a number")
            elif op == "%" and isinstance(left, str):
                _widths(left, budget)
                if "*" in left:   # a width taken from the arguments
                    _numbers(right if isinstance(right, tuple) else (right,), {}, budget)
            return budget.check({"*": operator.mul, "**": operator.pow, "+": operator.add,
                                 "%": operator.mod}[op](left, right))

    return Bounded


@functools.lru_cache(maxsize=1)
def _environment():
    """A bounded copy of the environment transformers renders chat templates in (its options,
    filters, globals and extensions), taken from an empty template: a chat template is never
    compiled by transformers here (jinja folds constants while compiling, running filters and
    operators: `'x' * 10**10` would allocate before any render)."""
    from transformers.utils.chat_template_utils import _compile_jinja_template
    base = _compile_jinja_template("").environment
    env = base.overlay()
    env.__class__ = _environment_class()
    env.finalize = env.__class__.finalize   # an instance attribute in jinja (None in transformers')
    env.filters = {name: _bounded_filter(name, f) for name, f in base.filters.items()}
    env.globals = {k: v for k, v in base.globals.items() if k != "lipsum"}   # lorem ipsum by the gigabyte
    return env


@functools.lru_cache(maxsize=8)
def _compiled(chat_template: str):
    return _environment().from_string(chat_template)


def literal_text(chat_template: str, source: str) -> str:
    """The template's literal strings joined by NULs (what transformers looks for control tokens
    in: chat_template_utils._get_template_literal_text), parsed without compiling it."""
    from jinja2 import nodes
    ast = _guarded(lambda: _environment().parse(chat_template), f"the chat template of {source}", None)
    literals = {n.data for n in ast.find_all(nodes.TemplateData)}
    literals |= {n.value for n in ast.find_all(nodes.Const) if isinstance(n.value, str)}
    return "\0".join(literals)


def render(chat_template: str, source: str, seconds: float | None = None, max_chars: int | None = None,
           **variables) -> str:
    """The template's text for these variables, or TemplateError (source: whose template, for
    the message)."""
    budget = Budget(TEMPLATE_SECONDS if seconds is None else seconds,
                    TEMPLATE_CHARS if max_chars is None else max_chars)
    return _guarded(lambda: _compiled(chat_template).render(**variables), f"the chat template of {source}", budget)


def _guarded(run, where: str, budget: Budget | None):
    """run() under the budget, its failures as TemplateError."""
    import jinja2
    token = _BUDGET.set(budget)
    try:
        return run()
    except _Bound as exc:
        raise TemplateError(f"{where} {exc}") from None
    except jinja2.TemplateSyntaxError as exc:
        raise TemplateError(f"{where} does not parse: {exc.message} (line {exc.lineno})") from None
    except jinja2.exceptions.SecurityError as exc:
        raise TemplateError(f"{where} broke the sandbox: {str(exc).rstrip('.')}") from None
    except jinja2.TemplateError as exc:   # raise_exception(...), an undefined name
        raise TemplateError(f"{where} refused the messages: {str(exc).rstrip('.')}") from None
    except Exception as exc:  # noqa: BLE001 - the template's own fault, whatever it is (RecursionError too)
        raise TemplateError(f"{where} failed: {type(exc).__name__}: {str(exc).rstrip('.')}") from None
    finally:
        _BUDGET.reset(token)


__all__ = ["render", "literal_text", "TemplateError", "Budget", "TEMPLATE_SECONDS", "TEMPLATE_CHARS"]
