"""Numbers a stopwatch agrees with, through %%traceml with real DataLoaders: each cell times its
own loop (time.perf_counter around it) and its own next() waits, and the box's figures are held
to those; a steady pattern of waits is INPUT-BOUND with advice true for the loader; a flat run
claims no trend; a short run compared with itself gets no negative bound."""

from __future__ import annotations

import re
from typing import Any

import pytest
from helpers import run, shell_fixture, traced

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

SETUP = """
import random, time
import torch
from torch.utils.data import DataLoader, Dataset

class Slow(Dataset):
    def __init__(self, n, ms):
        self.n, self.ms = n, ms
    def __len__(self):
        return self.n
    def __getitem__(self, i):
        time.sleep(self.ms / 1000)
        return torch.zeros(8)

class Ready(Dataset):
    def __len__(self):
        return 80
    def __getitem__(self, i):
        return torch.zeros(8)

def busy(ms):
    t = time.perf_counter()
    while time.perf_counter() - t < ms / 1000:
        pass

model = torch.nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
"""

shell = shell_fixture(SETUP)

# The loop as a user writes it, timing itself: the loop's wall clock, every next()'s wait.
TIMED_LOOP = """
waits, k = [], 0
t0 = a = time.perf_counter()
for x in loader:
    waits.append(time.perf_counter() - a)
    loss = model(x).sum()
    loss.backward()
    opt.step()
    opt.zero_grad()
    {body}
    k += 1
    a = time.perf_counter()
to_last_step_ms = 1000 * (a - t0)
wall_ms = 1000 * (time.perf_counter() - t0)
"""

# How far the box's figures may be from the cell's own clock up to its last step's end, beside
# the time the box itself names as between the steps (traceml's own set-up): the loop's first
# fetch begins after traceml reads the new DataLoader. The runs last 1-2.5 s, so that this stays
# within FEW_PERCENT on a loaded machine. The loop's last next() (StopIteration: the workers
# shut down, 0.1-0.3 s for four on a loaded machine) ends no step: the whole loop's clock is
# held to WHOLE_LOOP.
FEW_PERCENT = 0.06
WHOLE_LOOP = 0.15


def box_figures(text: str) -> dict[str, float]:
    """The box's figures: data wait, compute and step time (ms), and the time between steps."""
    numbers = re.search(r"Data wait: ([\d.]+)ms \| CPU compute: ([\d.]+)ms \| Step time: ([\d.]+)ms", text)
    assert numbers, text
    between = re.search(r"\|  - ([\d.]+)ms between the steps", text)
    return {
        "wait": float(numbers[1]),
        "compute": float(numbers[2]),
        "step": float(numbers[3]),
        "between": float(between[1]) if between else 0.0,
    }


def traced_loop(shell: Any, loader: str, body: str = "pass") -> tuple[Any, dict[str, float], dict[str, Any]]:
    run(shell, f"loader = {loader}", check=True)
    got = traced(shell, TIMED_LOOP.format(body=body))
    ns = shell.user_ns
    own = {"wall_ms": ns["wall_ms"], "to_last_step_ms": ns["to_last_step_ms"], "k": ns["k"]}
    return got, box_figures(got.text()), {**own, "waits_ms": [1000 * w for w in ns["waits"]]}


def assert_adds_up_to_the_clock(got: Any, box: dict[str, float], own: dict[str, Any]) -> None:
    """The box's step time x the steps (+ the time it says lies between them) is the loop's wall
    clock to its last step within a few %, and its data wait the cell's own hand-timed waits."""
    assert got.n_steps == own["k"]
    assert box["wait"] + box["compute"] == pytest.approx(box["step"], abs=0.11)  # rounding
    wall, k = own["to_last_step_ms"], own["k"]
    accounted = box["step"] * k + box["between"]
    assert box["between"] < 0.25 * wall, got.text()
    assert accounted == pytest.approx(wall, rel=FEW_PERCENT), (accounted, wall, got.text())
    assert accounted == pytest.approx(own["wall_ms"], rel=WHOLE_LOOP), (accounted, own["wall_ms"])
    hand = sum(own["waits_ms"])
    assert box["wait"] * k + box["between"] == pytest.approx(hand, abs=FEW_PERCENT * wall), (hand, got.text())


def test_four_workers_feeding_a_4_ms_step_the_box_adds_up_to_the_loop(shell: Any) -> None:
    got, box, own = traced_loop(shell, "DataLoader(Slow(200, 40), batch_size=1, num_workers=4)", "busy(4)")
    assert_adds_up_to_the_clock(got, box, own)
    # 4 workers at 40 ms a batch give one every 10 ms or so: the loop waits for its data, steadily.
    assert got.verdict == "INPUT-BOUND", got.text()
    assert "persistent" not in got.verdict_detail.next  # one pass over the loader


def test_two_workers_in_lockstep_are_a_steady_pattern_not_a_straggler(shell: Any) -> None:
    got, box, own = traced_loop(shell, "DataLoader(Slow(140, 28), batch_size=1, num_workers=2)", "busy(1.5)")
    assert_adds_up_to_the_clock(got, box, own)
    assert got.verdict == "INPUT-BOUND", got.text()
    # Where the cell's own waits alternate (a busy machine can pull the two workers apart), the
    # box says so; it says so only where they do. The test's measure (waits over 10 ms) is not
    # the pattern rule's (two humps of steps, regular gaps), so between clearly alternating and
    # clearly not (0.6 to 0.9 of the pairs: CI saw 0.82 without the line) either answer holds.
    long = [w > 10.0 for w in own["waits_ms"][5:]]
    alternate = sum(a != b for a, b in zip(long, long[1:], strict=False)) / (len(long) - 1)
    said = "every 2nd step waits" in got.text()
    assert said == (alternate >= 0.9) or 0.6 <= alternate < 0.9, (alternate, got.text())
    nxt = got.verdict_detail.next
    assert "persistent" not in nxt and "more DataLoader workers" in nxt, nxt


def test_a_checkpoint_every_4th_step_is_in_the_step_time_and_named(shell: Any) -> None:
    got, box, own = traced_loop(
        shell, "DataLoader(Ready(), batch_size=1)", "busy(3)\n    if k % 4 == 3: time.sleep(0.030)"
    )
    assert_adds_up_to_the_clock(got, box, own)
    assert "every 4th step takes" in got.text(), got.text()
    assert got.summary["step_ms"] < box["step"]  # the median alone hides the checkpoint


def test_a_flat_run_of_steps_from_1_to_10_ms_claims_no_trend(shell: Any) -> None:
    run(shell, "random.seed(3)\nloader = [torch.zeros(8)] * 90", check=True)
    got = traced(shell, TIMED_LOOP.format(body="time.sleep(random.uniform(0.001, 0.010))"))
    assert got.summary["trend"] is not None
    assert got.summary["trend"]["direction"] is None, got.text()
    assert "Steps got" not in got.text()


def test_a_short_run_compared_with_itself_has_no_negative_bound(shell: Any) -> None:
    run(shell, "loader = DataLoader(Slow(10, 2), batch_size=1)", check=True)
    traced(shell, TIMED_LOOP.format(body="busy(random.uniform(1, 4))"), "--no-live --name short")
    result = run(shell, "%traceml compare short short", check=True)
    interval = re.search(r"interval (-?[\d.]+)x to (-?[\d.]+)x", result.shown)
    assert interval, result.shown
    assert 0 < float(interval[1]) <= 1.0 <= float(interval[2]), result.shown
    assert "run both longer" in result.shown  # few steps: it says how sure it is
