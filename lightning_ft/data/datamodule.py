"""`PackedDataModule`: rows → examples → tokens → packed rows → micro-batches of optimizer steps.

Packed rows are grouped into optimizer steps of ``world_size × accumulate_grad_batches`` rows
before training. Every micro-batch carries the token and target-token counts of its whole step
(all micro-batches, all ranks), counted on the host, so the module can divide the summed token
losses by the target tokens of the whole step: exact loss normalisation with no collective and
no device sync. `StepSampler` keeps each step's micro-batches together, gives rank ``r`` its own
``accumulate_grad_batches`` rows of every step, and reshuffles the steps every epoch
(``seed + epoch``); Lightning's own distributed sampler is therefore switched off
(``use_distributed_sampler=False``).
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Sequence

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from lightning_ft.data.builtin import builtin_rows
from lightning_ft.data.formats import read_rows, to_examples
from lightning_ft.data.packing import PackedBatch, collate_packed, pack_sequences
from lightning_ft.data.tokenization import IGNORE_INDEX, tokenize_example

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

Document = tuple[list[int], list[int]]  # (input_ids, labels)


@dataclass
class PackingStats:
    """What tokenization and packing did to the data (logged, and written to summary.json)."""

    examples: int = 0
    truncated: int = 0
    dropped_too_long: int = 0
    dropped_no_targets: int = 0
    packed_rows: int = 0
    dropped_rows: int = 0  # rows left over when the steps are split evenly across ranks
    tokens: int = 0
    target_tokens: int = 0
    packing_efficiency: float = 0.0  # tokens / (packed_rows * max_tokens)


def _count_targets(labels: Sequence[int]) -> int:
    # the first label of a document is dropped when packing (never predicted across documents)
    return sum(1 for x in labels[1:] if x != IGNORE_INDEX)


class _RowDataset(Dataset):
    """Item ``i`` is packed row ``i`` with the token counts of the optimizer step it belongs to."""

    def __init__(self, rows: list[list[Document]], step_size: int):
        self.rows = rows
        self.step_size = step_size
        self.step_counts = []
        for s in range(0, len(rows), step_size):
            step = [doc for row in rows[s : s + step_size] for doc in row]
            self.step_counts.append((sum(len(ids) for ids, _ in step), sum(_count_targets(lab) for _, lab in step)))

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> PackedBatch:
        step_tokens, step_target_tokens = self.step_counts[i // self.step_size]
        return collate_packed(self.rows[i], step_tokens, step_target_tokens)


def _first(items: list[PackedBatch]) -> PackedBatch:
    (batch,) = items  # batch_size=1: a packed row is the micro-batch
    return batch


class StepSampler(Sampler[int]):
    """Yields this rank's row indices, optimizer step by optimizer step.

    Rows ``[s·W·k, (s+1)·W·k)`` form step ``s`` (W ranks, k micro-batches per step); rank ``r`` gets
    rows ``s·W·k + r·k … + k − 1`` of every step. Full steps are shuffled with ``seed + epoch`` when
    ``shuffle`` (a partial last step stays last); Lightning calls `set_epoch` at every epoch start.
    """

    def __init__(self, num_rows: int, micro_batches: int, world_size: int = 1, rank: int = 0, shuffle: bool = True, seed: int = 0):
        self.k, self.world_size, self.rank = micro_batches, world_size, rank
        self.num_steps = -(-num_rows // (micro_batches * world_size))
        self.num_rows = num_rows
        self.shuffle, self.seed, self.epoch = shuffle, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        full_steps = self.num_rows // (self.k * self.world_size)
        order = list(range(full_steps))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        # a partial step stays last: Lightning groups micro-batches by count, so one in the middle
        # would be merged with the next step's micro-batches
        order += list(range(full_steps, self.num_steps))
        step_rows = self.k * self.world_size
        for s in order:
            first = s * step_rows + self.rank * self.k
            yield from range(first, min(first + self.k, self.num_rows))

    def __len__(self) -> int:
        full, rest = divmod(self.num_rows, self.k * self.world_size)
        return full * self.k + min(max(rest - self.rank * self.k, 0), self.k)


class PackedDataModule(L.LightningDataModule):
    """Reads, formats, tokenizes and packs the training data.

    Args:
        tokenizer: a Hugging Face tokenizer (see `lightning_ft.data.tokenization.load_tokenizer`).
        path: a local .jsonl/.json/.parquet file, a `datasets` name, or ``builtin:<task>``.
        format: ``auto``, ``qa``, ``instruction``, ``chat`` or ``text``.
        max_tokens: the token budget of one packed micro-batch (T ≤ max_tokens).
        accumulate_grad_batches: micro-batches per optimizer step.
        train_on_prompt: train on prompt tokens too (default: only on responses).
        overflow: ``truncate`` or ``drop`` examples longer than ``max_tokens``.
        num_examples: use only the first N rows (for ``builtin:`` tasks: generate N rows).
        val_fraction: share of the packed rows held out for validation (0 = none).
        split: the split to read from a `datasets` name.
        system_prompt: a system message put first in every conversation that has none.
        seed: shuffling seed (the order of packed rows and of held-out rows).
        num_workers: DataLoader workers.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        path: str = "builtin:arithmetic",
        format: str = "auto",
        max_tokens: int = 1024,
        accumulate_grad_batches: int = 1,
        train_on_prompt: bool = False,
        overflow: str = "truncate",
        num_examples: int | None = None,
        val_fraction: float = 0.0,
        split: str = "train",
        system_prompt: str | None = None,
        seed: int = 0,
        num_workers: int = 0,
    ):
        super().__init__()
        if overflow not in ("truncate", "drop"):
            raise ValueError(f"data.overflow={overflow!r}: expected 'truncate' or 'drop'")
        if max_tokens < 2:
            raise ValueError(f"data.max_tokens={max_tokens}: must be at least 2")
        if accumulate_grad_batches < 1:
            raise ValueError(f"train.accumulate_grad_batches={accumulate_grad_batches}: must be at least 1")
        self.tokenizer = tokenizer
        self.path, self.format, self.split = path, format, split
        self.max_tokens = max_tokens
        self.accumulate_grad_batches = accumulate_grad_batches
        self.train_on_prompt = train_on_prompt
        self.overflow = overflow
        self.num_examples = num_examples
        self.val_fraction = val_fraction
        self.system_prompt = system_prompt
        self.seed = seed
        self.num_workers = num_workers
        self.stats = PackingStats()
        self._train_rows: list[list[Document]] | None = None
        self._val_rows: list[list[Document]] = []

    def setup(self, stage: str | None = None) -> None:
        if self._train_rows is not None:
            return
        docs = self._tokenize(self._read())
        bins = pack_sequences([len(ids) for ids, _ in docs], self.max_tokens)
        rows = [[docs[i] for i in b] for b in bins]
        random.Random(self.seed).shuffle(rows)
        n_val = int(round(len(rows) * self.val_fraction))
        if self.val_fraction > 0 and not 0 < n_val < len(rows):
            raise ValueError(f"data.val_fraction={self.val_fraction} leaves {n_val} of {len(rows)} packed rows for validation")
        self._val_rows, self._train_rows = rows[:n_val], rows[n_val:]
        world_size = self.trainer.world_size if self.trainer is not None else 1
        if world_size > 1:  # every rank must take the same number of steps
            keep = len(self._train_rows) // self._step_size * self._step_size
            if keep == 0:
                raise ValueError(
                    f"{len(self._train_rows)} packed training rows cannot fill one step of {world_size} ranks × "
                    f"{self.accumulate_grad_batches} micro-batches; lower data.max_tokens or use more data"
                )
            self.stats.dropped_rows = len(self._train_rows) - keep
            self._train_rows = self._train_rows[:keep]
        tokens = sum(len(ids) for ids, _ in docs)
        self.stats.packed_rows = len(rows)
        self.stats.tokens = tokens
        self.stats.target_tokens = sum(_count_targets(labels) for _, labels in docs)
        self.stats.packing_efficiency = tokens / (len(rows) * self.max_tokens)
        log.info(
            "data: %d examples → %d packed rows of ≤ %d tokens (%d train steps of %d rows, %d val rows); "
            "packing efficiency %.1f%%; truncated %d, dropped %d too long, %d with no target tokens",
            self.stats.examples, len(rows), self.max_tokens, -(-len(self._train_rows) // self._step_size),
            self._step_size, n_val, 100 * self.stats.packing_efficiency, self.stats.truncated, self.stats.dropped_too_long,
            self.stats.dropped_no_targets,
        )

    def _read(self) -> list[dict[str, Any]]:
        if self.path.startswith("builtin:"):
            return builtin_rows(self.path.removeprefix("builtin:"), self.num_examples or 4000, self.seed)
        rows = read_rows(self.path, self.split)
        return rows[: self.num_examples] if self.num_examples else rows

    def _tokenize(self, rows: Sequence[dict[str, Any]]) -> list[Document]:
        examples = to_examples(rows, self.format, source=self.path, system_prompt=self.system_prompt)
        self.stats.examples = len(examples)
        docs: list[Document] = []
        for ex in examples:
            ids, labels = tokenize_example(ex, self.tokenizer, self.train_on_prompt)
            if len(ids) > self.max_tokens:
                if self.overflow == "drop":
                    self.stats.dropped_too_long += 1
                    continue
                self.stats.truncated += 1
                ids, labels = ids[: self.max_tokens], labels[: self.max_tokens]
            if _count_targets(labels) == 0:
                self.stats.dropped_no_targets += 1
                continue
            docs.append((ids, labels))
        if not docs:
            raise ValueError(
                f"{self.path}: every one of the {len(examples)} examples was filtered out "
                f"({self.stats.dropped_too_long} longer than data.max_tokens={self.max_tokens} with data.overflow=drop, "
                f"{self.stats.dropped_no_targets} with no target tokens after prompt masking)"
            )
        return docs

    @property
    def _step_size(self) -> int:
        world_size = self.trainer.world_size if self.trainer is not None else 1
        return world_size * self.accumulate_grad_batches

    def _loader(self, rows: list[list[Document]], micro_batches: int, shuffle: bool) -> DataLoader:
        world_size, rank = (self.trainer.world_size, self.trainer.global_rank) if self.trainer is not None else (1, 0)
        return DataLoader(
            _RowDataset(rows, micro_batches * world_size),
            batch_size=1,
            sampler=StepSampler(len(rows), micro_batches, world_size, rank, shuffle, self.seed),
            collate_fn=_first,
            num_workers=self.num_workers,
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader(self._train_rows, self.accumulate_grad_batches, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self._val_rows, 1, shuffle=False)
