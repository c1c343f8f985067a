"""A safe arithmetic calculator tool: its own tokenizer and precedence parser, never eval/exec/compile/ast.

Grammar (Python's precedence, with `^` as a second spelling of `**`):

    expr    := term (('+' | '-') term)*
    term    := unary (('*' | '/' | '//' | '%') unary)*
    unary   := ('+' | '-') unary | power
    power   := atom (('**' | '^') unary)?          # right-associative; -2**2 == -(2**2) == -4
    atom    := NUMBER | CONSTANT | FUNCTION '(' expr (',' expr)* ')' | '(' expr ')'

Numbers: integers are exact Python ints (`2**100` is exact); a literal with `.` or an exponent (`1e-3`) is
a float. `/` is true division (a float, as in Python); `//` and `%` follow Python's floor semantics.

Output format (the tool's text): an int prints as its exact decimal digits; a float prints as Python's
shortest round-tripping repr (`0.1`, `1e+20`), except that an integral float below 1e16 in magnitude prints
without the trailing `.0` (`6/3` prints `2`, `sqrt(2)**2` prints `2.0000000000000004`). `evaluate()` returns
the number itself (`6/3` -> `2.0`).

Limits, each refused with a CalculatorError saying what is allowed: expression length, nesting depth,
integer size (checked before a power is computed), division by zero, math domain errors, overflow and
non-finite results.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from .tool import Tool, ToolError

MAX_LENGTH = 1000  # characters of expression
MAX_DEPTH = 64  # nested parentheses, calls and unary signs together
MAX_INT_BITS = 10_000  # about 3000 decimal digits
MAX_FACTORIAL = 1000

Number = int | float


class CalculatorError(ToolError):
    """A refused or invalid expression; the message says what was wrong and what is allowed."""


CONSTANTS: dict[str, float] = {"pi": math.pi, "e": math.e, "tau": math.tau}


def _real(name: str, x: Number) -> float:
    # Converting a huge int to float overflows; say so in the function's terms.
    try:
        return float(x)
    except OverflowError:
        raise CalculatorError(f"{name}: argument too large to convert to a float") from None


def _sqrt(x: Number) -> Number:
    if isinstance(x, int) and x >= 0:
        r = math.isqrt(x)
        if r * r == x:  # exact for perfect squares, including ones too big for a float
            return r
    return math.sqrt(_real("sqrt", x))


def _round(x: Number, digits: Number | None = None) -> Number:
    if digits is None:
        return round(x)
    if not isinstance(digits, int):
        raise CalculatorError("round(x, n): n must be an integer")
    if abs(digits) > 400:  # past float and MAX_INT_BITS precision either way; keeps round() cheap
        raise CalculatorError("round(x, n): n must be between -400 and 400")
    return round(x, digits)


def _log(x: Number, base: Number | None = None) -> float:
    if base is None:
        return math.log(x)
    if base == 1:
        raise CalculatorError("log(x, base): base must not be 1")
    return math.log(x, base)


def _factorial(x: Number) -> int:
    if not isinstance(x, int) or not 0 <= x <= MAX_FACTORIAL:
        raise CalculatorError(f"factorial needs an integer from 0 to {MAX_FACTORIAL}, got {_fmt_short(x)}")
    return math.factorial(x)


def _minmax(f: Callable[..., Number]) -> Callable[..., Number]:
    return lambda *xs: f(xs)


# name -> (function, fewest args, most args or None for any)
FUNCTIONS: dict[str, tuple[Callable[..., Number], int, int | None]] = {
    "sqrt": (_sqrt, 1, 1),
    "abs": (abs, 1, 1),
    "round": (_round, 1, 2),
    "floor": (math.floor, 1, 1),
    "ceil": (math.ceil, 1, 1),
    "exp": (math.exp, 1, 1),
    "log": (_log, 1, 2),
    "ln": (math.log, 1, 1),
    "log10": (math.log10, 1, 1),
    "log2": (math.log2, 1, 1),
    "sin": (math.sin, 1, 1),
    "cos": (math.cos, 1, 1),
    "tan": (math.tan, 1, 1),
    "asin": (math.asin, 1, 1),
    "acos": (math.acos, 1, 1),
    "atan": (math.atan, 1, 1),
    "min": (_minmax(min), 1, None),
    "max": (_minmax(max), 1, None),
    "factorial": (_factorial, 1, 1),
}

_OPERATORS = ("**", "//", "+", "-", "*", "/", "%", "^", "(", ")", ",")
_DIGITS = "0123456789"  # ASCII only: str.isdigit() would also accept '²' and other scripts' digits


def _fmt_short(x: Any) -> str:
    s = format_number(x) if isinstance(x, int | float) else repr(x)
    return s if len(s) <= 40 else s[:20] + "..." + s[-10:]


def format_number(x: Number) -> str:
    """The tool's text for a result (see the module docstring)."""
    if isinstance(x, int):
        return str(x)
    if x.is_integer() and abs(x) < 1e16:
        return str(int(x))
    return repr(x)


