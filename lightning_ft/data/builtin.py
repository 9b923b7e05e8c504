"""Built-in generated tasks: training data that needs nothing from outside (``data.path=builtin:<name>``).

``arithmetic``: integer addition, subtraction and multiplication questions with exact answers,
e.g. ``{"question": "What is 37 + 48?", "answer": "37 + 48 = 85"}``. A tiny model learns the
answer format within a few dozen steps and the arithmetic slowly after that, so the loss falls
clearly in a short CPU run (the built-in default of ``python -m lightning_ft fit``).
"""

from __future__ import annotations

import random

BUILTIN_TASKS = ("arithmetic",)


def arithmetic_rows(num_rows: int, seed: int = 0) -> list[dict[str, str]]:
    """Generate ``num_rows`` question/answer rows of two-operand integer arithmetic.

    Operands are 0..99 for + and -, 0..12 for ×; the same seed gives the same rows.
    """
    rng = random.Random(seed)
    rows = []
    for _ in range(num_rows):
        op = rng.choice("+-*")
        hi = 12 if op == "*" else 99
        a, b = rng.randint(0, hi), rng.randint(0, hi)
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        rows.append({"question": f"What is {a} {op} {b}?", "answer": f"{a} {op} {b} = {value}"})
    return rows


def builtin_rows(name: str, num_rows: int, seed: int = 0) -> list[dict[str, str]]:
    """Rows of the built-in task ``name``.

    Raises:
        ValueError: unknown task name (lists the known ones).
    """
    if name != "arithmetic":
        raise ValueError(f"data.path=builtin:{name}: unknown built-in task; known: {', '.join(BUILTIN_TASKS)}")
    return arithmetic_rows(num_rows, seed)
