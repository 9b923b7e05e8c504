"""Packed attention: same loss as running each document alone; metadata built once per batch."""

import pytest
import torch
import torch.nn.functional as F

from lightning_ft.data.packing import collate_packed
from lightning_ft.modules import attention
from lightning_ft.modules.finetune_module import load_causal_lm

TINY = {
    "qwen3_moe": dict(
        model_type="qwen3_moe", hidden_size=48, intermediate_size=96, moe_intermediate_size=40, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=12, num_experts=5, num_experts_per_tok=2,
        norm_topk_prob=True, vocab_size=97,
    ),
    "llama": dict(
        model_type="llama", hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=97,
    ),
}


def _model(kind):
    torch.manual_seed(0)
    return load_causal_lm(None, "random", dict(TINY[kind]), attn_implementation=attention.register_packed_attention()).eval()


def _docs(lengths, vocab=97, seed=0):
    g = torch.Generator().manual_seed(seed)
    docs = []
    for n in lengths:
        ids = torch.randint(0, vocab, (n,), generator=g).tolist()
        labels = [-100 if i < n // 3 else t for i, t in enumerate(ids)]  # a masked "prompt"
        docs.append((ids, labels))
    return docs


def _loss_sum(model, batch):
    logits = model(input_ids=batch.input_ids, position_ids=batch.position_ids, packed_batch=batch).logits.float()
    return F.cross_entropy(logits[0, :-1], batch.labels[0, 1:], ignore_index=-100, reduction="sum")


@pytest.mark.parametrize("kind", ["qwen3_moe", "llama"])
def test_packed_loss_equals_documents_one_by_one(kind):
    model = _model(kind)
    docs = _docs([7, 1, 12, 2, 9])
    with torch.no_grad():
        packed = collate_packed(docs)
        packed_loss = _loss_sum(model, packed) / packed.num_target_tokens
        sums, counts = 0.0, 0
        for doc in docs:
            single = collate_packed([doc])
            sums += _loss_sum(model, single)
            counts += single.num_target_tokens
    assert packed.num_target_tokens == counts
    torch.testing.assert_close(packed_loss, sums / counts, rtol=1e-5, atol=1e-5)


def test_mask_is_built_once_per_batch_whatever_the_layer_count(monkeypatch):
    builds = []
    real = attention.block_causal_mask
    monkeypatch.setattr(attention, "block_causal_mask", lambda *a: builds.append(1) or real(*a))
    model = _model("qwen3_moe")
    assert model.config.num_hidden_layers == 3
    with torch.no_grad():
        for n_batches in (1, 2):
            _loss_sum(model, collate_packed(_docs([5, 3, 8], seed=n_batches)))
            assert len(builds) == n_batches


def test_block_causal_mask_matches_the_picture():
    mask = attention.block_causal_mask(torch.tensor([0, 3, 5, 9], dtype=torch.int32), torch.device("cpu"))[0, 0]
    doc = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2])
    expected = (doc[:, None] == doc[None, :]) & torch.ones(9, 9, dtype=torch.bool).tril()
    assert torch.equal(mask, expected)
