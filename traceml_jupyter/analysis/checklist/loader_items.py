"""The checklist's items about the input: the DataLoader's settings (workers, persistence,
prefetch, collate_fn, start method), what feeds the steps when it is no DataLoader, and the
dataset's per-sample work and storage."""

from __future__ import annotations

from dataclasses import replace

from ..cell_code import RANDOM_CALL, CodeSite, SampleCode
from ..data_sources import Feeder
from ..loader_inside import dominant_stage
from ..number_text import ms as _ms
from ..number_text import pct as _pct
from ..step_parts import wait_words
from ..tune_plan import rate_text
from ..verdict import VerdictLabel
from .facts import (
    CHECK,
    DEFAULT_PREFETCH,
    FIX,
    INPUT_VERDICTS,
    OK,
    PREFETCH_TO_TRY,
    UNSAFE_START_METHODS,
    WORKER_VERDICTS,
    Facts,
    Item,
    needs_change,
    workers_now,
)


def default_start_method(version: tuple[int, int], platform: str) -> str:
    """How multiprocessing starts workers when nothing chose it: spawn on macOS and Windows,
    fork on Linux up to Python 3.13, forkserver from 3.14."""
    if platform.startswith(("win", "darwin")):
        return "spawn"
    return "forkserver" if version >= (3, 14) else "fork"