# ---- tokenizer ----

def _tokenize(text: str) -> list[tuple[str, Any, int]]:
    """(kind, value, position) with kind in {'num', 'name', 'op', 'end'}."""
    tokens: list[tuple[str, Any, int]] = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c.isspace():
            i += 1
            continue
        if c in _DIGITS or (c == "." and i + 1 < n and text[i + 1] in _DIGITS):
            start = i
            while i < n and text[i] in _DIGITS:
                i += 1
            is_float = False
            if i < n and text[i] == ".":
                is_float = True
                i += 1
                while i < n and text[i] in _DIGITS:
                    i += 1
            if i < n and text[i] in "eE":
                j = i + 1
                if j < n and text[j] in "+-":
                    j += 1
                if j < n and text[j] in _DIGITS:  # otherwise the 'e' is not part of this number (e.g. `2e`)
                    is_float = True
                    i = j
                    while i < n and text[i] in _DIGITS:
                        i += 1
            literal = text[start:i]
            if is_float:
                value: Number = float(literal)
                if not math.isfinite(value):
                    raise CalculatorError(f"number {literal[:30]!r} at position {start} is too large for a float")
            else:
                value = int(literal)
            tokens.append(("num", value, start))
            continue
        if c.isascii() and (c.isalpha() or c == "_"):
            start = i
            while i < n and text[i].isascii() and (text[i].isalnum() or text[i] == "_"):
                i += 1
            tokens.append(("name", text[start:i], start))
            continue
        for op in _OPERATORS:
            if text.startswith(op, i):
                tokens.append(("op", op, i))
                i += len(op)
                break
        else:
            raise CalculatorError(
                f"unexpected character {c!r} at position {i}; allowed: numbers, + - * / // % ** ^, parentheses, "
                "commas, and the names of functions and constants")
    tokens.append(("end", None, n))
    return tokens


# ---- checked arithmetic ----

def _check(x: Number) -> Number:
    if isinstance(x, bool):  # min/max never produce bools, but keep results plain numbers
        x = int(x)
    if isinstance(x, int):
        if x.bit_length() > MAX_INT_BITS:
            raise CalculatorError(f"integer result too large (more than {MAX_INT_BITS} bits, about 3000 digits)")
        return x
    if isinstance(x, float):
        if not math.isfinite(x):
            raise CalculatorError("result is not a finite number (overflow)")
        return x
    raise CalculatorError(f"result is not a real number: {_fmt_short(x)}")


