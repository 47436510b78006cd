"""Inside the step: forward, backward and optimizer time of sampled steps, on the run's clock.

Steps are sampled as the per-line costs are (line_costs.py): every step of the first
FULL_STEPS, then one in LINE_EVERY on average, the gap drawn at random (1 to 2 x LINE_EVERY - 1,
from a generator of our own: the user's random state is untouched) so that a pattern that
repeats every k steps (logging every 10 steps) is neither always nor never sampled. A sampled
step is timed whole; the others cost the step model one decrement, and `backward()` and the
optimizer step hook one flag read each.

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
outside the model, a closure's own overhead. Per step, stamps go to flat arrays; they are
summed per step off the per-step path (when columns are read, at the views' ticks and at the
end). A part that could not be timed on a step is NaN there (the forward while the roots are
being found; an optimizer first seen stepping mid-step); a run whose forward was never found
says so (`forward_state`).

On a GPU the same boundaries get CUDA events on the loop's stream (the stream the step started
on), read once complete, never waited for: the parts on the GPU's timeline.
"""

from __future__ import annotations

import random
import sys
import weakref
from array import array
from collections import deque
from collections.abc import Callable
from threading import get_ident
from time import perf_counter_ns
from typing import Any

import numpy as np

from .line_costs import FULL_STEPS, LINE_EVERY
from .model_calls import (
    FOUND,
    NOT_FOUND,
    SEARCHING,
    ModuleCalls,
    describe,
    frame_values,
    inner_values,
    module_class,
    modules_in,
)
from .probes import type_name, user_namespace
from .recorder import HISTORY_CAP
from .step_model import ITERATION, MERGE_MAX, NEVER, OPTIMIZER, StepModel
from .step_tally import StepTally

FORWARD, BACKWARD, OPTIMIZER_PART, CLOSURE = 0, 1, 2, 3
PARTS = ("forward", "backward", "optimizer")
PART_COLUMNS = ("forward_ms", "backward_ms", "optimizer_ms", "rest_ms")
GPU_PART_COLUMNS = ("forward_gpu_ms", "backward_gpu_ms", "optimizer_gpu_ms", "rest_gpu_ms")
FORWARD_OK, OPTIMIZER_OK = 1, 2  # validity bits of a sampled step
MAX_SEARCH = 8  # sampled steps the roots may take to show before the forward is "not found"
FOLD_RECORDS = 4096  # raw sampled steps kept before they are summed into per-step tallies
SEED = 0x7ACE
# A rest below zero by more than this share of the step's compute is not clock noise: NaN.
REST_TOLERANCE = 0.02


def _optimizer_facts(optimizer: Any) -> dict[str, Any]:
    """What the optimizer advice reads: its class, foreach/fused, parameter groups, tensors."""
    facts: dict[str, Any] = {"name": type_name(optimizer)}
    try:
        defaults = dict(getattr(optimizer, "defaults", {}) or {})
        facts["foreach"] = defaults.get("foreach")
        facts["fused"] = defaults.get("fused")
        groups = list(optimizer.param_groups)
        facts["param_groups"] = len(groups)
        facts["tensors"] = sum(len(g.get("params", ())) for g in groups)
    except Exception:
        pass
    return facts


