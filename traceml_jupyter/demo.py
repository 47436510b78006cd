"""Teaching scenarios: a real dataset, DataLoader, model and optimizer for each classic input
bottleneck, so a notebook cell can show the plain training loop a user would write.

    loader, model, opt, loss_fn, device = traceml_jupyter.demo.setup("slow")

    %%traceml --name slow
    for epoch in range(2):
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()

Scenarios, and the verdict each is built to get under `%%traceml`:

- ``fast``: images already in memory as tensors (a TensorDataset): COMPUTE-BOUND.
- ``slow``: each image is decoded when it is read, in the training process
  (``num_workers=0``): INPUT-BOUND.
- ``fixed``: the slow data with the checklist applied: worker processes, persistent workers,
  pinned memory on CUDA (and ``non_blocking=True`` copies in the loop): faster than slow.
- ``collate``: a ``collate_fn`` that augments every sample in Python: INPUT-BOUND.
- ``spiky``: cheap data, but workers restart every epoch (``persistent_workers=False``) and
  open their shards when they start: INPUT STRAGGLER.
- ``h2d`` (CUDA only): large float batches, ready at once, copied from pageable memory: the
  copy to the GPU is the step: H2D-BOUND.

The data costs are set from the measured time of one training step on this machine (see
`data_costs`), so the verdicts hold on a slow laptop, a loaded CI machine and a GPU alike. The
decode is a sleep: it stands for reading a file and decoding it in a library that releases
the GIL, so worker processes overlap it. The datasets, the collate function and the worker
start-up live in this module (not in ``__main__``), so worker processes also start under
Python 3.14's ``forkserver`` default.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from .analysis.verdict import VerdictLabel
from .capture.resources.host import usable_cpus
from .failures import read_or

SCENARIOS = ("fast", "slow", "fixed", "collate", "spiky", "h2d")
CPU_SCENARIOS = ("fast", "slow", "fixed", "collate", "spiky")
EPOCHS = {"fast": 2, "slow": 2, "fixed": 2, "collate": 2, "spiky": 4, "h2d": 2}

# The verdict each scenario is built to get (fixed is judged by its speed-up over slow).
INTENDED_VERDICT = {
    "fast": VerdictLabel.COMPUTE_BOUND,
    "slow": VerdictLabel.INPUT_BOUND,
    "collate": VerdictLabel.INPUT_BOUND,
    "spiky": VerdictLabel.INPUT_STRAGGLER,
    "h2d": VerdictLabel.H2D_BOUND,
}

# What each scenario stands for, in one line (the demo runner prints it above the box).
STORY = {
    "fast": "in-memory tensors: the loader keeps up, the model is the work",
    "slow": "a per-sample decode in the training process (num_workers=0)",
    "fixed": "the slow data with the checklist applied: workers, persistent_workers, non_blocking",
    "collate": "an expensive collate_fn assembling each batch",
    "spiky": "workers restart every epoch and the first batches stall",
    "h2d": "large unpinned batches copied to the GPU (CUDA only)",
}

# The least speed-up of fixed over slow that the demo notebook promises. Expected about 2.5x
# with 2 workers (see data_costs); measured 2.0x to 3.3x on a busy 2-core machine.
FIXED_SPEEDUP = 1.5

IMAGE_SHAPE = (3, 32, 32)
CLASSES = 10
Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class Sizes:
    """The shape of one scenario on one kind of device."""

    batch_size: int
    batches: int  # per epoch
    hidden: int  # width of the classifier's hidden layers
    depth: int  # number of hidden layers
    workers: int = 0
    image_shape: tuple[int, int, int] = IMAGE_SHAPE


@dataclass(frozen=True)
class DataCosts:
    """What the data pipeline of a scenario costs, per sample or per worker start."""

    decode_ms: float = 0.0  # per sample, in the dataset's __getitem__
    collate_ms: float = 0.0  # per sample, in collate_fn
    worker_start_s: float = 0.0  # per worker start (opening shards, reading an index)


def fixed_workers(cpus: int) -> int:
    """Workers of the fixed scenario: one a core, at least 2 and at most 4 (no more than the
    cores where there are 2 or more, so torch does not warn about too many workers)."""
    return max(2, min(4, cpus))


def sizes_for(
    scenario: str, on_cuda: bool, batches: int | None = None, cpus: int | None = None
) -> Sizes:
    """The shape of `scenario` on a CPU or a CUDA device.

    CPU: batches of 64 images and an MLP whose training step takes about 20 ms on a 2-core
    machine. CUDA: batches of 256 and a wider, deeper MLP (a few ms a step on a large GPU,
    some tens of ms on a T4), heavy enough that the GPU step outlasts the fetch of a batch.
    """
    check_scenario(scenario)
    if on_cuda:
        bs, per_epoch, hidden, depth = 256, 40, 4096, 8
    else:
        bs, per_epoch, hidden, depth = 64, 30, 1536, 2
    workers = {"fixed": fixed_workers(cpus or usable_cpus()), "spiky": 2}
    counts = {"fast": 2 * per_epoch, "spiky": 12}
    sizes = Sizes(bs, counts.get(scenario, per_epoch), hidden, depth, workers.get(scenario, 0))
    if scenario == "h2d":
        sizes = Sizes(128, 20, hidden=64, depth=1, image_shape=(3, 224, 224))
    if batches is not None:
        if batches < 1:
            raise ValueError("batches must be 1 or more")
        sizes = replace(sizes, batches=batches)
    return sizes


def data_costs(scenario: str, sizes: Sizes, step_ms: float, workers: int) -> DataCosts:
    """The data costs of `scenario`, from the measured training step time `step_ms` and the
    number of `workers` of the fixed loader.

    - slow (and fixed, the same data): a batch decodes in 0.75 x `workers` steps, so the
      slow loop waits for data 60 % (2 workers) to 75 % (4 workers) of each step, while the
      fixed loader's workers decode a batch every 0.75 step and keep up.
    - collate: the collate_fn costs 3 steps a batch: the loop waits about 75 % of each step.
    - spiky: a worker start costs 3 epochs of compute (at least 0.3 s, at most 3 s): the
      stall at each epoch start is most of the run, while the median wait stays tiny.
    The step time is the fastest measured (see `measure_step_ms`), so each share stays over
    10 % even when a loaded machine later runs the steps several times slower (with two
    torch threads on two busy cores, 4x is common).
    """
    check_scenario(scenario)
    per_sample = step_ms / sizes.batch_size
    if scenario in ("slow", "fixed"):
        return DataCosts(decode_ms=0.75 * workers * per_sample)
    if scenario == "collate":
        return DataCosts(collate_ms=3.0 * per_sample)
    if scenario == "spiky":
        start = 3.0 * sizes.batches * step_ms / 1000.0
        return DataCosts(worker_start_s=min(3.0, max(0.3, start)))
    return DataCosts()


def check_scenario(scenario: str) -> None:
    """Raise ValueError naming the known scenarios when `scenario` is not one of them."""
    if scenario not in SCENARIOS:
        raise ValueError(f"unknown demo scenario {scenario!r}; known: {', '.join(SCENARIOS)}")


# -- data ------------------------------------------------------------------------------------


# Costs are slept off in pieces of at least this many seconds: few wake-ups, so worker
# processes do not keep preempting the training process's compute threads.
SLEEP_PIECE_S = 0.005


def spend(owed_s: float) -> float:
    """Sleep off what is owed once it reaches SLEEP_PIECE_S; return what is still owed
    (negative when the sleep ran over), so that tiny per-sample costs add up exactly."""
    if owed_s < SLEEP_PIECE_S:
        return owed_s
    start = time.perf_counter()
    time.sleep(owed_s)
    return owed_s - (time.perf_counter() - start)


class EncodedImages(Dataset[Batch]):
    """Images stored encoded (uint8); each read decodes one into a normalised float tensor.

    `decode_ms` is what a real decoder (JPEG, audio, a tokenizer) costs per sample.
    """

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, decode_ms: float) -> None:
        self.images = images
        self.labels = labels
        self.decode_ms = decode_ms
        self._owed = 0.0

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def __getitem__(self, index: int) -> Batch:
        self._owed = spend(self._owed + self.decode_ms / 1000.0)
        image = self.images[index].float().div_(255.0).sub_(0.5)
        return image, self.labels[index]


class RawImages(Dataset[Batch]):
    """Encoded images returned as they are stored: the collate function does the work."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        self.images = images
        self.labels = labels

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def __getitem__(self, index: int) -> Batch:
        return self.images[index], self.labels[index]


