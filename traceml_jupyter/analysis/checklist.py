"""The checklist: pure rules that read the real DataLoader settings, the cell's code and what the
run measured (copies to the GPU, syncs, host time per line), and say item by item what is ok,
what to fix and what to check, with the value to try and the line."""

from __future__ import annotations

import ast
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .data_sources import Feeder
from .figures import ms as _ms
from .figures import pct as _pct
from .step_parts import wait_words
from .tune_plan import rate_text
from .verdict import sync_sentence

OK, FIX, CHECK = "ok", "fix", "check"

INPUT_VERDICTS = frozenset({"INPUT-BOUND", "INPUT STRAGGLER"})
WORKER_VERDICTS = INPUT_VERDICTS | {"MIXED"}
TRANSFER_VERDICTS = frozenset({"INPUT-BOUND", "H2D-BOUND", "MIXED"})
DEFAULT_PREFETCH = 2
PREFETCH_TO_TRY = 4

# Calls in __getitem__ that usually cost per sample and could be done once and cached.
COSTLY_CALL = re.compile(
    r"decode|open|read|load|imread|tokeni[sz]|encode|augment|transform|sleep|resize|crop|"
    r"flip|rotate|jitter|normal",
    re.IGNORECASE,
)
# Augmentations that differ each time they run: caching them would change the training.
RANDOM_CALL = re.compile(r"random|rand_|jitter|autoaugment|randaugment|trivialaugment|mixup|cutmix|erasing", re.IGNORECASE)
DTYPES = re.compile(r"^(torch\.)?(u?int\d*|float\d*|bfloat16|half|double|long|bool|complex\d*)$")
UNSAFE_START_METHODS = frozenset({"spawn", "forkserver"})


@dataclass(frozen=True)
class CodeSite:
    """A line as the user sees it: in the traced cell (`cell` None), another cell ("In [3]"),
    or a file ("mydata.py")."""

    line: int
    cell: str | None = None

    def label(self) -> str:
        return f"line {self.line}" if self.cell is None else f"{self.cell}, line {self.line}"


@dataclass(frozen=True)
class Item:
    """One evaluated checklist item."""

    key: str
    title: str
    status: str  # "ok", "fix" or "check"
    seen: str
    to_try: str | None
    site: CodeSite | None
    reason: str
    bears_on_verdict: bool

    @property
    def line(self) -> int | None:
        return self.site.line if self.site is not None else None

    @classmethod
    def from_dict(cls, saved: Mapping[str, Any]) -> Item:
        """The item `to_dict` wrote (a saved run's checklist, as it was evaluated)."""
        line = saved.get("line")
        site = CodeSite(int(line), saved.get("cell")) if isinstance(line, int) else None
        return cls(
            str(saved.get("key") or ""),
            str(saved.get("title") or ""),
            str(saved.get("status") or CHECK),
            str(saved.get("seen") or ""),
            saved.get("to_try"),
            site,
            str(saved.get("reason") or ""),
            bool(saved.get("bears_on_verdict")),
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "title": self.title,
            "status": self.status,
            "seen": self.seen,
            "to_try": self.to_try,
            "line": self.line,
            "cell": self.site.cell if self.site is not None else None,
            "where": self.site.label() if self.site is not None else None,
            "reason": self.reason,
            "bears_on_verdict": self.bears_on_verdict,
        }


@dataclass(frozen=True)
class Transfer:
    """A `.to(...)` or `.cuda(...)` call in the loop body."""

    site: CodeSite
    text: str
    non_blocking: bool


@dataclass(frozen=True)
class CopySeen:
    """What one line copied to the GPU, as measured (h2d.py), per step of the run."""

    site: CodeSite | None  # None: no notebook line could be named
    text: str  # the call as written (`x.to("cuda")`), else the line's text
    bytes_per_step: float
    ms_per_step: float | None  # GPU time of the copies
    gb_per_s: float | None
    pinned_share: float  # share of the line's copies made from pinned memory
    non_blocking_share: float  # share made with non_blocking=True


