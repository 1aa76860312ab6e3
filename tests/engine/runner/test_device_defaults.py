"""[scheduler] limits left at 0 (auto) take the device's defaults; limits the user set are kept."""

from __future__ import annotations

from tokenloom.engine.config import SchedulerConfig
from tokenloom.engine.runner.kv_plan import GIB, device_kv_budget_bytes


def test_unset_limits_are_cpu_sized_on_a_cpu():
    resolved = SchedulerConfig().resolved_for("cpu")
    assert (resolved.max_num_seqs, resolved.max_num_batched_tokens) == (64, 512)


def test_unset_limits_are_gpu_sized_on_cuda():
    resolved = SchedulerConfig().resolved_for("cuda")
    assert (resolved.max_num_seqs, resolved.max_num_batched_tokens) == (256, 8192)


def test_a_limit_the_user_set_is_kept_and_only_the_other_is_auto():
    resolved = SchedulerConfig(max_num_seqs=32).resolved_for("cuda")
    assert (resolved.max_num_seqs, resolved.max_num_batched_tokens) == (32, 8192)
    resolved = SchedulerConfig(max_num_batched_tokens=2048).resolved_for("cpu")
    assert (resolved.max_num_seqs, resolved.max_num_batched_tokens) == (64, 2048)


def test_the_kv_budget_is_the_utilised_share_less_what_is_in_use_and_reserved():
    total, free = 140 * GIB, 130 * GIB  # 10 GiB in use: weights and the CUDA context
    assert device_kv_budget_bytes(total, free, 0.9, reserved_bytes=3 * GIB) == int(140 * GIB * 0.9) - 10 * GIB - 3 * GIB


def test_the_kv_budget_is_never_negative():
    assert device_kv_budget_bytes(10 * GIB, 1 * GIB, 0.5, reserved_bytes=GIB) == 0
