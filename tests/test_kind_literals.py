"""Task kinds are written once, in digenrl/vocabulary.py; keys are made by the
constructors of digenrl/graph/keys.py.

Every module under ``digenrl/`` is parsed, and a string constant equal to a task kind
fails the test, wherever it is: a key built by hand, an op compared to a literal, a
binding table. Words that are the same letters but not kinds have a named definition of
their own, listed below with what they are; ``__all__`` lists name a module's functions
(a ``noise`` task function), not kinds.
"""

from __future__ import annotations

import ast
from pathlib import Path

from digenrl.vocabulary import KINDS

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "digenrl"

#: Named definitions that spell a kind's letters and mean something else:
#: (module path, name) -> what it is.
NOT_KINDS = {
    ("digenrl/seeding.py", "NOISE_DRAW"): "the draw of a sample's starting noise",
    ("digenrl/seeding.py", "INIT_DRAW"): "the draw of the initial weights",
    ("digenrl/store/__init__.py", "EVAL_GROUP"): "the store's group of held-out evaluations",
    ("digenrl/store/__init__.py", "REWARD_COLUMN"): "a sample's reward, a column of the store",
    ("digenrl/store/__init__.py", "ADVANTAGE_COLUMN"): "a sample's advantage, a column of the store",
    ("digenrl/serving/server.py", "SERVED_KEY"): "the reward server's status field",
    ("digenrl/schedulers/dashboard.py", "REWARD_CURVE"): "the dashboard's reward curve column",
}

#: Where the kinds are defined.
VOCABULARY = "digenrl/vocabulary.py"


def kind_literals(source: str, path: str) -> tuple[list[str], set[str]]:
    """Each string constant of ``source`` equal to a task kind, as ``path:line: 'kind'``,
    outside ``__all__`` and the :data:`NOT_KINDS` definitions; and those definitions
    found."""
    tree = ast.parse(source, path)
    allowed: set[int] = set()
    defined = set()
    for node in tree.body:
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, ast.AnnAssign) else [])
        names = {t.id for t in targets if isinstance(t, ast.Name)}
        if "__all__" in names or any((path, n) in NOT_KINDS for n in names):
            allowed |= {id(c) for c in ast.walk(node.value) if isinstance(c, ast.Constant)}
            defined |= {n for n in names if (path, n) in NOT_KINDS}
    found = [f"{path}:{c.lineno}: {c.value!r}"
             for c in sorted((c for c in ast.walk(tree) if isinstance(c, ast.Constant)),
                             key=lambda c: (c.lineno, c.col_offset))
             if isinstance(c.value, str) and c.value in KINDS and id(c) not in allowed]
    return found, defined


def test_no_kind_is_spelled_outside_the_vocabulary():
    found, defined = [], set()
    for file in sorted(PACKAGE.rglob("*.py")):
        path = file.relative_to(ROOT).as_posix()
        if path == VOCABULARY:
            continue
        literals, names = kind_literals(file.read_text(), path)
        found += literals
        defined |= {(path, n) for n in names}
    assert not found, ("task kinds spelled outside digenrl/vocabulary.py (use its "
                       "constants, and digenrl/graph/keys.py for keys): " + "; ".join(found))
    assert defined == set(NOT_KINDS), f"named definitions gone: {set(NOT_KINDS) - defined}"


def test_a_literal_kind_is_found_wherever_it_is():
    source = '''
__all__ = ["noise", "decode"]
NOISE_DRAW = "noise"
def binding(node):
    if node.op == "grad":
        return ("denoise", 1, 2, 3)
    return {"reward": 1}.get(node.op, "not a kind")
'''
    found, defined = kind_literals(source, "digenrl/seeding.py")
    assert found == ["digenrl/seeding.py:5: 'grad'", "digenrl/seeding.py:6: 'denoise'",
                     "digenrl/seeding.py:7: 'reward'"]
    assert defined == {"NOISE_DRAW"}
    # The same definition anywhere else is a kind spelled out.
    found, _ = kind_literals(source, "digenrl/run/runner.py")
    assert "digenrl/run/runner.py:3: 'noise'" in found
