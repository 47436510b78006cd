"""What the capture reads of the user's loader, dataset and batches (capture/data/): a read that
raises gives None (failures.read_or), and a failure of ours where a DataLoader is built stops at
that edge (`note_site`): the loader is built and iterated as without the magic."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import traceml_jupyter
from traceml_jupyter.capture.data import dataloaders
from traceml_jupyter.capture.data.dataloaders import describe_loader, python_objects
from traceml_jupyter.capture.data.probes import batch_size_of


class Squares(Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i * i)])


class HostileLoader(DataLoader[torch.Tensor]):
    """A loader whose `pin_memory` is a property that raises."""

    @property  # type: ignore[override]
    def pin_memory(self) -> bool:
        raise RuntimeError("nobody may ask")

    @pin_memory.setter
    def pin_memory(self, value: bool) -> None:
        pass


class Bottomless(Dataset[int]):
    def __len__(self) -> int:
        raise OverflowError("too long to say")

    def __getitem__(self, i: int) -> int:
        return i


def test_a_loader_setting_that_raises_reads_as_unknown_and_the_others_are_read() -> None:
    settings = describe_loader(HostileLoader(Squares(), batch_size=4))
    assert settings["pin_memory"] is None
    assert settings["batch_size"] == 4 and settings["num_workers"] == 0 and settings["n_samples"] == 8
    bottomless = describe_loader(DataLoader(Bottomless(), batch_size=2))
    assert bottomless["n_samples"] is None and bottomless["len"] is None and bottomless["batch_size"] == 2


class Unreadable(list[int]):
    def __iter__(self) -> Any:
        raise RuntimeError("not today")


def test_a_container_whose_first_item_cannot_be_read_is_passed_over() -> None:
    class Records(Dataset[int]):
        def __init__(self) -> None:
            self.rows = list(range(20_000))
            self.hidden = Unreadable(range(20_000))

    found = python_objects(Records())
    assert [row["attribute"] for row in found] == ["rows"]
    assert found[0]["items"] == "int" and found[0]["length"] == 20_000


class NoShape:
    @property
    def shape(self) -> Any:
        raise RuntimeError("nested tensors have none")


def test_a_batch_item_whose_shape_raises_is_skipped_and_the_next_tensor_decides() -> None:
    assert batch_size_of((NoShape(), torch.ones(5, 3))) == 5
    assert batch_size_of(NoShape()) is None


def test_a_failure_of_ours_where_a_loader_is_built_stops_at_note_site(monkeypatch: pytest.MonkeyPatch) -> None:
    """Finding the line that built the loader fails: the loader is built and iterated as
    without the magic, and the run has no construction line for it."""

    calls: list[Any] = []

    def broken(*args: Any) -> Any:
        calls.append(args)
        raise RuntimeError("our bug")

    def batches() -> list[list[float]]:
        return [batch.flatten().tolist() for batch in DataLoader(Squares(), batch_size=4)]

    expected = batches()
    monkeypatch.setattr(dataloaders, "construction_site", broken)
    with traceml_jupyter.trace(show=False) as run:
        got = [batch for batch in run.loop(batches())]
    assert got == expected == [[0.0, 1.0, 4.0, 9.0], [16.0, 25.0, 36.0, 49.0]]
    assert len(calls) == 1  # the loader built under the capture was looked at, and it failed
    assert run.result.data.loader_site is None
