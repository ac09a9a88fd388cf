"""What the container check asserts about a finished run folder, read as a user would read it: the config, one
metrics line per evaluation, the committed checkpoint against its manifest, the weights with
torch.load(weights_only=True), and the TensorBoard curves. Prints what it found, or each problem and exit 1.

    python run_facts.py RUN_FOLDER EPOCHS EVAL_EVERY
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path


def problems(run: Path, epochs: int, eval_every: int) -> tuple[list[str], list[str]]:
    found, seen = [], []
    config = run / "config.yaml"
    if f"epochs: {epochs}" not in (config.read_text() if config.is_file() else ""):
        found.append(f"{config}: missing, or not a config of {epochs} epochs")
    lines = (run / "metrics.jsonl").read_text().splitlines() if (run / "metrics.jsonl").is_file() else []
    records = [json.loads(line) for line in lines]
    evaluated = [r["epoch"] for r in records]
    if evaluated != list(range(eval_every, epochs + 1, eval_every)):
        found.append(f"metrics.jsonl: evaluations at epochs {evaluated}, want every {eval_every} to {epochs} once")
    else:
        seen.append(
            f"metrics.jsonl: {len(records)} evaluations, final test accuracy {records[-1]['test_accuracy']:.3f}"
        )
    latest = run / "checkpoints" / "latest.json"
    manifest = json.loads(latest.read_text()) if latest.is_file() else {}
    payload = run / "checkpoints" / manifest.get("file", "?")
    if not payload.is_file():
        found.append(f"checkpoints/latest.json names no checkpoint file: {manifest}")
    elif hashlib.sha256(payload.read_bytes()).hexdigest() != manifest.get("sha256"):
        found.append(f"{payload.name}: sha256 differs from its manifest")
    elif manifest.get("epoch") != epochs:
        found.append(f"checkpoints/latest.json: epoch {manifest.get('epoch')}, want {epochs}")
    else:
        seen.append(f"latest checkpoint {payload.name} (sha256 ok)")

    import torch

    state = torch.load(run / "model.pt", weights_only=True)
    if not state or not all(isinstance(t, torch.Tensor) for t in state.values()):
        found.append("model.pt: not a state_dict of tensors")
    else:
        seen.append(f"model.pt: {len(state)} tensors via torch.load(weights_only=True)")

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = sorted((run / "tensorboard").glob("events.out.tfevents.*"))
    board = EventAccumulator(str(run / "tensorboard")).Reload() if events else None
    tags = set(board.Tags()["scalars"]) if board else set()
    want = {"train/loss", "test/loss", "test/accuracy"}
    if not want <= tags:
        found.append(f"tensorboard/: {len(events)} event files, scalars {sorted(tags)}, want {sorted(want)}")
    else:
        last = board.Scalars("test/accuracy")[-1]
        seen.append(f"TensorBoard: {len(events)} event files, test/accuracy to step {last.step}")
    return found, seen


def main() -> int:
    found, seen = problems(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
    print("\n".join(found or seen))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
