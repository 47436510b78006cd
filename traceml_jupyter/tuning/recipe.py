"""The user's DataLoader, rebuilt for each candidate of `%traceml tune` with other worker
settings (same dataset, batching, collate_fn, worker_init_fn, generator, start method), and the
timer of the num_workers=0 candidate's parts (dataset, collate_fn, pinning)."""

from __future__ import annotations

import copy
import inspect
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..analysis.tune_plan import Setting, Split
from ..analysis.tune_rows import LoaderSettings
from ..failures import read_or

# -- the user's loader, rebuilt with other settings ----------------------------------------------


@dataclass
class Recipe:
    """How to build the user's loader again with other worker settings: the same dataset,
    batching, sampler kind, collate_fn, drop_last, worker_init_fn, generator and start method."""

    dataset: Any
    kwargs: dict[str, Any]  # everything but num_workers, persistent, prefetch and pin_memory
    iterable: bool  # an IterableDataset
    batch_text: str  # how the code line writes the batching
    current: LoaderSettings  # the user's num_workers, persistent_workers, prefetch, pin_memory

    def build(self, setting: Setting, timer: SplitTimer | None = None) -> Any:
        """A new DataLoader with `setting`; `timer`: time its dataset and collate_fn
        (num_workers=0)."""
        from torch.utils.data import DataLoader

        kwargs = dict(self.kwargs)
        dataset = self.dataset
        if timer is not None:
            dataset = timer.wrap_dataset(dataset, self.iterable)
            kwargs["collate_fn"] = timer.wrap_collate(kwargs["collate_fn"])
        kwargs["sampler"] = _fresh(kwargs.get("sampler"), dataset)
        kwargs["batch_sampler"] = _fresh(kwargs.get("batch_sampler"), dataset)
        return DataLoader(dataset, **kwargs, **setting.kwargs())


def _fresh(sampler: Any, dataset: Any) -> Any:
    """A sampler of the same kind for one candidate: a new RandomSampler (same generator,
    replacement, num_samples), or a shallow copy of a custom one, so that a sampler that counts
    epochs or keeps state counts them on the copy, not on the user's."""
    if sampler is None:
        return None
    from torch.utils.data import RandomSampler

    if type(sampler) is RandomSampler:
        return RandomSampler(
            dataset,
            replacement=sampler.replacement,
            num_samples=sampler._num_samples,
            generator=sampler.generator,
        )
    return read_or(sampler, copy.copy, sampler)  # the user's sampler: its copy may raise


def _accepts(name: str) -> bool:
    from torch.utils.data import DataLoader

    return name in inspect.signature(DataLoader.__init__).parameters


def recipe_of(loader: Any, names: Mapping[str, Any] | None = None) -> Recipe:
    """Read the user's loader (without iterating it): what each candidate is built from."""
    from torch.utils.data import IterableDataset, RandomSampler, SequentialSampler

    dataset = loader.dataset
    iterable = isinstance(dataset, IterableDataset)
    kwargs: dict[str, Any] = {
        "collate_fn": loader.collate_fn,
        "worker_init_fn": loader.worker_init_fn,
        "multiprocessing_context": loader.multiprocessing_context,
        "generator": loader.generator,
        "timeout": loader.timeout,
    }
    if _accepts("in_order"):
        kwargs["in_order"] = getattr(loader, "in_order", True)
    batch_size = loader.batch_size
    batch_sampler = loader.batch_sampler
    sampler = loader.sampler
    custom_batches = batch_size is None and batch_sampler is not None
    if iterable:
        kwargs.update(batch_size=batch_size, drop_last=loader.drop_last)
        batch_text = f"batch_size={batch_size}"
    elif custom_batches:
        kwargs["batch_sampler"] = batch_sampler
        batch_text = f"batch_sampler={name_of(batch_sampler, names) or 'batch_sampler'}"
    else:
        kwargs.update(batch_size=batch_size, drop_last=loader.drop_last)
        batch_text = f"batch_size={batch_size}"
        if type(sampler) is RandomSampler:
            kwargs["sampler"] = sampler
            batch_text += ", shuffle=True"
        elif type(sampler) is not SequentialSampler:
            kwargs["sampler"] = sampler
            batch_text += f", sampler={name_of(sampler, names) or 'sampler'}"
        if loader.drop_last:
            batch_text += ", drop_last=True"
    collate = loader.collate_fn
    if not str(getattr(collate, "__module__", "")).startswith("torch."):
        label = name_of(collate, names) or getattr(collate, "__name__", None) or "collate_fn"
        batch_text = f"{batch_text}, collate_fn={label}"
    current: LoaderSettings = {
        "num_workers": int(loader.num_workers or 0),
        "persistent_workers": bool(loader.persistent_workers),
        "prefetch_factor": loader.prefetch_factor if loader.num_workers else None,
        "pin_memory": bool(loader.pin_memory),
    }
    return Recipe(dataset, kwargs, iterable, batch_text, current)


