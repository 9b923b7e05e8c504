"""PackedDataModule: resumable step order, bad-input counts and errors, validation data."""

import json
from types import SimpleNamespace

import pytest
import torch

from lightning_ft.data.datamodule import PackedDataModule, StepDataLoader
from lightning_ft.data.tokenization import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("builtin")


def _datamodule(tokenizer, **kwargs):
    kwargs = {"num_examples": 60, "max_tokens": 128, "format": "qa", "seed": 3, **kwargs}
    dm = PackedDataModule(tokenizer, **kwargs)
    dm.setup()
    return dm


def _indices(loader):
    return [tuple(batch.input_ids[0].tolist()) for batch in loader]  # the rows' tokens identify them


def test_loader_resumes_mid_epoch_and_at_the_epoch_end(tokenizer):
    dm = _datamodule(tokenizer, accumulate_grad_batches=2)
    loader = dm.train_dataloader()
    assert isinstance(loader, StepDataLoader)
    loader.sampler.set_epoch(1)
    full = _indices(loader)
    dm.trainer = SimpleNamespace(training=True, world_size=1, global_rank=0)
    it = iter(loader)
    for _ in range(5):  # the training loop takes five micro-batches (Lightning's prefetch does not count)
        dm.on_before_batch_transfer(next(it), 0)
    state = loader.state_dict()
    assert state["epoch"] == 1 and state["consumed"] == 5

    resumed = _datamodule(tokenizer, accumulate_grad_batches=2).train_dataloader()
    resumed.load_state_dict(state)
    assert _indices(resumed) == full[5:]
    assert _indices(resumed) == full  # only the first iteration after loading is shortened

    loader.consumed = len(loader)  # a checkpoint at the last micro-batch: the next epoch starts
    assert loader.state_dict()["epoch"] == 2 and loader.state_dict()["consumed"] == 0

    # a run stopped by trainer.max_steps mid-epoch and extended: Lightning restores the loader, then
    # moves on to the next epoch, which starts at its first step (it skips the restored count)
    extended = _datamodule(tokenizer, accumulate_grad_batches=2).train_dataloader()
    extended.load_state_dict(state)
    extended.sampler.set_epoch(2)
    next_epoch = _datamodule(tokenizer, accumulate_grad_batches=2).train_dataloader()
    next_epoch.sampler.set_epoch(2)
    assert _indices(extended) == _indices(next_epoch)


def test_loader_refuses_a_state_of_another_data_layout(tokenizer):
    state = _datamodule(tokenizer, accumulate_grad_batches=2).train_dataloader().state_dict()
    other = _datamodule(tokenizer, accumulate_grad_batches=4).train_dataloader()
    other.load_state_dict(state)  # at an epoch start any layout may continue
    with pytest.raises(ValueError, match="cannot resume mid-epoch.*trainer.accumulate_grad_batches"):
        other.load_state_dict({**state, "consumed": 3})


