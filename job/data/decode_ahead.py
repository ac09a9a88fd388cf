"""Samples decoded ahead of the step that needs them: a stream's samples sent to the decoder in groups, a few groups
before they are used, those that cannot be decoded named once and counted (Skipped), and a device's images copied
to host memory without the host waiting."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future

import torch

from job.data.decode import Decoder, decoded
from job.data.sample_stream import SampleStream
from job.data.shards import Sample


def host_copy(images: torch.Tensor) -> torch.Tensor:
    """Images in host memory without the host waiting: a device's (the device decoder's) copied into page-locked
    memory on the stream, where the next pass's copy back to the device is queued after it."""
    if not images.is_cuda:
        return images
    out = torch.empty(images.shape, dtype=images.dtype, pin_memory=True)
    return out.copy_(images, non_blocking=True)


def submitted(group: list[Sample], urls: list[str], decoder: Decoder) -> tuple[Future, tuple[str, str], torch.Tensor]:
    """A group of samples sent to the decoder: its future, the first and last names (what a decoding error names)
    and its labels."""
    items = [(f"{urls[s.shard]}:{s.key}", *s.image()) for s in group]
    return decoder.submit(items), (items[0][0], items[-1][0]), torch.tensor([s.label() for s in group])


class Skipped:
    """The samples of a stream that could not be decoded: each named once (the first few) and counted, through
    `log`; their label is IGNORED, so the loss and the evaluation's counts leave them out, and a batch keeps its
    shape and its place in the epoch (a resumed run reads the same stream)."""

    SHOWN = 3

    def __init__(self, log: Callable[[str], None] | None) -> None:
        self.log, self.names = log, set()

    def decoded(self, future, names: tuple[str, str], labels: torch.Tensor) -> torch.Tensor:
        found: list[str] = []
        images = decoded(future, names, labels, found)
        for why in found:
            if why not in self.names:
                self.names.add(why)
                if self.log is not None and len(self.names) <= self.SHOWN:
                    self.log(f"data: skipped a sample: {why}")
                elif self.log is not None and len(self.names) in (self.SHOWN + 1, 100, 1000):
                    self.log(f"data: {len(self.names)} samples that cannot be decoded skipped so far")
        return images


def decoded_ahead(
    stream: SampleStream,
    urls: list[str],
    size: int,
    decoder: Decoder,
    ahead: int,
    whole_only: bool,
    skipped: Skipped | None = None,
) -> Iterator[tuple[torch.Tensor, torch.Tensor, tuple, list[Sample]]]:
    """The stream's samples in groups of `size`, decoded: (images, labels, the stream's position after the group,
    the group), each submitted to the decoder `ahead` groups before it is used; `whole_only`: a last, short group
    is left out. Closing it cancels what was submitted."""
    samples, pending = iter(stream), deque()
    try:
        while True:
            while len(pending) < ahead:
                group = [s for _, s in zip(range(size), samples)]
                if not group or (whole_only and len(group) < size):
                    break
                pending.append((*submitted(group, urls, decoder), stream.position(), group))
            if not pending:
                return
            future, names, labels, place, group = pending.popleft()
            yield (skipped or Skipped(None)).decoded(future, names, labels), labels, place, group
    finally:
        for future, *_ in pending:
            future.cancel()
