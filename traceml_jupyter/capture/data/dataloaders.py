"""Reading torch DataLoaders: the settings the checklist reads, as plain values, and the loader
behind a wrapper. Every read of the user's objects goes through `failures.read_or` (probes.py): a
loader that lies or raises gives None. The one edge here is `note_site`, run from the patched
`DataLoader.__init__` in the user's code: it never raises."""

from __future__ import annotations

import copy
import os
import sys
import sysconfig
from typing import Any

from ...facts.loader import CodeSite, LoaderFacts, NotedSite, PythonObjects
from ...failures import never_raise, read_or
from .probes import attribute, plain_count, safe_len, type_name

SITES_KEPT = 256  # DataLoaders whose construction line is remembered (the newest)
PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # traceml_jupyter/


def _dataloader_class() -> Any:
    # torch imports torch.utils.data itself: never import it here (not while torch is half
    # imported either)
    return getattr(sys.modules.get("torch.utils.data"), "DataLoader", None)


def unwrap_loader(iterable: Any) -> Any:
    """The DataLoader behind `iterable` when it is one or wraps one visibly (tqdm's .iterable)."""
    DataLoader = _dataloader_class()
    if DataLoader is None:
        return None
    for _ in range(4):
        if isinstance(iterable, DataLoader):
            return iterable
        iterable = attribute(iterable, "iterable")
        if iterable is None:
            return None
    return None


def describe_loader(loader: Any) -> LoaderFacts:
    """The settings the checklist reads, as plain values (no reference to the loader kept).
    A value that cannot be read honestly is None ("unknown" in the report)."""
    dataset = attribute(loader, "dataset")
    collate = attribute(loader, "collate_fn")
    collate_name = attribute(collate, "__qualname__") or type_name(collate)
    collate_module = attribute(collate, "__module__") or ""
    ds_type = type(dataset)
    return {
        "type": type_name(loader),
        "num_workers": plain_count(attribute(loader, "num_workers")),
        "batch_size": plain_count(attribute(loader, "batch_size")),
        "pin_memory": _flag(attribute(loader, "pin_memory")),
        "persistent_workers": _flag(attribute(loader, "persistent_workers")),
        "prefetch_factor": plain_count(attribute(loader, "prefetch_factor")),
        "multiprocessing_context": _context_name(attribute(loader, "multiprocessing_context")),
        "collate_fn": str(collate_name),
        "custom_collate": not str(collate_module).startswith("torch."),
        "dataset_type": str(attribute(ds_type, "__name__") or "object"),
        "dataset_module": str(attribute(ds_type, "__module__") or ""),
        "len": safe_len(loader),
        "n_samples": safe_len(dataset),
        "python_objects": python_objects(dataset),
    }


def loader_copy(loader: Any) -> Any:
    """A shallow copy of `loader` without its iterator: its dataset, sampler, batch size and
    collate_fn, for `%traceml tune` once the loader itself is gone; no worker processes kept
    (a persistent loader's workers live in its iterator). None if it cannot be copied."""
    return read_or(None, _copy_without_iterator, loader)


def _copy_without_iterator(loader: Any) -> Any:
    kept = copy.copy(loader)
    if "_iterator" in vars(kept):
        vars(kept)["_iterator"] = None
    return kept


PYTHON_OBJECTS_MIN = 10_000  # a container this long makes copy-on-read growth worth naming


def python_objects(dataset: Any, prefix: str = "", depth: int = 1) -> list[PythonObjects]:
    """The dataset's attributes that hold a list, tuple, dict or set of many Python objects
    (workers that read them copy the pages they sit on: copy-on-read), longest first; also
    those of a dataset it wraps (`Subset.dataset`). Every read is guarded."""
    found: list[PythonObjects] = []
    try:
        attrs = vars(dataset)
    except TypeError:
        return found
    if type(attrs) is not dict:
        return found
    for name, value in list(attrs.items()):
        kind = type(value)
        if kind in (list, tuple, dict, set):
            n = safe_len(value)
            if n is None or n < PYTHON_OBJECTS_MIN:
                continue
            first = read_or(NOTHING, _first_item, value, kind is dict)
            if first is NOTHING:
                continue
            found.append(PythonObjects(attribute=prefix + name, kind=kind.__name__, length=n, items=type_name(first)))
        elif depth > 0 and name == "dataset":
            found += python_objects(value, f"{prefix}{name}.", depth - 1)
    return sorted(found, key=lambda row: -row["length"])


NOTHING = object()  # a container whose first item cannot be read


def _first_item(value: Any, is_dict: bool) -> Any:
    return next(iter(value.values() if is_dict else value))


