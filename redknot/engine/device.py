"""Which torch device the engine runs on, checked against the hardware option."""
from __future__ import annotations

import torch

from redknot.config.schema import Accelerator, HardwareConfig

# CPU has no "free device memory" to size the cache from; this is its default budget
# (engine.scheduler.num_cache_blocks overrides it).
CPU_CACHE_BUDGET_BYTES = 512 * 2**20


def select_device(hardware: HardwareConfig) -> torch.device:
    """Check the machine fits ``hardware`` (error names the device found and the option that
    fits) and return the torch device to use."""
    from redknot.config.hardware_fit import check_device

    check_device(hardware)
    accel = Accelerator(hardware.accelerator)
    if accel == Accelerator.cpu:
        return torch.device("cpu")
    if accel == Accelerator.cuda:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("npu", 0)


def synchronize(device: torch.device) -> None:
    """Wait for the device so that host timestamps are taken after its work finished."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "npu":
        torch.npu.synchronize()


def cache_budget_bytes(device: torch.device, memory_utilization: float) -> int:
    """Bytes the state cache may take: on a GPU the free memory above the
    ``1 - memory_utilization`` share of the total kept back (weights are already loaded)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return int(free - (1.0 - memory_utilization) * total)
    if device.type == "npu":
        free, total = torch.npu.mem_get_info()
        return int(free - (1.0 - memory_utilization) * total)
    return CPU_CACHE_BUDGET_BYTES


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return 0