def suggested_workers(cpu_count: int | None) -> int:
    """About half the CPUs, at least 2."""
    return max(2, (cpu_count or 0) // 2)


def dataloader_item(f: Facts) -> Item:
    """Without a DataLoader object the loader settings cannot be read."""
    return Item(
        "dataloader",
        "DataLoader settings",
        CHECK,
        "no torch DataLoader seen",
        None,
        None,
        "The loop does not iterate a torch DataLoader (or wraps it where it cannot be seen), "
        "so workers, prefetching and pinned memory could not be read.",
        f.verdict in INPUT_VERDICTS,
    )


def data_source_item(f: Facts, source: Feeder) -> Item:
    """A source that is no DataLoader (a generator, a list, an iterator, a `get_batch()`), by
    name and line, and what makes such a source faster."""
    title = "What feeds the steps"
    bears = f.verdict in INPUT_VERDICTS
    seen = f"{source.label}: {source.noun}, no DataLoader"
    if source.built:
        return Item(
            "data_source", title, CHECK if bears else OK, seen, None, f.feeder_site,
            f"{source.label} is {source.noun}: its items are built before the loop, so taking "
            "one costs next to nothing, and DataLoader workers, prefetching and pinned memory "
            "do not apply."
            + (
                " A wait here is the loop's own cost per item next to very short steps: give "
                "each step more work (a larger batch)."
                if bears
                else ""
            ),
            bears,
        )
    reason = (
        f"{source.label} is {source.noun}: it makes each batch in the training process, between "
        "steps, so the loop waits for all of its work. Prefetch it in a background thread (a "
        "queue a few batches ahead: a thread overlaps work that waits on files or the network "
        "or runs outside Python's lock, as torch and NumPy do), or put it behind a DataLoader "
        "with workers (an IterableDataset whose __iter__ runs it, split with "
        "get_worker_info()), so that batches are made while the step computes."
    )
    if not bears:
        return Item("data_source", title, OK, seen, None, f.feeder_site, reason, False)
    return Item(
        "data_source", title, FIX, seen, "prefetch in a thread, or a DataLoader with workers",
        f.feeder_site, reason, True,
    )


def _cacheable(code: SampleCode) -> tuple[list[tuple[str, CodeSite]], list[str]]:
    """The costly calls that give the same result each time (cacheable), and the random ones."""
    fixed = [(c, site) for c, site in code.calls if not RANDOM_CALL.search(c)]
    return fixed, [c for c, _ in code.calls if RANDOM_CALL.search(c)]


def per_item_item(f: Facts, source: Feeder) -> Item:
    """Per-item work of a source that is no DataLoader, read from its code when found."""
    code = f.feeder_code
    name = code.dataset if code is not None else source.label
    title = f"Per-item work in {name}"
    bears = f.verdict in INPUT_VERDICTS
    if source.built:
        return Item(
            "per_sample_cost", title, OK, "items built before the loop", None, f.feeder_site,
            "Not applicable: the items exist before the loop starts.", False,
        )
    if code is None or not code.calls:
        seen = "source not available" if code is None else "no decode, I/O or tokenizer call recognised"
        return Item(
            "per_sample_cost", title, CHECK if bears else OK, seen, None,
            code.site if code is not None else f.feeder_site,
            f"Time one item of {name}: decoding, tokenization or augmentation done for every "
            "item, every pass, can often be done once and cached.",
            bears,
        )
    return _cache_item(
        title, code, name, ("item", "pass"), bears,
        "applies random augmentations, new every pass and not cacheable: make them in a "
        "background thread or DataLoader workers, or on the whole batch on the GPU.",
        "run it in a thread or workers",
    )


def _cache_item(
    title: str,
    code: SampleCode,
    what: str,
    every: tuple[str, str],
    bears: bool,
    random_reason: str,
    random_try: str,
) -> Item:
    """The per-sample (per-item) item once costly calls were read in `what`: the ones that give
    the same result each time can be cached; random augmentations cannot."""
    names = ", ".join(c for c, _ in code.calls[:4]) + (" ..." if len(code.calls) > 4 else "")
    fixed, random_names = _cacheable(code)
    if not fixed:  # random augmentations differ every epoch: nothing to cache
        return Item(
            "per_sample_cost", title, CHECK, names, random_try, code.calls[0][1],
            f"{what} {random_reason}", bears,
        )
    unit, period = every
    keep = f"; the random ones ({', '.join(random_names[:3])}) must stay per {period}" if random_names else ""
    return Item(
        "per_sample_cost", title, CHECK, names, "cache or precompute", fixed[0][1],
        f"{what} repeats this for every {unit} and every {period}; work that gives the same "
        f"result each time ({', '.join(c for c, _ in fixed[:3])}) can be done once and "
        f"cached{keep}.",
        bears,
    )


TUNE_HINT = " Measure it: `%traceml tune` (about 30 s)."


def tuned_workers_item(f: Facts, title: str, bears: bool) -> Item | None:
    """The num_workers item from what `%traceml tune` measured on this loader: the rates by
    worker count against the model's, instead of a rule of thumb. None without measured rates."""
    tuned = f.tuned or {}
    rows = [
        r
        for r in tuned.get("rows") or []
        if r.get("batches_per_s") is not None
        and (r.get("settings") or {}).get("prefetch_factor") in (None, DEFAULT_PREFETCH)
    ]
    best = tuned.get("best_settings") or {}
    if not rows or "num_workers" not in best:
        return None
    n, want = workers_now(f), int(best["num_workers"])
    model = tuned.get("model_batches_per_s")
    rates = ", ".join(
        f"{r['settings']['num_workers']} → {rate_text(r['batches_per_s'])}" for r in rows
    )
    reason = f"Measured by `%traceml tune`, batches/s by num_workers: {rates}"
    reason += f"; the model takes {rate_text(model)} a second. " if model else ". "
    to_try: str | None = str(want) if want != n else None
    if tuned.get("keeps_up"):
        status = OK if want == n else needs_change(bears)
        reason += f"{want} worker(s) keep the model fed"
        step, speedup = tuned.get("predicted_step_ms"), tuned.get("predicted_speedup")
        if want != n and step is not None:
            reason += f": predicted step {_ms(step)}"
            if speedup is not None:
                reason += f", {speedup:.1f}x faster"
        reason += "."
    elif model:
        status = CHECK if bears else OK
        reason += (
            f"No worker count keeps up (the fastest: {want}): make each sample cheaper "
            "(see the per-sample item)."
        )
    else:
        status = CHECK if want != n else OK
        reason += f"The fastest is {want} worker(s)."
    return Item("num_workers", title, status, str(n), to_try, f.loader_site, reason, bears)


IDLE_WORKER_CORES = 0.5  # a worker busy less than half a core waits (I/O, sleep, a lock)


def saturated_workers_item(f: Facts, title: str, bears: bool) -> Item:
    """CPU SATURATED: no more workers, whatever the rule of thumb or tune say."""
    n = workers_now(f)
    return Item(
        "num_workers", title, CHECK if bears else OK, str(n), None, f.loader_site,
        f"The CPU is saturated: {f.cpu_sentence or 'every usable core is busy.'} More workers "
        "won't help: they would share "
        "the same cores. Make per-sample work cheaper, cache decoded samples, or move the work to "
        "the GPU.",
        bears,
    )


def num_workers_item(f: Facts) -> Item:
    """num_workers: enough worker processes for the CPUs (the tune's rates, when measured)."""
    n, cpus = workers_now(f), f.cpu_count
    want = suggested_workers(cpus)
    bears = f.verdict in WORKER_VERDICTS
    of_cpus = f"about half of {cpus} CPUs" if cpus else "at least 2"
    title = "Worker processes (num_workers)"
    if f.cpu_saturated:
        return saturated_workers_item(f, title, bears)
    idle = f.workers_cores is not None and n > 0 and f.workers_cores / n < IDLE_WORKER_CORES
    if idle and f.verdict in INPUT_VERDICTS and f.tuned is None:
        busy = f.workers_cores or 0.0
        return Item(
            "num_workers", title, FIX, str(n), str(max(2 * n, want)), f.loader_site,
            f"The {n} worker(s) kept {busy:.1f} core(s) busy while the loop waited for data: they "
            "wait (disk, network, sleep) more than they compute, so more workers overlap more of "
            "the waiting, beyond the number of cores." + TUNE_HINT,
            bears,
        )
    if f.tuned is not None:
        tuned = tuned_workers_item(f, title, bears)
        if tuned is not None:
            return tuned
    if n == 0:
        return Item(
            "num_workers", title, needs_change(bears), "0", str(want), f.loader_site,
            "With num_workers=0 every batch is loaded in the training process between steps, "
            f"so the loop waits for all of it; {want} workers ({of_cpus}) load the next "
            "batches while this one trains." + TUNE_HINT,
            bears,
        )
    if cpus and n > cpus:
        return Item(
            "num_workers", title, CHECK, str(n), str(want), f.loader_site,
            f"{n} workers on {cpus} CPUs compete with each other and with the training process."
            + TUNE_HINT,
            bears,
        )
    if n < want and f.verdict == VerdictLabel.INPUT_BOUND:
        return Item(
            "num_workers", title, FIX, str(n), str(want), f.loader_site,
            f"{n} worker(s) do not keep up with the loop; try {want} ({of_cpus})." + TUNE_HINT,
            bears,
        )
    if f.verdict == VerdictLabel.INPUT_BOUND:
        return Item(
            "num_workers", title, CHECK, str(n), None, f.loader_site,
            f"{n} workers already use {of_cpus}: make each sample cheaper rather than adding "
            "workers." + TUNE_HINT,
            bears,
        )
    return Item(
        "num_workers", title, OK, str(n), None, f.loader_site,
        f"{n} worker process(es) load batches in the background.",
        bears,
    )


def persistent_workers_item(f: Facts) -> Item:
    """persistent_workers: workers kept between epochs (each epoch's start-up wait)."""
    n, persistent = workers_now(f), bool(f.loader and f.loader.get("persistent_workers"))
    bears = f.verdict in INPUT_VERDICTS
    title = "Keep workers between epochs (persistent_workers)"
    seen = str(persistent)
    if n == 0:
        reason = "Not applicable without workers"
        reason += (
            "; with num_workers > 0 and several epochs, set persistent_workers=True too."
            if f.several_passes
            else "."
        )
        return Item("persistent_workers", title, OK, seen, None, f.loader_site, reason, False)
    if persistent:
        return Item(
            "persistent_workers", title, OK, seen, None, f.loader_site,
            "Workers stay alive between epochs.", bears,
        )
    if not f.several_passes:
        return Item(
            "persistent_workers", title, OK, seen, "True (if you run several epochs)",
            f.loader_site,
            "The loader was iterated once, so its workers started once.",
            False,
        )
    startup = f.epoch_startup or {}
    if startup.get("reported") and startup.get("cause") == "workers restart":
        return Item(
            "persistent_workers", title, FIX, seen, "True", f.loader_site,
            f"Each epoch starts with a {wait_words(startup['wait_ms'])} wait ({_pct(startup.get('share'))} of the run, "
            f"{startup.get('restarts')} restarts, measured): the loop waits for {n} new "
            "worker(s) and their first batches; persistent workers stay alive between epochs.",
            True,
        )
    return Item(
        "persistent_workers", title, needs_change(bears), seen, "True", f.loader_site,
        f"Each epoch starts {n} new worker(s) and the loop waits for their first batches; "
        "persistent workers stay alive between epochs.",
        bears,
    )


def prefetch_factor_item(f: Facts) -> Item:
    """prefetch_factor: batches queued per worker (deeper for stalls)."""
    n = workers_now(f)
    raw = f.loader.get("prefetch_factor") if f.loader else None
    title = "Batches prefetched per worker (prefetch_factor)"
    if n == 0:
        return Item(
            "prefetch_factor", title, OK, "n/a (no workers)", None, f.loader_site,
            "Not applicable without workers: prefetching happens in worker processes.", False,
        )
    pf = int(raw) if raw is not None else DEFAULT_PREFETCH
    seen = str(pf) if raw is not None else f"{DEFAULT_PREFETCH} (default)"
    if pf < PREFETCH_TO_TRY and f.verdict == VerdictLabel.INPUT_STRAGGLER:
        return Item(
            "prefetch_factor", title, FIX, seen, str(PREFETCH_TO_TRY), f.loader_site,
            f"With {pf} batch(es) queued per worker, one slow batch stalls the loop; a deeper "
            "queue hides uneven sample times.",
            True,
        )
    if pf < PREFETCH_TO_TRY and f.verdict == VerdictLabel.INPUT_BOUND:
        return Item(
            "prefetch_factor", title, CHECK, seen, str(PREFETCH_TO_TRY), f.loader_site,
            "A deeper queue hides uneven sample times, but not workers that are too slow on "
            "average: add workers first.",
            True,
        )
    return Item(
        "prefetch_factor", title, OK, seen, None, f.loader_site,
        f"Each worker keeps {pf} batch(es) ready.", f.verdict in INPUT_VERDICTS,
    )


def collate_item(f: Facts) -> Item:
    """collate_fn: a custom one to time, the default one fine."""
    assert f.loader is not None
    name = str(f.loader.get("collate_fn") or "default_collate")
    bears = f.verdict in INPUT_VERDICTS
    title = "Batch assembly (collate_fn)"
    measured = f.inside.get("collate_ms") if f.inside else None
    if f.inside and measured is not None:  # timed in the workers
        stage = dominant_stage(f.inside)
        dominates = stage is not None and stage["label"] == "COLLATE"  # (else OK: it is measured)
        return Item(
            "collate_fn", title, needs_change(bears) if dominates else OK, f"{name}: {measured:.1f} ms a batch",
            "vectorise it (stack, pad once)" if dominates else None, f.loader_site,
            f"Measured in the workers: {measured:.1f} ms a batch, "
            + ("the largest part of a batch's making: vectorise it, or do the per-sample work in __getitem__."
               if dominates else "not the largest part of a batch's making."),
            bears,
        )
    if f.loader.get("custom_collate"):
        return Item(
            "collate_fn", title, CHECK, name, "time it on one batch", f.loader_site,
            "A custom collate_fn runs once per batch, in the training process when "
            "num_workers=0; padding or stacking Python lists there can cost as much as the step.",
            bears,
        )
    return Item(
        "collate_fn", title, OK, name, None, f.loader_site,
        "torch's default collate stacks tensors.", bears,
    )


def per_sample_item(f: Facts) -> Item:
    """__getitem__'s costly calls per sample, read from its source; the time a sample measured
    in the workers, when it was."""
    item = _per_sample_item(f)
    typical = f.inside.get("item_ms") if f.inside else None
    if typical is None:
        return item
    return replace(item, reason=f"{item.reason} Measured in the workers: {typical:.2f} ms a sample (median).")


def _per_sample_item(f: Facts) -> Item:
    title = "Per-sample work in __getitem__"
    bears = f.verdict in INPUT_VERDICTS
    code = f.sample_code
    if code is None or code.site is None:
        what = f"{code.dataset}.__getitem__" if code else "the dataset's __getitem__"
        return Item(
            "per_sample_cost", title, CHECK, "source not available", None, None,
            f"Time {what} on one sample: decoding, tokenization or augmentation done for every "
            "sample, every epoch, can often be done once and cached.",
            bears,
        )
    if not code.calls:
        # Names cannot show every cost: on an input-bound run the sample still needs timing.
        return Item(
            "per_sample_cost", title, CHECK if bears else OK,
            "no decode, I/O or tokenizer call recognised", None, code.site,
            f"{code.dataset}.__getitem__ calls nothing that is known to cost per sample"
            + ("; time it on one sample (%timeit dataset[0]) to be sure." if bears else "."),
            bears,
        )
    return _cache_item(
        title, code, f"{code.dataset}.__getitem__", ("sample", "epoch"), bears,
        "applies random augmentations, which give a new result every epoch and cannot be "
        "cached: spread them over DataLoader workers, or apply them to the whole batch on the GPU.",
        "run it in workers, or on the GPU",
    )


def storage_item(f: Facts) -> Item:
    """Storage and shard balance: a few slow fetches (INPUT STRAGGLER)."""
    bears = f.verdict == VerdictLabel.INPUT_STRAGGLER

    seen = (
        f"{f.straggler_steps} slow fetch(es); p99 wait {_ms(f.wait_p99_ms)} vs median "
        f"{_ms(f.wait_median_ms)}"
    )
    return Item(
        "storage",
        "Storage and shard balance",
        CHECK,
        seen,
        "look at what the slow steps read",
        None,
        "Rare slow fetches often come from a few large or remote files, a cold cache, or "
        "shards of uneven size that leave one worker behind.",
        bears,
    )


def start_method_item(f: Facts, workers_advised: bool) -> Item:
    """Workers can import the Dataset under the start method (spawn and a notebook class)."""
    assert f.loader is not None
    n = workers_now(f)
    module = str(f.loader.get("dataset_module") or "")
    dataset = str(f.loader.get("dataset_type") or "the Dataset")
    method = f.start_method or "fork"
    title = "Workers can import the Dataset (start method)"
    site = f.sample_code.class_site if f.sample_code else None
    in_notebook = module == "__main__"
    if not in_notebook or method not in UNSAFE_START_METHODS:
        where = "a notebook cell" if in_notebook else f"module {module}"
        reason = f"Workers started with {method} can use a Dataset defined in {where}."
        if in_notebook:
            reason += (
                " From Python 3.14, Linux starts workers with forkserver, which cannot: "
                "keep Datasets in a .py module to be ready."
            )
        return Item(
            "start_method", title, OK, f"{method}; {dataset} from {where}", None, site,
            reason, False,
        )
    status = FIX if n > 0 or workers_advised else CHECK
    return Item(
        "start_method", title, status, f"{method}; {dataset} defined in a notebook cell",
        f"move {dataset} into a .py module and import it", site,
        f"Workers started with {method} import the Dataset class by name, and a class defined "
        "in a notebook cell lives in __main__, which they cannot import: loading fails with "
        "\"Can't get attribute\" or \"Can't pickle\" (the same holds for a collate_fn "
        "defined in a cell).",
        status == FIX,
    )