@dataclass(frozen=True)
class LineSeen:
    """A statement of the loop body and its measured host time per step (line_costs.py)."""

    site: CodeSite
    text: str
    ms_per_step: float


@dataclass(frozen=True)
class SampleCode:
    """What the dataset's `__getitem__` does per sample, read from its source."""

    dataset: str
    calls: tuple[tuple[str, CodeSite], ...]  # costly calls seen, with their lines
    site: CodeSite | None  # the `def __getitem__` line
    class_site: CodeSite | None  # the `class ...` line


@dataclass(frozen=True)
class Facts:
    """Everything the rules read: the loader's settings, the code around the loop, the run."""

    verdict: str
    loader: Mapping[str, Any] | None
    cpu_count: int | None
    on_gpu: bool = False
    several_passes: bool = False
    loader_site: CodeSite | None = None
    transfers: tuple[Transfer, ...] | None = None  # None: the loop body could not be read
    sample_code: SampleCode | None = None
    start_method: str | None = None
    straggler_steps: int = 0
    wait_median_ms: float | None = None
    wait_p99_ms: float | None = None
    pinned_share: float | None = None  # measured share of copied bytes from pinned memory
    non_blocking_share: float | None = None  # measured share of bytes copied non_blocking
    copies: tuple[CopySeen, ...] | None = None  # measured copies to the GPU, costliest first
    sync_top: Mapping[str, Any] | None = None  # the line whose syncs cost most (summary key)
    batch_size: int | None = None
    step_ms: float | None = None  # median step on the run's clock
    host_issue_ms: float | None = None  # median host time issuing a step (GPU clock)
    gpu_idle_share: float | None = None  # GPU idle inside steps (NVML), else None
    busiest_line: LineSeen | None = None  # the body statement with the most host time
    tuned: Mapping[str, Any] | None = None  # the last `%traceml tune` of this loader (to_dict())
    epoch_startup: Mapping[str, Any] | None = None  # each pass's start-up wait (summary key)
    cpu_saturated: bool | None = None  # CPU SATURATED (analysis/resources.py); None: not measured
    cpu_sentence: str | None = None  # the cores busy, in words ("the training process and ...")
    workers_cores: float | None = None  # median cores the DataLoader workers kept busy
    # What fed the steps when it is no DataLoader (a generator, a list, an iterator, get_batch()),
    # where it is, and the code behind it (its costly calls), when found.
    feeder: Feeder | None = None
    feeder_site: CodeSite | None = None
    feeder_code: SampleCode | None = None


# -- reading code (pure AST) -----------------------------------------------------------------


def parse_cell(source: str, transform: Callable[[str], str] | None = None) -> ast.Module | None:
    """A cell's tree with lines numbered as the user sees them: a first `%%traceml` line is
    line 1 and the code starts on line 2. Other cell magics are not Python: None."""
    offset = 0
    if source.startswith("%%"):
        first, _, source = source.partition("\n")
        if not re.match(r"%%traceml\b", first):
            return None
        offset = 1
    try:
        code = transform(source) if transform is not None else source
        tree = ast.parse(code)
    except (SyntaxError, ValueError):
        return None
    except Exception:  # a transformer that fails on odd input
        return None
    if offset:
        ast.increment_lineno(tree, offset)
    return tree


def _call_name(call: ast.Call) -> str | None:
    func = call.func
    if isinstance(func, ast.Attribute):
        return func.attr
    if isinstance(func, ast.Name):
        return func.id
    return None


def _short(node: ast.AST, width: int = 48) -> str:
    text = ast.unparse(node)
    return text if len(text) <= width else text[: width - 3] + "..."


def loop_at(tree: ast.AST, line: int) -> ast.For | ast.AsyncFor | None:
    """The `for` statement that starts on `line`."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.For, ast.AsyncFor)) and node.lineno == line:
            return node
    return None


def nested_in_loop(tree: ast.AST, line: int) -> bool:
    """True when the `for` on `line` runs inside another loop (an epoch loop, usually)."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.For, ast.AsyncFor, ast.While)) and node.lineno != line:
            for inner in ast.walk(node):
                if inner is not node and isinstance(inner, (ast.For, ast.AsyncFor)):
                    if inner.lineno == line:
                        return True
    return False