class CudaParts:
    """CUDA events at the part boundaries of sampled steps, on the loop's stream; each stamp's
    own GPU time (its span less its nested stamps' spans) once its events have completed."""

    def __init__(self, cuda: Any) -> None:
        self.cuda = cuda
        self._free: list[Any] = []
        self._open: list[tuple[Any, list[int]]] = []  # per open part: its start event, nested stamps
        self.pending: deque[tuple[int, Any, Any, list[int]]] = deque()  # stamp, start, end, nested
        self.spans: dict[int, float] = {}  # stamp -> its GPU span (ms), until its parent is read
        self.own: dict[int, float] = {}  # stamp -> own GPU ms, resolved

    def _event(self) -> Any:
        cuda = self.cuda
        ev = self._free.pop() if self._free else cuda.marks.new_event()
        cuda.marks.record(ev, cuda.step_stream())
        return ev

    def enter(self) -> None:
        self._open.append((self._event(), []))

    def exit(self, stamp: int) -> None:
        start, nested = self._open.pop()
        self.pending.append((stamp, start, self._event(), nested))
        if self._open:
            self._open[-1][1].append(stamp)

    def reset(self) -> None:
        self._open.clear()

    def poll(self) -> None:
        """Read every stamp whose events completed, in order (nested stamps come first)."""
        pending = self.pending
        while pending:
            stamp, start, end, nested = pending[0]
            if not (start.query() and end.query()):
                return
            pending.popleft()
            span = float(start.elapsed_time(end))
            self.spans[stamp] = span
            self.own[stamp] = span - sum(self.spans.pop(n, 0.0) for n in nested)
            self._free += (start, end)

    def close(self) -> None:
        """The last events are done once the step clock's last event is (it waited for it)."""
        if self.pending:
            end = self.pending[-1][2]
            if hasattr(end, "synchronize"):
                end.synchronize()
        self.poll()
        self.pending.clear()
        self._free.clear()


