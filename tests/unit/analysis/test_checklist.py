"""Checklist rules as pure functions: synthetic loader settings and code, at each rule's edges."""

from __future__ import annotations

import ast
import json
import textwrap
from dataclasses import replace
from typing import Any

import pytest

from traceml_jupyter.analysis.cell_code import (
    CodeSite,
    SampleCode,
    Transfer,
    assigned_line,
    costly_calls,
    dataloader_sites,
    loop_at,
    nested_in_loop,
    parse_cell,
    pick_loader_line,
    sample_code_in,
    transfers_in,
)
from traceml_jupyter.analysis.checklist import (
    CHECK,
    FIX,
    OK,
    CopySeen,
    Facts,
    LineSeen,
    batch_size_item,
    collate_item,
    default_start_method,
    evaluate,
    h2d_copies_item,
    launch_overhead_item,
    non_blocking_item,
    num_workers_item,
    per_sample_item,
    per_step_bytes,
    persistent_workers_item,
    pin_memory_item,
    prefetch_factor_item,
    start_method_item,
    storage_item,
    suggested_workers,
    sync_item,
)

LOADER_LINE = CodeSite(3)


def loader(**settings: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "num_workers": 0,
        "batch_size": 32,
        "pin_memory": False,
        "persistent_workers": False,
        "prefetch_factor": None,
        "multiprocessing_context": None,
        "collate_fn": "default_collate",
        "custom_collate": False,
        "dataset_type": "Images",
        "dataset_module": "__main__",
    }
    base.update(settings)
    return base


def facts(verdict: str = "INPUT-BOUND", **changes: Any) -> Facts:
    settings = changes.pop("settings", {})
    base = Facts(
        verdict=verdict,
        loader=loader(**settings),
        cpu_count=8,
        loader_site=LOADER_LINE,
        start_method="fork",
    )
    return replace(base, **changes)


def cell_tree(code: str) -> ast.Module:
    tree = parse_cell("%%traceml\n" + textwrap.dedent(code).strip("\n"))
    assert tree is not None
    return tree


# -- num_workers -----------------------------------------------------------------------------


@pytest.mark.parametrize(("cpus", "want"), [(8, 4), (16, 8), (4, 2), (2, 2), (1, 2), (None, 2)])
def test_workers_to_try_are_half_the_cpus_and_at_least_two(cpus: int | None, want: int) -> None:
    assert suggested_workers(cpus) == want


def test_a_saturated_cpu_gets_no_more_workers_whatever_the_rule_of_thumb() -> None:
    busy = "the training process and its DataLoader workers keep 7.8 of the 8 usable cores busy (...)."
    for workers in (0, 2, 8):
        item = num_workers_item(facts("INPUT-BOUND", settings={"num_workers": workers}, cpu_saturated=True, cpu_sentence=busy))
        assert item.status == CHECK and item.to_try is None
        assert item.reason.startswith("The CPU is saturated: the training process") and "More workers won't help" in item.reason
    tuned = {"rows": [{"settings": {"num_workers": 4}, "batches_per_s": 99.0}], "best_settings": {"num_workers": 4}}
    item = num_workers_item(facts("INPUT-BOUND", settings={"num_workers": 2}, cpu_saturated=True, tuned=tuned))
    assert item.to_try is None  # not even what tune measured alone


def test_workers_that_wait_get_more_workers_beyond_the_cores() -> None:
    item = num_workers_item(facts("INPUT-BOUND", settings={"num_workers": 8}, cpu_saturated=False, workers_cores=0.4))
    assert (item.status, item.to_try) == (FIX, "16") and "wait (disk, network, sleep)" in item.reason
    busy = num_workers_item(facts("INPUT-BOUND", settings={"num_workers": 8}, cpu_saturated=False, workers_cores=6.0))
    assert busy.to_try != "16"  # computing workers: the rule of thumb


def test_no_workers_on_an_input_bound_run_is_a_fix_on_the_loader_line() -> None:
    item = num_workers_item(facts("INPUT-BOUND"))
    assert (item.status, item.seen, item.to_try, item.line) == (FIX, "0", "4", 3)
    assert item.bears_on_verdict
    assert item.site is not None and item.site.label() == "line 3"