class AugmentCollate:
    """A collate_fn that augments each sample in Python (decode, flip, shift) before stacking:
    per-sample work that is easy to put in collate_fn and hard to see there."""

    def __init__(self, per_sample_ms: float) -> None:
        self.per_sample_ms = per_sample_ms
        self._owed = 0.0

    def __call__(self, samples: list[Batch]) -> Batch:
        images, labels = [], []
        for i, (image, label) in enumerate(samples):
            self._owed = spend(self._owed + self.per_sample_ms / 1000.0)
            x = image.float().div_(255.0).sub_(0.5)
            if i % 2:
                x = x.flip(-1)
            images.append(torch.roll(x, shifts=i % 3 - 1, dims=-2))
            labels.append(label)
        return torch.stack(images), torch.stack(labels)


class OpenShards:
    """A worker_init_fn: each worker opens its shards (an index, file handles) as it starts."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __call__(self, worker_id: int) -> None:
        time.sleep(self.seconds)


class LargeBatches(Dataset[Batch]):
    """Whole batches of full-size float images (3x224x224), ready in ordinary (pageable) host
    memory: fetching one costs nothing, copying it to the GPU is the whole story."""

    def __init__(
        self, batches: int, batch_size: int, shape: tuple[int, int, int], seed: int = 0
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.batches = batches
        self.bank = torch.rand((4, batch_size, *shape), generator=gen)
        self.labels = torch.randint(0, CLASSES, (batches, batch_size), generator=gen)

    def __len__(self) -> int:
        return self.batches

    def __getitem__(self, index: int) -> Batch:
        return self.bank[index % len(self.bank)], self.labels[index]


def encoded_images(n: int, shape: tuple[int, int, int], seed: int) -> Batch:
    """`n` synthetic encoded images (uint8) whose class shows in their brightness, and labels."""
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, CLASSES, (n,), generator=gen)
    noise = torch.randint(0, 160, (n, *shape), generator=gen, dtype=torch.int16)
    images = (noise + (labels * 9).view(-1, 1, 1, 1)).clamp(0, 255).to(torch.uint8)
    return images, labels


# -- model -----------------------------------------------------------------------------------


def classifier(sizes: Sizes) -> nn.Module:
    """A plain MLP image classifier: Flatten, `depth` x (Linear, ReLU), Linear."""
    features = sizes.image_shape[0] * sizes.image_shape[1] * sizes.image_shape[2]
    layers: list[nn.Module] = [nn.Flatten()]
    width = features
    for _ in range(sizes.depth):
        layers += [nn.Linear(width, sizes.hidden), nn.ReLU()]
        width = sizes.hidden
    layers.append(nn.Linear(width, CLASSES))
    return nn.Sequential(*layers)


_STEP_MS: dict[tuple[str, int, int, int, int], float] = {}


def measure_step_ms(sizes: Sizes, device: torch.device, repeats: int = 7) -> float:
    """The fastest of a few training steps (ms) of the classifier on `device`, on a throwaway
    copy; measured once per process, shape and torch thread count, so slow and fixed get the
    same data costs.

    The fastest, not the median: a busy machine slows some steps many times over, and data
    costs set from a slowed step would outrun the fixed loader's workers."""
    key = (str(device), torch.get_num_threads(), sizes.batch_size, sizes.hidden, sizes.depth)
    if key in _STEP_MS:
        return _STEP_MS[key]
    model = classifier(sizes).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    x = torch.randn((sizes.batch_size, *sizes.image_shape), device=device)
    y = torch.randint(0, CLASSES, (sizes.batch_size,), device=device)
    on_cuda = device.type == "cuda"
    times = []
    for _ in range(2 + repeats):  # the first two steps warm up allocators and kernels
        if on_cuda:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
        if on_cuda:
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - start) * 1000.0)
    _STEP_MS[key] = min(times[2:])
    return _STEP_MS[key]


