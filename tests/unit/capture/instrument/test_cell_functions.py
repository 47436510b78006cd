"""Which functions of earlier cells a traced cell calls, read off the cell before it runs: a
method is found on the class of its receiver, also when the cell itself makes the object
(`Trainer(...).fit()`, `t = Trainer(...)` then `t.fit()`, a factory, chained calls), along the
class's MRO, without running any of the user's code."""

from __future__ import annotations

import ast
import itertools
import linecache
import textwrap
import types
from collections.abc import Iterator
from typing import Any

import pytest

from traceml_jupyter.capture.instrument.cell_functions import (
    Scope,
    called_cell_functions,
    class_of,
    function_loop,
    names_in,
    returned_class,
)
from traceml_jupyter.capture.instrument.locate import find_training_loop

NUMBERS = itertools.count(9000)

TRAINERS = '''
class Base:
    def __init__(self, model, loader):
        self.model, self.loader = model, loader
    def __enter__(self):
        return self
    def __exit__(self, *exc):
        return False
    def setup(self):
        self.ready = True
        return self
    def fit(self, epochs=1):
        for _ in range(epochs):
            self.epoch()
    def epoch(self):
        for x in self.loader:
            self.model(x).backward()

class Trainer(Base):
    def epoch(self):
        for x in self.loader:  # the subclass's own loop
            self.model(x).backward()
    @classmethod
    def from_config(cls, config):
        return cls(config["model"], config["loader"])

def make_trainer(model, loader):
    trainer = Trainer(model, loader)
    trainer.setup()
    return trainer

def make_annotated(kind) -> "Trainer":
    return BUILDERS[kind]()

BUILDERS = {}
'''


@pytest.fixture
def cells() -> Iterator[dict[str, Any]]:
    """A namespace whose functions and classes come from notebook cells (their source in
    linecache under an IPython-style name), the cells' entries dropped afterwards."""
    names: list[str] = []
    namespace: dict[str, Any] = {"__name__": "__main__"}

    def define(source: str) -> None:
        text = textwrap.dedent(source)
        name = f"<ipython-input-{next(NUMBERS)}-test>"
        linecache.cache[name] = (len(text), None, text.splitlines(keepends=True), name)
        names.append(name)
        exec(compile(text, name, "exec"), namespace)

    namespace["define"] = define
    define(TRAINERS)
    yield namespace
    for name in names:
        linecache.cache.pop(name, None)


def called(cell: str, namespace: dict[str, Any]) -> list[str]:
    ns = {k: v for k, v in namespace.items() if k != "define"}
    return [f.__qualname__ for f in called_cell_functions(ast.parse(textwrap.dedent(cell)), ns)]


@pytest.mark.parametrize(
    "cell",
    [
        "history = Trainer(model, loader).fit()",
        "trainer = Trainer(model, loader)\ntrainer.fit()",
        "trainer: Trainer = Trainer(model, loader)\ntrainer.fit(3)",
        "(t := Trainer(model, loader)).fit()",
        "Trainer(model, loader).setup().fit()",
        "t = Trainer(model, loader).setup()\nt.fit()",
        "make_trainer(model, loader).fit()",
        "Trainer.from_config({'model': model, 'loader': loader}).fit()",
        "with Trainer(model, loader) as trainer:\n    trainer.fit()",
        "for trainer in [Trainer(model, a), Trainer(model, b)]:\n    trainer.fit()",
        "trainers = [Trainer(model, part) for part in parts]\nfor t in trainers:\n    t.fit()",
        "trainers = (Trainer(model, a), Trainer(model, b))\ntrainers[1].fit()",
    ],
)
def test_a_method_of_an_object_the_cell_makes_is_found_on_its_class(cells: dict[str, Any], cell: str) -> None:
    got = called(cell, cells)
    # fit is inherited from Base; the epoch it calls is Trainer's override (self is a Trainer).
    assert "Base.fit" in got and "Trainer.epoch" in got and "Base.epoch" not in got


def test_an_instance_from_an_earlier_cell_is_found_as_before(cells: dict[str, Any]) -> None:
    cells["define"]("trainer = Trainer(None, [])\nbase = Base(None, [])\n")
    assert called("trainer.fit()", cells) == ["Base.fit", "Trainer.epoch"]
    assert called("base.fit()", cells) == ["Base.fit", "Base.epoch"]


def test_a_list_of_trainers_from_an_earlier_cell(cells: dict[str, Any]) -> None:
    cells["define"]("trainers = [Trainer(None, []), Trainer(None, [])]\nmixed = [Trainer(None, []), 1]\n")
    assert called("for t in trainers:\n    t.fit()", cells) == ["Base.fit", "Trainer.epoch"]
    assert called("for t in mixed:\n    t.fit()", cells) == []


