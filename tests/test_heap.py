"""``runtime/heap.py``: freed memory kept for the next step (no page faults for its tensors)."""

import subprocess
import sys

from parambox.runtime import heap

# A step that frees 24 MiB at the heap's top: glibc's default trim threshold (twice the largest block
# mapped on its own so far) gives it back to the kernel, so the next step faults its pages in again.
CHILD = """
import resource, torch
from parambox.runtime.heap import keep_freed_memory
x = torch.ones(1 << 21)  # 8 MiB
def faults_in_steps(n=10):
    def step():
        a, b, c = x * 2, x * 3, x * 4
        return float((a + b + c).sum())
    step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(n):
        step()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(faults_in_steps(), keep_freed_memory(), faults_in_steps())
"""


def test_freed_blocks_serve_the_next_step_without_page_faults():
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True).stdout
    default, kept, after = out.split()
    assert kept == "True"
    assert int(default) > 10 * 2048  # every step faulted in most of its 8 MiB blocks (4 KiB pages)
    # Kept: at most one block's pages over the 10 steps (about 1 run in 6 here, the heap grows once
    # more after the warm-up step, by one 8 MiB block: 2048 faults), against most blocks every step.
    assert int(after) < 2 * 2048


def test_opted_out_it_leaves_malloc_alone(monkeypatch):
    monkeypatch.setenv(heap.ENV, "0")
    assert heap.keep_freed_memory() is False