def name_of(obj: Any, names: Mapping[str, Any] | None) -> str | None:
    """A name the user's namespace binds to `obj` (public names first)."""
    if names is None:
        return None
    found = sorted(k for k, v in list(names.items()) if v is obj and k.isidentifier())
    public = [k for k in found if not k.startswith("_")]
    return (public or found)[0] if found else None


# -- the split at num_workers=0 -------------------------------------------------------------------


class SplitTimer:
    """Times the dataset and the collate_fn of one num_workers=0 candidate, through wrappers
    given to that candidate only (the user's objects are not touched)."""

    def __init__(self) -> None:
        self.getitem_s = 0.0
        self.samples = 0
        self.collate_s = 0.0
        self.batches = 0
        self.pin_s = 0.0
        self.pinned = 0
        self.source = "__getitem__"

    def wrap_dataset(self, dataset: Any, iterable: bool) -> Any:
        """The dataset wrapped to time each sample's read (`iterable`: an IterableDataset)."""
        from torch.utils.data import Dataset, IterableDataset

        timer = self
        if iterable:
            self.source = "the dataset's iterator"

            class TimedStream(IterableDataset):  # type: ignore[type-arg]
                def __iter__(self) -> Iterator[Any]:
                    items = iter(dataset)
                    while True:
                        start = time.perf_counter()
                        try:
                            item = next(items)
                        except StopIteration:
                            return
                        finally:
                            timer.getitem_s += time.perf_counter() - start
                        timer.samples += 1
                        yield item

            return TimedStream()

        class TimedDataset(Dataset):  # type: ignore[type-arg]
            def __len__(self) -> int:
                return len(dataset)

            def __getitem__(self, index: Any) -> Any:
                start = time.perf_counter()
                try:
                    return dataset[index]
                finally:
                    timer.getitem_s += time.perf_counter() - start
                    timer.samples += 1

            def __getitems__(self, indices: Sequence[Any]) -> Any:
                # One timing a batch: the fetcher calls this when batching, as it would call
                # the dataset's own __getitems__, or __getitem__ once per index.
                start = time.perf_counter()
                try:
                    own = getattr(dataset, "__getitems__", None)
                    return own(indices) if own else [dataset[i] for i in indices]
                finally:
                    timer.getitem_s += time.perf_counter() - start
                    timer.samples += len(indices)

        if getattr(dataset, "__getitems__", None):
            self.source = "__getitems__"
        return TimedDataset()

    def wrap_collate(self, collate: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """The collate_fn wrapped to time each batch's assembly."""
        timer = self

        def timed_collate(samples: Any) -> Any:
            start = time.perf_counter()
            try:
                return collate(samples)
            finally:
                timer.collate_s += time.perf_counter() - start
                timer.batches += 1

        return timed_collate

    def split(self, batch_ms: float, cpu_share: float | None) -> Split:
        """Where a batch's `batch_ms` went: the dataset, collate_fn, pinning; `cpu_share`: its
        CPU work."""
        n = max(1, self.batches)
        return Split(
            batch_ms=batch_ms,
            samples_per_batch=self.samples / n if self.samples else None,
            getitem_ms=1000.0 * self.getitem_s / n if self.batches else None,
            collate_ms=1000.0 * self.collate_s / n if self.batches else None,
            pin_ms=1000.0 * self.pin_s / self.pinned if self.pinned else None,
            cpu_share=cpu_share,
            source=self.source,
        )


