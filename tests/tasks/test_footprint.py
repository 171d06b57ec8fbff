"""What a step holds beyond its process's resident models (digenrl.tasks.footprint):
the peak of the tensor bytes allocated inside a block, on real tensors."""

from __future__ import annotations

import threading

import torch

from digenrl.tasks.footprint import PeakBytes, tensor_bytes

MB = 4 * 1000 * 1000  # a 1000 x 1000 float32 tensor


def test_the_peak_counts_what_the_block_allocated_and_still_held():
    """x, y = x @ x and z = relu(y) alive at once (3 tensors); once x and y are gone a
    fourth is allocated (w) and split into views (no bytes), and an in-place op and a
    view of a weight made before the block add nothing."""
    weight = torch.randn(1000, 1000)
    with PeakBytes() as peak:
        x = torch.randn(1000, 1000)
        y = x @ x
        z = torch.relu(y)
        del x, y
        w = z * 2
        w.add_(1.0)
        halves = w.chunk(2)
        _ = weight.t()
        del w, z
        assert peak.live == MB          # the halves keep w's storage
        del halves
        assert peak.live == 0
    assert peak.peak == 3 * MB


def test_another_threads_tensors_are_not_counted():
    """The mode is the thread's: a tensor allocated meanwhile by another thread is not
    the block's."""
    done = threading.Event()
    kept: list[torch.Tensor] = []

    def other() -> None:
        kept.append(torch.zeros(1000, 1000))
        done.set()

    with PeakBytes() as peak:
        a = torch.ones(500, 1000)
        thread = threading.Thread(target=other)
        thread.start()
        thread.join()
    assert done.is_set() and peak.peak == MB // 2
    del a


def test_resident_bytes_count_each_storage_once_on_its_device():
    """Two modules sharing a weight count it once; a module on another device type is
    not this device's."""
    a = torch.nn.Linear(100, 100)
    b = torch.nn.Linear(100, 100)
    b.weight = a.weight
    per = 100 * 100 * 4
    assert tensor_bytes([a, b], torch.device("cpu")) == per + 2 * 100 * 4
    with torch.device("meta"):
        c = torch.nn.Linear(100, 100)
    assert tensor_bytes([c], torch.device("cpu")) == 0
