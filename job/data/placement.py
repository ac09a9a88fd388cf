"""Where a data set lives while a run trains, decided here and nowhere else: streamed from shards or held in memory
(before anything is decoded), and, held, on the training device or the host. Each decision is a value with its
reason, which the start-up line prints; the first is recorded in every checkpoint, since streaming and holding
read the data in another order with another decoder: a resumed run keeps what its run started with. A data set
packed to stream keeps small images decoded in its pack (Stored): the pack's index records it, and the checkpoint
too, so that a run resumed mid-epoch reads the pack its saved byte offsets point into."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from job.data.files import Source, images_listed, is_archive


@dataclass(frozen=True)
class Stored:
    """How a pack made to stream holds its images, and why: decoded (uint8 pixels, so that an epoch reads them back
    and decodes nothing) or as their files' bytes (decoded each time they are read)."""

    decoded: bool
    reason: str

    def saved(self) -> dict:
        return {"decoded": self.decoded, "reason": self.reason}


# Pixels an image may have to be kept decoded in a pack: up to 64 x 64 (CIFAR, MNIST, Tiny ImageNet), 12 KB an image
# decoded, a few times its JPEG or PNG; decoding it costs a streamed epoch more than reading those bytes (CIFAR-10 on
# 2 cores: 0.9 s of CPU an epoch of 10,000 images against 0.2 s to read them, docs/benchmarks.md). A photo decoded
# takes ten to fifty times its file: kept as it is.
SMALL_IMAGE = 64 * 64


def decide_stored(largest: int) -> Stored:
    """How a pack holds images the largest of which has `largest` pixels (0: none seen)."""
    if 0 < largest <= SMALL_IMAGE:
        return Stored(True, f"images of at most {largest} pixels kept decoded in its pack: an epoch decodes nothing")
    return Stored(False, f"images of up to {largest} pixels kept as their files in its pack, decoded as read")


def stored_from(saved: dict | None) -> Stored | None:
    """A Stored as a pack's index or a checkpoint records it (Stored.saved()); None where none is recorded: shards
    of the user's own, and a pack (or a run) of a version whose packs kept every image as its file."""
    if not isinstance(saved, dict) or not isinstance(saved.get("decoded"), bool):
        return None
    return Stored(saved["decoded"], str(saved.get("reason", "")))


@dataclass(frozen=True)
class Streaming:
    """Whether a data set is streamed from shards rather than held decoded in memory, and why; packed to stream
    by the run, how its pack holds the images (None: shards of the user's own, or a run of an earlier version)."""

    streamed: bool
    reason: str
    stored: Stored | None = None

    def saved(self) -> dict:
        return {"streamed": self.streamed, "reason": self.reason} | (
            {"stored": self.stored.saved()} if self.stored is not None else {}
        )


HELD = Streaming(False, "held in memory")


def decide_streaming(
    setting: str,
    decoded_bytes: Callable[[], int],
    share: float,
    started: Streaming | None = None,
    log: Callable[[str], None] = lambda line: None,
    name: str = "the data",
) -> Streaming:
    """data.placement: `stream` streams; `host` and `device` hold; `auto` keeps what the run `started` with (a
    resumed run), else streams when the data set, decoded (`decoded_bytes()`, asked only then), would take more
    than `share` of the free host memory, and says so (`name`: the data's URL). A setting that overrides what the
    run started with says what it costs."""
    if setting != "auto":
        choice = Streaming(setting == "stream", f"data.placement={setting}")
        if started is not None and started.streamed != choice.streamed:
            was = "streamed" if started.streamed else "held in memory"
            log(
                f"data: {choice.reason} where the run started {was}: the order, decoder and resizing change from "
                "here on, so the run goes on but no longer matches one that never stopped"
            )
        return choice
    choice = kept(started) if started is not None else by_memory(decoded_bytes(), share)
    if choice.streamed:
        log(f"data: {name}: {choice.reason}: streaming it")
    return choice


def kept(started: Streaming) -> Streaming:
    """A resumed run's decision: the one it started with (its reason said once, however often it resumes)."""
    said = "as the run started"
    return Streaming(
        started.streamed,
        started.reason if started.reason.startswith(said) else f"{said} ({started.reason})",
        started.stored,
    )


def by_memory(need: int, share: float) -> Streaming:
    """Streamed when `need` bytes would take more than `share` of the free host memory."""
    from job.group.memory import available_host_memory

    room = share * available_host_memory()
    if need > room:
        return Streaming(
            True, f"decoded, it would take {need / 1e9:.1f} GB, more than {room / 1e9:.1f} GB of host memory"
        )
    return Streaming(False, f"decoded, it takes {need / 1e9:.2f} GB of the {room / 1e9:.1f} GB allowed")


def decoded_size(src: Source, held: int | None) -> int:
    """About how many bytes SRC's images take decoded (uint8, 3 channels) at `held` x `held` (None: as they are,
    the first image's size). An archive is not read to count its images: its own size stands in, which only
    understates (images compress)."""
    fs, infos = src.fs, images_listed(src)
    if is_archive(src.path):
        return int(next(iter(infos.values())).get("size") or 0)
    if not infos:
        return 0
    if held is None:
        from PIL import Image  # here: a run on a table never opens an image

        from job.data.image import heif_readable

        first = min(infos)
        heif_readable()
        try:
            with fs.open(first, "rb") as f, Image.open(f) as img:
                held_w, held_h = img.size
        except Exception:  # an unreadable image is named when the folder is read
            return 0
    else:
        held_w = held_h = held
    return len(infos) * 3 * held_w * held_h


def restored(saved: dict | None) -> Streaming | None:
    """The decision a checkpoint recorded (None from checkpoints that recorded none)."""
    if not isinstance(saved, dict) or not isinstance(saved.get("streamed"), bool):
        return None
    return Streaming(saved["streamed"], str(saved.get("reason", "")), stored_from(saved.get("stored")))


def hold_on(nbytes: int, device: torch.device, setting: str, share: float, cap: float | None = None) -> torch.device:
    """Where data held in memory is held: on the training device when asked or when it fits in `share` of its free
    memory (of at most `cap` bytes, where the process is held to less than the device has); else the host. Either
    gives the same batches."""
    if device.type == "cpu" or setting == "host":
        return torch.device("cpu")
    if setting == "device":
        return device
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        free = min(free, cap) if cap is not None else free
        return device if nbytes <= share * free else torch.device("cpu")
    return device
