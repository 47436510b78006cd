"""The summary and the verdict of what a run recorded, read off its recording (what `Recorded`
names of it) once the run finishes (or at each read while it runs): the step's numbers (analysis/summary.py), the data
sources and phases, the parts of the step, the trend, each epoch's start-up, the resources,
and, with several ranks, the rank verdict. Every key is listed in docs/api.md, "The summary"."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol, cast

from .analysis.compile import CompileFacts, CompileReading, compiling_verdict, read_compile
from .analysis.data_sources import loader_facts
from .analysis.step_parts import epoch_startup, parts_summary, trend
from .analysis.step_pattern import step_pattern
from .analysis.summary import auto_warmup, summarize, with_batch_size
from .analysis.summary_keys import Summary
from .analysis.verdict import Verdict, diagnose

if TYPE_CHECKING:
    import numpy as np

    from .analysis.summary_keys import RankRow
    from .capture.steps.recorder import Recorder
    from .facts.loader import LoaderFacts, PhaseRow, SourceRow
    from .facts.resources import GpuMemoryFacts, HeldBefore, HostFacts, OomFacts


class StepFacts(Protocol):
    """The parts of the step as they were measured (capture/inside/step_parts.StepParts, or the
    rank shown: ranks/backward.RankParts)."""

    def columns(self, cols: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The parts' per-step columns, placed on the steps of `cols`."""

    def facts(self) -> Mapping[str, object]:
        """The summary's facts of the parts: forward_state, forward_modules, optimizers."""


class Recorded(Protocol):
    """What the summary reads of a recording (recording.Recording), read-only."""

    @property
    def recorder(self) -> Recorder:
        """The per-step columns recorded so far."""
    @property
    def warmup(self) -> int | None:
        """The warm-up steps asked for (None: automatic)."""
    @property
    def gpu_used(self) -> bool:
        """The loop ran on a CUDA device."""
    @property
    def watch_summary(self) -> Mapping[str, Any]:
        """The optional watches' facts the verdict quotes."""
    @property
    def batch_size(self) -> int | None:
        """Samples in a batch, if known."""
    @property
    def batches_per_step(self) -> float | None:
        """Batches fetched per step."""
    @property
    def ranks(self) -> list[RankRow] | None:
        """One summary per rank (several ranks), else None."""
    @property
    def sources(self) -> list[SourceRow]:
        """Every data source and what it fed."""
    @property
    def phases(self) -> list[PhaseRow]:
        """The passes kept out of the steps (validation, eval)."""
    @property
    def step_kind(self) -> str:
        """What a step was (optimizer, backward, ...)."""
    @property
    def step_definition(self) -> str:
        """What a step was, as a sentence."""
    @property
    def wall_ms(self) -> float | None:
        """The cell's wall time."""
    @property
    def model_compiled(self) -> bool:
        """The model was torch.compile-d."""
    @property
    def step_parts(self) -> StepFacts | None:
        """The parts of sampled steps (None: not measured)."""
    @property
    def loader_info(self) -> LoaderFacts | None:
        """The training DataLoader's settings."""
    @property
    def pass_starts(self) -> list[int]:
        """The steps where each pass over the loader began."""
    @property
    def cell_source(self) -> str | None:
        """The traced cell's text."""
    @property
    def loop_cell_source(self) -> str | None:
        """The text of the cell whose function holds the loop."""
    @property
    def loop_line(self) -> int | None:
        """The located loop's line."""
    @property
    def loader_ref(self) -> Callable[[], Any] | None:
        """A reference to the training DataLoader (None: none)."""
    @property
    def loader_name(self) -> str | None:
        """The training DataLoader's name in the namespace."""
    @property
    def gpu_memory(self) -> GpuMemoryFacts | None:
        """The GPU memory watch, if measured."""
    @property
    def host(self) -> HostFacts | None:
        """The host's CPU and memory samples, if measured."""
    @property
    def held_before(self) -> HeldBefore | None:
        """What earlier cells held on the GPU."""
    @property
    def oom(self) -> OomFacts | None:
        """An out-of-memory error's facts."""
    @property
    def cuda_device(self) -> int | None:
        """The loop's CUDA device index."""


def analyse(run: Recorded, cols: dict[str, np.ndarray]) -> tuple[Summary, Verdict]:
    """The summary and the verdict of what `run` recorded, its per-step columns `cols`."""
    rec = run.recorder
    compiled = _compiled(run, cols)
    summary = summarize(_steady(cols, compiled), rec.n_steps, _warmup(run, compiled), run.gpu_used, rec.totals())
    summary.update(_compile_summary(compiled))
    late = [s for s in (compiled.kept_out if compiled else ()) if s >= int(summary["warmup_steps"])]
    summary["n_analysed"] = max(0, int(summary["n_analysed"]) - len(late))  # compiling, profiled: not analysed
    summary.update(cast(Summary, run.watch_summary))  # the GPU watch's keys (capture/gpu)
    summary.update(_source_summary(run))
    summary.update(_inside_the_step(run, cols, summary))
    with_batch_size(summary, run.batch_size, run.batches_per_step)
    summary.update(_resource_summary(run, cols, int(summary["warmup_steps"])))
    verdict = diagnose(summary)
    if compiled is not None and compiled.mostly_compiling:
        verdict = compiling_verdict(compiled, summary, verdict)
    if run.ranks:
        from .analysis.rank_verdict import with_ranks

        summary, verdict = with_ranks(summary, run.ranks)
    return summary, verdict