def iter_names(loop: ast.For | ast.AsyncFor) -> set[str]:
    """Names in the loop's iterable: `enumerate(train_loader)` -> {"enumerate", "train_loader"}."""
    return {n.id for n in ast.walk(loop.iter) if isinstance(n, ast.Name)}


def dataloader_sites(tree: ast.AST) -> list[tuple[int, frozenset[str]]]:
    """Lines that construct a DataLoader, each with the names its statement assigns."""
    sites: dict[int, set[str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and _call_name(node) == "DataLoader":
            sites.setdefault(node.lineno, set())
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign, ast.NamedExpr)):
            targets = [node.target]
        else:
            continue
        names = {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        for inner in ast.walk(node):
            if isinstance(inner, ast.Call) and _call_name(inner) == "DataLoader":
                sites[inner.lineno] |= names
    return [(line, frozenset(names)) for line, names in sorted(sites.items())]


def pick_loader_line(sites: Sequence[tuple[int, frozenset[str]]], names: set[str]) -> int | None:
    """The construction whose statement assigns one of `names`, if any."""
    for line, assigned in sites:
        if assigned & names:
            return line
    return None


def assigned_line(tree: ast.AST, names: set[str]) -> int | None:
    """The first statement that assigns one of `names` (where a loader built elsewhere, by a
    function or a library, comes into the notebook)."""
    lines = []
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, (ast.AnnAssign, ast.NamedExpr)):
            targets = [node.target]
        if any(isinstance(n, ast.Name) and n.id in names for t in targets for n in ast.walk(t)):
            lines.append(targets[0].lineno)
    return min(lines) if lines else None


