"""Swap copies: data round-trips, and the host never reads host blocks before the fence says the
device-to-host copies that wrote them have finished (a recording fence stands in for CUDA's)."""

from __future__ import annotations

import torch

from tokenloom.engine.runner.copy_fence import NoCopyFence
from tokenloom.engine.runner.swap_copier import SwapCopier

LAYERS, BLOCKS, HOST_BLOCKS, BLOCK_SIZE, HEADS, DIM = 2, 6, 5, 4, 2, 8


class RecordingFence:
    def __init__(self, log: list[str]):
        self.log = log

    def record(self) -> None:
        self.log.append("record")

    def wait(self) -> None:
        self.log.append("wait")


def make_copier(fence) -> SwapCopier:
    device_pool = torch.randn(LAYERS, 2, BLOCKS, BLOCK_SIZE, HEADS, DIM)
    host_pool = torch.zeros(HOST_BLOCKS, LAYERS, 2, BLOCK_SIZE, HEADS, DIM)
    return SwapCopier(device_pool, host_pool, fence)


def recording_copier() -> tuple[SwapCopier, list[str]]:
    log: list[str] = []
    copier = make_copier(RecordingFence(log))
    copy_to_host, read_host = copier._copy_to_host, copier._read_host_blocks

    def logged_copy(blocks, host_start):
        log.append(f"d2h {host_start}+{blocks.shape[0]}")
        copy_to_host(blocks, host_start)

    def logged_read(host_ids):
        log.append(f"host read {host_ids}")
        return read_host(host_ids)

    copier._copy_to_host, copier._read_host_blocks = logged_copy, logged_read
    return copier, log


def test_swap_out_then_in_restores_every_layer_of_the_blocks():
    copier = make_copier(NoCopyFence())
    original = copier.device_pool.clone()
    copier.swap_out([(1, 3), (4, 0)])
    copier.device_pool.zero_()
    copier.swap_in([(3, 5), (0, 2)])
    assert torch.equal(copier.device_pool[:, :, 5], original[:, :, 1])
    assert torch.equal(copier.device_pool[:, :, 2], original[:, :, 4])


def test_host_blocks_are_block_major_so_a_host_block_is_one_contiguous_range():
    copier = make_copier(NoCopyFence())
    copier.swap_out([(2, 1)])
    assert copier.host_pool[1].is_contiguous()
    assert torch.equal(copier.host_pool[1], copier.device_pool[:, :, 2])


def test_consecutive_host_blocks_go_in_one_copy_and_the_fence_is_recorded_after_the_copies():
    copier, log = recording_copier()
    copier.swap_out([(0, 1), (3, 2), (5, 3), (2, 0)])
    assert log == ["d2h 1+3", "d2h 0+1", "record"]


def test_swap_in_waits_on_the_fence_before_the_host_reads_the_swapped_out_blocks():
    copier, log = recording_copier()
    copier.swap_out([(1, 0), (2, 1)])
    copier.swap_in([(0, 4), (1, 5)])
    assert log == ["d2h 0+2", "record", "wait", "host read [0, 1]"]


def test_a_plan_that_swaps_out_and_in_at_once_records_before_it_waits():
    copier, log = recording_copier()
    copier.swap_out([(1, 2)])  # an earlier step's swap-out, still in flight on a GPU
    copier.swap_out([(3, 3)])  # this plan: out, then in (ModelRunner.copy_swaps' order)
    copier.swap_in([(2, 1)])
    assert log.index("wait") > max(i for i, entry in enumerate(log) if entry == "record")
    assert log[-1] == "host read [2]"
