"""A card capped to fewer bytes than it has, so that a larger GPU rehearses a smaller one (`gpu_memory_gb`)."""

from __future__ import annotations

import torch


def cap_gpu_memory(device: str | torch.device, gpu_memory_gb: float | None) -> None:
    """Cap this process's CUDA allocator on `device` to `gpu_memory_gb` GB (10^9 bytes): an allocation past it fails
    as it would on a card of that size. Nothing for None or a CPU device."""
    device = torch.device(device)
    if device.type != "cuda" or gpu_memory_gb is None:
        return
    index = torch.cuda.current_device() if device.index is None else device.index  # accelerate's "cuda" has none
    total = torch.cuda.get_device_properties(index).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, gpu_memory_gb * 1e9 / total), index)