def test_no_workers_on_a_compute_bound_run_is_only_worth_a_check() -> None:
    item = num_workers_item(facts("COMPUTE-BOUND"))
    assert item.status == CHECK
    assert not item.bears_on_verdict


def test_too_few_workers_on_an_input_bound_run_is_a_fix() -> None:
    item = num_workers_item(facts(settings={"num_workers": 1}))
    assert (item.status, item.seen, item.to_try) == (FIX, "1", "4")


def test_half_the_cpus_already_points_at_per_sample_cost() -> None:
    item = num_workers_item(facts(settings={"num_workers": 4}))
    assert item.status == CHECK
    assert item.to_try is None
    assert "cheaper" in item.reason


def test_more_workers_than_cpus_is_a_check() -> None:
    item = num_workers_item(facts("COMPUTE-BOUND", settings={"num_workers": 12}))
    assert (item.status, item.to_try) == (CHECK, "4")


def test_enough_workers_on_a_compute_bound_run_is_ok() -> None:
    item = num_workers_item(facts("COMPUTE-BOUND", settings={"num_workers": 4}))
    assert item.status == OK


# -- persistent_workers, prefetch_factor -----------------------------------------------------


def test_workers_restarting_every_epoch_are_a_fix() -> None:
    f = facts("INPUT STRAGGLER", several_passes=True, settings={"num_workers": 4})
    item = persistent_workers_item(f)
    assert (item.status, item.seen, item.to_try, item.line) == (FIX, "False", "True", 3)


def test_one_pass_needs_no_persistent_workers() -> None:
    f = facts("INPUT STRAGGLER", several_passes=False, settings={"num_workers": 4})
    item = persistent_workers_item(f)
    assert item.status == OK
    assert not item.bears_on_verdict


def test_persistent_workers_already_set_are_ok() -> None:
    settings = {"num_workers": 4, "persistent_workers": True}
    assert persistent_workers_item(facts(several_passes=True, settings=settings)).status == OK


def test_persistent_workers_without_workers_do_not_apply() -> None:
    item = persistent_workers_item(facts(several_passes=True))
    assert item.status == OK
    assert "Not applicable" in item.reason
    assert not item.bears_on_verdict


def test_default_prefetch_on_a_straggler_run_is_a_fix() -> None:
    item = prefetch_factor_item(facts("INPUT STRAGGLER", settings={"num_workers": 2, "prefetch_factor": 2}))
    assert (item.status, item.seen, item.to_try) == (FIX, "2", "4")


def test_default_prefetch_on_an_input_bound_run_is_a_check() -> None:
    item = prefetch_factor_item(facts("INPUT-BOUND", settings={"num_workers": 2}))
    assert (item.status, item.seen) == (CHECK, "2 (default)")
    assert item.bears_on_verdict


def test_deep_prefetch_is_ok_and_none_without_workers() -> None:
    settings = {"num_workers": 2, "prefetch_factor": 4}
    assert prefetch_factor_item(facts("INPUT STRAGGLER", settings=settings)).status == OK
    item = prefetch_factor_item(facts("INPUT STRAGGLER"))
    assert (item.status, item.seen) == (OK, "n/a (no workers)")


# -- pin_memory, non_blocking ----------------------------------------------------------------


def test_pin_memory_does_not_apply_to_a_cpu_only_run() -> None:
    item = pin_memory_item(facts("INPUT-BOUND", on_gpu=False, settings={"pin_memory": True}))
    assert item.status == OK
    assert "Not applicable" in item.reason
    assert not item.bears_on_verdict


def test_unpinned_batches_on_a_gpu_run_are_a_fix_with_the_measured_share() -> None:
    item = pin_memory_item(facts("H2D-BOUND", on_gpu=True, pinned_share=0.0))
    assert (item.status, item.to_try, item.line) == (FIX, "True", 3)
    assert item.seen == "False (0 % of copied bytes pinned)"
    assert pin_memory_item(facts("H2D-BOUND", on_gpu=True, settings={"pin_memory": True})).status == OK


def test_a_blocking_copy_is_a_fix_on_its_own_line() -> None:
    transfers = (
        Transfer(CodeSite(6), "x.to(device, non_blocking=True)", True),
        Transfer(CodeSite(7), "y.to(device)", False),
    )
    item = non_blocking_item(facts("INPUT-BOUND", on_gpu=True, transfers=transfers))
    assert (item.status, item.seen, item.to_try, item.line) == (FIX, "y.to(device)", "non_blocking=True", 7)