def test_a_name_the_cell_binds_again_means_its_new_object(cells: dict[str, Any]) -> None:
    cells["define"]("trainer = Base(None, [])\n")
    assert called("trainer = Trainer(model, loader)\ntrainer.fit()", cells) == ["Base.fit", "Trainer.epoch"]
    # Used before the cell binds it again: the object from the earlier cell.
    assert called("trainer.fit()\ntrainer = Trainer(model, loader)\n", cells) == ["Base.fit", "Base.epoch"]


def test_names_the_cell_binds_to_what_its_code_does_not_tell_are_not_guessed(cells: dict[str, Any]) -> None:
    cells["define"]("trainer = Base(None, [])\n")
    for cell in (
        "for trainer in pick():\n    trainer.fit()",
        "for trainer in [Trainer(model, a), Base(model, b)]:\n    trainer.fit()",
        "for i, trainer in enumerate(trainers):\n    trainer.fit()",
        "trainer, other = pick()\ntrainer.fit()",
        "from somewhere import trainer\ntrainer.fit()",
        "class Trainer:\n    def fit(self):\n        pass\nTrainer(model, loader).fit()",
    ):
        assert called(cell, cells) == [], cell
    # Setting an attribute or an item binds no name: the instance from before is still it.
    assert called("trainer.lr = 0.1\nstate[trainer] = 1\ntrainer.fit()", cells) == ["Base.fit", "Base.epoch"]


def test_the_class_a_factory_returns(cells: dict[str, Any]) -> None:
    ns = {k: v for k, v in cells.items() if k != "define"}
    scope = Scope(ns, {})
    assert returned_class(cells["make_trainer"]) is cells["Trainer"]  # `trainer = Trainer(...)`, `return trainer`
    assert returned_class(cells["make_annotated"]) is cells["Trainer"]  # its annotation, `-> "Trainer"`
    assert returned_class(cells["Base"].setup, cells["Trainer"]) is cells["Trainer"]  # `return self`
    assert class_of(ast.parse("Trainer.from_config(c)", mode="eval").body, scope) is cells["Trainer"]
    assert class_of(ast.parse("make_annotated('x').setup()", mode="eval").body, scope) is cells["Trainer"]


def test_what_the_code_does_not_tell_finds_nothing(cells: dict[str, Any]) -> None:
    cells["define"]("def opaque():\n    return BUILDERS.get('x')\n")
    assert called("opaque().fit()", cells) == ["opaque"]
    assert called("t = len([])\nt.fit()", cells) == []
    assert called("unknown_name.fit()\nTrainer(model, loader)", cells) == []  # a class made: no method runs


def test_the_users_code_never_runs_while_calls_are_resolved(cells: dict[str, Any]) -> None:
    cells["define"](
        '''
        SEEN = []
        class Meta(type):
            def __getattr__(cls, name):
                SEEN.append(("class", name))
                raise AttributeError(name)
        class Lazy(metaclass=Meta):
            def __getattr__(self, name):
                SEEN.append(("instance", name))
                raise AttributeError(name)
            @property
            def inner(self):
                SEEN.append(("property", "inner"))
                return Trainer(None, [])
            def build(self):
                return Trainer(None, [])
        lazy = Lazy()
        '''
    )
    got = called("lazy.missing.fit()\nlazy.inner.fit()\nLazy.nope().fit()\nLazy().build().fit()\n", cells)
    assert got == ["Lazy.build", "Base.fit", "Trainer.epoch"] and cells["SEEN"] == []


def test_the_loop_is_located_in_the_method_found(cells: dict[str, Any]) -> None:
    (fit, epoch) = [f for f in called_cell_functions(ast.parse("Trainer(m, l).fit()"), cells)]
    assert isinstance(epoch, types.FunctionType)
    found = function_loop(epoch, find_training_loop)
    assert found is not None and found.func is cells["Trainer"].__dict__["epoch"]
    assert "the subclass's own loop" in found.lines[found.choice.lineno - 1]
    assert found.where == "function Trainer.epoch"


def test_the_names_a_cell_uses_are_its_names_not_keywords_or_attributes() -> None:
    # A notebook's `model` (an earlier cell's, maybe a compiled one) is not what
    # `Trainer(model=lm)` calls, nor is its `train` what `.train()` calls.
    cell = "out = Trainer(model=lm, args=hf_args, train_dataset=tokens).train()\n"
    assert names_in(cell) == {"out", "Trainer", "lm", "hf_args", "tokens"}
    # the magic's own line is no code of the cell's
    assert names_in("%%traceml --no-live\n" + cell) == names_in(cell)
    # code that does not parse: every identifier that follows no dot
    assert names_in("for x in loader: $\n    step(x.cuda())") == {"for", "x", "in", "loader", "step"}
