"""`PackedDataModule`: rows → examples → tokens → packed rows → micro-batches of optimizer steps.

Packed rows are grouped into optimizer steps of ``world_size × accumulate_grad_batches`` rows
before training. Every micro-batch carries the token and target-token counts of its whole step
(all micro-batches, all ranks), counted on the host, so the module can divide the summed token
losses by the target tokens of the whole step: exact loss normalisation with no collective and
no device sync. `StepSampler` keeps each step's micro-batches together, gives rank ``r`` its own
``accumulate_grad_batches`` rows of every step, and reshuffles the steps every epoch
(``seed + epoch``); Lightning's own distributed sampler is therefore switched off
(``use_distributed_sampler=False``).

Exact resume: the training loader is a `StepDataLoader`, which Lightning treats as stateful
(``state_dict``/``load_state_dict``: the fit loop stores it in every checkpoint and restores it
before the first batch). Its state is the epoch and the number of micro-batches of that epoch the
training loop has taken (counted in `PackedDataModule.on_before_batch_transfer`, so the batch
Lightning prefetches is not counted); a resumed run continues the same epoch order from the next
micro-batch.
"""

from __future__ import annotations

import hashlib
import logging
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Sequence

import lightning as L
import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_only, rank_zero_warn
from torch.utils.data import DataLoader, Dataset, Sampler
from typing_extensions import override

from lightning_ft.data.builtin import builtin_rows
from lightning_ft.data.formats import Example, read_rows, to_examples
from lightning_ft.data.packing import PackedBatch, collate_packed, pack_sequences
from lightning_ft.data.tokenization import IGNORE_INDEX, target_text, tokenize_example
from lightning_ft.errors import check_choice

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

#: data.overflow: what happens to an example longer than data.max_tokens
OVERFLOWS = ("truncate", "drop")

log = logging.getLogger(__name__)

Document = tuple[list[int], list[int]]  # (input_ids, labels)


@dataclass
class PackingStats:
    """What tokenization and packing did to the data (logged, and written to summary.json)."""

    examples: int = 0
    truncated: int = 0
    dropped_too_long: int = 0
    dropped_no_targets: int = 0  # no target token left after prompt masking (and truncation), or an empty reply
    packed_rows: int = 0
    dropped_rows: int = 0  # rows left over when the steps are split evenly across ranks
    tokens: int = 0
    target_tokens: int = 0
    packing_efficiency: float = 0.0  # tokens / (packed_rows * max_tokens)
    val_examples: int = 0  # examples held out for validation (data.val_fraction or data.val_path)
    val_rows: int = 0
    longest_document: int = 0  # tokens of the longest document, training or validation (after truncation)


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


def rows_fingerprint(rows: list[list[Document]]) -> str:
    """A digest of packed rows' tokens and labels, in order (16 hex digits of SHA-1): the same data, template,
    tokenizer, packing and seed give the same one. ~30 ns a token."""
    digest = hashlib.sha1()
    for row in rows:
        for ids, labels in row:
            digest.update(np.asarray(ids, dtype=np.int64).tobytes())
            digest.update(np.asarray(labels, dtype=np.int64).tobytes())
        digest.update(b"|")  # row boundaries count: the same documents packed otherwise differ
    return digest.hexdigest()[:16]


def _first(items: list[PackedBatch]) -> PackedBatch:
    (batch,) = items  # batch_size=1: a packed row is the micro-batch
    return batch