def _compiled(run: Recorded, cols: Mapping[str, np.ndarray]) -> CompileReading | None:
    """What torch.compile did during the run, read against its steps (None: nothing compiled)."""
    facts = cast("CompileFacts | None", getattr(run, "compiled", None))  # a rank's recording: none
    return read_compile(facts, cols, run.wall_ms) if facts is not None else None


def _warmup(run: Recorded, compiled: CompileReading | None) -> int | None:
    """The warm-up: what was asked for (or the automatic one), stretched over the steps that
    compiled in the run's first half (kept out of the steady state, with the reason "compiling")."""
    n = run.recorder.n_steps
    early = [s for s in compiled.compiling_steps if s < max(1, n // 2)] if compiled is not None else []
    if not early:
        return run.warmup
    asked = auto_warmup(n) if run.warmup is None else run.warmup
    return max(asked, early[-1] + 1)


def _steady(cols: dict[str, np.ndarray], compiled: CompileReading | None) -> dict[str, np.ndarray]:
    """The columns without the steps that compiled (the steady state's figures: a recompile at
    the last batch is no step of the training's pace), nor those the eager share's profiler ran in."""
    if compiled is None or not compiled.kept_out:
        return cols
    import numpy as np

    keep = ~np.isin(cols["step"], compiled.kept_out)
    return {name: column[keep] for name, column in cols.items()}


def _compile_summary(compiled: CompileReading | None) -> Summary:
    if compiled is None:
        return {"compile_s": None, "compile_share": None, "compiling_steps": [], "eager_share": None}
    return {
        "compile_s": compiled.seconds,
        "compile_share": compiled.share_of_cell,
        "compiling_steps": list(compiled.compiling_steps),
        "eager_share": compiled.eager["share"] if compiled.eager is not None else None,
    }


def _source_summary(run: Recorded) -> Summary:
    """What the verdict quotes of the data sources and the phases."""
    training = next((src for src in run.sources if src.get("training")), None)
    return {
        "step_kind": run.step_kind,
        "step_definition": run.step_definition,
        "batches_per_step": run.batches_per_step,
        "data_source": training.get("label") if training else None,
        "data_source_kind": training.get("kind") if training else None,
        "data_source_type": training.get("type") if training else None,
        "data_source_line": training.get("line") if training else None,
        "phases": list(run.phases),
        "wall_ms": run.wall_ms,
        "model_compiled": run.model_compiled,
    }


def _inside_the_step(run: Recorded, cols: dict[str, np.ndarray], summary: Summary) -> Summary:
    """The parts of the step, the trend over the run and each epoch's start-up wait."""
    analysed = cols["step"] >= int(summary["warmup_steps"])
    clock = str(summary["clock"])
    out = parts_summary(cols, analysed, clock)
    parts = run.step_parts
    out.update(cast(Summary, parts.facts()) if parts is not None else {"forward_state": None, "forward_modules": [], "optimizers": []})
    out["trend"] = trend(cols, analysed, clock)
    out.update(loader_facts(run.loader_info, run.pass_starts))
    workers = out["loader_workers"]
    out["step_pattern"] = step_pattern(cols, analysed, clock, run.pass_starts, workers, run.batches_per_step)
    total = (summary.get("totals_ms") or {}).get("step_gpu_ms" if clock == "gpu" else "step_ms")
    out["epoch_startup"] = epoch_startup(cols, run.pass_starts, total, run.loader_info, clock)
    return out


def _resource_summary(run: Recorded, cols: dict[str, Any], warmup: int) -> Summary:
    """GPU memory, CPU and host memory in numbers and findings (analysis/resources.py)."""
    from .analysis.kept_graph import kept_graphs
    from .analysis.resources import ResourceFacts, resource_summary
    from .capture.data.probes import user_namespace
    from .capture.resources.gpu_memory import module_names

    source = run.loop_cell_source or run.cell_source
    kept = [k.to_dict() for k in kept_graphs(source, run.loop_line, module_names(user_namespace()))]
    loader = run.loader_ref() if run.loader_ref is not None else None
    facts = ResourceFacts(
        columns=cols,
        warmup=warmup,
        gpu_memory=run.gpu_memory,
        host=run.host,
        kept=kept,
        python_objects=list((run.loader_info or {}).get("python_objects") or []),
        loader_name=run.loader_name,
        training_loader=id(loader) if loader is not None else None,
        held=run.held_before,
        oom=run.oom,
        device=run.cuda_device,
    )
    summary = resource_summary(facts)
    summary["kept_graphs"] = kept
    return summary

