"""The checklist's items about the GPU: pinned memory, non_blocking copies, the copies the run
measured, the batch size, kernel launches and synchronising calls."""

from __future__ import annotations

from ..cell_code import CodeSite
from ..number_text import ms as _ms
from ..verdict import VerdictLabel, sync_sentence
from .facts import (
    CHECK,
    FIX,
    OK,
    TRANSFER_VERDICTS,
    Facts,
    Item,
    capitalised,
    how_much,
    measured_share,
    needs_change,
)


def pin_memory_item(f: Facts) -> Item:
    """pin_memory: page-locked batches copy to the GPU asynchronously (on a GPU only)."""
    pinned = bool(f.loader and f.loader.get("pin_memory"))
    title = "Page-locked batches (pin_memory)"
    measured = measured_share(f.pinned_share, "pinned")
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
        "pin_memory", title, needs_change(bears), "False" + measured, "True", f.loader_site,
        "Copies from pageable memory go through a staging buffer and cannot overlap compute; "
        "pinned batches can (with .to(device, non_blocking=True)).",
        bears,
    )


def non_blocking_item(f: Facts) -> Item:
    """non_blocking: the loop's copies to the GPU overlap compute (from pinned memory only)."""
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
            "non_blocking", title, needs_change(bears),
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
    measured = measured_share(f.non_blocking_share, "non_blocking")
    return Item(
        "non_blocking", title, needs_change(bears), first.text + more + measured,
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


def h2d_copies_item(f: Facts) -> Item | None:
    """The costliest measured copy to the GPU: bytes, bandwidth, pinned or not, blocking or not,
    on its line. None when no copy was measured (a CPU run, or no copy in the steps)."""
    if not f.copies:
        return None
    top = f.copies[0]
    bears = f.verdict == VerdictLabel.H2D_BOUND
    pinned = how_much(top.pinned_share, "pinned", "pageable")
    nb = how_much(top.non_blocking_share, "non_blocking", "blocking")
    rate = f" at {top.gb_per_s:.1f} GB/s" if top.gb_per_s else ""
    seen = f"{per_step_bytes(top.bytes_per_step)}/step{rate}, {pinned}, {nb}"
    where = top.site.label() if top.site is not None else "a line outside the notebook"
    took = f" in {top.ms_per_step:.2f} ms" if top.ms_per_step is not None else ""
    reason = (
        f"{capitalised(where)} (`{top.text}`) copies {per_step_bytes(top.bytes_per_step)} per "
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
        status = needs_change(bears)
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
    if f.verdict != VerdictLabel.HOST_BOUND:
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
    bears = f.verdict == VerdictLabel.HOST_BOUND
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
            f"{capitalised(busiest.site.label())} takes the most host time: "
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
    bears = f.verdict == VerdictLabel.HOST_BOUND and every
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