# -- the scenarios -----------------------------------------------------------------------------


class Demo(NamedTuple):
    """What a training cell needs; unpacks as `loader, model, opt, loss_fn, device`."""

    loader: Any
    model: Any
    opt: Any
    loss_fn: Any
    device: Any


def training_loop(scenario: str) -> str:
    """The plain loop the demo cells train with (the fixed scenario copies non_blocking)."""
    nb = ", non_blocking=True" if scenario == "fixed" else ""
    return (
        f"for epoch in range({EPOCHS[scenario]}):\n"
        "    for x, y in loader:\n"
        f"        x, y = x.to(device{nb}), y.to(device{nb})\n"
        "        opt.zero_grad()\n"
        "        loss = loss_fn(model(x), y)\n"
        "        loss.backward()\n"
        "        opt.step()\n"
    )


def build_loader(
    scenario: str, sizes: Sizes, costs: DataCosts, on_cuda: bool, seed: int = 0
) -> DataLoader[Any]:
    """The DataLoader of `scenario`, written as a user would write it."""
    n = sizes.batch_size * sizes.batches
    gen = torch.Generator().manual_seed(seed)
    if scenario == "h2d":  # the dataset yields whole batches: batch_size=None
        data = LargeBatches(sizes.batches, sizes.batch_size, sizes.image_shape, seed)
        return DataLoader(data, batch_size=None, shuffle=True, generator=gen)
    images, labels = encoded_images(n, sizes.image_shape, seed)
    if scenario == "fast":
        x = images.float().div_(255.0).sub_(0.5)
        return DataLoader(
            TensorDataset(x, labels), batch_size=sizes.batch_size, shuffle=True, generator=gen
        )
    if scenario == "collate":
        return DataLoader(
            RawImages(images, labels),
            batch_size=sizes.batch_size,
            shuffle=True,
            generator=gen,
            collate_fn=AugmentCollate(costs.collate_ms),
        )
    encoded = EncodedImages(images, labels, costs.decode_ms)
    if scenario == "slow":
        return DataLoader(encoded, batch_size=sizes.batch_size, shuffle=True, generator=gen)
    if scenario == "fixed":
        return DataLoader(
            encoded,
            batch_size=sizes.batch_size,
            shuffle=True,
            generator=gen,
            num_workers=sizes.workers,
            persistent_workers=True,
            pin_memory=on_cuda,
        )
    if scenario == "spiky":
        return DataLoader(
            encoded,
            batch_size=sizes.batch_size,
            shuffle=True,
            generator=gen,
            num_workers=sizes.workers,
            persistent_workers=False,
            worker_init_fn=OpenShards(costs.worker_start_s),
        )
    raise ValueError(f"unknown demo scenario {scenario!r}; known: {', '.join(SCENARIOS)}")


