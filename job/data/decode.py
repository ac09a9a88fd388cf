"""Decoding images for streamed shards: in worker processes on the host (torchvision's decoders, one thread each,
off the training process and its GIL), or on a CUDA device (nvJPEG's batched decoder through torchvision), in
batches submitted ahead of the step that needs them."""

from __future__ import annotations

import multiprocessing
import os
import signal
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import NamedTuple

import numpy as np
import torch

from job.data.batches import IGNORED
from job.data.image import UnreadableImage, exif_orientation, pixels, stored_pixels
from job.data.preprocess import Preprocess
from job.data.shards import PIXELS
from job.errors import ConfigError, DataError, one_line
from job.group.env import cpu_share, end_with
from job.group.memory import is_out_of_memory

JPEG = ("jpg", "jpeg")


class Decoded(NamedTuple):
    """A batch decoded: its images (zeros where one could not be decoded), and those samples (index, why)."""

    images: np.ndarray | torch.Tensor
    bad: list[tuple[int, str]]


def decode(items: list[tuple[str, str, bytes]], pre: Preprocess | None = None, skip: bool = False) -> np.ndarray:
    """Images (name, extension, bytes) decoded to one uint8 N x 3 x H x W array the one way every host path decodes
    (job/data/image.py: EXIF turn, HEIC, every mode to RGB), each held as `pre` says (None: as it is)."""
    return decode_batch(items, pre or Preprocess(), skip).images


def decode_batch(items: list[tuple[str, str, bytes]], pre: Preprocess, skip: bool) -> Decoded:
    """decode(), with an image that cannot be decoded left as zeros and named (skip), or stopping it (not skip).
    Runs in a worker process."""
    out, bad = None, []
    for n, (name, ext, data) in enumerate(items):
        try:
            held = stored_pixels(data, name, pre) if ext == PIXELS else pixels(data, name, pre)
            img = held.transpose(2, 0, 1)
        except UnreadableImage as e:
            if not skip:
                raise
            bad.append((n, str(e)))
            continue
        if out is None:
            out = np.zeros((len(items), *img.shape), dtype=np.uint8)
        elif img.shape != out.shape[1:]:
            raise different_sizes(out.shape[1:], img.shape, name)
        out[n] = img
    if out is None:  # not one image of the batch: its size is what it would be held at, if any
        if pre.size is None:
            raise DataError(f"no image of the batch of samples {items[0][0]} to {items[-1][0]} could be decoded")
        out = np.zeros((len(items), 3, *pre.size), dtype=np.uint8)
    return Decoded(out, bad)


def upright_held(img: torch.Tensor, data: bytes, pre: Preprocess) -> torch.Tensor:
    """A JPEG decoded at full size by torchvision (nvJPEG, or its CPU decoder) as the host holds it: turned by its
    EXIF tag (which nvJPEG does not apply) and held as `pre` says, on the image's device."""
    return pre.hold_tensor(orient(img, exif_orientation(data)))


def orient(img: torch.Tensor, orientation: int) -> torch.Tensor:
    """A C x H x W image turned as its EXIF orientation says (what Pillow's exif_transpose does), on its device."""
    h, w = -2, -1
    if orientation == 2:
        return img.flip(w)
    if orientation == 3:
        return img.flip(h).flip(w)
    if orientation == 4:
        return img.flip(h)
    if orientation == 5:
        return img.transpose(h, w)
    if orientation == 6:
        return torch.rot90(img, -1, (h, w))
    if orientation == 7:
        return img.transpose(h, w).flip(h).flip(w)
    if orientation == 8:
        return torch.rot90(img, 1, (h, w))
    return img


def different_sizes(first: tuple, other: tuple, name: str) -> DataError:
    return DataError(
        f"images differ in size ({tuple(first[1:])} and {tuple(other[1:])}, e.g. {name}); set data.image_size"
    )


def start_worker(owner: int) -> None:
    torch.set_num_threads(1)
    # The training process handles Ctrl-C and SIGTERM (it finishes the step and commits a checkpoint); a signal
    # sent to the whole process group must not kill the decoders under it. The process that asked for them
    # (`owner`) ending, however it ends, ends them: their parent, the forkserver, waits for them instead.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    end_with(owner)


