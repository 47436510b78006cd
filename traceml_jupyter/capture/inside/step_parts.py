"""Inside the step: forward, backward and optimizer time of sampled steps, on the run's clock.

Steps are sampled as the per-line costs are (line_costs.py): every step of the first
FULL_STEPS, then one in LINE_EVERY on average; one in 64 when the last sampled step took under
a millisecond and one in 256 under 0.1 ms (a sampled step costs the capture about 10 µs: this
keeps it a fraction of a microsecond a step). The gap is drawn at random (uniform, from a generator of our own: the user's random state is
untouched), so that a pattern that repeats every k steps (logging every 10 steps) is neither
always nor never sampled. A sampled step is timed whole; the others cost the step model one
decrement, and `backward()` and the optimizer step hook one flag read each.

While a sampled step runs ("armed"):

- forward: each outermost call of a root module (model_calls.py), timed by its class's
  `__call__` patched for the step; calls made inside a fetch are data wait, not forward;
- backward: each `torch.autograd.backward` (Tensor.backward goes through it);
- optimizer: each optimizer's step, from a pre hook put on that optimizer for the step to the
  capture's global post hook (which stamps it before it may end the step). A closure passed to
  `step()` (Lightning's automatic optimisation runs forward and backward inside it) is timed
  too, and its time is not the optimizer's.

Each stamp is one call's own time: its duration less the time of the stamped calls nested in
it and of the data wait inside it (the step model's running wait total). So the parts add up
without double counting, and the rest of the step is compute - forward - backward - optimizer:
logging, metrics, schedulers, checkpoints, `zero_grad()`, the loss where it is computed
outside the model, a closure's own overhead. Stamps go to flat arrays (part_store.py) and are
summed per step off the per-step path, when columns are read. A part that could not be timed
on a step is NaN there (the forward of a root first seen mid-step; an optimizer first seen
stepping); a run whose forward was never found says so (`forward_state`).

On a GPU the same boundaries get CUDA events on the loop's stream (the stream the step started
on), read once complete, never waited for: the parts on the GPU's timeline.

Edges (a failure of ours stops there, turns the parts off with a note, and the user's call runs
as without us): the step model's callback (`sample_due`) and its merges (`merged`), a timed
part's end (`_timed`: a root's call, `backward()`, a closure), our pre hook on an optimizer and
the global post hook's `optimizer_stepped`; the first look for the model's calls (`_walk`) leaves
a note of its own. Every CUDA call of the GPU parts goes through `_on_gpu`, which turns the GPU
time (only) off. What is read of the user's objects goes through `failures.read_or`.
"""

from __future__ import annotations

import random
import sys
import weakref
from collections.abc import Callable, Mapping
from threading import get_ident
from time import perf_counter_ns
from typing import Any, TypedDict, TypeVar

import numpy as np

from ...failures import failure_text, never_raise, read_or
from ..data.probes import attribute, type_name, user_namespace
from ..instrument.cell_functions import names_in
from ..instrument.dynamo import compile_check
from ..steps.step_model import ITERATION, MERGE_MAX, NEVER, StepModel
from ..steps.step_model import OPTIMIZER as OPTIMIZER_LEVEL
from .cuda_parts import CudaParts
from .line_costs import FULL_STEPS, LINE_EVERY
from .model_calls import (
    FOUND,
    MAX_SCAN,
    NOT_FOUND,
    SEARCHING,
    ModuleCalls,
    describe,
    frame_values,
    instances_in,
    is_instance,
    module_class,
)
from .part_store import (
    BACKWARD,
    CLOSURE,
    FOLD_RECORDS,
    FORWARD,
    FORWARD_OK,
    OPTIMIZER,
    OPTIMIZER_OK,
    PartStore,
)

# Mean gap between sampled steps after the first FULL_STEPS, by the last sampled step's length.
EVERY_BY_STEP_NS = ((1_000_000, LINE_EVERY), (100_000, 64), (0, 256))
MAX_SEARCH = 8  # training steps the roots may take to show before the forward is "not found"
SEED = 0x7ACE