def default_device() -> torch.device:
    """CUDA when a GPU is there, found without initialising CUDA (NVML's device count) unless
    CUDA is initialised already: `torch.cuda.is_available()` would initialise it and break a
    later fork-started launcher (accelerate.notebook_launcher). Pass device="cuda" to insist."""
    count = read_or(-1, _cuda_devices, torch.cuda)  # a broken driver or NVML: none seen
    return torch.device("cuda" if count > 0 else "cpu")


def _cuda_devices(cuda: Any) -> int:
    """The CUDA devices torch sees: its count once CUDA is initialised, else NVML's (-1: none)."""
    if cuda.is_initialized():
        return int(cuda.device_count())
    return int(getattr(cuda, "_device_count_nvml", lambda: -1)())


def setup(
    scenario: str = "slow",
    batches: int | None = None,
    device: str | torch.device | None = None,
    seed: int = 0,
) -> Demo:
    """Build the data, DataLoader, model, optimizer and loss of a demo scenario.

    `batches` (per epoch) shortens or lengthens a run; `device` defaults to CUDA when there
    is a GPU, else the CPU. The first call on a device times a few training steps (about
    a second on a laptop CPU) to set the data costs.
    """
    check_scenario(scenario)
    dev = torch.device(device) if device is not None else default_device()
    on_cuda = dev.type == "cuda"
    if scenario == "h2d" and not on_cuda:
        raise ValueError("the h2d scenario copies batches to a CUDA GPU; this machine has none")
    sizes = sizes_for(scenario, on_cuda, batches)
    if scenario in ("fast", "h2d"):
        costs = DataCosts()
    else:
        workers = sizes_for("fixed", on_cuda).workers
        costs = data_costs(scenario, sizes, measure_step_ms(sizes, dev), workers)
    torch.manual_seed(seed)
    model = classifier(sizes).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loader = build_loader(scenario, sizes, costs, on_cuda, seed)
    return Demo(loader, model, opt, nn.CrossEntropyLoss(), dev)


# -- a trainer whose loop the magic cannot see ----------------------------------------------------


def library_fit(
    loader: Any, model: Any, opt: Any, loss_fn: Any, device: Any, epochs: int = 1
) -> int:
    """Train as library code does: batches pulled with `next()` in a `while` loop, out of the
    notebook's sight (`%%traceml` times it by its optimizer steps). Returns the steps."""
    steps = 0
    for _ in range(epochs):
        batches = iter(loader)
        while True:
            try:
                x, y = next(batches)
            except StopIteration:
                break
            x, y = x.to(device), y.to(device)
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()
            steps += 1
    return steps