def test_loader_refuses_other_data_mid_epoch_and_warns_at_an_epoch_start(tokenizer, tmp_path):
    """Edited data (the same row count, other tokens) is caught by the rows' fingerprint."""
    rows = [{"question": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(40)]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    state = {**_datamodule(tokenizer, path=str(path), num_examples=None).train_dataloader().state_dict(), "consumed": 2}
    path.write_text("".join(json.dumps({**r, "answer": r["answer"].replace("1", "7")}) + "\n" for r in rows))
    edited = _datamodule(tokenizer, path=str(path), num_examples=None).train_dataloader()
    assert edited._layout()["rows"] == state["layout"]["rows"] and edited._layout()["data"] != state["layout"]["data"]
    with pytest.raises(ValueError, match=r"cannot resume mid-epoch.*\(the training data's tokens differ: data.path's contents"):
        edited.load_state_dict(state)
    with pytest.warns(UserWarning, match=r"resuming at the start of epoch 0 with other training data"):
        edited.load_state_dict({**state, "consumed": 0})
    old = {**state, "layout": {k: v for k, v in state["layout"].items() if k != "data"}}  # written before the fingerprint
    edited.load_state_dict(old)
    assert edited.sampler.start == 2
    # the fingerprint is of the rows before they are cut to whole steps of several processes: another device count
    # (allowed at an epoch's start) keeps it
    two = PackedDataModule(tokenizer, path=str(path), max_tokens=128, format="qa", seed=3, accumulate_grad_batches=3)
    two.trainer = SimpleNamespace(world_size=2, global_rank=0)
    two.setup()
    assert two.stats.dropped_rows > 0 and two._fingerprint == edited.fingerprint


def test_overlong_examples_are_truncated_or_dropped_and_counted(tokenizer, tmp_path):
    rows = [{"question": f"q{i}?", "answer": f"a{i}"} for i in range(10)]
    rows[3]["answer"] = " ".join(["word"] * 200)
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.warns(UserWarning, match="1 of 10 examples are longer than data.max_tokens=64 and were truncated"):
        dm = _datamodule(tokenizer, path=str(path), max_tokens=64, num_examples=None)
    assert (dm.stats.truncated, dm.stats.dropped_too_long, dm.stats.examples) == (1, 0, 10)
    assert max(len(ids) for row in dm._train_rows for ids, _ in row) == 64
    with pytest.warns(UserWarning, match="were dropped"):
        dm = _datamodule(tokenizer, path=str(path), max_tokens=64, num_examples=None, overflow="drop")
    assert (dm.stats.truncated, dm.stats.dropped_too_long) == (0, 1)
    assert sum(len(row) for row in dm._train_rows) == 9


def test_too_many_examples_without_targets_stop_with_the_count_and_an_example(tokenizer):
    broken = load_tokenizer("builtin")
    # a wrong template: assistant turns are never rendered, so prompt masking leaves nothing to train on
    broken.chat_template = "{% for m in messages %}{% if m['role'] != 'assistant' %}{{ m['content'] }}\n{% endif %}{% endfor %}"
    with pytest.raises(ValueError, match=r"60 of 60 examples have no target token .*data.max_no_target_fraction=0.5.*"
                                         r"the first is builtin:arithmetic row 1, rendered as 'What is"):
        _datamodule(broken)
    assert _datamodule(broken, train_on_prompt=True).stats.dropped_no_targets == 0


def test_examples_whose_replies_truncation_cut_off_name_data_max_tokens_first(tokenizer):
    # the prompts are longer than 8 tokens: truncation keeps no reply token, the template is fine
    with pytest.raises(ValueError, match=r"60 of 60 examples have no target token .*rendered as '.*'\. 60 of them lost "
                                         r"their reply to truncation at data.max_tokens=8: raise data.max_tokens; else check"):
        _datamodule(tokenizer, max_tokens=8)


def test_examples_with_an_empty_reply_or_text_are_dropped_and_named(tokenizer, tmp_path):
    """An empty answer trains nothing but the template's end-of-turn tokens: such examples are dropped with a warning
    naming the first; when they are most of the data the run stops (chat, qa and text alike)."""
    rows = [{"question": f"q{i}?", "answer": "" if i in (2, 5) else f"a{i}"} for i in range(10)]
    path = tmp_path / "qa.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.warns(UserWarning, match=r"2 of 10 examples have an empty reply \(the first: .*qa.jsonl:3\): nothing to "
                                         r"learn but the end-of-turn tokens; they were dropped"):
        dm = _datamodule(tokenizer, path=str(path), num_examples=None)
    assert dm.stats.dropped_no_targets == 2 and sum(len(row) for row in dm._train_rows) == 8
    assert _datamodule(tokenizer, path=str(path), num_examples=None, train_on_prompt=True).stats.dropped_no_targets == 0
    chat = tmp_path / "chat.jsonl"
    chat.write_text("".join(json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": " "}]})
                            + "\n" for _ in range(4)))
    with pytest.raises(ValueError, match=r"4 of 4 examples have an empty reply \(the first: .*chat.jsonl:1\).*"
                                         r"data.max_no_target_fraction=0.5 of them: check the reply field of the data"):
        _datamodule(tokenizer, path=str(chat), num_examples=None, format="auto")
    text = tmp_path / "text.jsonl"
    text.write_text("".join(json.dumps({"text": ""}) + "\n" for _ in range(3)))
    with pytest.raises(ValueError, match=r"3 of 3 examples have an empty text"):
        _datamodule(tokenizer, path=str(text), num_examples=None, format="auto")


def test_validation_file_and_generation_examples(tokenizer, tmp_path):
    val = tmp_path / "val.jsonl"
    val.write_text("".join(json.dumps({"question": f"Half of {2 * i}?", "answer": f"#### {i}"}) + "\n" for i in range(5)))
    dm = _datamodule(tokenizer, val_path=str(val))
    assert dm.has_validation and dm.stats.val_examples == 5 and dm.stats.val_rows == len(dm._val_rows) > 0
    assert len(dm._train_rows) == dm.stats.packed_rows  # nothing held out of the training data
    examples = dm.generation_examples(3)
    assert len(examples) == 3
    for prompt, reference in examples:
        assert tokenizer.decode(prompt).endswith("<|im_start|>assistant\n")
        assert tokenizer.decode(reference).startswith("#### ") and tokenizer.decode(reference).endswith("<|im_end|>\n")
    with pytest.raises(ValueError, match="set one of them"):
        PackedDataModule(tokenizer, val_path=str(val), val_fraction=0.1)


@pytest.mark.parametrize(
    "option, message",
    [
        ({"val_fraction": 1.5}, r"data.val_fraction=1.5: expected a share in \[0, 1\)"),
        ({"val_fraction": -0.1}, r"data.val_fraction=-0.1: expected a share"),
        ({"num_examples": 0}, r"data.num_examples=0: must be at least 1"),
    ],
)
def test_out_of_range_options_name_their_key(tokenizer, option, message):
    with pytest.raises(ValueError, match=message):
        PackedDataModule(tokenizer, **option)


def test_every_rank_runs_the_same_number_of_validation_batches_and_the_padding_counts_nothing(tokenizer):
    """FSDP2 all-gathers weights in every forward: a rank with one batch fewer would leave the others waiting."""
    dm = _datamodule(tokenizer, val_fraction=0.2)
    assert len(dm._val_rows) == 3
    per_rank = []
    for rank in (0, 1):
        dm.trainer = SimpleNamespace(world_size=2, global_rank=rank, training=False)
        per_rank.append(list(dm.val_dataloader()))
    assert [len(batches) for batches in per_rank] == [2, 2]
    padding = per_rank[1][-1]
    assert padding.num_target_tokens == 0 and torch.equal(padding.input_ids, per_rank[0][0].input_ids)
    dm.trainer = SimpleNamespace(world_size=1, global_rank=0, training=False)
    assert sum(b.num_target_tokens for batches in per_rank for b in batches) == sum(b.num_target_tokens for b in dm.val_dataloader())