def _power(base: Number, exp: Number) -> Number:
    if isinstance(base, int) and isinstance(exp, int):
        if exp < 0:  # a float, as in Python
            if base == 0:
                raise CalculatorError("division by zero (0 raised to a negative power)")
            return _real("**", base) ** exp
        if abs(base) <= 1:  # 0, 1, -1: cheap for any exponent (which is itself under MAX_INT_BITS)
            return base**exp
        # Estimate the size before computing: |base|**exp has about exp*log2|base| bits.
        if exp.bit_length() > 64 or exp * math.log2(abs(base)) > MAX_INT_BITS:
            raise CalculatorError(
                f"integer result too large: {_fmt_short(base)}**{_fmt_short(exp)} would have more than "
                f"{MAX_INT_BITS} bits")
        return base**exp
    b, x = _real("**", base), _real("**", exp)
    if b == 0 and x < 0:
        raise CalculatorError("division by zero (0 raised to a negative power)")
    return math.pow(b, x)  # a domain error (negative base, fractional power) instead of Python's complex


def _divide(a: Number, b: Number) -> float:
    if b == 0:
        raise CalculatorError("division by zero")
    return a / b


def _floordiv(a: Number, b: Number) -> Number:
    if b == 0:
        raise CalculatorError("division by zero (in //)")
    return a // b


def _mod(a: Number, b: Number) -> Number:
    if b == 0:
        raise CalculatorError("division by zero (in %)")
    return a % b


def _guarded(fn: Callable[[], Number], where: str, domain: str) -> Number:
    """fn() with Python's arithmetic exceptions turned into CalculatorErrors naming `where`."""
    try:
        r = fn()
    except CalculatorError:
        raise
    except ZeroDivisionError:
        raise CalculatorError(f"division by zero in {where}") from None
    except OverflowError:
        raise CalculatorError(f"overflow: {where} is too large") from None
    except (ValueError, TypeError):
        raise CalculatorError(f"math domain error: {domain}") from None
    return _check(r)


def _multiply(a: Number, b: Number) -> Number:
    if isinstance(a, int) and isinstance(b, int) and a.bit_length() + b.bit_length() > MAX_INT_BITS + 1:
        raise CalculatorError(f"integer result too large (more than {MAX_INT_BITS} bits)")
    return a * b


BINARY: dict[str, Callable[[Number, Number], Number]] = {
    "+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": _multiply, "/": _divide, "//": _floordiv, "%": _mod,
    "**": _power, "^": _power,
}


def _binary(op: str, a: Number, b: Number) -> Number:
    return _guarded(lambda: BINARY[op](a, b), f"the result of {op}",
                    f"{op} is not defined here (e.g. a negative number to a fractional power)")


def _call(name: str, args: list[Number]) -> Number:
    f, lo, hi = FUNCTIONS[name]
    if len(args) < lo or (hi is not None and len(args) > hi):
        want = f"{lo}" if lo == hi else (f"{lo} or {hi}" if hi is not None else f"at least {lo}")
        raise CalculatorError(f"{name}() takes {want} argument(s), got {len(args)}")
    return _guarded(lambda: f(*args), f"{name}()",
                    f"{name}() is not defined for {', '.join(map(_fmt_short, args))}")


# ---- parser ----