def test_non_blocking_copies_are_ok_and_cpu_runs_do_not_apply() -> None:
    transfers = (Transfer(CodeSite(6), "x.to(device, non_blocking=True)", True),)
    assert non_blocking_item(facts(on_gpu=True, transfers=transfers)).status == OK
    cpu = non_blocking_item(facts(on_gpu=False, transfers=()))
    assert (cpu.status, cpu.bears_on_verdict) == (OK, False)


def test_no_copy_in_the_loop_body_is_a_check() -> None:
    item = non_blocking_item(facts(on_gpu=True, transfers=()))
    assert item.status == CHECK
    unread = non_blocking_item(facts(on_gpu=True, transfers=None))
    assert (unread.status, unread.seen) == (CHECK, "loop body not readable")


# -- collate, per-sample cost, storage -------------------------------------------------------


def test_a_custom_collate_is_a_check_that_bears_on_input_verdicts() -> None:
    settings = {"collate_fn": "pad_batch", "custom_collate": True}
    item = collate_item(facts("INPUT-BOUND", settings=settings))
    assert (item.status, item.seen, item.bears_on_verdict) == (CHECK, "pad_batch", True)
    assert not collate_item(facts("COMPUTE-BOUND", settings=settings)).bears_on_verdict
    assert collate_item(facts()).status == OK


def test_per_sample_decoding_is_a_check_on_its_line() -> None:
    code = SampleCode("Images", (("Image.open()", CodeSite(9, "In [2]")),), CodeSite(8, "In [2]"), CodeSite(4, "In [2]"))
    item = per_sample_item(facts(sample_code=code))
    assert (item.status, item.seen, item.to_try) == (CHECK, "Image.open()", "cache or precompute")
    assert item.site is not None and item.site.label() == "In [2], line 9"


def test_plain_indexing_and_unknown_source() -> None:
    plain = SampleCode("Images", (), CodeSite(8), CodeSite(4))
    assert per_sample_item(facts("COMPUTE-BOUND", sample_code=plain)).status == OK
    # No recognised call is no proof of cheap samples when the loop waits for data.
    assert per_sample_item(facts("INPUT-BOUND", sample_code=plain)).status == CHECK
    unknown = per_sample_item(facts(sample_code=None))
    assert (unknown.status, unknown.seen) == (CHECK, "source not available")


def test_storage_is_always_a_check_that_bears_only_on_stragglers() -> None:
    item = storage_item(facts("INPUT STRAGGLER", straggler_steps=3, wait_median_ms=1.0, wait_p99_ms=250.0))
    assert (item.status, item.bears_on_verdict) == (CHECK, True)
    assert item.seen == "3 slow fetch(es); p99 wait 250.0 ms vs median 1.0 ms"
    assert not storage_item(facts("INPUT-BOUND")).bears_on_verdict


# -- the forkserver pitfall ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("version", "platform", "method"),
    [
        ((3, 13), "linux", "fork"),
        ((3, 14), "linux", "forkserver"),
        ((3, 15), "linux", "forkserver"),
        ((3, 11), "darwin", "spawn"),
        ((3, 14), "win32", "spawn"),
    ],
)
def test_default_start_method(version: tuple[int, int], platform: str, method: str) -> None:
    assert default_start_method(version, platform) == method


CLASS_SITE = SampleCode("Images", (), CodeSite(8, "In [2]"), CodeSite(4, "In [2]"))


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_workers_and_a_notebook_dataset_under_forkserver_or_spawn_are_a_fix(method: str) -> None:
    f = facts(start_method=method, sample_code=CLASS_SITE, settings={"num_workers": 2})
    item = start_method_item(f, workers_advised=False)
    assert (item.status, item.bears_on_verdict) == (FIX, True)
    assert item.to_try == "move Images into a .py module and import it"
    assert item.site is not None and item.site.label() == "In [2], line 4"


def test_advising_workers_for_a_notebook_dataset_under_forkserver_is_a_fix() -> None:
    f = facts(start_method="forkserver", sample_code=CLASS_SITE)
    assert start_method_item(f, workers_advised=True).status == FIX
    assert start_method_item(f, workers_advised=False).status == CHECK


