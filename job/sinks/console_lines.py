"""The console's view of a run: a progress bar per epoch on a terminal, one plain line per evaluation otherwise, and
the test split's line at the end."""

from __future__ import annotations

import sys

from job.console import say
from job.sinks.journal import chosen_metric
from job.sinks.sink import EVALUATION, TESTED, WINDOW, Record, Sink


class ConsoleLines(Sink):
    def __init__(self, epochs: int, steps_per_epoch: int) -> None:
        self.epochs, self.steps_per_epoch = epochs, steps_per_epoch
        self.interactive = sys.stderr.isatty()
        self.bar = None

    def epoch_started(self, epoch: int, done_steps: int) -> None:
        """A bar per epoch on a terminal (short epochs too: a CPU may take minutes over a few steps)."""
        if self.interactive:
            from tqdm import tqdm

            self.bar = tqdm(
                total=self.steps_per_epoch,
                initial=done_steps,
                desc=f"epoch {epoch + 1}/{self.epochs}",
                leave=False,
                dynamic_ncols=True,
                file=sys.stderr,
            )

    def stepped(self, steps: int) -> None:
        if self.bar is not None:
            self.bar.update(steps)

    def epoch_ended(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def take(self, record: Record) -> None:
        r, on = record.values, record.split
        if record.kind == WINDOW and self.bar is not None:
            self.bar.set_postfix(loss=f"{r['train/loss']:.4f}", refresh=False)
        elif record.kind == EVALUATION:
            metric = chosen_metric(r, on)
            say(
                f"epoch {r['epoch']}/{self.epochs}  step {record.step}  train_loss {r['train_loss']:.4f}  "
                f"{on}_loss {r[f'{on}_loss']:.4f}  {on}_{metric} {r[f'{on}_{metric}']:.4f}  "
                f"{r['samples_per_s']:.0f} samples/s"
            )
        elif record.kind == TESTED:
            metric = chosen_metric(r, "test")
            final = r.get(f"final_test_{metric}")
            also = f"; the final model's {final:.4f}" if final is not None else ""
            say(
                f"test: the model chosen on val (epoch {r['chosen_epoch']}): test_loss {r['test_loss']:.4f}  "
                f"test_{metric} {r[f'test_{metric}']:.4f}{also}"
            )
