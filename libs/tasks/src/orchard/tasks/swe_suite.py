"""The built-in software-engineering suite: small Python repositories with real bugs, generated
in code, of graded difficulty, split into SFT, RL and held-out evaluation tasks.

Every task comes from a *family* (a kind of bug people write) filled in from a seed: names,
limits and values differ from task to task, the bug and its fix have the same shape. Families
are graded:

1. one token is wrong (a comparison at a boundary, an operator);
2. one line is wrong (an off-by-one range, a missing empty-input guard);
3. two places must change together (a format and its parser disagree).

:func:`generate_suite` returns :class:`SuiteTask` values: the
:class:`~orchard.tasks.swe_tasks.RepoBlueprint` (turned into a git repository with a base
commit, gold patch and test patch by :func:`orchard.tasks.swe_tasks.materialize`) and the
scripted teacher's plan for it: the solution, and a failure a person would make. The split is
stratified by family, so every split holds every family and the held-out set measures whether
a model learned the kind of fix, not one task.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from orchard.tasks.swe_tasks import RepoBlueprint

__all__ = [
    "FAMILIES",
    "FAMILY_COMMANDS",
    "FAMILY_DESCRIPTIONS",
    "MAX_TASKS",
    "MIN_TASKS",
    "SUITE_DESCRIPTION",
    "SUITE_NAME",
    "FamilyCommands",
    "SuiteTask",
    "generate_suite",
    "split_suite",
    "teacher_script",
]

SUITE_NAME = "builtin:swe"
"""The suite's name where services list it (orchard-reward's ListTaskSuites)."""
SUITE_DESCRIPTION = (
    "Small Python repositories generated in code, each with one real bug of a known family "
    "and the tests that show it, scored by running those tests in a sandbox"
)
MIN_TASKS = 1
MAX_TASKS = 10_000
"""Most tasks one (count, seed) makes: the bound recipes and services check counts against."""

Split = Literal["sft", "rl", "evaluate"]

_VERBS = ("check", "compute", "count", "find", "measure", "pick", "rate", "score", "tally", "weigh")
_NOUNS = (
    "orders", "parcels", "tickets", "visits", "badges", "points", "seats", "crates", "loans",
    "shifts", "votes", "laps", "books", "tokens", "meals", "trips",
)  # fmt: skip
_PACKAGES = ("ledger", "depot", "kiosk", "harbor", "atlas", "quarry", "meadow", "beacon")

SOLVE_RATE = {1: 0.8, 2: 0.6, 3: 0.4}
"""How often the scripted teacher follows the solution, by difficulty."""


@dataclass(frozen=True, slots=True)
class Edit:
    """One exact replacement in one file (the `edit` tool's arguments)."""

    path: str
    old_text: str
    new_text: str


@dataclass(frozen=True, slots=True)
class FamilyCommands:
    """Shell commands that read, fix and wrongly fix any task of one family.

    They name no task-specific identifier (the module is found by its file name under
    ``src/*/``), so the same command solves every task of the family: what a student model
    must learn is which family a problem statement describes and the shape of its fix.
    """

    look: str
    fix: str
    wrong: str


@dataclass(frozen=True, slots=True)
class SuiteTask:
    """One generated task."""

    blueprint: RepoBlueprint
    family: str
    difficulty: int
    module_path: str
    """The file that holds the bug, relative to the repository."""
    marker: str
    """A piece of the problem statement no other task's statement contains (the teacher's
    plan is selected by it)."""
    fix: tuple[Edit, ...]
    wrong_fix: tuple[Edit, ...]
    """A plausible wrong attempt, as edits."""
    shell: FamilyCommands
    """The same fix and wrong attempt as shell commands: what the teacher types."""

    @property
    def instance_id(self) -> str:
        return self.blueprint.instance_id


@dataclass(frozen=True, slots=True)
class _Names:
    package: str
    function: str
    number: int
    rng: random.Random


@dataclass(frozen=True, slots=True)
class _Parts:
    """What a family generator makes for one task."""

    base: dict[str, str]
    fixed: dict[str, str]
    tests: dict[str, str]
    statement: str
    fix: tuple[Edit, ...]
    wrong: tuple[Edit, ...]
    fail_to_pass: tuple[str, ...]
    pass_to_pass: tuple[str, ...]


def _module(names: _Names, stem: str) -> str:
    return f"src/{names.package}/{stem}.py"


def _tests_file(names: _Names) -> str:
    return f"tests/test_{names.function}.py"


def _boundary(names: _Names) -> _Parts:
    fn, limit = names.function, names.number
    path = _module(names, "rules")
    base = (
        '"""Eligibility rules."""\n\n\n'
        f"def {fn}(value):\n"
        f'    """True when value is at least {limit}."""\n'
        f"    return value > {limit}\n"
    )
    fixed = base.replace(f"value > {limit}", f"value >= {limit}")
    test = _tests_file(names)
    imports = f"from {names.package}.rules import {fn}\n\n\n"
    old_tests = (
        imports
        + f"def test_well_above():\n    assert {fn}({limit + 5})\n\n\n"
        + f"def test_below():\n    assert not {fn}({limit - 3})\n"
    )
    new_tests = old_tests + f"\n\ndef test_the_limit_itself_counts():\n    assert {fn}({limit})\n"
    statement = (
        f"`{fn}({limit})` returns False, but the rule is 'at least {limit}': the limit itself "
        f"must count. Fix `{fn}` in {path}."
    )
    fix = (Edit(path, f"return value > {limit}", f"return value >= {limit}"),)
    wrong = (
        Edit(path, f"return value > {limit}", f"return value > {limit - 1} and value != {limit}"),
    )
    f2p = (f"{test}::test_the_limit_itself_counts",)
    p2p = (f"{test}::test_well_above", f"{test}::test_below")
    return _Parts(
        {path: base, test: old_tests},
        {path: fixed},
        {test: new_tests},
        statement,
        fix,
        wrong,
        f2p,
        p2p,
    )


def _operator(names: _Names) -> _Parts:
    fn = names.function
    a, b, c, d = (names.rng.randint(2, 9) for _ in range(4))
    path = _module(names, "billing")
    base = (
        '"""Order totals."""\n\n\n'
        f"def {fn}(prices, quantities):\n"
        '    """The sum of price times quantity over the lines of an order."""\n'
        "    total = 0\n"
        "    for price, quantity in zip(prices, quantities):\n"
        "        total += price + quantity\n"
        "    return total\n"
    )
    fixed = base.replace("price + quantity", "price * quantity")
    test = _tests_file(names)
    old_tests = (
        f"from {names.package}.billing import {fn}\n\n\n"
        f"def test_an_empty_order_costs_nothing():\n    assert {fn}([], []) == 0\n"
    )
    new_tests = old_tests + (
        f"\n\ndef test_lines_multiply_price_by_quantity():\n"
        f"    assert {fn}([{a}, {b}], [{c}, {d}]) == {a * c + b * d}\n"
    )
    statement = (
        f"`{fn}([{a}, {b}], [{c}, {d}])` returns {a + c + b + d}, but an order costs price times "
        f"quantity per line: it should be {a * c + b * d}. Fix it in {path}."
    )
    fix = (Edit(path, "total += price + quantity", "total += price * quantity"),)
    wrong = (Edit(path, "total += price + quantity", "total += price + quantity * 2"),)
    f2p = (f"{test}::test_lines_multiply_price_by_quantity",)
    p2p = (f"{test}::test_an_empty_order_costs_nothing",)
    return _Parts(
        {path: base, test: old_tests},
        {path: fixed},
        {test: new_tests},
        statement,
        fix,
        wrong,
        f2p,
        p2p,
    )


def _off_by_one(names: _Names) -> _Parts:
    fn, n = names.function, names.number % 7 + 3
    path = _module(names, "series")
    base = (
        '"""Running sums."""\n\n\n'
        f"def {fn}(n):\n"
        '    """The sum of the whole numbers 1 to n, both included; 0 when n < 1."""\n'
        "    return sum(range(1, n))\n"
    )
    fixed = base.replace("range(1, n)", "range(1, n + 1)")
    test = _tests_file(names)
    old_tests = (
        f"from {names.package}.series import {fn}\n\n\n"
        f"def test_nothing_below_one():\n    assert {fn}(0) == 0\n    assert {fn}(-4) == 0\n"
    )
    new_tests = old_tests + (
        f"\n\ndef test_n_is_included():\n    assert {fn}(1) == 1\n"
        f"    assert {fn}({n}) == {n * (n + 1) // 2}\n"
    )
    statement = (
        f"`{fn}({n})` gives {n * (n - 1) // 2} instead of {n * (n + 1) // 2}: the docstring says "
        f"n itself is included. Fix {path}."
    )
    fix = (Edit(path, "return sum(range(1, n))", "return sum(range(1, n + 1))"),)
    wrong = (Edit(path, "return sum(range(1, n))", "return sum(range(0, n))"),)
    f2p = (f"{test}::test_n_is_included",)
    p2p = (f"{test}::test_nothing_below_one",)
    return _Parts(
        {path: base, test: old_tests},
        {path: fixed},
        {test: new_tests},
        statement,
        fix,
        wrong,
        f2p,
        p2p,
    )


def _empty_input(names: _Names) -> _Parts:
    fn, default = names.function, 0
    path = _module(names, "peaks")
    body = (
        "    best = values[0]\n"
        "    for value in values[1:]:\n"
        "        if value > best:\n"
        "            best = value\n"
        "    return best\n"
    )
    base = (
        '"""Peaks of series."""\n\n\n'
        f"def {fn}(values):\n"
        f'    """The largest of values, or {default} when there are none."""\n' + body
    )
    guard = f"    if not values:\n        return {default}\n"
    fixed = base.replace("    best = values[0]\n", guard + "    best = values[0]\n")
    test = _tests_file(names)
    old_tests = (
        f"from {names.package}.peaks import {fn}\n\n\n"
        f"def test_the_largest_wins():\n    assert {fn}([3, 9, 2]) == 9\n"
    )
    new_tests = old_tests + (
        f"\n\ndef test_no_values_give_the_default():\n    assert {fn}([]) == {default}\n"
    )
    statement = (
        f"`{fn}([])` raises IndexError; it should return {default}, as its docstring says. "
        f"Fix {path}."
    )
    fix = (Edit(path, "    best = values[0]\n", guard + "    best = values[0]\n"),)
    wrong = (Edit(path, "    best = values[0]\n", "    best = values[0] if values else None\n"),)
    f2p = (f"{test}::test_no_values_give_the_default",)
    p2p = (f"{test}::test_the_largest_wins",)
    return _Parts(
        {path: base, test: old_tests},
        {path: fixed},
        {test: new_tests},
        statement,
        fix,
        wrong,
        f2p,
        p2p,
    )


def _round_trip(names: _Names) -> _Parts:
    fn = names.function
    qty = names.number % 9 + 2
    path = _module(names, "codec")
    base = (
        '"""A line format: NAME:QUANTITY, the quantity 1 when left out."""\n\n\n'
        f"def format_{fn}(name, quantity):\n"
        '    return f"{name}={quantity}"\n\n\n'
        f"def parse_{fn}(text):\n"
        '    name, _, quantity = text.partition(":")\n'
        "    return name.strip(), int(quantity)\n"
    )
    fixed = base.replace('f"{name}={quantity}"', 'f"{name}:{quantity}"').replace(
        "return name.strip(), int(quantity)\n",
        "return name.strip(), int(quantity) if quantity.strip() else 1\n",
    )
    test = _tests_file(names)
    old_tests = (
        f"from {names.package}.codec import format_{fn}, parse_{fn}\n\n\n"
        f"def test_parse_reads_name_and_quantity():\n"
        f'    assert parse_{fn}("pear:{qty}") == ("pear", {qty})\n'
    )
    new_tests = old_tests + (
        f"\n\ndef test_format_and_parse_round_trip():\n"
        f'    assert parse_{fn}(format_{fn}("fig", {qty})) == ("fig", {qty})\n'
        f"\n\ndef test_a_missing_quantity_is_one():\n"
        f'    assert parse_{fn}("plum") == ("plum", 1)\n'
    )
    statement = (
        f"`format_{fn}` and `parse_{fn}` in {path} disagree: format writes NAME=QUANTITY while "
        f"the format is NAME:QUANTITY, and `parse_{fn}('plum')` fails where the quantity should "
        "default to 1. Fix both."
    )
    fix = (
        Edit(path, 'f"{name}={quantity}"', 'f"{name}:{quantity}"'),
        Edit(
            path,
            "return name.strip(), int(quantity)",
            "return name.strip(), int(quantity) if quantity.strip() else 1",
        ),
    )
    wrong = (Edit(path, 'f"{name}={quantity}"', 'f"{name}:{quantity}"'),)  # half the fix
    f2p = (f"{test}::test_format_and_parse_round_trip", f"{test}::test_a_missing_quantity_is_one")
    p2p = (f"{test}::test_parse_reads_name_and_quantity",)
    return _Parts(
        {path: base, test: old_tests},
        {path: fixed},
        {test: new_tests},
        statement,
        fix,
        wrong,
        f2p,
        p2p,
    )


FAMILIES = {
    "boundary": (1, _boundary),
    "operator": (1, _operator),
    "off_by_one": (2, _off_by_one),
    "empty_input": (2, _empty_input),
    "round_trip": (3, _round_trip),
}
"""Family name -> (difficulty, generator)."""

FAMILY_DESCRIPTIONS = {
    "boundary": "A comparison at a limit is off by one token (> where >= is meant).",
    "operator": "An arithmetic operator is wrong (a sum where a product is meant).",
    "off_by_one": "A range stops one short of the last value it must include.",
    "empty_input": "A function fails on an empty input instead of returning its default.",
    "round_trip": "A format and its parser disagree; both must change together.",
}
"""Family name -> one line on the bug and its fix."""

FAMILY_COMMANDS = {
    "boundary": FamilyCommands(
        look="cat src/*/rules.py",
        fix="sed -i 's/value > /value >= /' src/*/rules.py",
        wrong="sed -i 's/value > /value > 1 + /' src/*/rules.py",
    ),
    "operator": FamilyCommands(
        look="cat src/*/billing.py",
        fix="sed -i 's/price + quantity/price * quantity/' src/*/billing.py",
        wrong="sed -i 's/price + quantity/price + quantity * 2/' src/*/billing.py",
    ),
    "off_by_one": FamilyCommands(
        look="cat src/*/series.py",
        fix="sed -i 's/range(1, n))/range(1, n + 1))/' src/*/series.py",
        wrong="sed -i 's/range(1, n))/range(0, n))/' src/*/series.py",
    ),
    "empty_input": FamilyCommands(
        look="cat src/*/peaks.py",
        fix="sed -i 's/^    best = values\\[0\\]$/    if not values:\\n        return 0\\n"
        "    best = values[0]/' src/*/peaks.py",
        wrong="sed -i 's/^    best = values\\[0\\]$/    best = values[0] if values else None/' "
        "src/*/peaks.py",
    ),
    "round_trip": FamilyCommands(
        look="cat src/*/codec.py",
        fix="sed -i 's/{name}={quantity}/{name}:{quantity}/; "
        "s/int(quantity)$/int(quantity) if quantity.strip() else 1/' src/*/codec.py",
        wrong="sed -i 's/{name}={quantity}/{name}:{quantity}/' src/*/codec.py",
    ),
}
"""Family name -> the shell commands the scripted teacher types (GNU sed)."""


def _unique_names(rng: random.Random, count: int) -> list[str]:
    pairs = [f"{v}_{n}" for v in _VERBS for n in _NOUNS]
    if count > len(pairs):
        # Past the word lists, numbered names keep every marker unique.
        pairs += [f"{p}_{i}" for i in range(2, 2 + count // len(pairs) + 1) for p in pairs]
    rng.shuffle(pairs)
    return pairs[:count]


def generate_suite(count: int, seed: int = 0) -> list[SuiteTask]:
    """``count`` tasks cycling through the families (so difficulties are balanced), the same for
    the same seed on every machine."""
    if not MIN_TASKS <= count <= MAX_TASKS:
        raise ValueError(f"count must lie in [{MIN_TASKS}, {MAX_TASKS}], got {count}")
    rng = random.Random(seed)
    functions = _unique_names(rng, count)
    families = list(FAMILIES)
    tasks = []
    for index in range(count):
        family = families[index % len(families)]
        difficulty, make = FAMILIES[family]
        names = _Names(
            package=f"{rng.choice(_PACKAGES)}{index}",
            function=functions[index],
            number=rng.randint(10, 90),
            rng=rng,
        )
        parts = make(names)
        instance_id = f"orchard-swe-{seed}-{index:03d}-{family}"
        blueprint = RepoBlueprint(
            instance_id=instance_id,
            repo=f"orchard/{names.package}",
            problem_statement=parts.statement,
            base_files={
                **parts.base,
                f"src/{names.package}/__init__.py": "",
                "pyproject.toml": _PYPROJECT,
            },
            fix=parts.fixed,
            tests=parts.tests,
            fail_to_pass=parts.fail_to_pass,
            pass_to_pass=parts.pass_to_pass,
        )
        tasks.append(
            SuiteTask(
                blueprint=blueprint,
                family=family,
                difficulty=difficulty,
                module_path=parts.fix[0].path,
                marker=f"`format_{names.function}`"
                if family == "round_trip"
                else f"`{names.function}(",
                fix=parts.fix,
                wrong_fix=parts.wrong,
                shell=FAMILY_COMMANDS[family],
            )
        )
    _check_markers(tasks)
    return tasks


# A src/ layout; pytest puts src/ on the import path, so nothing needs installing. The tests
# need no plugin: not loading the interpreter's installed ones (pytest 8.4 and newer) makes a
# test run about six times cheaper, and test runs are most of an episode's CPU.
_PYPROJECT = (
    '[tool.pytest.ini_options]\ntestpaths = ["tests"]\npythonpath = ["src"]\n'
    'addopts = "--disable-plugin-autoload"\n'
)


def _check_markers(tasks: Sequence[SuiteTask]) -> None:
    for task in tasks:
        holders = [t for t in tasks if task.marker in t.blueprint.problem_statement]
        if holders != [task]:
            raise AssertionError(f"marker {task.marker!r} is not unique")  # a generator bug


def split_suite(
    tasks: Sequence[SuiteTask], fractions: dict[Split, float], seed: int = 0
) -> dict[Split, list[SuiteTask]]:
    """Tasks divided by ``fractions`` (summing to 1) within each family, so every split holds
    every family when there are enough tasks; held-out tasks are never in another split."""
    if abs(sum(fractions.values()) - 1.0) > 1e-9:
        raise ValueError(f"fractions must sum to 1, they sum to {sum(fractions.values()):g}")
    rng = random.Random(seed)
    out: dict[Split, list[SuiteTask]] = {"sft": [], "rl": [], "evaluate": []}
    for family in FAMILIES:
        members = [t for t in tasks if t.family == family]
        rng.shuffle(members)
        start = 0
        order: list[Split] = ["evaluate", "sft", "rl"]  # held-out first: it must never be empty
        for i, split in enumerate(order):
            share = fractions.get(split, 0.0)
            if i == len(order) - 1:
                take = len(members) - start
            else:
                take = round(share * len(members))
                if split == "evaluate" and share > 0 and members:
                    take = max(1, take)
            out[split] += members[start : start + take]
            start += take
    for chosen in out.values():
        chosen.sort(key=lambda t: t.instance_id)
    return out


def teacher_script(tasks: Sequence[SuiteTask], model: str = "scripted-teacher") -> dict[str, Any]:
    """The scripted teacher's plans for ``tasks``, in the scripted policy's JSON form
    (:meth:`orchard.rollout.scripted_policy.PolicyScript.from_json`), all through the shell:
    read the module and run the tests; then the solution fixes the bug, runs the tests again
    and submits, and the failure makes the family's wrong fix and submits untested."""

    def bash(thought: str, command: str) -> dict[str, Any]:
        return {"thought": thought, "tool": "bash", "arguments": {"command": command}}

    plans = []
    for task in tasks:
        commands = task.shell
        solution = [
            bash("I read the code first.", commands.look),
            bash("I run the tests.", "python -m pytest -q"),
            bash("I fix the bug.", commands.fix),
            bash("I run the tests again.", "python -m pytest -q"),
            {"thought": "The tests pass; I submit.", "tool": "submit", "arguments": {}},
        ]
        failure = [
            bash("A quick look at the code.", commands.look),
            bash("I run the tests.", "python -m pytest -q"),
            bash("I think this is it.", commands.wrong),
            {"thought": "Done, I submit.", "tool": "submit", "arguments": {}},
        ]
        plans.append(
            {
                "match": task.marker,
                "solve_rate": SOLVE_RATE[task.difficulty],
                "solution": solution,
                "failure": failure,
            }
        )
    return {"model": model, "plans": plans}