def test_fork_or_a_module_dataset_is_ok() -> None:
    fork = start_method_item(facts(start_method="fork", settings={"num_workers": 2}), False)
    assert (fork.status, fork.bears_on_verdict) == (OK, False)
    assert "3.14" in fork.reason
    module = facts(start_method="forkserver", settings={"num_workers": 2, "dataset_module": "mydata"})
    assert start_method_item(module, False).status == OK


def test_evaluate_on_python_314_with_a_cell_dataset_and_no_workers() -> None:
    f = facts("INPUT-BOUND", start_method=default_start_method((3, 14), "linux"), sample_code=CLASS_SITE)
    items = {item.key: item for item in evaluate(f)}
    assert items["num_workers"].status == FIX
    assert items["start_method"].status == FIX


# -- evaluate --------------------------------------------------------------------------------


def test_items_bearing_on_the_verdict_come_first_and_none_is_dropped() -> None:
    items = evaluate(facts("INPUT-BOUND"))
    keys = [item.key for item in items]
    assert set(keys) == {
        "num_workers", "persistent_workers", "prefetch_factor", "pin_memory", "non_blocking",
        "collate_fn", "per_sample_cost", "storage", "start_method",
    }  # fmt: skip
    bears = [item.bears_on_verdict for item in items]
    assert bears == sorted(bears, reverse=True)
    json.dumps([item.to_dict() for item in items])


def test_without_a_dataloader_one_item_says_so() -> None:
    items = evaluate(replace(facts("INPUT-BOUND"), loader=None))
    keys = [item.key for item in items]
    assert "dataloader" in keys and "num_workers" not in keys
    assert items[0].key == "dataloader"


def test_to_dict_carries_the_line_and_the_cell() -> None:
    code = SampleCode("Images", (("decode()", CodeSite(9, "In [2]")),), CodeSite(8, "In [2]"), None)
    item = per_sample_item(facts(sample_code=code)).to_dict()
    assert (item["line"], item["cell"], item["where"]) == (9, "In [2]", "In [2], line 9")


# -- reading the code ------------------------------------------------------------------------


def test_parse_cell_numbers_lines_as_the_user_sees_them() -> None:
    tree = cell_tree("""
        import torch
        loader = DataLoader(ds, num_workers=0)
        for x in loader:
            pass
    """)
    assert dataloader_sites(tree) == [(3, frozenset({"loader"}))]
    assert loop_at(tree, 4) is not None
    assert parse_cell("%%timeit\nx = 1") is None
    assert parse_cell("x = (") is None
    plain = parse_cell("x = 1\nloader = DataLoader(ds)")
    assert plain is not None and dataloader_sites(plain)[0][0] == 2


def test_parse_cell_applies_the_shells_transform() -> None:
    tree = parse_cell("%%traceml\n%time y = 1\nloader = DataLoader(ds)", lambda s: s.replace("%time ", ""))
    assert tree is not None and dataloader_sites(tree) == [(3, frozenset({"loader"}))]


def test_the_loader_line_is_the_one_the_loop_iterates() -> None:
    tree = cell_tree("""
        val_loader = DataLoader(val, batch_size=64)
        train_loader, other = DataLoader(train), 1
        for x in enumerate(train_loader):
            pass
    """)
    sites = dataloader_sites(tree)
    assert pick_loader_line(sites, {"enumerate", "train_loader"}) == 3
    assert pick_loader_line(sites, {"loader"}) is None
    assert assigned_line(tree, {"other"}) == 3


def test_transfers_in_the_loop_body() -> None:
    tree = cell_tree("""
        for epoch in range(2):
            for x, y in loader:
                x = x.to(device, non_blocking=True)
                y = y.cuda()
                z = x.to(torch.float16)
                w = x.to(device, non_blocking=False)
                def later(t):
                    return t.to(device)
                loss = model(x)
    """)
    loop = loop_at(tree, 3)
    assert loop is not None
    found = transfers_in(loop)
    assert [(t.site.line, t.non_blocking) for t in found] == [(4, True), (5, False), (7, False)]
    assert nested_in_loop(tree, 3)
    assert not nested_in_loop(tree, 2)