class Decoder:
    """Batches of images decoded in `workers` processes (0: in the calling thread), in submission order."""

    def __init__(self, workers: int, pre: Preprocess | None = None, skip: bool = True) -> None:
        self.pre, self.workers, self.skip = pre or Preprocess(), workers, skip
        self.pool = shared_pool(workers) if workers else None

    def submit(self, items: list[tuple[str, str, bytes]]) -> Future:
        """A future of the items' Decoded batch."""
        if self.pool is None:
            f: Future = Future()
            try:
                f.set_result(decode_batch(items, self.pre, self.skip))
            except DataError as e:
                f.set_exception(e)
            return f
        return self.pool.submit(decode_batch, items, self.pre, self.skip)


POOLS: dict[int, ProcessPoolExecutor] = {}


def shared_pool(workers: int) -> ProcessPoolExecutor:
    """One pool of decoding processes per size, kept for the process's life: a run in a notebook, or the
    evaluation after training, does not start them again (they start in about as long as `import torch`)."""
    pool = POOLS.get(workers)
    if pool is None or getattr(pool, "_broken", False):
        ctx = multiprocessing.get_context("forkserver")
        pool = POOLS[workers] = ProcessPoolExecutor(
            workers, mp_context=ctx, initializer=start_worker, initargs=(os.getpid(),)
        )
    return pool


def close_pools() -> None:
    """Stop the decoding processes now, for a process that ends without the interpreter's own exit (which would)."""
    while POOLS:
        POOLS.popitem()[1].shutdown(wait=True, cancel_futures=True)


def decoded(
    future: Future, names: tuple[str, str], labels: torch.Tensor | None = None, skipped: list | None = None
) -> torch.Tensor:
    """A batch's images, on the host or on the decoding device; a decoder process that died on it (a native
    decoder's abort on a corrupt image) is named. A sample that could not be decoded gets the label IGNORED in
    `labels` (its image is zeros) and its message appended to `skipped`."""
    try:
        images, bad = future.result()
        for i, why in bad:
            if labels is not None:
                labels[i] = IGNORED
            if skipped is not None:
                skipped.append(why)
        if isinstance(images, np.ndarray):
            return torch.from_numpy(images)
        # Made on the device decoder's stream, used on the caller's from here: its memory may go back to the
        # decoder's pool only once the caller's queued work on it is done (else the decoder writes into it).
        images.record_stream(torch.cuda.current_stream(images.device))
        return images
    except BrokenProcessPool:
        raise DataError(
            f"a decoding process died on the batch of samples {names[0]} to {names[1]}: a corrupt image among them?"
        ) from None


def auto_workers(setting: int | str, device: str | None = None, cores: int | None = None) -> int:
    """Decoding processes for data.workers: as set, or one per core but one (at most 8), of this process's share of
    the CPUs it may use (env.cpu_share: a container's quota, the group's processes on the machine). Training on a
    CPU of two cores or fewer decodes in the training process: the cores are all training's already, and a
    decoding process adds its copies and its contention to the same work (measured: docs/benchmarks.md)."""
    if setting != "auto":
        return int(setting)
    cores = cores or cpu_share()
    if device == "cpu" and cores <= 2:
        return 0
    return max(1, min(8, cores - 1))


def decoder_for(
    where: str, workers: int | str, device: torch.device | None, pre: Preprocess, skip: bool
) -> Decoder | DeviceDecoder:
    """Where images are decoded, decided here once for training's streams and for predict: `where` is data.decode
    (predict's --decode): device, the CUDA device's nvJPEG (JPEG images; others on the host), else `workers`
    processes on the host (auto_workers); auto stays on the host until decoding on the device is measured faster
    (docs/benchmarks.md). `device`: where the model runs, None when nothing trains while decoding."""
    if where == "device" and device is not None:
        if device.type != "cuda":
            raise ConfigError(f"decoding on the device needs a CUDA device; this runs on {device.type}")
        return DeviceDecoder(device, pre, skip)
    return Decoder(auto_workers(workers, device.type if device is not None else None), pre, skip)


DEVICE_GROUP = 32  # JPEG images nvJPEG decodes at once: full-size photos are held at full size until resized