def _flag(value: Any) -> bool | None:
    return value if isinstance(value, bool) else None


def _context_name(ctx: Any) -> str | None:
    return None if ctx is None else read_or(None, _start_method, ctx)


def _start_method(ctx: Any) -> str:
    get = getattr(ctx, "get_start_method", None)
    return str(get()) if get else str(ctx)


def loader_of_iterator(iterator: Any, namespace: Any) -> Any:
    """The DataLoader in the user's namespace that an iterator made before the run came from
    (`it = iter(loader)` in an earlier cell): the one over the same dataset, else None."""
    DataLoader = _dataloader_class()
    dataset = attribute(iterator, "_dataset")
    if DataLoader is None or dataset is None or not namespace:
        return None
    for value in read_or((), _values, namespace):
        if read_or(False, isinstance, value, DataLoader) and attribute(value, "dataset") is dataset:
            return value
    return None


def _values(namespace: Any) -> list[Any]:
    return list(namespace.values())


# -- where a DataLoader is built -------------------------------------------------------------------
def note_site(sites: dict[int, NotedSite], loader: Any, frame: Any) -> None:
    """Remember in `sites` (by id of the loader, the newest SITES_KEPT) where `loader` is built,
    from `frame` (the caller of its __init__) up, and where its dataset's __getitem__ is.
    Never raises: the edge of the loader's construction in the user's code (a failure of ours
    leaves the site unknown)."""
    with never_raise():
        site = construction_site(loader, frame)
        if site is None:
            return
        site.update(dataset_site(attribute(loader, "dataset")) or {})
        while len(sites) >= SITES_KEPT:
            sites.pop(next(iter(sites)))
        sites[id(loader)] = site


def split_site(site: NotedSite | None) -> tuple[CodeSite | None, CodeSite | None]:
    """A noted site as the run keeps it: ({"file", "line"} of the loader, {"file", "line",
    "class"} of its dataset's __getitem__), each None when not known."""
    if not site:
        return None, None
    loader: CodeSite = {"file": site["file"], "line": site["line"]}
    if "dataset_file" not in site:
        return loader, None
    return loader, {"file": site["dataset_file"], "line": site["dataset_line"], "class": site["dataset_class"]}


def _user_code(filename: str) -> bool:
    """A file of the user's, or a notebook cell (`<ipython-input-3-...>`): not torch, not ours,
    not the standard library or a library."""
    if filename.startswith("<frozen") or filename.startswith(PACKAGE_DIR):
        return False
    paths = sysconfig.get_paths()
    roots = {paths.get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    return not any(root and filename.startswith(root) for root in roots)


def construction_site(loader: Any, frame: Any) -> NotedSite | None:
    """{"file", "line"} of the line that built `loader`, from the frame that called its
    __init__ up: the first frame of the user's code that is not a DataLoader subclass's own
    __init__; else the first frame outside torch."""
    torch_dir = os.path.dirname(getattr(sys.modules.get("torch"), "__file__", "") or "") + os.sep
    fallback: NotedSite | None = None
    for _ in range(32):
        if frame is None:
            break
        code = frame.f_code
        name = code.co_filename
        inside = code.co_name == "__init__" and frame.f_locals.get("self") is loader
        if not inside and not name.startswith(torch_dir):
            if _user_code(name):
                found: NotedSite = {"file": _path(name), "line": int(frame.f_lineno)}
                return found
            if fallback is None and not name.startswith(PACKAGE_DIR):
                fallback = {"file": _path(name), "line": int(frame.f_lineno)}
        frame = frame.f_back
    return fallback


def _path(filename: str) -> str:
    """A file's absolute path (a process's relative path means nothing to the kernel); a
    code name such as `<ipython-input-3-...>` as it is."""
    return filename if filename.startswith("<") else os.path.abspath(filename)


def inner_dataset(dataset: Any) -> Any:
    """The dataset behind torch's wrappers (Subset, ...)."""
    for _ in range(4):
        inner = attribute(dataset, "dataset")
        if inner is None or str(attribute(type(dataset), "__module__")).split(".")[0] != "torch":
            break
        dataset = inner
    return dataset


def dataset_site(dataset: Any) -> NotedSite | None:
    """Where the dataset's `__getitem__` is written (through torch's wrappers such as Subset)."""
    dataset = inner_dataset(dataset)
    if dataset is None:
        return None
    cls = type(dataset)
    func = attribute(cls, "__getitem__")
    code = attribute(attribute(func, "__func__") or func, "__code__")
    if code is None:
        return None
    site: NotedSite = {"dataset_file": _path(code.co_filename), "dataset_line": int(code.co_firstlineno), "dataset_class": cls.__name__}
    return site