T = TypeVar("T")


class OptimizerFacts(TypedDict, total=False):
    """What the optimizer advice reads of an optimizer that stepped: what could be read of it."""

    name: str  # its class
    foreach: bool | None  # its defaults' foreach / fused (None: torch's default)
    fused: bool | None
    param_groups: int
    tensors: int
    label: str  # "opt (AdamW)": its name in the notebook, if any, and its class


class PartsFacts(TypedDict):
    """What the summary quotes of the parts of the step (`StepParts.facts`)."""

    parts_sampled_steps: int
    forward_state: str | None  # SEARCHING, FOUND, NOT_FOUND (model_calls.py); None: no step sampled
    forward_modules: list[str]
    optimizers: list[OptimizerFacts]
    parts_sampling: str


def _optimizer_facts(optimizer: Any) -> OptimizerFacts:
    """What the optimizer advice reads: its class, foreach/fused, parameter groups, tensors."""
    facts: OptimizerFacts = {"name": type_name(optimizer)}
    read_or(None, _read_optimizer, optimizer, facts)  # the user's optimizer: what could be read is kept
    return facts


def _read_optimizer(optimizer: Any, facts: OptimizerFacts) -> None:
    defaults = dict(getattr(optimizer, "defaults", {}) or {})
    facts["foreach"] = defaults.get("foreach")
    facts["fused"] = defaults.get("fused")
    groups = list(optimizer.param_groups)
    facts["param_groups"] = len(groups)
    facts["tensors"] = sum(len(g.get("params", ())) for g in groups)