class DeviceDecoder:
    """Batches decoded on a CUDA device: their JPEG images by nvJPEG's batched decoder (torchvision.io.decode_jpeg
    with the device), DEVICE_GROUP at a time, resized there too; other formats, and a group nvJPEG refuses (a CMYK
    JPEG), on the host. In one thread of the training process per device, on a stream of its own, so that the
    host's part of the decoding overlaps the training step (torchvision's operators release the GIL). A future's
    images are a uint8 N x 3 x H x W tensor on the device, complete when it is done."""

    workers = 0  # no decoding processes

    def __init__(self, device: torch.device, pre: Preprocess | None = None, skip: bool = True) -> None:
        index = device.index if device.index is not None else torch.cuda.current_device()
        self.device, self.pre, self.skip = torch.device("cuda", index), pre or Preprocess(), skip
        self.thread, self.stream = device_thread(self.device)

    def submit(self, items: list[tuple[str, str, bytes]]) -> Future:
        return self.thread.submit(self.decode, items)

    def decode(self, items: list[tuple[str, str, bytes]]) -> Decoded:
        jpeg = [i for i, (_, ext, _) in enumerate(items) if ext in JPEG]
        images: list[torch.Tensor | None] = [None] * len(items)
        bad: list[tuple[int, str]] = []
        with torch.cuda.stream(self.stream):
            for start in range(0, len(jpeg), DEVICE_GROUP):
                group = jpeg[start : start + DEVICE_GROUP]
                for i, img in zip(group, self.decode_jpegs([items[i][2] for i in group])):
                    if img is not None:
                        images[i] = upright_held(img, items[i][2], self.pre)
            for i, item in enumerate(items):
                if images[i] is None:
                    try:
                        images[i] = torch.from_numpy(decode([item], self.pre)[0]).to(self.device)
                    except UnreadableImage as e:
                        if not self.skip:
                            raise
                        bad.append((i, str(e)))
            good = next((img for img in images if img is not None), None)
            if good is None:
                raise DataError(f"no image of the batch of samples {items[0][0]} to {items[-1][0]} could be decoded")
            images = [img if img is not None else torch.zeros_like(good) for img in images]  # a bad one: zeros
            for img, (name, _, _) in zip(images, items):
                if img.shape != images[0].shape:
                    raise different_sizes(images[0].shape, img.shape, name)
            out = torch.stack(images)
        self.stream.synchronize()  # this thread waits; the training thread never does
        return Decoded(out, bad)

    def decode_jpegs(self, data: list[bytes]) -> list[torch.Tensor | None]:
        """The images on the device; None for each when nvJPEG refuses the group (the host decodes those). Running
        out of device memory is not a refusal: it stops the batch, as anywhere else.

        Waits first for the work queued on this stream (the last group's resizes): nvJPEG's hardware decoder writes
        its outputs without waiting for the stream it is given, into memory the caching allocator may just have
        handed back from tensors those queued resizes still read (pytorch/vision#9606): corrupt images otherwise."""
        from torchvision.io import ImageReadMode, decode_jpeg

        self.stream.synchronize()  # this thread waits; decode_jpeg waits for its own work before it returns anyway
        try:
            tensors = [torch.frombuffer(d, dtype=torch.uint8) for d in data]
            return decode_jpeg(tensors, mode=ImageReadMode.RGB, device=self.device)
        except RuntimeError as e:
            if is_out_of_memory(e):  # torchvision rethrows CUDA's out-of-memory as a RuntimeError of its own
                raise torch.OutOfMemoryError(one_line(e)) from None
            return [None] * len(data)


THREADS: dict[int, tuple[ThreadPoolExecutor, torch.cuda.Stream]] = {}


def device_thread(device: torch.device) -> tuple[ThreadPoolExecutor, torch.cuda.Stream]:
    """The decoding thread and stream of a CUDA device, made once per process (find-batch-size builds its recipe
    many times); the thread's current device is this one (a new thread's is the first GPU)."""
    if device.index not in THREADS:
        thread = ThreadPoolExecutor(1, f"job-decode-{device.index}", torch.cuda.set_device, (device,))
        THREADS[device.index] = thread, torch.cuda.Stream(device)
    return THREADS[device.index]
