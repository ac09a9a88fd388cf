import torch

from job.data.augment import channel_stats, crop_flip
from job.data.dataset import Split
from job.data.loader import BatchLoader

CPU = torch.device("cpu")


def images(n=10, size=6):
    return Split(
        torch.randint(0, 256, (n, 3, size, size), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)),
        torch.arange(n),
    )


def test_crop_flip_matches_per_image_reference():
    x = images(8).x
    crops = torch.randint(0, 5, (8, 2), generator=torch.Generator().manual_seed(1))
    flips = torch.tensor([True, False] * 4)
    out = crop_flip(x, 2, crops, flips)
    padded = torch.nn.functional.pad(x, (2, 2, 2, 2))
    for i in range(8):
        oy, ox = crops[i].tolist()
        ref = padded[i, :, oy : oy + 6, ox : ox + 6]
        if flips[i]:
            ref = ref.flip(-1)
        assert torch.equal(out[i], ref)


def test_batches_cover_the_split_once_and_are_seeded():
    split = images(10)
    loader = BatchLoader(split, 4, CPU, CPU, seed=3, shuffle=True)
    assert len(loader) == 3
    labels = torch.cat([b.y for b in loader.batches(epoch=0)])
    assert sorted(labels.tolist()) == list(range(10))
    again = torch.cat([b.y for b in loader.batches(epoch=0)])
    other_epoch = torch.cat([b.y for b in loader.batches(epoch=1)])
    assert torch.equal(labels, again) and not torch.equal(labels, other_epoch)
    dropped = BatchLoader(split, 4, CPU, CPU, drop_last=True)
    assert len(dropped) == 2


def test_resuming_mid_epoch_gives_the_same_remaining_batches():
    loader = BatchLoader(images(12), 4, CPU, CPU, seed=5, shuffle=True, crop_padding=2, hflip=True)
    full = list(loader.batches(epoch=2))
    rest = list(loader.batches(epoch=2, start=1))
    assert len(rest) == 2
    for a, b in zip(full[1:], rest):
        assert torch.equal(a.x, b.x) and torch.equal(a.y, b.y)


def test_images_are_scaled_and_normalised():
    split = images(6)
    mean, std = channel_stats(split.x)
    loader = BatchLoader(split, 6, CPU, CPU, mean=mean, std=std)
    (batch,) = list(loader.batches())
    x = batch.x
    assert x.dtype == torch.float32
    assert torch.allclose(x.mean((0, 2, 3)), torch.zeros(3), atol=1e-5)
    assert torch.allclose(x.std((0, 2, 3), unbiased=False), torch.ones(3), atol=1e-4)


def test_a_table_held_whole_is_one_batch_made_once():
    """A full-batch table (Iris) is the same batch every epoch: made once and given again (no per-step views), shuffled
    or not; a table in several batches, and images (converted to float each time), are made every epoch."""
    table = Split(torch.randn(10, 4), torch.arange(10) % 3)
    whole = BatchLoader(table, 64, CPU, CPU, seed=1, shuffle=True)
    (first,) = list(whole.batches(0))
    (again,) = list(whole.batches(7))
    assert again is first and first.x is whole.x and torch.equal(first.x, table.x) and first.samples == 10
    parts = BatchLoader(table, 4, CPU, CPU, seed=1, shuffle=True)
    assert [b.x for b in parts.batches(0)][0] is not [b.x for b in parts.batches(0)][0]
    pictures = BatchLoader(images(6), 6, CPU, CPU)
    assert next(pictures.batches(0)) is not next(pictures.batches(1))


def test_decoding_processes_end_with_the_process_that_started_them(tmp_path):
    """A training process killed (kill -9, the out-of-memory killer) takes its decoding processes with it: they ignore
    SIGTERM and SIGINT (the trainer handles those), so nothing else would end them."""
    import signal
    import subprocess
    import sys

    import psutil
    from conftest import job_env

    script = (
        "import os, sys, time\n"
        "from job.data.decode import shared_pool\n"
        "pool = shared_pool(2)\n"
        "print(sorted({f.result() for f in [pool.submit(os.getpid) for _ in range(8)]}), flush=True)\n"
        "time.sleep(600)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=job_env())
    try:
        assert proc.stdout.readline().startswith("[")  # decoded in other processes: they are running
        workers = psutil.Process(proc.pid).children(recursive=True)  # and the forkserver that started them
        assert len(workers) >= 2
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    gone, alive = psutil.wait_procs(workers, timeout=60)
    alive = [w for w in alive if w.status() != psutil.STATUS_ZOMBIE]  # ended, waiting for this machine's init
    for w in alive:
        w.kill()
    assert not alive, f"decoding processes left behind: {[w.pid for w in alive]}"