class StepParts:
    """Forward, backward and optimizer time of sampled steps (see the module docstring)."""

    def __init__(
        self,
        model: StepModel,
        thread: int,
        cuda_of: Callable[[], Any] = lambda: None,
        code_of: Callable[[], str] = lambda: "",
    ) -> None:
        self.model = model
        self.thread = thread
        self.cuda_of = cuda_of  # the capture's GPU clock (CudaStepClock) or None
        self.code_of = code_of  # the traced code: the namespace's names it uses are looked at first
        self.on = False  # a sampled step runs: what backward() and the optimizer hook read
        self.active = False
        self.calls = ModuleCalls(self.module_call)
        self.store = PartStore()
        self.note: str | None = None
        self.sampled = 0  # sampled steps recorded
        self._rng = random.Random(SEED).random
        self._first = 0  # index of the capture's first step
        self._kind, self._t0, self._own = self.store.kind, self.store.t0, self.store.own
        self._acc: list[int] = []  # per open part: the own-less time of the parts nested in it
        self._opt_open: list[tuple[int, int, int]] = []  # open optimizer steps: (t0, wait0, index)
        self._in_forward = False
        self._seen_call = False  # a root was called in the open sampled step
        self._ever_called: set[int] = set()
        self._flags = 0  # validity of the open sampled step
        # optimizers: id -> (weak ref, its pre hooks dict, our key there, our pre hook, index)
        self._optimizers: dict[int, tuple[Any, Any, int, Any, int]] = {}
        self.optimizer_facts: list[OptimizerFacts] = []
        self._optimizer_refs: list[Any] = []
        self._stepped: set[int] = set()  # indices of the optimizers seen stepping
        self._gpu: CudaParts | None = None
        self._gpu_parts: CudaParts | None = None
        self._gpu_broken = False  # an error in our GPU bookkeeping: no GPU parts for the run
        self._namespace_seen: Mapping[str, Any] | None = None  # what begin() looked at: the walk skips it
        # The cell calls a torch.compile'd function: nothing is patched nor hooked (its model and
        # optimizer run in compiled code, where nothing of ours may be: instrument/dynamo.py)
        self.compiled = False

    # -- the schedule ---------------------------------------------------------------------------
    def begin(self) -> None:
        """The capture starts: the first step is sampled."""
        cls = module_class()
        if cls is None or self.compiled:
            return  # no torch: nothing to time; a compiled training step: nothing of ours in it
        self.active = True
        self._first = self.model.recorder.n_steps
        namespace = user_namespace()
        if namespace:
            named = names_in(self.code_of())
            items = sorted(list(namespace.items()), key=lambda kv: kv[0] not in named)  # the cell's names first
            self._namespace_seen = dict(items[:MAX_SCAN])
            self.calls.add(self._modules_and_optimizers_in([v for _, v in items], cls), from_namespace=True)
        self._arm()
        self.model.sample_in = 1

    def sample_due(self, start: int, end: int) -> None:
        """The step model's callback: a sampled step closed (record it; arm the next or not),
        or the step before a sampled one closed (arm)."""
        if not self.active:
            self.model.sample_in = NEVER
            return
        began = perf_counter_ns()
        self.guarded(self._due, start, end)
        self.model.exclude_time(perf_counter_ns() - began)  # our time is no step's

    def guarded(self, call: Callable[..., T], *args: Any) -> T | None:
        """The edge of the parts: every entry point that the user's loop, torch's hooks or the
        step model calls runs its bookkeeping through here. Any error of ours turns the parts
        off for the run (`failed`) and answers None; it never reaches the user's code."""
        try:
            return call(*args)
        except Exception as exc:
            self.failed(exc)
            return None

    def stand_aside(self, *, forget: bool = False) -> None:
        """The cell calls a torch.compile'd function (found when its loop starts), or Dynamo
        starts compiling (`forget`: what was sampled before is dropped, so the run has no parts
        rather than those of a few eager steps): the parts are off for the run, before Dynamo
        saw any patch or hook of theirs."""
        self.compiled = True
        if self.active:
            self.active = False
            self.model.sample_in = NEVER
            self._disarm()
            self.calls.forget()
        if forget and self.sampled:
            self.sampled = 0
            self.store = PartStore()
            self._kind, self._t0, self._own = self.store.kind, self.store.t0, self.store.own

    def failed(self, exc: BaseException) -> None:
        """Any error in our bookkeeping: the parts are off for the rest of the run, with a note."""
        self.note = f"The parts of the step were turned off: {failure_text(exc)}"
        self.active = False
        self.model.sample_in = NEVER
        self._disarm()

    def _due(self, start: int, end: int) -> None:
        model = self.model
        if not self.on:
            self._arm()
            model.sample_in = 1
            return
        index = model.recorder.n_steps - 1
        self._record(index)
        if index + 1 < self._first + FULL_STEPS:
            gap = 1
        else:
            mean = next(every for longer, every in EVERY_BY_STEP_NS if end - start >= longer)
            gap = 1 + int(self._rng() * (2 * mean - 1))  # 1 .. 2 mean - 1: `mean` on average
        if gap == 1:
            self._open_step()
            model.sample_in = 1
        else:
            self._disarm()
            model.sample_in = gap - 1

    def _arm(self) -> None:
        self.calls.install()
        for ref, pre_hooks, key, pre, _ in self._optimizers.values():
            if ref() is not None:
                pre_hooks[key] = pre
        self.on = True
        self._open_step()

    def _follow_gpu(self) -> None:
        """Events on the capture's GPU clock as it is now (it decides the loop's device during
        the first steps, and turns itself off on an error)."""
        cuda = self.cuda_of()
        if cuda is None:
            self._gpu = None
            return
        if self._gpu_parts is None:
            self._gpu_parts = CudaParts(cuda, self.store.gpu_own)
            self.store.has_gpu = True
        self._gpu_parts.cuda = cuda
        self._gpu = self._gpu_parts

    def _open_step(self) -> None:
        # The forward is whole while the roots are searched too, unless a root shows up only
        # during the step (then its first calls were missed) or the search ends unfound.
        self._flags = OPTIMIZER_OK | FORWARD_OK
        if self._acc:
            self._acc.clear()
        if self._opt_open:
            self._opt_open.clear()
        self._in_forward = self._seen_call = False
        if not self._gpu_broken and (self._gpu_parts is not None or self.cuda_of() is not None):
            self._follow_gpu()
        if self._gpu is not None:
            self._gpu.reset()

    def _disarm(self) -> None:
        self.on = False
        self.calls.remove()
        for _, pre_hooks, key, _, _ in self._optimizers.values():
            pre_hooks.pop(key, None)

    # -- stamps ---------------------------------------------------------------------------------
    def _enter(self) -> tuple[int, int]:
        """A part begins (this cannot fail: a list append and two reads; its GPU event is
        guarded in `_on_gpu`)."""
        self._acc.append(0)
        if self._gpu is not None:
            self._on_gpu(self._gpu.enter)
        return perf_counter_ns(), self.model.wait_total

    def _exit(self, kind: int, t0: int, w0: int) -> None:
        t1 = perf_counter_ns()
        span = t1 - t0 - (self.model.wait_total - w0)  # less the data wait inside it
        acc = self._acc
        nested = acc.pop() if acc else 0
        if acc:
            acc[-1] += span
        self._kind.append(kind)
        self._t0.append(t0)
        self._own.append(span - nested)
        if self._gpu is not None:
            self._on_gpu(self._gpu.exit, self.store.base + len(self._kind) - 1)

    def _on_gpu(self, do: Callable[..., None], *args: Any) -> None:
        """The edge of the GPU parts: a CUDA call of theirs that fails turns their GPU time off
        for the run (a note says so); the CPU parts go on."""
        try:
            do(*args)
        except Exception as exc:
            self._gpu_failed(exc)

    def _gpu_failed(self, exc: BaseException) -> None:
        self.note = f"GPU time of the step's parts turned off: {failure_text(exc)}"
        self._gpu = self._gpu_parts = None
        self._gpu_broken = True
        self.store.has_gpu = False

    def _timed(self, kind: int, call: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        """`call(*args, **kwargs)` stamped as one part; our bookkeeping never raises into it."""
        __tracebackhide__ = True  # noqa: F841
        t0, w0 = self._enter()
        try:
            return call(*args, **kwargs)
        finally:  # in the user's `finally`: our error never replaces theirs
            self.guarded(self._exit, kind, t0, w0)

    def module_call(self, orig: Callable[..., Any], module: Any, args: Any, kwargs: Any) -> Any:
        """A patched `__call__` of a root's class: time the call when it is an outermost call
        of a root on the capture's thread during a sampled step, outside any fetch."""
        __tracebackhide__ = True  # noqa: F841
        if not self.on or self._in_forward or get_ident() != self.thread or self.model._stack:
            return orig(module, *args, **kwargs)
        who = self.calls.root(module)
        if who < 0:
            return orig(module, *args, **kwargs)
        self._in_forward = self._seen_call = True
        if who not in self._ever_called:
            self._ever_called.add(who)
        try:
            return self._timed(FORWARD, orig, (module, *args), kwargs)
        finally:
            self._in_forward = False

    def backward(self, original: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        """`torch.autograd.backward` on a sampled step (the capture's wrapper calls this)."""
        __tracebackhide__ = True  # noqa: F841
        if not self.calls.walked:
            self._walk(sys._getframe(1))
        return self._timed(BACKWARD, original, args, kwargs)

    def _walk(self, frame: Any) -> None:
        """Discovery: the modules and optimizers in the frames of a training event."""
        self.calls.walked = True
        cls = module_class()
        if cls is None or self.calls.state != SEARCHING:
            return
        guard = never_raise()  # once a run
        with guard:
            values = frame_values(frame, cls, self._namespace_seen)
            if self.calls.add(self._modules_and_optimizers_in(values, cls)):
                self._flags &= ~FORWARD_OK  # a root new in this step: its forward was missed
        if guard.error is not None:
            self.note = f"The model's calls could not be looked for: {failure_text(guard.error)}"

    # -- optimizers -----------------------------------------------------------------------------
    def _modules_and_optimizers_in(self, values: list[Any], cls: type) -> list[Any]:
        """Hook the optimizers among `values` (and one level inside their containers); return
        the modules there. One pass over the values for both."""
        torch = sys.modules.get("torch")
        base = getattr(getattr(torch, "optim", None), "Optimizer", None)
        kinds = (cls, base) if isinstance(base, type) else (cls,)
        modules = []
        for v in instances_in(values, kinds):
            if is_instance(v, cls):
                modules.append(v)
            else:
                self._hook_optimizer(v)
        return modules

    def _hook_optimizer(self, optimizer: Any) -> bool:
        """Our pre hook on this optimizer (in its own dict of pre hooks, there while armed).
        False when it cannot be hooked."""
        if id(optimizer) in self._optimizers:
            return True
        pre_hooks = attribute(optimizer, "_optimizer_step_pre_hooks")
        if not isinstance(pre_hooks, dict):
            return False
        try:
            ref = weakref.ref(optimizer)
        except TypeError:
            return False
        who = len(self.optimizer_facts)
        self.optimizer_facts.append(_optimizer_facts(optimizer))
        self._optimizer_refs.append(ref)
        key = -(1 << 40) - who  # never one of torch's own handle ids (they count up from 0)
        parts = self
        compiling = compile_check(sys.modules.get("torch"))

        def pre(opt: Any, args: Any, kwargs: Any) -> Any:
            if compiling() or not parts.on or get_ident() != parts.thread:  # (dynamo.py)
                return None
            return parts.guarded(parts._optimizer_starts, who, args, kwargs)  # never raised into the step

        self._optimizers[id(optimizer)] = (ref, pre_hooks, key, pre, who)
        if self.on:
            pre_hooks[key] = pre
        return True

    def _optimizer_starts(self, who: int, args: Any, kwargs: Any) -> tuple[Any, Any] | None:
        """Our pre hook's work: the optimizer's step starts now (its closure, if any, timed)."""
        t0, w0 = self._enter()
        self._opt_open.append((t0, w0, who))
        return self._timed_closure(args, kwargs)

    def _timed_closure(self, args: Any, kwargs: Any) -> tuple[Any, Any] | None:
        """`optimizer.step(closure)`: the closure timed, so its time is not the optimizer's."""
        closure = kwargs.get("closure") if kwargs else None
        in_args = closure is None and len(args) > 1 and callable(args[1])
        if in_args:
            closure = args[1]
        if closure is None:
            return None
        parts = self
        compiling = compile_check(sys.modules.get("torch"))

        def timed_closure(*a: Any, **k: Any) -> Any:
            __tracebackhide__ = True  # noqa: F841
            if compiling() or not parts.on or get_ident() != parts.thread:  # (dynamo.py)
                return closure(*a, **k)
            return parts._timed(CLOSURE, closure, a, k)

        if in_args:
            return (args[0], timed_closure, *args[2:]), kwargs
        return args, {**kwargs, "closure": timed_closure}

    def optimizer_stepped(self, optimizer: Any) -> None:
        """An optimizer step ended on a sampled step (the capture's global post hook, before
        the step may end): its time is stamped. An optimizer seen for the first time is hooked
        from now on; its start was missed here."""
        self.guarded(self._optimizer_ended, optimizer)

    def _optimizer_ended(self, optimizer: Any) -> None:
        known = self._optimizers.get(id(optimizer))
        if known is None:
            if not self.calls.walked:
                self._walk(sys._getframe(1))
            if self._hook_optimizer(optimizer):
                self._stepped.add(self._optimizers[id(optimizer)][4])
                self._flags &= ~OPTIMIZER_OK
            return
        self._stepped.add(known[4])
        if not self._opt_open or self._opt_open[-1][2] != known[4]:
            self._flags &= ~OPTIMIZER_OK  # armed while it stepped: its start was missed
            return
        t0, w0, _ = self._opt_open.pop()
        self._exit(OPTIMIZER, t0, w0)

    # -- sampled steps --------------------------------------------------------------------------
    def _record(self, index: int) -> None:
        """A sampled step closed: its stamps are those since the last one's."""
        if self.calls.state is SEARCHING:
            self._search(index)
        flags = self._flags
        if self.calls.state is not FOUND:
            flags &= ~FORWARD_OK
        spans = self.model.spans
        self.store.record(index, flags, [(sp.start_ns, sp.end_ns) for sp in spans] if spans else None)
        self.sampled += 1
        if len(self.store.rec_step) > FOLD_RECORDS:
            self._fold()

    def _search(self, index: int) -> None:
        """While the roots are searched: found once one is called in a sampled step; after two
        steps without, the roots' children are tried (once); then not found. A step counts once
        (the micro-steps of the first steps, merged when the step model sees what a step is,
        are one), and only once steps are training steps (not the DataLoader's fetches)."""
        calls = self.calls
        if not calls.walked:
            self._walk(sys._getframe(3))
        if self._seen_call:
            calls.state = FOUND
            calls.keep_called(self._ever_called)
            return
        if index <= calls.last_index or self.model.level < ITERATION:  # no training step yet
            return
        calls.last_index = index
        calls.attempts += 1
        if calls.attempts >= MAX_SEARCH or (calls.attempts >= 2 and (calls.widened or not calls.widen(self._ever_called))):
            calls.state = NOT_FOUND
            calls.forget()
            self.store.no_forward = True

    def merged(self, n: int) -> None:
        """The last n closed steps were merged into the open step (the step model saw what a
        step is): their stamps become the open step's, which is whole only if each was
        sampled; a merged step that is not sampled takes its stamps with it."""
        flags = self.guarded(self.store.merged, self.model.recorder.n_steps, n, self.on)
        if flags is not None:
            self._flags &= flags

    def _merges_possible(self) -> bool:
        model = self.model
        return model.level < OPTIMIZER_LEVEL and model.recorder.n_steps - model.steps_at_start <= MERGE_MAX

    def _fold(self) -> None:
        """Sum the oldest sampled steps into the history (bounded memory), once no merge can
        reach them and their GPU times are read."""
        if self._merges_possible():
            return
        store, gpu = self.store, self._gpu_parts
        n_rec = len(store.rec_step)
        if gpu is not None:
            gpu.poll()
            if gpu.pending:
                oldest = gpu.pending[0][0] - store.base
                n_rec = int(np.searchsorted(np.array(store.rec_end, dtype=np.int64), oldest, side="right"))
        store.fold(n_rec)

    # -- reading --------------------------------------------------------------------------------
    def columns(self, cols: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The parts of the recorder's kept steps (part_store.PartStore.columns)."""
        if self._gpu_parts is not None:
            self._on_gpu(self._gpu_parts.poll)
        return self.store.columns(cols)

    def facts(self) -> PartsFacts:
        """What the summary quotes: the forward's state and modules, the optimizers, sampling."""
        namespace = user_namespace()
        optimizers: list[OptimizerFacts] = []
        for i, (facts, ref) in enumerate(zip(self.optimizer_facts, self._optimizer_refs, strict=True)):
            if i not in self._stepped:
                continue  # in the namespace, but it did not step in this run
            opt = ref()
            optimizers.append({**facts, "label": describe(opt, namespace) if opt is not None else facts.get("name", "")})
        return {
            "parts_sampled_steps": self.sampled,
            "forward_state": self.calls.state if self.sampled else None,
            "forward_modules": self.calls.found_labels(self._ever_called, namespace),
            "optimizers": optimizers,
            "parts_sampling": (
                f"every step for the first {FULL_STEPS}, then one in {LINE_EVERY} on average "
                "(one in 64 for steps under 1 ms, one in 256 under 0.1 ms)"
            ),
        }

    # -- the end --------------------------------------------------------------------------------
    def close(self) -> None:
        """The capture ended: nothing of ours stays on a class or an optimizer; GPU times read."""
        if self.on:
            self._disarm()
        self.active = False
        self.model.sample_in = NEVER
        self._namespace_seen = None
        self.calls.forget()
        for _, pre_hooks, key, _, _ in self._optimizers.values():
            pre_hooks.pop(key, None)
        self._optimizers.clear()
        if self.calls.state is SEARCHING and self.sampled:  # a run of a step or two
            self.calls.state = FOUND if self._ever_called else NOT_FOUND
            self.store.no_forward = not self._ever_called
        if self._gpu_parts is not None:
            self._on_gpu(self._gpu_parts.close)
