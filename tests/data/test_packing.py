import random

import pytest
import torch

from lightning_ft.data.datamodule import StepSampler
from lightning_ft.data.packing import collate_packed, pack_sequences


def _first_fit_decreasing_bins(lengths, budget):
    bins = []
    for n in sorted(lengths, reverse=True):
        for b in bins:
            if sum(b) + n <= budget:
                b.append(n)
                break
        else:
            bins.append([n])
    return len(bins)


def test_packing_respects_budget_places_every_doc_once_and_beats_ffd():
    rng = random.Random(0)
    lengths = [rng.randint(1, 300) for _ in range(500)] + [512, 1]
    bins = pack_sequences(lengths, 512)
    placed = sorted(i for b in bins for i in b)
    assert placed == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 512 for b in bins)
    assert len(bins) <= _first_fit_decreasing_bins(lengths, 512)


def test_packing_rejects_documents_over_budget():
    with pytest.raises(ValueError, match="document 1 has 9 tokens.*data.max_tokens"):
        pack_sequences([3, 9], 8)


def test_collate_builds_metadata_on_the_host():
    docs = [([1, 2, 3], [-100, 2, 3]), ([4, 5], [4, 5]), ([6], [6]), ([7, 8, 9, 10], [7, 8, 9, 10])]
    b = collate_packed(docs)
    assert b.input_ids.tolist() == [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]
    assert b.position_ids.tolist() == [[0, 1, 2, 0, 1, 0, 0, 1, 2, 3]]
    # the first token of every document is never a target (no prediction across a boundary)
    assert b.labels.tolist() == [[-100, 2, 3, -100, 5, -100, -100, 8, 9, 10]]
    assert b.cu_seqlens.dtype == torch.int32 and b.cu_seqlens.tolist() == [0, 3, 5, 6, 10]
    assert b.max_seqlen == 4 and isinstance(b.max_seqlen, int)
    assert b.num_target_tokens == 6 == b.step_target_tokens
    moved = b.to("cpu")
    assert moved.cu_seqlens.device.type == "cpu" and moved._cache == {}


def test_padding_appends_one_document_of_ignored_tokens():
    b = collate_packed([([1, 2, 3], [-100, 2, 3]), ([4, 5], [4, 5])])
    p = b.padded(9, pad_id=7)
    assert p.input_ids.tolist() == [[1, 2, 3, 4, 5, 7, 7, 7, 7]]
    assert p.labels.tolist() == [[-100, 2, 3, -100, 5, -100, -100, -100, -100]]
    assert p.position_ids.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3]]
    assert p.cu_seqlens.dtype == torch.int32 and p.cu_seqlens.tolist() == [0, 3, 5, 9]
    assert p.max_seqlen == 4 and p.num_tokens == 9 and p.num_docs == 3
    assert (p.num_target_tokens, p.step_tokens, p.step_target_tokens) == (b.num_target_tokens, b.step_tokens, b.step_target_tokens)
    assert b.padded(5) is b
    with pytest.raises(ValueError, match="cannot pad a batch of 5 tokens to 4"):
        b.padded(4)


@pytest.mark.parametrize("rows,k,world", [(10, 1, 1), (10, 3, 1), (12, 2, 2), (13, 2, 3)])
def test_step_sampler_gives_ranks_disjoint_whole_steps(rows, k, world):
    per_rank = []
    for rank in range(world):
        sampler = StepSampler(rows, k, world, rank, shuffle=True, seed=3)
        sampler.set_epoch(1)
        idx = list(sampler)
        assert len(idx) == len(sampler)
        per_rank.append(idx)
    flat = sorted(i for idx in per_rank for i in idx)
    assert flat == list(range(rows))
    for rank, idx in enumerate(per_rank):  # a rank's rows of one step are consecutive and in its own slot
        steps = [i // (k * world) for i in idx]
        assert all((i % (k * world)) // k == rank for i in idx)
        seen = [s for j, s in enumerate(steps) if j == 0 or s != steps[j - 1]]
        assert len(seen) == len(set(seen))
        partial = rows // (k * world) if rows % (k * world) else None
        assert partial not in seen or seen[-1] == partial  # a partial step comes last
    epoch0 = StepSampler(rows, k, world, 0, shuffle=True, seed=3)
    if rows // (k * world) >= 5:  # enough steps that two shuffles essentially never agree
        assert list(epoch0) != per_rank[0]


def test_padded_rows_hold_one_document_each():
    batch = collate_packed([([5, 6, 7], [5, 6, 7]), ([8], [8]), ([9, 10], [-100, 10])])
    rows = batch.padded_rows(pad_id=0)
    assert rows["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0], [9, 10, 0]]
    assert rows["labels"].tolist() == [[-100, 6, 7], [-100, -100, -100], [-100, 10, -100]]
    assert rows["position_ids"].tolist() == [[0, 1, 2], [0, 0, 0], [0, 1, 0]]
    assert rows["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0], [1, 1, 0]]