def test_costly_calls_in_getitem() -> None:
    tree = cell_tree("""
        class Images(Dataset):
            def __len__(self):
                return 10
            def __getitem__(self, i):
                img = Image.open(self.paths[i]).convert("RGB")
                time.sleep(0.01)
                ids = self.tokenizer(self.texts[i])
                return self.transform(img), torch.tensor(ids)
    """)
    code = sample_code_in(tree, "Images", "In [4]")
    assert code is not None
    assert [name for name, _ in code.calls] == [
        "Image.open()", "time.sleep()", "self.tokenizer()", "self.transform()",
    ]  # fmt: skip
    assert code.calls[0][1] == CodeSite(6, "In [4]")
    assert code.site == CodeSite(5, "In [4]") and code.class_site == CodeSite(2, "In [4]")
    cheap = cell_tree("class T:\n    def __getitem__(self, i):\n        return self.x[i]")
    getitem = cheap.body[0].body[0]  # type: ignore[attr-defined]
    assert costly_calls(getitem) == []
    assert sample_code_in(cheap, "Missing") is None


# -- copies to the GPU, host-bound loops, syncs (measured on a GPU) ----------------------------


def copy_seen(line: int = 4, pinned: float = 0.0, non_blocking: float = 0.0) -> CopySeen:
    return CopySeen(CodeSite(line), 'x.to("cuda")', 20e6, 4.0, 5.0, pinned, non_blocking)


def test_no_measured_copy_means_no_copy_item() -> None:
    assert h2d_copies_item(facts("H2D-BOUND", on_gpu=True)) is None
    assert h2d_copies_item(facts("H2D-BOUND", on_gpu=True, copies=())) is None


def test_a_pageable_blocking_copy_on_an_h2d_bound_run_is_a_fix_on_its_line() -> None:
    others = (copy_seen(), copy_seen(5, pinned=1.0), CopySeen(None, "?", 8.0, None, None, 0.0, 0.0))
    item = h2d_copies_item(facts("H2D-BOUND", on_gpu=True, copies=others))
    assert item is not None and item.bears_on_verdict
    assert (item.status, item.line, item.to_try) == (FIX, 4, "pinned + non_blocking=True")
    assert item.seen == "20.0 MB/step at 5.0 GB/s, pageable, blocking"
    assert 'Line 4 (`x.to("cuda")`) copies 20.0 MB per step in 4.00 ms.' in item.reason
    assert "pin_memory=True" in item.reason and "non_blocking=True" in item.reason
    assert item.reason.endswith("Other copies: line 5.")


def test_half_pinned_copies_ask_for_what_is_missing() -> None:
    item = h2d_copies_item(facts("H2D-BOUND", on_gpu=True, copies=(copy_seen(pinned=0.5, non_blocking=1.0),)))
    assert item is not None
    assert (item.status, item.to_try) == (FIX, "pinned")
    assert item.seen.endswith("50 % pinned, non_blocking")


def test_pinned_asynchronous_copies_leave_fewer_bytes_to_try() -> None:
    fast = (copy_seen(pinned=1.0, non_blocking=1.0),)
    bound = h2d_copies_item(facts("H2D-BOUND", on_gpu=True, copies=fast))
    assert bound is not None and (bound.status, bound.to_try) == (CHECK, "fewer bytes per step")
    assert "uint8" in bound.reason
    other = h2d_copies_item(facts("COMPUTE-BOUND", on_gpu=True, copies=fast))
    assert other is not None and (other.status, other.bears_on_verdict) == (OK, False)


def test_slow_copies_on_another_verdict_are_a_folded_check() -> None:
    item = h2d_copies_item(facts("HOST-BOUND", on_gpu=True, copies=(copy_seen(),)))
    assert item is not None and (item.status, item.bears_on_verdict) == (CHECK, False)


def test_a_host_bound_loop_gets_a_larger_batch_at_the_loader_line() -> None:
    item = batch_size_item(facts("HOST-BOUND", on_gpu=True, batch_size=32))
    assert (item.status, item.seen, item.to_try, item.line) == (FIX, "32", "64 (if memory allows)", 3)
    assert item.bears_on_verdict
    unknown = batch_size_item(facts("HOST-BOUND", on_gpu=True))
    assert (unknown.seen, unknown.to_try) == ("unknown", "a larger batch")
    other = batch_size_item(facts("COMPUTE-BOUND", on_gpu=True, batch_size=32))
    assert (other.status, other.bears_on_verdict) == (OK, False)
    assert "this one is COMPUTE-BOUND" in other.reason