class _Parser:
    def __init__(self, text: str):
        self.tokens = _tokenize(text)
        self.i = 0
        self.depth = 0

    def peek(self) -> tuple[str, Any, int]:
        return self.tokens[self.i]

    def take(self) -> tuple[str, Any, int]:
        tok = self.tokens[self.i]
        self.i += 1
        return tok

    def expect(self, op: str) -> None:
        kind, value, pos = self.take()
        if kind != "op" or value != op:
            raise CalculatorError(f"expected {op!r} at position {pos}, found {_describe(kind, value)}")

    def enter(self, pos: int) -> None:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise CalculatorError(f"expression nested too deeply at position {pos} (at most {MAX_DEPTH} levels)")

    def parse(self) -> Number:
        value = self.expr()
        kind, tok, pos = self.peek()
        if kind != "end":
            hint = " (missing operator?)" if kind in ("num", "name") or tok == "(" else ""
            raise CalculatorError(f"unexpected {_describe(kind, tok)} at position {pos}{hint}")
        return value

    def expr(self) -> Number:
        value = self.term()
        while self.peek()[0] == "op" and self.peek()[1] in ("+", "-"):
            op = self.take()[1]
            value = _binary(op, value, self.term())
        return value

    def term(self) -> Number:
        value = self.unary()
        while self.peek()[0] == "op" and self.peek()[1] in ("*", "/", "//", "%"):
            op = self.take()[1]
            value = _binary(op, value, self.unary())
        return value

    def unary(self) -> Number:
        kind, tok, pos = self.peek()
        if kind == "op" and tok in ("+", "-"):
            self.take()
            self.enter(pos)
            value = self.unary()
            self.depth -= 1
            return _check(-value) if tok == "-" else value
        return self.power()

    def power(self) -> Number:
        base = self.atom()
        kind, tok, pos = self.peek()
        if kind == "op" and tok in ("**", "^"):
            self.take()
            self.enter(pos)
            exp = self.unary()  # right-assoc: 2**3**2 == 2**(3**2); 2**-1 allowed as in Python
            self.depth -= 1
            return _binary("**", base, exp)
        return base

    def atom(self) -> Number:
        kind, tok, pos = self.take()
        if kind == "num":
            return tok
        if kind == "op" and tok == "(":
            self.enter(pos)
            value = self.expr()
            self.expect(")")
            self.depth -= 1
            return value
        if kind == "name":
            is_call = self.peek()[0] == "op" and self.peek()[1] == "("
            if tok in CONSTANTS:
                if is_call:
                    raise CalculatorError(f"{tok} is a constant, not a function (position {pos})")
                return CONSTANTS[tok]
            if tok in FUNCTIONS:
                if not is_call:
                    raise CalculatorError(f"{tok} is a function; call it as {tok}(...) (position {pos})")
                self.take()
                self.enter(pos)
                args = [self.expr()]
                while self.peek()[0] == "op" and self.peek()[1] == ",":
                    self.take()
                    args.append(self.expr())
                self.expect(")")
                self.depth -= 1
                return _call(tok, args)
            raise CalculatorError(
                f"unknown name {tok[:40]!r} at position {pos}; functions: {', '.join(FUNCTIONS)}; "
                f"constants: {', '.join(CONSTANTS)}")
        raise CalculatorError(f"expected a number, name or '(' at position {pos}, found {_describe(kind, tok)}")


def _describe(kind: str, value: Any) -> str:
    if kind == "end":
        return "the end of the expression"
    if kind == "num":
        return f"number {_fmt_short(value)}"
    if kind == "name":
        return f"name {value[:40]!r}"
    return f"{value!r}"


def evaluate(expression: str) -> Number:
    """The value of an arithmetic expression (see the module docstring); raises CalculatorError."""
    if not isinstance(expression, str):
        raise CalculatorError(f"expression must be a string, got {type(expression).__name__}")
    if len(expression) > MAX_LENGTH:
        raise CalculatorError(f"expression is {len(expression)} characters long; at most {MAX_LENGTH} are allowed")
    if not expression.strip():
        raise CalculatorError("expression is empty")
    return _Parser(expression).parse()


class Calculator(Tool):
    name = "calculator"
    description = (
        "Evaluate an arithmetic expression exactly or in floating point. Supports + - * / // % and ** or ^ "
        "(power), parentheses, unary minus, exact big integers, the constants pi, e, tau and the functions "
        + ", ".join(FUNCTIONS) + ". log(x, base) takes an optional base; round(x, n) optional digits.")
    parameters = {
        "type": "object",
        "properties": {"expression": {"type": "string", "description": "e.g. (3 + 4) * 2 ** 10 / sqrt(2)"}},
        "required": ["expression"],
        "additionalProperties": False,
    }

    def call(self, arguments: dict[str, Any]) -> str:
        return format_number(evaluate(arguments["expression"]))
