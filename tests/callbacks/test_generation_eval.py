import pytest
from cli_helpers import FAST, run_cli, summary

from lightning_ft.callbacks.generation_eval import GenerationEval, extract_answer


@pytest.mark.parametrize("text,answer", [
    ("Natalia sold 48/2 = 24 clips.\n#### 72", "72"),
    ("#### 1,234.\nThe end", "1234"),
    ("costs $5 #### $5", "5"),
    ("37 + 48 = 85", "37 + 48 = 85"),  # no ####: the whole reply
    ("  85 \n", "85"),
    ("####", ""),
])
def test_extract_answer(text, answer):
    assert extract_answer(text) == answer


def test_generation_eval_rejects_empty_budgets():
    with pytest.raises(ValueError, match="eval.num_examples=0"):
        GenerationEval(num_examples=0)


def test_greedy_generation_with_a_kv_cache_matches_the_packed_forward():
    """``model.generate`` goes through the packed attention's stock-SDPA fallback; its tokens are the argmax
    of the packed forward (the training path) over the same sequence."""
    import torch

    from lightning_ft.data.packing import collate_packed
    from lightning_ft.model.build import ModelBuilder
    from lightning_ft.module import FinetuneModule

    config = dict(model_type="qwen3_moe", hidden_size=32, intermediate_size=64, moe_intermediate_size=24,
                  num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_experts=4,
                  num_experts_per_tok=2, norm_topk_prob=True, vocab_size=64, initializer_range=0.5)
    torch.manual_seed(0)
    module = FinetuneModule(ModelBuilder(model={"init": "random", "config": config}, lora={"rank": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}))
    module.configure_model()
    module.model.eval()
    prompt = [1, 5, 9, 3, 7, 2]
    with torch.no_grad():
        out = module.model.generate(input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                    max_new_tokens=8, do_sample=False, use_cache=True, pad_token_id=0, eos_token_id=None)
        seq = out[0].tolist()
        batch = collate_packed([(seq, seq)])
        logits = module.model(input_ids=batch.input_ids, position_ids=batch.position_ids, packed_batch=batch).logits
    assert len(seq) == len(prompt) + 8
    assert logits[0, len(prompt) - 1 : -1].argmax(-1).tolist() == seq[len(prompt):]


def test_generation_without_prompts_is_refused_before_the_first_step(tmp_path):
    # every token a target: nothing to generate from; refused before training, not at the first
    # validation after the whole run has trained (which would end the run failed, with no adapter)
    proc = run_cli(tmp_path, *FAST, "trainer.max_steps=3", "data.val_fraction=0.2", "data.train_on_prompt=true",
                   "eval.generate=true", ok=False)
    assert "eval.generate=true: no validation example has a prompt to generate from" in proc.stderr
    assert "data.train_on_prompt=true" in proc.stderr and "Traceback" not in proc.stderr
    assert summary(tmp_path)["steps"] == 0