class StepParts:
    """Forward, backward and optimizer time of sampled steps (see the module docstring)."""

    def __init__(self, model: StepModel, thread: int, cuda_of: Callable[[], Any] = lambda: None) -> None:
        self.model = model
        self.thread = thread
        self.cuda_of = cuda_of  # the capture's GPU clock (CudaSteps) or None
        self.on = False  # a sampled step runs: what backward() and the optimizer hook read
        self.active = False
        self.calls = ModuleCalls(self.module_call)
        self.note: str | None = None
        self._rng = random.Random(SEED)
        self._first = 0  # index of the capture's first step
        # stamps: kind, root or optimizer index, start (ns), own time (ns)
        self._kind: array[int] = array("b")
        self._who: array[int] = array("h")
        self._t0: array[int] = array("q")
        self._own: array[int] = array("q")
        self._acc: list[int] = []  # per open part: the own-less time of the parts nested in it
        self._opt_open: list[tuple[int, int, int]] = []  # open optimizer steps: (t0, wait0, who)
        self._in_forward = False
        # sampled steps: index, end of their stamps, validity, kept-out spans
        self._rec_step: array[int] = array("q")
        self._rec_end: array[int] = array("q")
        self._rec_flags: array[int] = array("b")
        self._rec_spans: dict[int, list[tuple[int, int]]] = {}
        self._flags = 0  # validity of the open sampled step (its stamps follow the last record's)
        # optimizers: id -> (weak ref, its pre hooks dict, our key there, our pre hook, index)
        self._optimizers: dict[int, tuple[Any, Any, int, Any, int]] = {}
        self.optimizer_facts: list[dict[str, Any]] = []
        self._optimizer_refs: list[Any] = []
        self._gpu: CudaParts | None = None
        self._gpu_parts: CudaParts | None = None
        self._gpu_base = 0  # stamps folded away before the GPU's stamp numbers
        # summed sampled steps (bounded like the recorder), per part and clock
        self._tallies = {name: StepTally(dense=False, cap=HISTORY_CAP) for name in PARTS + tuple(p + "_gpu" for p in PARTS)}
        self.sampled = 0  # sampled steps recorded
        self._called: set[int] = set()  # roots called in the open sampled step
        self._ever_called: set[int] = set()

    # -- the schedule ---------------------------------------------------------------------------
    def begin(self) -> None:
        """The capture starts: the first step is sampled."""
        if module_class() is None:
            return  # no torch: nothing to time
        self.active = True
        self._first = self.model.recorder.n_steps
        namespace = user_namespace()
        if namespace:
            self.calls.add(modules_in(list(namespace.values()), module_class()))  # type: ignore[arg-type]
            self._hook_optimizers_in(list(namespace.values()))
        self._arm()
        self.model.sample_in = 1

    def sample_due(self, start: int, end: int) -> None:
        """The step model's callback: a sampled step closed (record it; arm the next or not),
        or the step before a sampled one closed (arm)."""
        if not self.active:
            self.model.sample_in = NEVER
            return
        try:
            self._due(start, end)
        except Exception as exc:  # ours: never raised into the user's loop
            self.failed(exc)

    def failed(self, exc: BaseException) -> None:
        """Any error in our bookkeeping: the parts are off for the rest of the run, with a note."""
        self.note = f"The parts of the step were turned off: {type(exc).__name__}: {exc}"
        self.active = False
        self.model.sample_in = NEVER
        try:
            self._disarm()
        except Exception:
            self.on = False

    def _due(self, start: int, end: int) -> None:
        model = self.model
        if not self.on:
            self._arm()
            model.sample_in = 1
            return
        index = model.recorder.n_steps - 1
        self._record(index, start, end)
        gap = 1 if index + 1 < self._first + FULL_STEPS else self._rng.randint(1, 2 * LINE_EVERY - 1)
        if gap == 1:
            self._open_step()
            model.sample_in = 1
        else:
            self._disarm()
            model.sample_in = gap - 1

    def _arm(self) -> None:
        self.calls.install()
        for ref, pre_hooks, key, pre, _ in list(self._optimizers.values()):
            if ref() is not None:
                pre_hooks[key] = pre
        cuda = self.cuda_of()
        if cuda is not None and self._gpu_parts is None:
            self._gpu_parts = CudaParts(cuda)
        self._gpu = self._gpu_parts if cuda is not None else None
        self.on = True
        self._open_step()

    def _open_step(self) -> None:
        # The forward is whole while the roots are searched too, unless a root shows up only
        # during the step (then its first calls were missed) or the search ends unfound.
        self._flags = OPTIMIZER_OK | (FORWARD_OK if self.calls.state != NOT_FOUND else 0)
        self._acc.clear()
        self._opt_open.clear()
        self._in_forward = False
        self._called = set()
        if self._gpu is not None:
            self._gpu.reset()

    def _disarm(self) -> None:
        self.on = False
        self.calls.remove()
        for _, pre_hooks, key, _, _ in list(self._optimizers.values()):
            pre_hooks.pop(key, None)

    # -- stamps ---------------------------------------------------------------------------------
    def _enter(self) -> tuple[int, int]:
        self._acc.append(0)
        if self._gpu is not None:
            self._enter_gpu()
        return perf_counter_ns(), self.model.wait_total

    def _enter_gpu(self) -> None:
        try:
            self._gpu.enter()  # type: ignore[union-attr]
        except Exception as exc:
            self._gpu_failed(exc)

    def _exit(self, kind: int, who: int, t0: int, w0: int) -> None:
        t1 = perf_counter_ns()
        span = t1 - t0 - (self.model.wait_total - w0)  # less the data wait inside it
        acc = self._acc
        nested = acc.pop() if acc else 0
        if acc:
            acc[-1] += span
        stamp = len(self._kind)
        self._kind.append(kind)
        self._who.append(who)
        self._t0.append(t0)
        self._own.append(span - nested)
        if self._gpu is not None:
            try:
                self._gpu.exit(stamp + self._gpu_base)
            except Exception as exc:
                self._gpu_failed(exc)

    def _gpu_failed(self, exc: BaseException) -> None:
        self.note = f"GPU time of the step's parts turned off: {type(exc).__name__}: {exc}"
        self._gpu = self._gpu_parts = None

    def _timed(self, kind: int, who: int, call: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        """`call(*args, **kwargs)` stamped as one part; our bookkeeping never raises into it."""
        __tracebackhide__ = True  # noqa: F841
        try:
            t0, w0 = self._enter()
        except Exception as exc:
            self.failed(exc)
            return call(*args, **kwargs)
        try:
            return call(*args, **kwargs)
        finally:
            try:
                self._exit(kind, who, t0, w0)
            except Exception as exc:
                self.failed(exc)

    def module_call(self, orig: Callable[..., Any], module: Any, args: Any, kwargs: Any) -> Any:
        """A patched `__call__` of a root's class: time the call when it is an outermost call
        of a root on the capture's thread during a sampled step, outside any fetch."""
        __tracebackhide__ = True  # noqa: F841
        if not self.on or self._in_forward or get_ident() != self.thread or self.model._stack:
            return orig(module, *args, **kwargs)
        who = self.calls.root(module)
        if who < 0:
            return orig(module, *args, **kwargs)
        self._in_forward = True
        self._called.add(who)
        try:
            return self._timed(FORWARD, who, orig, (module, *args), kwargs)
        finally:
            self._in_forward = False

    def backward(self, original: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        """`torch.autograd.backward` on a sampled step (the capture's wrapper calls this)."""
        __tracebackhide__ = True  # noqa: F841
        if not self.calls.walked:
            self._walk(sys._getframe(1))
        return self._timed(BACKWARD, -1, original, args, kwargs)

    def _walk(self, frame: Any) -> None:
        """Discovery: the modules and optimizers in the frames of a training event."""
        self.calls.walked = True
        cls = module_class()
        if cls is None or self.calls.state != SEARCHING:
            return
        try:
            values = frame_values(frame)
            if self.calls.add(modules_in(values, cls)):
                self._flags &= ~FORWARD_OK  # a root new in this step: its forward was missed
            self._hook_optimizers_in(values)
        except Exception as exc:
            self.note = f"The model's calls could not be looked for: {type(exc).__name__}: {exc}"

    # -- optimizers -----------------------------------------------------------------------------
    def _hook_optimizers_in(self, values: list[Any]) -> None:
        torch = sys.modules.get("torch")
        try:
            base = torch.optim.Optimizer  # type: ignore[union-attr]
        except Exception:
            return
        for value in values:
            for v in [value, *inner_values(value)]:
                try:
                    if isinstance(v, base):
                        self._hook_optimizer(v)
                except Exception:
                    continue

    def _hook_optimizer(self, optimizer: Any) -> bool:
        """Our pre hook on this optimizer (in its own dict of pre hooks, there while armed).
        False when it cannot be hooked."""
        if id(optimizer) in self._optimizers:
            return True
        pre_hooks = getattr(optimizer, "_optimizer_step_pre_hooks", None)
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

        def pre(opt: Any, args: Any, kwargs: Any) -> Any:
            if not parts.on or get_ident() != parts.thread:
                return None
            try:
                t0, w0 = parts._enter()
                parts._opt_open.append((t0, w0, who))
                return parts._timed_closure(args, kwargs)
            except Exception as exc:  # ours: never raised into the optimizer's step
                parts.failed(exc)
                return None

        self._optimizers[id(optimizer)] = (ref, pre_hooks, key, pre, who)
        if self.on:
            pre_hooks[key] = pre
        return True

    def _timed_closure(self, args: Any, kwargs: Any) -> tuple[Any, Any] | None:
        """`optimizer.step(closure)`: the closure timed, so its time is not the optimizer's."""
        closure = kwargs.get("closure") if kwargs else None
        in_args = closure is None and len(args) > 1 and callable(args[1])
        if in_args:
            closure = args[1]
        if closure is None:
            return None
        parts = self

        def timed_closure(*a: Any, **k: Any) -> Any:
            __tracebackhide__ = True  # noqa: F841
            if not parts.on or get_ident() != parts.thread:
                return closure(*a, **k)
            return parts._timed(CLOSURE, -1, closure, a, k)

        if in_args:
            return (args[0], timed_closure, *args[2:]), kwargs
        return args, {**kwargs, "closure": timed_closure}

    def optimizer_stepped(self, optimizer: Any) -> None:
        """An optimizer step ended on a sampled step (the capture's global post hook, before
        the step may end): its time is stamped. An optimizer seen for the first time is hooked
        from now on; its start was missed here."""
        try:
            self._optimizer_ended(optimizer)
        except Exception as exc:
            self.failed(exc)

    def _optimizer_ended(self, optimizer: Any) -> None:
        known = self._optimizers.get(id(optimizer))
        if known is None:
            if not self.calls.walked:
                self._walk(sys._getframe(1))
            if self._hook_optimizer(optimizer):
                self._flags &= ~OPTIMIZER_OK
            return
        if not self._opt_open or self._opt_open[-1][2] != known[4]:
            self._flags &= ~OPTIMIZER_OK  # armed while it stepped: its start was missed
            return
        t0, w0, who = self._opt_open.pop()
        self._exit(OPTIMIZER_PART, who, t0, w0)

    # -- sampled steps --------------------------------------------------------------------------
    def _record(self, index: int, start: int, end: int) -> None:
        """A sampled step closed: its stamps are those since the last record's."""
        self._search(index)
        self._ever_called |= self._called
        if self.calls.state != FOUND:
            self._flags &= ~FORWARD_OK
        spans = [(s.start_ns, s.end_ns) for s in self.model.spans]
        self._rec_step.append(index)
        self._rec_end.append(len(self._kind))
        self._rec_flags.append(self._flags)
        if spans:
            self._rec_spans[len(self._rec_step) - 1] = spans
        self.sampled += 1
        if len(self._rec_step) > FOLD_RECORDS:
            self._fold()

    def _search(self, index: int) -> None:
        """While the roots are searched: found once one is called in a sampled step; after two
        steps without, the roots' children are tried (once); then not found. A step counts once
        (the micro-steps of the first steps, merged when the step model sees what a step is,
        are one), and only once steps are training steps (not the DataLoader's fetches)."""
        calls = self.calls
        if calls.state != SEARCHING:
            return
        if not calls.walked:
            self._walk(sys._getframe(3))
        if self._called:
            calls.state = FOUND
            return
        if index <= calls.last_index or self.model.level < ITERATION:  # no training step yet
            return
        calls.last_index = index
        calls.attempts += 1
        if calls.attempts >= MAX_SEARCH or (calls.attempts >= 2 and (calls.widened or not calls.widen(self._ever_called))):
            calls.state = NOT_FOUND
            calls.forget()

    def merged(self, n: int) -> None:
        """The last n closed steps were merged into the open step (the step model saw what a
        step is): their stamps become the open step's, which is whole only if each was
        sampled; a merged step that is not sampled takes its stamps with it."""
        try:
            self._merge(n)
        except Exception as exc:
            self.failed(exc)

    def _merge(self, n: int) -> None:
        first = self.model.recorder.n_steps  # the open step's index now
        steps = np.array(self._rec_step, dtype=np.int64)  # a copy: the buffer is resized below
        keep = int(np.searchsorted(steps, first))
        dropped = range(keep, len(steps))
        whole = len(dropped) == n and all(self._rec_flags[i] & OPTIMIZER_OK for i in dropped)
        forward = all(self._rec_flags[i] & FORWARD_OK for i in dropped)
        for i in dropped:
            self._rec_spans.pop(i, None)
        del self._rec_step[keep:]
        del self._rec_end[keep:]
        del self._rec_flags[keep:]
        if not self.on:
            self._truncate(int(self._rec_end[-1]) if len(self._rec_end) else 0)
        elif not whole:
            self._flags = 0
        elif not forward:
            self._flags &= ~FORWARD_OK
        for tally in self._tallies.values():
            tally.merge_from(first)

    def _truncate(self, n_stamps: int) -> None:
        """Forget the stamps from `n_stamps` on (and their GPU times)."""
        for buf in (self._kind, self._who, self._t0, self._own):
            del buf[n_stamps:]
        gpu = self._gpu_parts
        if gpu is not None:
            last = n_stamps + self._gpu_base
            gpu.pending = deque(p for p in gpu.pending if p[0] < last)
            for stamp in [s for s in gpu.own if s >= last]:
                del gpu.own[stamp]

    # -- reading --------------------------------------------------------------------------------
    def _merges_possible(self) -> bool:
        model = self.model
        return model.level < OPTIMIZER and model.recorder.n_steps - model.steps_at_start <= MERGE_MAX

    def _sums(self, upto: int | None = None) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """Per recorded sampled step (the first `upto`): its index and each part's own time in
        ms on the CPU clock and (NaN where not read) the GPU's."""
        n_rec = len(self._rec_step) if upto is None else upto
        steps = np.frombuffer(self._rec_step, dtype=np.int64)[:n_rec].copy()
        out: dict[str, np.ndarray] = {}
        if not n_rec:
            for name in self._tallies:
                out[name] = np.empty(0)
            return steps, out
        ends = np.frombuffer(self._rec_end, dtype=np.int64)[:n_rec]
        n_stamps = int(ends[-1])
        kind = np.frombuffer(self._kind, dtype=np.int8)[:n_stamps].astype(np.int64)
        own = np.frombuffer(self._own, dtype=np.int64)[:n_stamps].astype(np.float64) / 1e6
        counts = np.diff(ends, prepend=0)
        rec_of = np.repeat(np.arange(n_rec), counts)
        keep = np.ones(len(kind), dtype=bool)
        if self._rec_spans:  # stamps inside a phase kept out of the step (validation) are not its
            t0 = np.frombuffer(self._t0, dtype=np.int64)[:n_stamps]
            for r, spans in self._rec_spans.items():
                if r >= n_rec:
                    continue
                mine = rec_of == r
                for s, e in spans:
                    keep &= ~(mine & (t0 >= s) & (t0 < e))
        gpu_own = np.full(len(kind), np.nan)
        if self._gpu_parts is not None and self._gpu_parts.own:
            for stamp, value in self._gpu_parts.own.items():
                i = stamp - self._gpu_base
                if 0 <= i < len(gpu_own):
                    gpu_own[i] = value
        flags = np.frombuffer(self._rec_flags, dtype=np.int8)[:n_rec]
        for p, name in enumerate(PARTS):
            sel = keep & (kind == p)
            cpu = np.bincount(rec_of[sel], weights=own[sel], minlength=n_rec)[:n_rec]
            gpu_values = gpu_own[sel]
            gpu = np.bincount(rec_of[sel], weights=np.nan_to_num(gpu_values), minlength=n_rec)[:n_rec]
            missing = np.bincount(rec_of[sel], weights=np.isnan(gpu_values).astype(np.float64), minlength=n_rec)[:n_rec]
            gpu = np.where(missing > 0, np.nan, gpu)
            if self._gpu_parts is None:
                gpu = np.full(n_rec, np.nan)
            bit = FORWARD_OK if p == FORWARD else (OPTIMIZER_OK if p == OPTIMIZER_PART else 0)
            if bit:
                bad = (flags & bit) == 0
                cpu = np.where(bad, np.nan, cpu)
                gpu = np.where(bad, np.nan, gpu)
            out[name] = cpu
            out[name + "_gpu"] = gpu
        if self.calls.state == NOT_FOUND:
            out["forward"] = np.full(n_rec, np.nan)
            out["forward_gpu"] = np.full(n_rec, np.nan)
        return steps, out

    def _fold(self) -> None:
        """Sum the oldest sampled steps into the tallies (bounded memory), once no merge can
        reach them and their GPU times are read."""
        if self._merges_possible():
            return
        gpu = self._gpu_parts
        if gpu is not None:
            gpu.poll()
        n_rec = len(self._rec_step)
        if gpu is not None and gpu.pending:
            oldest = gpu.pending[0][0] - self._gpu_base
            n_rec = int(np.searchsorted(np.array(self._rec_end, dtype=np.int64), oldest, side="right"))
        if n_rec <= 0:
            return
        steps, sums = self._sums(n_rec)
        for name, values in sums.items():
            tally = self._tallies[name]
            for step, value in zip(steps.tolist(), values.tolist(), strict=True):
                tally.add(step, value)
        used = int(self._rec_end[n_rec - 1])
        for buf in (self._kind, self._who, self._t0, self._own):
            del buf[:used]
        del self._rec_step[:n_rec]
        del self._rec_flags[:n_rec]
        ends_left = [e - used for e in self._rec_end[n_rec:]]
        self._rec_end = array("q", ends_left)
        self._rec_spans = {r - n_rec: s for r, s in self._rec_spans.items() if r >= n_rec}
        if gpu is not None:
            for stamp in [s for s in gpu.own if s - self._gpu_base < used]:
                del gpu.own[stamp]
        self._gpu_base += used

    def per_step(self) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """Every sampled step kept (folded and raw): its index, and each part in ms."""
        if self._gpu_parts is not None:
            try:
                self._gpu_parts.poll()
            except Exception as exc:
                self._gpu_failed(exc)
        steps, raw = self._sums()
        folded = {name: tally for name, tally in self._tallies.items()}
        some = next(iter(folded.values()))
        old_steps = np.frombuffer(some._steps, dtype=np.int64).copy() if len(some) else np.empty(0, np.int64)
        if not len(old_steps):
            return steps, raw
        out = {name: np.concatenate([tally.column(old_steps), raw[name]]) for name, tally in folded.items()}
        return np.concatenate([old_steps, steps]), out

    def columns(self, cols: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The parts of the recorder's kept steps `cols["step"]` (NaN where a step was not
        sampled or a part not timed), and the rest: compute less the three parts."""
        steps = np.asarray(cols["step"], dtype=np.int64)
        have, values = self.per_step()
        out: dict[str, np.ndarray] = {}
        idx = np.searchsorted(have, steps) if len(have) else np.zeros(len(steps), dtype=np.int64)
        idx = np.clip(idx, 0, max(len(have) - 1, 0))
        hit = (have[idx] == steps) if len(have) else np.zeros(len(steps), dtype=bool)
        for clock, names in (("", PART_COLUMNS), ("_gpu", GPU_PART_COLUMNS)):
            got = []
            for part, name in zip(PARTS, names[:3], strict=True):
                column = np.full(len(steps), np.nan)
                if len(have):
                    column[hit] = values[part + clock][idx[hit]]
                out[name] = column
                got.append(column)
            compute = np.asarray(cols.get("compute" + clock + "_ms", np.full(len(steps), np.nan)), dtype=np.float64)
            rest = compute - got[0] - got[1] - got[2]
            small = (rest < 0) & (rest >= -REST_TOLERANCE * np.abs(compute))
            rest = np.where(small, 0.0, rest)
            out[names[3]] = np.where(rest < 0, np.nan, rest)
        return out

    def facts(self) -> dict[str, Any]:
        """What the summary quotes: the forward's state and modules, the optimizers, sampling."""
        namespace = user_namespace()
        labels = self.calls.found_labels(self._ever_called | self._called, namespace)
        optimizers = []
        for facts, ref in zip(self.optimizer_facts, self._optimizer_refs, strict=True):
            opt = ref()
            optimizers.append({**facts, "label": describe(opt, namespace) if opt is not None else facts["name"]})
        return {
            "parts_sampled_steps": self.sampled,
            "forward_state": self.calls.state if self.sampled else None,
            "forward_modules": labels,
            "optimizers": optimizers,
            "parts_sampling": f"every step for the first {FULL_STEPS}, then one in {LINE_EVERY} on average",
        }

    # -- the end --------------------------------------------------------------------------------
    def close(self) -> None:
        """The capture ended: nothing of ours stays on a class or an optimizer; GPU times read."""
        if self.on:
            self._disarm()
        self.active = False
        self.model.sample_in = NEVER
        self.calls.forget()
        for _, pre_hooks, key, _, _ in list(self._optimizers.values()):
            pre_hooks.pop(key, None)
        self._optimizers.clear()
        if self.calls.state == SEARCHING and self.sampled:  # a run of a step or two
            self.calls.state = FOUND if self._ever_called else NOT_FOUND
        if self._gpu_parts is not None:
            try:
                self._gpu_parts.close()
            except Exception as exc:
                self._gpu_failed(exc)