def _own_nodes(body: Sequence[ast.stmt]) -> Iterator[ast.AST]:
    """Nodes of a body, not inside a nested function or class definition."""
    stack: list[ast.AST] = list(body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        yield node
        stack.extend(ast.iter_child_nodes(node))


def _is_dtype_only(call: ast.Call) -> bool:
    """`x.to(torch.float16)` or `x.to(dtype=...)` changes the type, not the device."""
    if call.keywords and all(k.arg == "dtype" for k in call.keywords) and not call.args:
        return True
    if len(call.args) == 1 and not call.keywords:
        return bool(DTYPES.match(ast.unparse(call.args[0])))
    return False


def transfers_in(loop: ast.For | ast.AsyncFor, cell: str | None = None) -> list[Transfer]:
    """The loop body's `.to(...)` / `.cuda(...)` calls, with whether they pass non_blocking."""
    found = []
    for node in _own_nodes(loop.body):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        if node.func.attr not in ("to", "cuda") or _is_dtype_only(node):
            continue
        non_blocking = any(
            k.arg == "non_blocking" and not (isinstance(k.value, ast.Constant) and not k.value.value)
            for k in node.keywords
        )
        found.append(Transfer(CodeSite(node.lineno, cell), _short(node), non_blocking))
    return sorted(found, key=lambda t: t.site.line)


def class_def(tree: ast.AST, name: str) -> ast.ClassDef | None:
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    return None


def method_def(tree: ast.AST, line: int) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    """The function defined on `line` (its `def` line or one of its decorators' lines)."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if line == node.lineno or line in [d.lineno for d in node.decorator_list]:
                return node
    return None


def costly_calls(
    func: ast.FunctionDef | ast.AsyncFunctionDef, cell: str | None = None
) -> list[tuple[str, CodeSite]]:
    """Calls in a `__getitem__` that decode, read, tokenize, augment or sleep, in line order."""
    found: dict[str, CodeSite] = {}
    for node in _own_nodes(func.body):
        if isinstance(node, ast.Call):
            name = _call_name(node)
            if name and COSTLY_CALL.search(name):
                text = _short(node.func, 32) + "()"
                if text not in found or node.lineno < found[text].line:
                    found[text] = CodeSite(node.lineno, cell)
    return sorted(found.items(), key=lambda kv: kv[1].line)


def sample_code_in(tree: ast.AST, class_name: str, cell: str | None = None) -> SampleCode | None:
    """Read `class_name.__getitem__` in a cell's tree (when the class is defined there)."""
    cls = class_def(tree, class_name)
    if cls is None:
        return None
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in (
            "__getitem__",
            "__getitems__",
        ):
            return SampleCode(
                class_name,
                tuple(costly_calls(node, cell)),
                CodeSite(node.lineno, cell),
                CodeSite(cls.lineno, cell),
            )
    return SampleCode(class_name, (), None, CodeSite(cls.lineno, cell))


def default_start_method(version: tuple[int, int], platform: str) -> str:
    """How multiprocessing starts workers when nothing chose it: spawn on macOS and Windows,
    fork on Linux up to Python 3.13, forkserver from 3.14."""
    if platform.startswith(("win", "darwin")):
        return "spawn"
    return "forkserver" if version >= (3, 14) else "fork"


def suggested_workers(cpu_count: int | None) -> int:
    """About half the CPUs, at least 2."""
    return max(2, (cpu_count or 0) // 2)


# -- rules -----------------------------------------------------------------------------------


def _needs_change(bears: bool) -> str:
    """A setting worth changing is a fix when it bears on the verdict, else worth a check."""
    return FIX if bears else CHECK


def _workers(f: Facts) -> int:
    assert f.loader is not None
    return int(f.loader.get("num_workers") or 0)


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
    n, want = _workers(f), int(best["num_workers"])
    model = tuned.get("model_batches_per_s")
    rates = ", ".join(
        f"{r['settings']['num_workers']} → {rate_text(r['batches_per_s'])}" for r in rows
    )
    reason = f"Measured by `%traceml tune`, batches/s by num_workers: {rates}"
    reason += f"; the model takes {rate_text(model)} a second. " if model else ". "
    to_try: str | None = str(want) if want != n else None
    if tuned.get("keeps_up"):
        status = OK if want == n else _needs_change(bears)
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
    n = _workers(f)
    return Item(
        "num_workers", title, CHECK if bears else OK, str(n), None, f.loader_site,
        f"The CPU is saturated: {f.cpu_sentence or 'every usable core is busy.'} More workers "
        "won't help: they would share "
        "the same cores. Make per-sample work cheaper, cache decoded samples, or move the work to "
        "the GPU.",
        bears,
    )


def num_workers_item(f: Facts) -> Item:
    n, cpus = _workers(f), f.cpu_count
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
            "num_workers", title, _needs_change(bears), "0", str(want), f.loader_site,
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
    if n < want and f.verdict == "INPUT-BOUND":
        return Item(
            "num_workers", title, FIX, str(n), str(want), f.loader_site,
            f"{n} worker(s) do not keep up with the loop; try {want} ({of_cpus})." + TUNE_HINT,
            bears,
        )
    if f.verdict == "INPUT-BOUND":
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
    n, persistent = _workers(f), bool(f.loader and f.loader.get("persistent_workers"))
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
        "persistent_workers", title, _needs_change(bears), seen, "True", f.loader_site,
        f"Each epoch starts {n} new worker(s) and the loop waits for their first batches; "
        "persistent workers stay alive between epochs.",
        bears,
    )


def prefetch_factor_item(f: Facts) -> Item:
    n = _workers(f)
    raw = f.loader.get("prefetch_factor") if f.loader else None
    title = "Batches prefetched per worker (prefetch_factor)"
    if n == 0:
        return Item(
            "prefetch_factor", title, OK, "n/a (no workers)", None, f.loader_site,
            "Not applicable without workers: prefetching happens in worker processes.", False,
        )
    pf = int(raw) if raw is not None else DEFAULT_PREFETCH
    seen = str(pf) if raw is not None else f"{DEFAULT_PREFETCH} (default)"
    if pf < PREFETCH_TO_TRY and f.verdict == "INPUT STRAGGLER":
        return Item(
            "prefetch_factor", title, FIX, seen, str(PREFETCH_TO_TRY), f.loader_site,
            f"With {pf} batch(es) queued per worker, one slow batch stalls the loop; a deeper "
            "queue hides uneven sample times.",
            True,
        )
    if pf < PREFETCH_TO_TRY and f.verdict == "INPUT-BOUND":
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


def _measured(share: float | None, what: str) -> str:
    return "" if share is None else f" ({100 * share:.0f} % of copied bytes {what})"


def pin_memory_item(f: Facts) -> Item:
    pinned = bool(f.loader and f.loader.get("pin_memory"))
    title = "Page-locked batches (pin_memory)"
    measured = _measured(f.pinned_share, "pinned")
    if not f.on_gpu:
        return Item(
            "pin_memory", title, OK, str(pinned), None, f.loader_site,
            "Not applicable: this run used the CPU only, and pinned memory speeds up copies "
            "to a GPU.",
            False,
        )
    bears = f.verdict in TRANSFER_VERDICTS
    if pinned:
        return Item(
            "pin_memory", title, OK, "True" + measured, None, f.loader_site,
            "Batches arrive in page-locked memory, ready for asynchronous copies.", bears,
        )
    return Item(
        "pin_memory", title, _needs_change(bears), "False" + measured, "True", f.loader_site,
        "Copies from pageable memory go through a staging buffer and cannot overlap compute; "
        "pinned batches can (with .to(device, non_blocking=True)).",
        bears,
    )


def non_blocking_item(f: Facts) -> Item:
    title = "Asynchronous copies (.to(device, non_blocking=True))"
    if not f.on_gpu:
        return Item(
            "non_blocking", title, OK, "n/a (CPU run)", None, None,
            "Not applicable: no copies to a GPU in a CPU-only run.", False,
        )
    bears = f.verdict in TRANSFER_VERDICTS
    if f.transfers is None:
        return Item(
            "non_blocking", title, CHECK, "loop body not readable", None, None,
            "Pass non_blocking=True where batches are moved to the GPU.", bears,
        )
    if not f.transfers:
        return Item(
            "non_blocking", title, CHECK, "no .to() or .cuda() in the loop body", None, None,
            "Batches are moved elsewhere (a function, the model): pass non_blocking=True there.",
            bears,
        )
    blocking = [t for t in f.transfers if not t.non_blocking]
    pageable = [c for c in f.copies or () if c.non_blocking_share > 0 and c.pinned_share < 0.999]
    if not blocking and pageable:  # CUDA makes the host wait for a copy from pageable memory
        top = pageable[0]
        return Item(
            "non_blocking", title, _needs_change(bears),
            f"non_blocking=True from pageable memory ({100 * top.pinned_share:.0f} % pinned)",
            "pin_memory=True", top.site or f.loader_site,
            "non_blocking=True without pinned memory is synchronous: CUDA waits for the GPU "
            "before it copies from pageable memory, so the host still waits every step. Pin "
            "the batches (DataLoader(pin_memory=True)) to make the copy asynchronous.",
            bears,
        )
    if not blocking:
        return Item(
            "non_blocking", title, OK, "non_blocking=True", None, f.transfers[0].site,
            "Copies are asynchronous.", bears,
        )
    first = blocking[0]
    more = f" (+{len(blocking) - 1} more)" if len(blocking) > 1 else ""
    measured = _measured(f.non_blocking_share, "non_blocking")
    return Item(
        "non_blocking", title, _needs_change(bears), first.text + more + measured,
        "non_blocking=True", first.site,
        "A blocking copy makes the host wait for the transfer before it can queue the next "
        "kernels; from pinned memory a non-blocking copy frees the host (on the loop's stream "
        "it still runs between kernels; a side-stream prefetch overlaps it with compute).",
        bears,
    )


def per_step_bytes(value: float) -> str:
    """Bytes in the units a reader compares: "20.0 MB", "512 B"."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if value >= size:
            return f"{value / size:.1f} {unit}"
    return f"{value:.0f} B"


def _how_much(share: float, yes: str, no: str) -> str:
    """"pinned", "pageable" or "60 % pinned" for a share of copies."""
    if share >= 0.999:
        return yes
    if share <= 0.001:
        return no
    return f"{100 * share:.0f} % {yes}"


def _capital(text: str) -> str:
    return text[:1].upper() + text[1:]


def h2d_copies_item(f: Facts) -> Item | None:
    """The costliest measured copy to the GPU: bytes, bandwidth, pinned or not, blocking or not,
    on its line. None when no copy was measured (a CPU run, or no copy in the steps)."""
    if not f.copies:
        return None
    top = f.copies[0]
    bears = f.verdict == "H2D-BOUND"
    pinned = _how_much(top.pinned_share, "pinned", "pageable")
    nb = _how_much(top.non_blocking_share, "non_blocking", "blocking")
    rate = f" at {top.gb_per_s:.1f} GB/s" if top.gb_per_s else ""
    seen = f"{per_step_bytes(top.bytes_per_step)}/step{rate}, {pinned}, {nb}"
    where = top.site.label() if top.site is not None else "a line outside the notebook"
    took = f" in {top.ms_per_step:.2f} ms" if top.ms_per_step is not None else ""
    reason = (
        f"{_capital(where)} (`{top.text}`) copies {per_step_bytes(top.bytes_per_step)} per "
        f"step{took}. "
    )
    to_try = []
    if top.pinned_share < 0.999:
        to_try.append("pinned")
        reason += (
            "Pageable memory is copied through a staging buffer: pin the batches "
            "(DataLoader(pin_memory=True), or tensor.pin_memory()). "
        )
    if top.non_blocking_share < 0.999:
        to_try.append("non_blocking=True")
        reason += (
            "A blocking copy holds the host until it is done; from pinned memory, "
            ".to(device, non_blocking=True) frees the host (non_blocking from pageable memory "
            "is still synchronous). "
        )
    if to_try:
        status = _needs_change(bears)
    else:
        status = CHECK if bears else OK
        reason += (
            "Pinned and asynchronous already: on the loop's stream the copy still runs between "
            "the kernels; prefetch the next batch on a side CUDA stream (wait_stream) to overlap "
            "it with compute, copy fewer bytes (uint8 images, converted on the GPU), or keep the "
            "data on the GPU. "
        )
    others = [c.site.label() for c in f.copies[1:4] if c.site is not None]
    if others:
        reason += "Other copies: " + ", ".join(others) + "."
    return Item(
        "h2d_copies",
        "Copies to the GPU (.to / .cuda)",
        status,
        seen,
        " + ".join(to_try) if to_try else "fewer bytes per step",
        top.site,
        reason.strip(),
        bears,
    )


def batch_size_item(f: Facts) -> Item:
    """On a host-bound loop, a larger batch gives each kernel launch more work."""
    title = "Work per launch (batch size)"
    seen = str(f.batch_size) if f.batch_size else "unknown"
    if f.verdict != "HOST-BOUND":
        return Item(
            "batch_size", title, OK, seen, None, f.loader_site,
            f"Bears on a host-bound loop only; this one is {f.verdict}.", False,
        )
    to_try = f"{2 * f.batch_size} (if memory allows)" if f.batch_size else "a larger batch"
    return Item(
        "batch_size", title, FIX, seen, to_try, f.loader_site,
        "Issuing a step's kernels takes the host about as long whatever the batch; a larger "
        "batch gives every launch more work, so the GPU waits less for the host (scale the "
        "learning rate with it).",
        True,
    )


def launch_overhead_item(f: Facts) -> Item:
    """On a host-bound loop: fewer, larger kernels, pointed at the body line with the most host
    time (from the cost per line)."""
    title = "Fewer, larger kernels (torch.compile, CUDA graphs, AMP)"
    bears = f.verdict == "HOST-BOUND"
    busiest = f.busiest_line
    site = busiest.site if busiest is not None else None
    if f.host_issue_ms is not None and f.step_ms:
        seen = f"host issues {_ms(f.host_issue_ms)} of a {_ms(f.step_ms)} step"
    else:
        seen = "host time per step not measured"
    if not bears:
        return Item(
            "launch_overhead", title, OK, seen, None, site,
            f"Bears on a host-bound loop only; this one is {f.verdict}.", False,
        )
    reason = "The GPU waits while Python issues many small ops"
    if f.gpu_idle_share is not None:
        reason += f" (it idles {100 * f.gpu_idle_share:.0f} % of the step)"
    reason += ". "
    if busiest is not None:
        reason += (
            f"{_capital(busiest.site.label())} takes the most host time: "
            f"{busiest.ms_per_step:.2f} ms per step. "
        )
    reason += (
        "torch.compile fuses small ops into fewer kernels; CUDA graphs "
        '(torch.compile(mode="reduce-overhead")) replay a whole step in one launch; mixed '
        "precision (torch.autocast) makes each kernel cheaper; whole-tensor ops instead of Python "
        "loops over elements mean fewer small ops."
    )
    return Item(
        "launch_overhead", title, FIX, seen, "torch.compile(model), CUDA graphs, torch.autocast",
        site, reason, True,
    )


def sync_item(f: Facts) -> Item | None:
    """The cell line whose synchronising calls cost the host most (`loss.item()` every step),
    or None when no sync was seen on a line of the cell."""
    top = f.sync_top
    sentence = sync_sentence(top)
    if top is None or sentence is None:
        return None
    every = bool(top.get("every_step"))
    bears = f.verdict == "HOST-BOUND" and every
    call = str(top.get("call") or "a call")
    share = top.get("share")
    seen = f"{call} every step" if every else f"{call} {top.get('calls_per_step', 0):.2g} per step"
    if share is not None:
        seen += f" ({100 * share:.1f} % of the step)"
    title = "Syncs with the GPU in the step (.item(), .cpu(), printing a tensor)"
    if not every:
        return Item(
            "sync", title, OK, seen, None, CodeSite(int(top["line"])),
            sentence + " Not every step: the GPU keeps a queue of work most of the time.",
            False,
        )
    return Item(
        "sync", title, FIX if bears else CHECK, seen, "every N steps, or out of the step",
        CodeSite(int(top["line"])),
        sentence + " Each sync empties the GPU's queue: the host waits for the GPU, then the "
        "GPU waits while the host issues the next step. Move it out of the step or do it every "
        "N steps (sum the loss on the GPU with loss.detach() and read it once).",
        bears,
    )


def collate_item(f: Facts) -> Item:
    assert f.loader is not None
    name = str(f.loader.get("collate_fn") or "default_collate")
    bears = f.verdict in INPUT_VERDICTS
    title = "Batch assembly (collate_fn)"
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
    bears = f.verdict == "INPUT STRAGGLER"

    def ms(v: float | None) -> str:
        return "n/a" if v is None else f"{v:.1f} ms"

    seen = (
        f"{f.straggler_steps} slow fetch(es); p99 wait {ms(f.wait_p99_ms)} vs median "
        f"{ms(f.wait_median_ms)}"
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
    assert f.loader is not None
    n = _workers(f)
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


def evaluate(f: Facts) -> list[Item]:
    """Every item, those that bear on the verdict first (each group in checklist order)."""
    items: list[Item] = []
    source = f.feeder if f.loader is None else None
    if source is not None:
        items.append(data_source_item(f, source))
    elif f.loader is None:
        items.append(dataloader_item(f))
    else:
        workers = num_workers_item(f)
        items += [
            workers,
            persistent_workers_item(f),
            prefetch_factor_item(f),
            pin_memory_item(f),
        ]
    items.append(non_blocking_item(f))
    copies = h2d_copies_item(f)
    if copies is not None:
        items.append(copies)
    if f.on_gpu:
        items += [batch_size_item(f), launch_overhead_item(f)]
    sync = sync_item(f)
    if sync is not None:
        items.append(sync)
    if f.loader is not None:
        items.append(collate_item(f))
    items.append(per_item_item(f, source) if source is not None else per_sample_item(f))
    items.append(storage_item(f))
    if f.loader is not None:
        items.append(start_method_item(f, workers_advised=workers.status == FIX))
    return sorted(items, key=lambda item: not item.bears_on_verdict)
