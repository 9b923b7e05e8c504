"""Tokenizers and turning `Example`s into ``input_ids`` and ``labels``.

Conversations are rendered with the tokenizer's chat template. The prompt/target split is found
by rendering growing prefixes of the conversation: for every assistant turn ``i``,

    render(messages[:i], add_generation_prompt=True)   →  everything before the reply (prompt)
    render(messages[:i+1])                              →  ... plus the reply and its end-of-turn

so the target tokens are exactly the reply and the template's end-of-turn marker, whatever the
template. An `Example` with ``completion_turns`` (a ``prompt_completion`` row) has targets only in
its last ``completion_turns`` messages: the assistant turns of its prompt are context. Templates
whose renders are not prefixes of each other (some strip earlier turns) get a clear error. Labels
use ``-100`` for tokens that are not trained on (`IGNORE_INDEX`).

``model.tokenizer=builtin`` is a byte-level BPE tokenizer the project trains itself with the
`tokenizers` library on generated text (no download), cached under ``$LIGHTNING_FT_CACHE``
(default ``~/.cache/lightning_ft``) and carrying the ChatML template below.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from lightning_ft.data.builtin import arithmetic_rows
from lightning_ft.data.formats import Example

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

IGNORE_INDEX = -100
BUILTIN_TOKENIZER = "builtin"
_BUILTIN_VERSION = "bpe512-v1"
_BUILTIN_VOCAB_SIZE = 512
_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

#: ChatML (the format of Qwen's templates, without tools or reasoning tags).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def cache_dir() -> Path:
    """The project's cache folder: ``$LIGHTNING_FT_CACHE`` or ``~/.cache/lightning_ft``."""
    return Path(os.environ.get("LIGHTNING_FT_CACHE", Path.home() / ".cache" / "lightning_ft"))


def load_tokenizer(name_or_path: str) -> PreTrainedTokenizerBase:
    """Load a tokenizer: ``builtin`` (trained and cached on first use) or a Hugging Face path/name.

    A tokenizer without a chat template gets the ChatML template (with a warning); one without a
    pad token uses its eos token for padding.

    Raises:
        OSError: from `AutoTokenizer.from_pretrained` when the path is not a tokenizer.
    """
    from transformers import AutoTokenizer

    if name_or_path == BUILTIN_TOKENIZER:
        path = cache_dir() / "tokenizers" / _BUILTIN_VERSION
        if not (path / "tokenizer.json").exists():
            _train_builtin_tokenizer(path)
        name_or_path = str(path)
    tokenizer = AutoTokenizer.from_pretrained(name_or_path)
    if tokenizer.chat_template is None:
        log.warning("tokenizer %s has no chat template: using ChatML. Set one on the tokenizer to change it.", name_or_path)
        tokenizer.chat_template = CHATML_TEMPLATE
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _train_builtin_tokenizer(path: Path) -> None:
    """Train the built-in byte-level BPE tokenizer and save it atomically to ``path``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    log.info("training the built-in tokenizer (once) into %s", path)
    corpus = [f"{r['question']}\n{r['answer']}" for r in arithmetic_rows(20000, seed=1234)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_BUILTIN_VOCAB_SIZE,
        special_tokens=_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=CHATML_TEMPLATE
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=".tmp-"))
    fast.save_pretrained(tmp)
    try:
        os.replace(tmp, path)  # atomic: concurrent ranks either see nothing or the whole folder
    except OSError:  # another process won the race
        shutil.rmtree(tmp, ignore_errors=True)


def target_text(example: Example) -> str:
    """The text ``example`` trains on with prompt masking: its text (the ``text`` format, a standard
    ``prompt_completion`` row's completion), or its target assistant turns' contents (every assistant turn, or those
    among the last ``completion_turns`` messages), joined. Whitespace only means nothing to learn but the template's
    end-of-turn tokens."""
    if example.messages is None:
        return example.text or ""
    first = 0 if example.completion_turns is None else len(example.messages) - example.completion_turns
    return "".join(m["content"] for i, m in enumerate(example.messages) if m["role"] == "assistant" and i >= first)


def tokenize_example(
    example: Example, tokenizer: PreTrainedTokenizerBase, train_on_prompt: bool = False
) -> tuple[list[int], list[int]]:
    """Tokenize one example into ``(input_ids, labels)`` of equal length.

    Labels equal the input ids on target tokens and `IGNORE_INDEX` elsewhere (labels are not
    shifted: the loss shifts them). Plain text gets the eos token appended and is all target, but the tokens
    of its ``prompt`` (tokenized on its own and put first), unless ``train_on_prompt``.

    Raises:
        ValueError: the chat template's renders are not prefixes of each other, or the template raises
            on the conversation (e.g. "roles must alternate"), or text data with a tokenizer that has no
            eos token (each names the example).
    """
    if example.text is not None:
        if tokenizer.eos_token_id is None:
            raise ValueError(
                f"{example.source}: the tokenizer has no eos token, which ends each text document; "
                "use a tokenizer that has one (model.tokenizer=...)"
            )
        ids = tokenizer(example.text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        if example.prompt is None:
            return ids, list(ids)
        context = tokenizer(example.prompt, add_special_tokens=False)["input_ids"]
        return context + ids, (list(context) if train_on_prompt else [IGNORE_INDEX] * len(context)) + ids
    segments = _chat_segments(tokenizer, list(example.messages), example.source, example.completion_turns)
    encoded = tokenizer([text for text, _ in segments], add_special_tokens=False)["input_ids"]
    input_ids: list[int] = []
    labels: list[int] = []
    for (_, is_target), ids in zip(segments, encoded):
        input_ids.extend(ids)
        labels.extend(ids if (is_target or train_on_prompt) else [IGNORE_INDEX] * len(ids))
    return input_ids, labels


def _chat_segments(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict], source: str, completion_turns: int | None = None
) -> list[tuple[str, bool]]:
    from jinja2 import TemplateError

    def render(msgs: list[dict], generation_prompt: bool) -> str:
        try:
            return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=generation_prompt)
        except TemplateError as err:  # the template's own check, e.g. "roles must alternate user/assistant"
            roles = [m["role"] for m in messages]
            raise ValueError(f"{source}: the tokenizer's chat template refuses this conversation ({err}); its roles: {roles}") from None

    segments: list[tuple[str, bool]] = []
    done = ""
    first_target = 0 if completion_turns is None else len(messages) - completion_turns
    for i, message in enumerate(messages):
        if message["role"] != "assistant" or i < first_target:
            continue
        prompt = render(messages[:i], True) if i else ""
        full = render(messages[: i + 1], False)
        if not prompt.startswith(done) or not full.startswith(prompt):
            raise ValueError(
                f"{source}: the tokenizer's chat template does not render conversations as growing prefixes, "
                "so the assistant replies cannot be located; use a template that does, or data.train_on_prompt=true"
            )
        segments += [(prompt[len(done):], False), (full[len(prompt):], True)]
        done = full
    rest = render(messages, False)[len(done):]
    if rest:
        segments.append((rest, False))
    return [s for s in segments if s[0]]