def test_a_host_bound_loop_points_at_the_line_with_the_most_host_time() -> None:
    busiest = LineSeen(CodeSite(5), "y = tiny_ops(x)", 3.2)
    f = facts("HOST-BOUND", on_gpu=True, host_issue_ms=3.4, step_ms=3.5, gpu_idle_share=0.6, busiest_line=busiest)
    item = launch_overhead_item(f)
    assert (item.status, item.line, item.seen) == (FIX, 5, "host issues 3.4 ms of a 3.5 ms step")
    assert item.to_try == "torch.compile(model), CUDA graphs, torch.autocast"
    assert "it idles 60 % of the step" in item.reason and "Line 5 takes the most host time: 3.20 ms" in item.reason
    for advice in ("torch.compile", "CUDA graphs", "torch.autocast", "fewer small ops"):
        assert advice in item.reason
    other = launch_overhead_item(replace(f, verdict="INPUT-BOUND"))
    assert (other.status, other.bears_on_verdict, other.line) == (OK, False, 5)
    assert launch_overhead_item(facts("HOST-BOUND", on_gpu=True)).seen == "host time per step not measured"


SYNC_TOP = {
    "line": 7,
    "in_cell": True,
    "call": "loss.item()",
    "calls_per_step": 1.0,
    "every_step": True,
    "wait_ms_per_step": 0.1,
    "share": 0.31,
}


def test_an_item_every_step_on_a_host_bound_loop_is_a_fix_on_its_line() -> None:
    item = sync_item(facts("HOST-BOUND", on_gpu=True, sync_top=SYNC_TOP))
    assert item is not None and item.bears_on_verdict
    assert (item.status, item.line, item.to_try) == (FIX, 7, "every N steps, or out of the step")
    assert item.seen == "loss.item() every step (31.0 % of the step)"
    assert item.reason.startswith(
        "`loss.item()` on line 7 synchronises every step: the host waits there 31.0 % of the step."
    )
    assert "Move it out of the step or do it every N steps" in item.reason


def test_syncs_on_other_verdicts_or_not_every_step() -> None:
    busy = sync_item(facts("COMPUTE-BOUND", on_gpu=True, sync_top=SYNC_TOP))
    assert busy is not None and (busy.status, busy.bears_on_verdict) == (CHECK, False)
    rare = sync_item(facts("HOST-BOUND", on_gpu=True, sync_top={**SYNC_TOP, "every_step": False, "calls_per_step": 0.1}))
    assert rare is not None and (rare.status, rare.bears_on_verdict) == (OK, False)
    assert rare.seen == "loss.item() 0.1 per step (31.0 % of the step)"
    assert sync_item(facts("HOST-BOUND", on_gpu=True)) is None
    assert sync_item(facts("HOST-BOUND", on_gpu=True, sync_top={**SYNC_TOP, "in_cell": False})) is None


def test_gpu_items_join_the_checklist_only_where_they_were_measured() -> None:
    cpu = {item.key for item in evaluate(facts("INPUT-BOUND"))}
    assert not cpu & {"h2d_copies", "batch_size", "launch_overhead", "sync"}
    f = facts("HOST-BOUND", on_gpu=True, copies=(copy_seen(pinned=1.0, non_blocking=1.0),), sync_top=SYNC_TOP)
    items = evaluate(f)
    keys = [item.key for item in items]
    assert {"h2d_copies", "batch_size", "launch_overhead", "sync"} <= set(keys)
    assert keys[:3] == ["batch_size", "launch_overhead", "sync"]  # what bears on HOST-BOUND first
    json.dumps([item.to_dict() for item in items])


@pytest.mark.parametrize(("n", "text"), [(0, "0 B"), (512, "512 B"), (4e3, "4.0 kB"), (20e6, "20.0 MB"), (2.5e9, "2.5 GB")])
def test_bytes_per_step_read_in_their_units(n: float, text: str) -> None:
    assert per_step_bytes(n) == text
