import pytest

from lightning_ft.data.formats import Example, to_examples
from lightning_ft.data.tokenization import IGNORE_INDEX, load_tokenizer, tokenize_example


def test_builtin_tokenizer_round_trips_text():
    tok = load_tokenizer("builtin")
    text = "What is 37 + 48? Natalia sold 48/2 = 24 clips. ünïcode ✓"
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text
    assert tok.eos_token == "<|im_end|>"


def test_only_assistant_replies_are_targets():
    tok = load_tokenizer("builtin")
    messages = (
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "What is 1 + 2?"},
        {"role": "assistant", "content": "1 + 2 = 3"},
        {"role": "user", "content": "And 2 + 2?"},
        {"role": "assistant", "content": "4"},
    )
    ids, labels = tokenize_example(Example(messages=messages), tok)
    assert len(ids) == len(labels)
    assert tok.decode(ids) == tok.apply_chat_template(list(messages), tokenize=False)
    targets = tok.decode([t for t, lab in zip(ids, labels) if lab != IGNORE_INDEX])
    assert targets == "1 + 2 = 3<|im_end|>\n4<|im_end|>\n"
    ids2, labels2 = tokenize_example(Example(messages=messages), tok, train_on_prompt=True)
    assert ids2 == ids and labels2 == ids


#: Llama-3's chat template (its header and end-of-turn tokens as text), for a template other than the builtin ChatML
LLAMA3_TEMPLATE = (
    "{{ '<|begin_of_text|>' }}{% for m in messages %}"
    "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' + m['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)


@pytest.mark.parametrize("template", [None, LLAMA3_TEMPLATE])
def test_prompt_completion_targets_exactly_the_completion(template):
    """A string prompt/completion row is plain text as TRL reads it: the prompt's tokens then the completion's and
    eos, no chat template, the completion and eos the targets (all with train_on_prompt); a conversational row,
    with the builtin ChatML template and a real one: the completion's turns only."""
    tok = load_tokenizer("builtin")
    tok.chat_template = template or tok.chat_template
    (standard,) = to_examples([{"prompt": "The sky is", "completion": " blue."}])
    ids, labels = tokenize_example(standard, tok)
    prompt_ids = tok("The sky is", add_special_tokens=False)["input_ids"]
    completion_ids = tok(" blue.", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert ids == prompt_ids + completion_ids
    assert labels == [IGNORE_INDEX] * len(prompt_ids) + completion_ids
    assert tokenize_example(standard, tok, train_on_prompt=True) == (ids, ids)
    prompt = [{"role": "system", "content": "sys"}, {"role": "user", "content": "What is 1 + 2?"},
              {"role": "assistant", "content": "1 + 2 = 3"}, {"role": "user", "content": "And 2 + 2?"}]
    completion = [{"role": "assistant", "content": "2 + 2"}, {"role": "assistant", "content": "= 4"}]
    (conv,) = to_examples([{"prompt": prompt, "completion": completion}])
    ids, labels = tokenize_example(conv, tok)
    assert tok.decode(ids) == tok.apply_chat_template(prompt + completion, tokenize=False)
    targets = tok.decode([t for t, lab in zip(ids, labels) if lab != IGNORE_INDEX])
    assert targets == ("2 + 2<|im_end|>\n= 4<|im_end|>\n" if template is None else "2 + 2<|eot_id|>= 4<|eot_id|>")
    assert "1 + 2 = 3" not in targets  # the prompt's assistant turn is context
    assert tokenize_example(conv, tok, train_on_prompt=True) == (ids, ids)


def test_text_is_all_target_and_ends_with_eos():
    tok = load_tokenizer("builtin")
    ids, labels = tokenize_example(Example(text="hello"), tok)
    assert ids == labels and ids[-1] == tok.eos_token_id


def test_a_template_that_raises_or_a_tokenizer_without_eos_names_the_row():
    tok = load_tokenizer("builtin")
    tok.chat_template = (  # a Mistral-style check
        "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant') }}{% endif %}{{ m['content'] }}{% endfor %}"
    )
    messages = ({"role": "system", "content": "s"}, {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"})
    with pytest.raises(ValueError, match=r"data row 3: the tokenizer's chat template refuses this conversation "
                                         r"\(Conversation roles must alternate user/assistant\); its roles: \['system', 'user', 'assistant'\]"):
        tokenize_example(Example(messages=messages, source="data row 3"), tok)
    tok = load_tokenizer("builtin")
    tok.eos_token = None
    with pytest.raises(ValueError, match="data row 1: the tokenizer has no eos token"):
        tokenize_example(Example(text="hello", source="data row 1"), tok)