class StepSampler(Sampler[int]):
    """Yields this rank's row indices, optimizer step by optimizer step.

    Rows ``[s·W·k, (s+1)·W·k)`` form step ``s`` (W ranks, k micro-batches per step); rank ``r`` gets
    rows ``s·W·k + r·k … + k − 1`` of every step. Full steps are shuffled with ``seed + epoch`` when
    ``shuffle`` (a partial last step stays last); Lightning calls `set_epoch` at every epoch start.
    ``start`` skips that many of this rank's indices at the next iteration only (resuming mid-epoch),
    and only in the epoch it was set for: a resumed run that Lightning moves on to the next epoch
    (from a checkpoint written after its epoch was closed, e.g. by ``every_n_epochs``) starts that
    epoch at its first step.
    """

    def __init__(self, num_rows: int, micro_batches: int, world_size: int = 1, rank: int = 0, shuffle: bool = True, seed: int = 0):
        self.k, self.world_size, self.rank = micro_batches, world_size, rank
        self.num_steps = -(-num_rows // (micro_batches * world_size))
        self.num_rows = num_rows
        self.shuffle, self.seed, self.epoch = shuffle, seed, 0
        self.start = 0

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.start = 0
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
        skip, self.start = self.start, 0
        for s in order:
            first = s * step_rows + self.rank * self.k
            for i in range(first, min(first + self.k, self.num_rows)):
                if skip:
                    skip -= 1
                else:
                    yield i

    def __len__(self) -> int:
        full, rest = divmod(self.num_rows, self.k * self.world_size)
        return full * self.k + min(max(rest - self.rank * self.k, 0), self.k)


class StepDataLoader(DataLoader):
    """The training `DataLoader` over a `StepSampler`, resumable mid-epoch.

    Lightning saves ``state_dict()`` in every checkpoint and calls ``load_state_dict`` before it
    first iterates the loader of a resumed run (any loader with both methods is stateful to it),
    except at an epoch end of a run bounded by ``trainer.max_epochs``, where the next epoch starts at
    its first step (`PackedDataModule.train_dataloader` sets the sampler's epoch).

    Attributes:
        consumed: micro-batches of the current epoch the training loop has taken; the owner
            (`PackedDataModule`) increments it as each batch reaches the loop.
        fingerprint: `rows_fingerprint` of the run's training rows (before they are cut to whole steps for several
            processes, so another device count at an epoch's start keeps it), saved in the resume state; set by the
            owner ("" compares equal to any).
    """

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        if not isinstance(self.sampler, StepSampler):
            raise TypeError(f"StepDataLoader needs a StepSampler, got {type(self.sampler).__name__}")
        self.consumed = 0
        self.fingerprint = ""

    @override
    def __iter__(self) -> Iterator[Any]:
        self.consumed = self.sampler.start
        return super().__iter__()

    def state_dict(self) -> dict[str, Any]:
        """``{"epoch", "consumed", "layout"}``; a finished epoch is saved as the start of the next."""
        epoch, consumed = self.sampler.epoch, self.consumed
        if consumed >= len(self.sampler):
            epoch, consumed = epoch + 1, 0
        return {"epoch": epoch, "consumed": consumed, "layout": self._layout()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue at micro-batch ``consumed`` of epoch ``epoch`` at the next iteration.

        The layout's ``data`` is the training rows' ``fingerprint``: other data (a file edited or replaced, another
        template or tokenizer) is refused mid-epoch and warned about at an epoch's start, where the new data trains
        from. A checkpoint written before a layout key existed, or a loader without a fingerprint, compares the others.

        Raises:
            ValueError: the checkpoint stopped mid-epoch and was written with another data layout
                (rows, micro-batches per step, ranks, seed or the data itself), so its position means nothing here.
        """
        saved, here = state["layout"], self._layout()
        changed = [key for key in here if key in saved and saved[key] != here[key] and (key != "data" or here[key] and saved[key])]
        if state["consumed"] and changed:
            data = " (the training data's tokens differ: data.path's contents, the data.* settings, the template or the tokenizer)"
            raise ValueError(
                f"cannot resume mid-epoch: the checkpoint's data layout was {saved}, this run's is {here}"
                f"{data if 'data' in changed else ''}; resume with the same data, data.max_tokens, "
                "trainer.accumulate_grad_batches, trainer.devices and seed as the run that wrote it"
            )
        if "data" in changed:
            rank_zero_warn(f"resuming at the start of epoch {state['epoch']} with other training data than the run that wrote "
                           "the checkpoint (its tokens differ): the new data trains from here")
        self.sampler.set_epoch(state["epoch"])
        self.sampler.start = state["consumed"]

    def _layout(self) -> dict[str, int | str]:
        s = self.sampler
        return {"rows": s.num_rows, "micro_batches": s.k, "world_size": s.world_size, "seed": s.seed,
                "data": self.fingerprint}


class PackedDataModule(L.LightningDataModule):
    """Reads, formats, tokenizes and packs the training (and validation) data.

    Args:
        tokenizer: a Hugging Face tokenizer (see `lightning_ft.data.tokenization.load_tokenizer`).
        path: a local .jsonl/.json/.parquet file, a `datasets` name, or ``builtin:<task>``.
        format: ``auto``, ``qa``, ``instruction``, ``chat``, ``prompt_completion`` or ``text``.
        max_tokens: the token budget of one packed micro-batch (T ≤ max_tokens).
        accumulate_grad_batches: micro-batches per optimizer step.
        train_on_prompt: train on prompt tokens too (default: only on responses).
        overflow: ``truncate`` or ``drop`` examples longer than ``max_tokens`` (counted in `stats`,
            and a warning says how many).
        num_examples: use only the first N training rows (for ``builtin:`` tasks: generate N rows).
        val_fraction: share of the packed rows held out for validation (0 = none).
        val_path: a separate validation file (same kinds of source as ``path``, every row used);
            excludes ``val_fraction``.
        max_no_target_fraction: stop with an error when more than this share of the examples has
            no target token left after prompt masking (a wrong chat template or response marker).
        split: the split to read from a `datasets` name.
        system_prompt: a system message put first in every conversation that has none.
        seed: shuffling seed (the order of packed rows and of held-out rows).
        num_workers: DataLoader workers.

    Raises:
        ValueError: a bad option value (names the ``data.`` key).
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
        val_path: str | None = None,
        max_no_target_fraction: float = 0.5,
        split: str = "train",
        system_prompt: str | None = None,
        seed: int = 0,
        num_workers: int = 0,
    ):
        super().__init__()
        check_choice("data.overflow", overflow, OVERFLOWS)
        if max_tokens < 2:
            raise ValueError(f"data.max_tokens={max_tokens}: must be at least 2")
        if accumulate_grad_batches < 1:
            raise ValueError(f"trainer.accumulate_grad_batches={accumulate_grad_batches}: must be at least 1")
        if num_examples is not None and num_examples < 1:
            raise ValueError(f"data.num_examples={num_examples}: must be at least 1 (or null: every row)")
        if not 0 <= val_fraction < 1:
            raise ValueError(f"data.val_fraction={val_fraction}: expected a share in [0, 1) (0: no validation)")
        if val_path and val_fraction > 0:
            raise ValueError(f"data.val_path={val_path!r} and data.val_fraction={val_fraction}: set one of them")
        if not 0 <= max_no_target_fraction <= 1:
            raise ValueError(f"data.max_no_target_fraction={max_no_target_fraction}: expected a share in [0, 1]")
        self.tokenizer = tokenizer
        self.path, self.format, self.split = path, format, split
        self.max_tokens = max_tokens
        self.accumulate_grad_batches = accumulate_grad_batches
        self.train_on_prompt = train_on_prompt
        self.overflow = overflow
        self.num_examples = num_examples
        self.val_fraction = val_fraction
        self.val_path = val_path
        self.max_no_target_fraction = max_no_target_fraction
        self.system_prompt = system_prompt
        self.seed = seed
        self.num_workers = num_workers
        self.stats = PackingStats()
        self._train_rows: list[list[Document]] | None = None
        self._val_rows: list[list[Document]] = []
        self._train_loader: StepDataLoader | None = None

    @property
    def has_validation(self) -> bool:
        """Whether validation data is configured (``val_fraction`` or ``val_path``)."""
        return self.val_fraction > 0 or bool(self.val_path)

    def setup(self, stage: str | None = None) -> None:
        if self._train_rows is not None:
            return
        docs = self._tokenize(self._read(self.path, self.num_examples, self.seed, "data.path"), self.path, self.stats)
        rows = self._pack(docs)
        random.Random(self.seed).shuffle(rows)
        if self.val_path:
            val_docs = self._tokenize(self._read(self.val_path, None, self.seed + 1, "data.val_path"), self.val_path, PackingStats())
            self._val_rows, self._train_rows = self._pack(val_docs), rows
        else:
            n_val = int(round(len(rows) * self.val_fraction))
            if self.val_fraction > 0 and not 0 < n_val < len(rows):
                raise ValueError(f"data.val_fraction={self.val_fraction} leaves {n_val} of {len(rows)} packed rows for validation")
            self._val_rows, self._train_rows = rows[:n_val], rows[n_val:]
        self._fingerprint = rows_fingerprint(self._train_rows)  # before the cut to whole steps: the device count may change
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
        self.stats.val_rows = len(self._val_rows)
        self.stats.longest_document = max((len(ids) for row in (*rows, *self._val_rows) for ids, _ in row), default=0)
        self.stats.val_examples = sum(len(row) for row in self._val_rows)
        if rank_zero_only.rank == 0:  # every rank packs the same rows: say it once
            log.info(
                "data: %d examples → %d packed rows of ≤ %d tokens (%d train steps of %d rows, %d val rows); "
                "packing efficiency %.1f%%; truncated %d, dropped %d too long, %d with no target tokens",
                self.stats.examples, len(rows), self.max_tokens, -(-len(self._train_rows) // self._step_size),
                self._step_size, len(self._val_rows), 100 * self.stats.packing_efficiency, self.stats.truncated,
                self.stats.dropped_too_long, self.stats.dropped_no_targets,
            )

    def _read(self, path: str, num_examples: int | None, seed: int, key: str) -> list[dict[str, Any]]:
        if path.startswith("builtin:"):
            return builtin_rows(path.removeprefix("builtin:"), num_examples or 4000, seed)
        rows = read_rows(path, self.split, key)
        return rows[:num_examples] if num_examples else rows

    def _tokenize(self, rows: Sequence[dict[str, Any]], source: str, stats: PackingStats) -> list[Document]:
        """Examples → documents, counting into ``stats``; raises ValueError when too few remain."""
        examples = to_examples(rows, self.format, source=source, system_prompt=self.system_prompt)
        stats.examples = len(examples)
        docs: list[Document] = []
        first_no_target: tuple[str, list[int]] | None = None
        cut_off = 0  # examples whose targets were all past data.max_tokens: truncation, not the template, left none
        empty: list[Example] = []  # examples whose reply (or text) is empty: only the end-of-turn tokens would train
        for ex in examples:
            if not (self.train_on_prompt or target_text(ex).strip()):
                empty.append(ex)
                continue
            ids, labels = tokenize_example(ex, self.tokenizer, self.train_on_prompt)
            truncated = len(ids) > self.max_tokens
            if truncated:
                if self.overflow == "drop":
                    stats.dropped_too_long += 1
                    continue
                stats.truncated += 1
                ids, labels = ids[: self.max_tokens], labels[: self.max_tokens]
            if _count_targets(labels) == 0:
                stats.dropped_no_targets += 1
                cut_off += truncated
                first_no_target = first_no_target or (ex.source, ids)
                continue
            docs.append((ids, labels))
        too_long = stats.truncated + stats.dropped_too_long
        if too_long:
            action = "dropped" if self.overflow == "drop" else "truncated"
            rank_zero_warn(
                f"{source}: {too_long} of {len(examples)} examples are longer than data.max_tokens={self.max_tokens} "
                f"and were {action} (data.overflow={self.overflow}); raise data.max_tokens to keep them whole"
            )
        no_target = stats.dropped_no_targets  # replies the template or truncation left without target tokens
        stats.dropped_no_targets += len(empty)
        if empty:
            first = empty[0]
            what = "reply" if first.messages is not None else "completion" if first.prompt is not None else "text"
            message = (f"{source}: {len(empty)} of {len(examples)} examples have an empty {what} (the first: {first.source}): "
                       "nothing to learn but the end-of-turn tokens")
            if len(empty) > self.max_no_target_fraction * len(examples):
                raise ValueError(f"{message}; more than data.max_no_target_fraction={self.max_no_target_fraction} of "
                                 f"them: check the {what} field of the data")
            rank_zero_warn(f"{message}; they were dropped")
        if first_no_target is not None and no_target > self.max_no_target_fraction * len(examples):
            where, ids = first_no_target
            text = self.tokenizer.decode(ids)
            shown = repr(text[:300]) + ("..." if len(text) > 300 else "")
            template = "check that the tokenizer's chat template renders the assistant replies (or set data.train_on_prompt=true)"
            fix = (  # the likelier cause first: truncation that left most of them without their reply
                f"{cut_off} of them lost their reply to truncation at data.max_tokens={self.max_tokens}: raise "
                f"data.max_tokens; else {template}" if 2 * cut_off >= no_target else template[0].upper() + template[1:]
            )
            raise ValueError(
                f"{source}: {no_target} of {len(examples)} examples have no target token after prompt "
                f"masking, more than data.max_no_target_fraction={self.max_no_target_fraction} of them; the first is "
                f"{where}, rendered as {shown}. {fix}"
            )
        if not docs:
            raise ValueError(
                f"{source}: every one of the {len(examples)} examples was filtered out "
                f"({stats.dropped_too_long} longer than data.max_tokens={self.max_tokens} with data.overflow=drop, "
                f"{stats.dropped_no_targets} with no target tokens after prompt masking)"
            )
        return docs

    def _pack(self, docs: list[Document]) -> list[list[Document]]:
        bins = pack_sequences([len(ids) for ids, _ in docs], self.max_tokens)
        return [[docs[i] for i in b] for b in bins]

    def generation_examples(self, n: int) -> list[tuple[list[int], list[int]]]:
        """The first ``n`` validation documents as ``(prompt_ids, reference_ids)``.

        The prompt is every token before the document's first target token (for a conversation:
        up to and including the assistant header of the first reply); the reference is that
        first run of target tokens (the reply and its end-of-turn marker).
        """
        examples = []
        for ids, labels in (doc for row in self._val_rows for doc in row):
            first = next(i for i, lab in enumerate(labels) if lab != IGNORE_INDEX)
            if first == 0:
                continue  # all-target text: no prompt to generate from
            end = next((i for i in range(first, len(labels)) if labels[i] == IGNORE_INDEX), len(labels))
            examples.append((ids[:first], ids[first:end]))
            if len(examples) == n:
                break
        return examples

    @property
    def _step_size(self) -> int:
        world_size = self.trainer.world_size if self.trainer is not None else 1
        return world_size * self.accumulate_grad_batches

    def _sampler(self, rows: list[list[Document]], micro_batches: int, shuffle: bool) -> StepSampler:
        world_size, rank = (self.trainer.world_size, self.trainer.global_rank) if self.trainer is not None else (1, 0)
        return StepSampler(len(rows), micro_batches, world_size, rank, shuffle, self.seed)

    def _loader(self, rows: list[list[Document]], micro_batches: int, shuffle: bool) -> StepDataLoader:
        sampler = self._sampler(rows, micro_batches, shuffle)
        return StepDataLoader(
            _RowDataset(rows, micro_batches * sampler.world_size),
            batch_size=1,
            sampler=sampler,
            collate_fn=_first,
            num_workers=self.num_workers,
            # its own generator: creating an iterator then draws no number from the global RNG,
            # whose state checkpoints restore for exact resume
            generator=torch.Generator().manual_seed(self.seed),
        )

    def train_batches_per_epoch(self) -> int:
        """The micro-batches this rank's training loader yields in an epoch (``len(train_dataloader())``),
        counted without making the loader (`lightning_ft.module.training_steps` sizes the LR schedule with it).

        Raises:
            RuntimeError: before `setup` has read the data.
        """
        if self._train_rows is None:
            raise RuntimeError("PackedDataModule.train_batches_per_epoch: call setup() first")
        return len(self._sampler(self._train_rows, self.accumulate_grad_batches, shuffle=True))

    def train_dataloader(self) -> StepDataLoader:
        self._train_loader = self._loader(self._train_rows, self.accumulate_grad_batches, shuffle=True)
        self._train_loader.fingerprint = self._fingerprint
        if self.trainer is not None:
            # Note: the epoch the fit loop is at (a resumed run's, restored by now). Lightning makes the loader's
            # iterator right after this call, and with workers it draws its first indices at once, before the
            # loop's own set_epoch (at the epoch start); a resume at an epoch end loads no loader state (Lightning
            # restores loader states only inside an epoch or with trainer.max_steps), so nothing else sets it.
            self._train_loader.sampler.set_epoch(self.trainer.fit_loop.epoch_progress.current.processed)
        return self._train_loader

    def val_dataloader(self) -> DataLoader:
        # Every rank runs the same number of validation batches: FSDP2 all-gathers weights in every
        # forward, so the ranks must run in lockstep. The last ranks get a copy of a row with every
        # label ignored, which adds nothing to the loss sum or the target-token count.
        world_size = self.trainer.world_size if self.trainer is not None else 1
        rows = self._val_rows
        if rows and len(rows) % world_size:
            rows = rows + [[(ids, [IGNORE_INDEX] * len(ids)) for ids, _ in rows[0]]] * (-len(rows) % world_size)
        return self._loader(rows, 1, shuffle=False)

    @override
    def on_before_batch_transfer(self, batch: PackedBatch, dataloader_idx: int) -> PackedBatch:
        # called once per batch the loop takes (after Lightning's prefetch), so this counts consumption
        if self.trainer is not None and self.trainer.training and self._train_loader is not None:
            self._train_loader.consumed += 1
        return batch
