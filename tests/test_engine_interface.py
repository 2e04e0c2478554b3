"""Every engine build_engine returns has every member of the declared `acco.engine.Engine`, with a
signature its callers can use: the trainer and the checkpoints use nothing else."""

from __future__ import annotations

import ast
import inspect
import textwrap

import pytest

from acco.engine import Engine
from acco.engine.decoupled import DecoupledEngine
from acco.engine.diloco import DiLoCoEngine
from acco.engine.torch_ddp import TorchDDPEngine
from acco.engine.torch_hsdp import TorchHSDPEngine

ENGINES = [DecoupledEngine, TorchDDPEngine, TorchHSDPEngine, DiLoCoEngine]


def members(protocol) -> dict[str, object]:
    return {name: value for name, value in vars(protocol).items() if not name.startswith("_")}


def assigned_in_init(cls) -> set[str]:
    """The `self.X` attributes that cls.__init__ assigns (an attribute a property may declare)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls.__init__)))
    return {
        t.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign)
        for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
        for t in ast.walk(target)
        if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
    }


def mismatches(cls, protocol=Engine) -> list[str]:
    """What `cls` lacks of `protocol`: a member, a parameter of the same name and kind, or a default
    for a parameter of its own that the protocol's callers do not pass."""
    found = []
    for name, declared in members(protocol).items():
        if isinstance(declared, property):
            if not isinstance(getattr(cls, name, None), property) and name not in assigned_in_init(cls):
                found.append(f"{cls.__name__}.{name}: neither a property nor set in __init__")
            continue
        method = getattr(cls, name, None)
        if not callable(method):
            found.append(f"{cls.__name__}.{name}: missing")
            continue
        want = inspect.signature(declared).parameters
        have = inspect.signature(method).parameters
        for p in want.values():
            q = have.get(p.name)
            if q is None or q.kind != p.kind or (p.default is not p.empty and q.default is q.empty):
                found.append(f"{cls.__name__}.{name}: parameter {p}, has {q}")
        for q in have.values():
            required = q.default is q.empty and q.kind not in (q.VAR_POSITIONAL, q.VAR_KEYWORD)
            if q.name not in want and required:
                found.append(f"{cls.__name__}.{name}: parameter {q} that callers do not pass")
    return found


@pytest.mark.parametrize("cls", ENGINES, ids=lambda c: c.__name__)
def test_every_engine_has_the_declared_interface(cls):
    assert mismatches(cls) == []


def test_the_interface_covers_what_the_engines_share():
    """A public method all three engines have is declared (or, if a new one, add it to Engine)."""
    shared = set.intersection(*({n for n, v in vars(c).items() if not n.startswith("_") and callable(v)
                                 or isinstance(v, property)} for c in ENGINES))
    assert shared - set(members(Engine)) == set()


def test_the_check_sees_a_missing_member_and_a_changed_signature():
    class Broken(DecoupledEngine):
        quiesce = None

        def load_state_dict(self, state, resharded):  # a required parameter the callers never pass
            return True

        def state_bytes(self, detail):
            return {}

    found = "\n".join(mismatches(Broken))
    assert "Broken.quiesce: missing" in found
    assert "Broken.load_state_dict: parameter old_state" in found and "resharded" in found
    assert "Broken.state_bytes: parameter detail" in found
    assert mismatches(DecoupledEngine) == []
