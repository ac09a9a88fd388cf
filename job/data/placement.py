"""Where a data set lives while a run trains, decided here and nowhere else: streamed from shards or held in memory
(before anything is decoded), and, held, on the training device or the host. Each decision is a value with its
reason, which the start-up line prints."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Streaming:
    """Whether a data set is streamed from shards rather than held decoded in memory, and why."""

    streamed: bool
    reason: str


def decide_streaming(setting: str, decoded_bytes: int | None, share: float) -> Streaming:
    """data.placement: stream always streams; host or device hold; auto streams when the data set, decoded
    (`decoded_bytes`, None when it cannot be streamed), would take more than `share` of the free host memory."""
    if setting == "stream":
        return Streaming(True, "data.placement=stream")
    if setting != "auto" or decoded_bytes is None:
        return Streaming(False, f"data.placement={setting}")
    from job.memory import available_host_memory

    room = share * available_host_memory()
    if decoded_bytes > room:
        return Streaming(
            True, f"decoded, it would take {decoded_bytes / 1e9:.1f} GB, more than {room / 1e9:.1f} GB of host memory"
        )
    return Streaming(False, f"decoded, it takes {decoded_bytes / 1e9:.2f} GB of {room / 1e9:.1f} GB allowed")


def hold_on(nbytes: int, device: torch.device, setting: str, share: float, cap: float | None = None) -> torch.device:
    """Where data held in memory is held: on the training device when asked or when it fits in `share` of its free
    memory (of at most `cap` bytes, where the process is held to less than the device has); else the host."""
    if device.type == "cpu" or setting == "host":
        return torch.device("cpu")
    if setting == "device":
        return device
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        free = min(free, cap) if cap is not None else free
        return device if nbytes <= share * free else torch.device("cpu")
    return device
