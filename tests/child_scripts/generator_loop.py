"""A loop with no training events and no torch: batches from a generator, a sleep as the work.
Its steps exist only with `--loop generator_loop.py:LINE` (the `for` below)."""

import sys
import time


def batches(n: int, sleep_s: float):
    for i in range(n):
        time.sleep(sleep_s)  # reading a batch
        yield i


def main() -> None:
    total = 0
    for batch in batches(int(sys.argv[1]) if len(sys.argv) > 1 else 20, 0.004):
        time.sleep(0.001)  # the work on it
        total += batch
    print("total", total)


if __name__ == "__main__":
    main()
