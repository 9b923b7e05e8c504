"""Exact-match accuracy of greedy generations on validation examples (``eval.generate=true``).

For question/answer data in the GSM8K style the reference reply ends with ``#### <answer>``::

    Natalia sold 48/2 = 24 clips in May. ... 48 + 24 = 72
    #### 72

and a generation is correct when the text after its last ``####`` equals the reference's (first line,
commas and ``$`` removed, a final period dropped; OpenAI's grade-school-math answer format). A reply
without ``####`` is compared whole (stripped), which suits short answers such as the built-in
arithmetic task. The model generates with its own (PEFT-wrapped) ``generate``: without a
``packed_batch`` the packed attention function runs `lightning_ft.model.attention.unpacked_attention` with a KV cache.
"""

from __future__ import annotations

import logging

import lightning as L
import torch
from typing_extensions import override

log = logging.getLogger(__name__)


def extract_answer(text: str) -> str:
    """The final answer in ``text``: what follows the last ``####``, else the whole text (see the module notes)."""
    if "####" in text:
        lines = text.rsplit("####", 1)[1].strip().splitlines()
        text = lines[0] if lines else ""
        text = text.replace(",", "").replace("$", "").strip().removesuffix(".")
    return text.strip()


class GenerationEval(L.Callback):
    """Logs ``val/exact_match`` (a share in [0, 1]) at the end of every validation run.

    The datamodule's first ``num_examples`` validation documents (`PackedDataModule.generation_examples`)
    are split across ranks; each is generated for alone (batch 1, so no padding) and the counts are
    summed over ranks.

    Args:
        num_examples: validation examples to generate for (``eval.num_examples``).
        max_new_tokens: the generation budget of each (``eval.max_new_tokens``).

    Raises:
        ValueError: a non-positive ``num_examples`` or ``max_new_tokens``; when fitting starts (before
            the first step), a datamodule without ``generation_examples`` or without examples that have a prompt.
    """

    def __init__(self, num_examples: int = 32, max_new_tokens: int = 64):
        if num_examples < 1 or max_new_tokens < 1:
            raise ValueError(f"eval.num_examples={num_examples}, eval.max_new_tokens={max_new_tokens}: both must be positive")
        self.num_examples = num_examples
        self.max_new_tokens = max_new_tokens

    def _examples(self, trainer: L.Trainer) -> list[tuple[list[int], list[int]]]:
        datamodule = trainer.datamodule
        if not hasattr(datamodule, "generation_examples"):
            raise ValueError("eval.generate=true needs a PackedDataModule (it provides the validation examples)")
        examples = datamodule.generation_examples(self.num_examples)
        if not examples:
            raise ValueError(
                "eval.generate=true: no validation example has a prompt to generate from: every token is a target "
                "(text data, or data.train_on_prompt=true); set eval.generate=false"
            )
        return examples

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._examples(trainer)  # refused before the first step, not after the run has trained (the data is set up by now)

    @override
    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        examples = self._examples(trainer)
        datamodule = trainer.datamodule
        tokenizer = datamodule.tokenizer
        correct = 0
        mine = examples[trainer.global_rank :: trainer.world_size]
        for prompt_ids, reference_ids in mine:
            input_ids = torch.tensor([prompt_ids], device=pl_module.device)
            output = pl_module.model.generate(
                input_ids=input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=self.max_new_tokens,
                do_sample=False,
                use_cache=True,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )
            generated = tokenizer.decode(output[0, len(prompt_ids) :], skip_special_tokens=True)
            reference = tokenizer.decode(reference_ids, skip_special_tokens=True)
            correct += extract_answer(generated) == extract_answer(reference)
        counts = torch.tensor([correct, len(mine)], dtype=torch.float32, device=pl_module.device)
        if trainer.world_size > 1:
            counts = trainer.strategy.reduce(counts, reduce_op="sum")
        accuracy = counts[0] / counts[1]
        pl_module.log("val/exact_match", accuracy, prog_bar=True)
        log.info("validation exact match: %.3f on %d examples", float(accuracy), len(examples))
