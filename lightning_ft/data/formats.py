"""Reading training rows and turning them into conversations.

Every supported row shape becomes an `Example`: either a conversation (a list of
``{"role", "content"}`` messages, rendered later with the tokenizer's chat template, where
only the assistant turns are targets) or a plain ``text`` (every token is a target, but those of
a ``prompt`` before it).

=============  ====================================================  ==========================
format         row fields                                            becomes
=============  ====================================================  ==========================
``qa``         ``question``, ``answer``                              user → assistant
``instruction`` ``instruction``, ``output`` (``input`` optional), or  user → assistant, one
               ``instruction`` + ``instances: [{input, output}]``    example per instance
``chat``       ``messages: [{role, content}, ...]``                  the messages as they are
``prompt_completion`` ``prompt``, ``completion``: two strings, or    plain text, prompt then
               two lists of ``{role, content}`` messages             completion; or the messages
``text``       ``text``                                              plain text
=============  ====================================================  ==========================

``prompt_completion`` is TRL's prompt-completion dataset type (also OpenAI's legacy fine-tuning
file), read as TRL's trainer reads it. Its *standard* rows (two strings) are plain text: the
prompt's tokens, then the completion's and the eos token, with no chat template (``{"prompt": "The
sky is", "completion": " blue."}``); only the completion and the eos token are targets
(`data.system_prompt` does not apply). Unlike TRL, the two are tokenized each on its own (the
completion starts where generation from the prompt would) and no BOS token is added, as for
``text``. For a prompt meant as a user turn, use ``qa`` (``question``, ``answer``) or the
conversational rows. Those are ``prompt``: the messages before the reply (system, user, and earlier
assistant turns) and ``completion``: the assistant message(s); the chat template renders them, and
only the completion is a target, not the assistant turns of the prompt.

Rows come from a local ``.jsonl``/``.json``/``.parquet`` file (JSON parsed as written, see
`read_rows`) or a Hugging Face ``datasets`` name (read with `datasets.load_dataset`), or from a
built-in generator (``builtin:<name>``, see `lightning_ft.data.builtin`).
"""

from __future__ import annotations

import difflib
import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterable, Sequence

from lightning_ft.errors import check_choice

log = logging.getLogger(__name__)

FORMATS = ("qa", "instruction", "chat", "prompt_completion", "text")
ROLES = ("system", "user", "assistant")
TOOL_ROLES = ("tool", "function", "ipython")  # tool results: not supported (refused by name)
TOOL_KEYS = ("tool_calls", "function_call")  # an assistant's tool calls: not supported
_IGNORED_WARNED: set[tuple[str, ...]] = set()  # sets of ignored message keys already warned about
_REQUIRED = {
    "qa": ("question", "answer"),
    "instruction": ("instruction", "output | instances"),
    "chat": ("messages",),
    "prompt_completion": ("prompt", "completion"),
    "text": ("text",),
}


@dataclass(frozen=True)
class Example:
    """One training document before tokenization: a conversation or a plain text.

    Attributes:
        messages: ``[{"role": "system"|"user"|"assistant", "content": str}, ...]`` or None.
        text: the document for the ``text`` format (the completion of a standard ``prompt_completion`` row), or None.
        prompt: plain text before ``text`` that is context, not a target (a standard ``prompt_completion``
            row's prompt), or None.
        source: where it came from (``file:line``, or ``file row N`` without lines), used in error messages.
        completion_turns: the number of last messages that are the targets (all assistant turns, the
            completion of a ``prompt_completion`` row); None: every assistant turn is a target.
    """

    messages: tuple[dict[str, str], ...] | None = None
    text: str | None = None
    source: str = ""
    completion_turns: int | None = None
    prompt: str | None = None


_FILE_TYPES = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


class Rows(list):
    """Rows read by `read_rows`, with the line each starts on in a JSON Lines file (for error messages).

    Attributes:
        lines: ``lines[i]`` is the 1-based line of row ``i``; None where rows have no line (parquet, `datasets`).
    """

    def __init__(self, rows: Iterable[dict[str, Any]] = (), lines: list[int] | None = None):
        super().__init__(rows)
        self.lines = lines

    def __getitem__(self, index):
        if isinstance(index, slice):  # `rows[:n]` keeps the lines of the rows kept
            return Rows(super().__getitem__(index), None if self.lines is None else self.lines[index])
        return super().__getitem__(index)


def check_data_path(key: str, path: str | None) -> None:
    """Raise when ``path`` names a local data file that cannot be one (before any work starts).

    A ``builtin:`` task and a name that is neither an existing path nor written as a file (a
    `datasets` name) pass; they are checked when read.

    Raises:
        FileNotFoundError: a ``.jsonl``/``.json``/``.parquet`` path that does not exist.
        ValueError: a folder, or an existing file of another type.
    """
    if not path or path.startswith("builtin:"):
        return
    local = Path(path).expanduser()
    suffix = local.suffix.lower()
    if local.is_dir():
        raise ValueError(f"{key}={path!r} is a folder; expected a .jsonl, .json or .parquet file")
    if local.exists() and suffix not in _FILE_TYPES:
        raise ValueError(f"{key}={path!r}: unsupported file type {suffix!r}; expected .jsonl, .json or .parquet")
    if not local.exists() and suffix in _FILE_TYPES:
        raise FileNotFoundError(f"{key}={path!r}: no such file (relative paths start from {Path.cwd()})")


def read_rows(path: str, split: str = "train", key: str = "data.path") -> Rows:
    """Read all rows of a local file or a `datasets` name (``key``: the config key that named it, for errors);
    rows of a JSON Lines file carry their line numbers (`Rows`).

    A ``.jsonl`` file, and a ``.json`` file holding an array of objects (or JSON Lines), are parsed
    with the `json` module, every value exactly as written: `datasets`' JSON reader infers one Arrow
    type per column, which turned the string "007" into the integer 7 beside an integer row and
    ISO-date strings into timestamps. Other ``.json`` layouts and ``.parquet`` (typed columns) go
    through `datasets.load_dataset`.

    Args:
        path: ``.jsonl``/``.json``/``.parquet`` file, or a dataset name for `datasets.load_dataset`.
        split: the split to read from a dataset name.

    Raises:
        ValueError: malformed JSON or text that is not UTF-8 (names the file and line, and says
            when the file is cut short), an unreadable (corrupt) file, or no rows.
        FileNotFoundError: ``path`` looks like a local file and does not exist.
    """
    import datasets

    check_data_path(key, path)
    local = Path(path).expanduser()
    suffix = local.suffix.lower()
    rows = None
    if local.exists():
        if suffix == ".jsonl":
            rows = _read_json_lines(local)
        elif suffix == ".json":
            rows = _read_json(local)
        if rows is None and local.stat().st_size > 0:
            try:
                rows = datasets.load_dataset(_FILE_TYPES[suffix], data_files=str(local), split="train").to_list()
            except Exception as err:  # datasets wraps parser errors in its own types (no position)
                reason = " ".join(str(err).split())  # pyarrow's messages can end in a newline
                raise ValueError(f"{local}: could not read it as {suffix} ({reason}); is it corrupt or truncated?") from err
    else:
        try:
            rows = datasets.load_dataset(path, split=split).to_list()
        except Exception as err:
            raise ValueError(
                f"{key}={path!r} is not a local file and could not be loaded as a `datasets` name "
                f"(split {split!r}): {err}"
            ) from err
    if not rows:
        raise ValueError(f"{path}: the file has no rows")
    return rows if isinstance(rows, Rows) else Rows(rows)


_TRUNCATED = "the file ends inside this {}: it is truncated (cut short while being written or copied)"


def _decode(path: Path, raw: bytes, first_line: int = 1, at_end: bool = True) -> str:
    """``raw`` as UTF-8 text (a leading byte-order mark dropped); a ValueError naming ``path:line`` otherwise
    (``at_end``: ``raw`` runs to the end of the file, where a character cut short means a truncated file)."""
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        line = first_line + raw.count(b"\n", 0, err.start)
        if at_end and err.reason == "unexpected end of data":
            raise ValueError(f"{path}:{line}: {_TRUNCATED.format('UTF-8 character')}") from None
        raise ValueError(
            f"{path}:{line}: not UTF-8 text (byte 0x{raw[err.start]:02x}); save the file as UTF-8"
        ) from None


def _json_error(err: json.JSONDecodeError) -> str:
    """``err``'s message and column, e.g. "Expecting ',' delimiter at column 12"."""
    return f"{err.msg}{'' if err.msg.endswith(' at') else ' at'} column {err.colno}"


def _ran_out(err: json.JSONDecodeError, text: str) -> bool:
    """Whether the JSON ``text`` ends before its value does (a truncated file), rather than holding a wrong character."""
    return err.pos >= len(text.rstrip()) or err.msg.startswith("Unterminated string")


def _read_json_lines(path: Path) -> Rows:
    """The rows of a JSON Lines file with their line numbers; a ValueError naming ``path:line`` for the first
    line that is not a JSON object (and saying so when it is the last line, cut short: a truncated file)."""
    rows = Rows(lines=[])
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            last = not raw.endswith(b"\n")  # only a file's last line can lack its newline
            line = _decode(path, raw, lineno, at_end=last)
            if not line.strip():
                continue
            line = line.rstrip("\r\n")  # a decode error's column is then the line's own
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                cut = "; " + _TRUNCATED.format("line") if last and _ran_out(err, line) else ""
                raise ValueError(f"{path}:{lineno}: not valid JSON ({_json_error(err)}){cut}") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{lineno}: expected a JSON object per line, got {type(row).__name__}")
            rows.append(row)
            rows.lines.append(lineno)
    return rows


def _read_json(path: Path) -> Rows | list[dict[str, Any]] | None:
    """The rows of a .json file holding an array of objects (or JSON Lines); None for another layout
    (`datasets` reads it). Raises a ValueError naming ``path:line:column`` where the file stops being JSON."""
    text = _decode(path, path.read_bytes())
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        if err.msg == "Extra data" and text.lstrip().startswith("{"):  # JSON Lines in a .json file
            return _read_json_lines(path)
        cut = "; " + _TRUNCATED.format("array") if _ran_out(err, text) else ""
        raise ValueError(f"{path}:{err.lineno}:{err.colno}: not valid JSON ({err.msg}){cut}") from None
    if not isinstance(data, list):
        return None
    for i, row in enumerate(data):
        if not isinstance(row, dict):
            raise ValueError(f"{path}: element {i} of the array is a {type(row).__name__}; expected one JSON object per row")
    return data


def detect_format(row: dict[str, Any], source: str = "") -> str:
    """Name the format of a row from its non-null fields (see the module table).

    Null fields do not count: `datasets` gives every row the union of all rows' keys, with None
    where a row lacks one, so a key that only some later row has is present (as None) in every row.

    Raises:
        ValueError: no known field set is present (names the fields found and the ones expected).
    """
    fields = {k for k, v in row.items() if v is not None}
    if "messages" in fields:
        return "chat"
    if "instruction" in fields and ("output" in fields or "instances" in fields):
        return "instruction"
    if {"question", "answer"} <= fields:
        return "qa"
    if {"prompt", "completion"} <= fields:
        return "prompt_completion"
    if "text" in fields:
        return "text"
    expected = "; ".join(f"{fmt}: {', '.join(names)}" for fmt, names in _REQUIRED.items())
    known = sorted({name for names in _REQUIRED.values() for f in names for name in f.split(" | ")} | {"input", "instances"})
    found = sorted(fields)
    if "prompt" in fields and "completion" not in fields:  # TRL's prompt-only type (generation, preference data)
        hint = "; a prompt without a completion has nothing to train on (supervised fine-tuning needs the reply)"
    else:
        hint = _close_keys(found, known)
    raise ValueError(f"{source}: cannot tell the data format from the fields {found}; expected one of: {expected}{hint}")


def _close_keys(given: Iterable[str], wanted: Iterable[str]) -> str:
    """``"; did you mean 'answer' for 'answr'?"`` for each key of ``given`` that is not in ``wanted`` but close to one of them."""
    wanted = list(wanted)
    pairs = [(close[0], key) for key in given if key not in wanted and (close := difflib.get_close_matches(key, wanted, n=1))]
    return "; did you mean " + ", ".join(f"{w!r} for {k!r}" for w, k in pairs) + "?" if pairs else ""


def to_examples(
    rows: Sequence[dict[str, Any]], fmt: str = "auto", source: str = "data", system_prompt: str | None = None
) -> list[Example]:
    """Convert rows to `Example`s.

    Args:
        rows: dicts as read by `read_rows`.
        fmt: one of `FORMATS`, or ``auto`` to detect it from the first row (logged).
        source: a name for error messages (usually the file path); a row is named ``source:line`` where
            ``rows`` has lines (`Rows` of a JSON Lines file), else ``source row N``.
        system_prompt: if given, a system message put first in every conversation that has none.

    Raises:
        ValueError: unknown format, a row missing the fields of its format, a non-string field,
            a chat message with an unknown role, or a tool call, tool result or tool definitions (each names
            the row; tool-calling conversations are not supported).
    """
    if not rows:
        raise ValueError(f"{source}: no rows")
    lines = getattr(rows, "lines", None)

    def where(i: int) -> str:  # i: 1-based
        return f"{source}:{lines[i - 1]}" if lines else f"{source} row {i}"

    if fmt == "auto":
        fmt = detect_format(rows[0], where(1))
        log.info("data.format=auto: %s looks like the %r format", source, fmt)
    check_choice("data.format", fmt, ("auto", *FORMATS))
    examples: list[Example] = []
    own = plain = 0  # examples that keep their own system message; examples of plain text (no messages)
    for i, row in enumerate(rows, start=1):
        for example in _row_examples(row, fmt, where(i), first=i == 1):
            if system_prompt and example.messages is None:
                plain += 1
            elif system_prompt and example.messages[0]["role"] == "system":
                own += 1
            elif system_prompt:
                example = replace(example, messages=({"role": "system", "content": system_prompt}, *example.messages))
            examples.append(example)
    if own or plain:
        log.info("data.system_prompt: %s: put first in %d of %d examples; %d have a system message of their own and keep "
                 "it, %d are plain text (no chat template) and take none", source, len(examples) - own - plain,
                 len(examples), own, plain)
    return examples


def _row_examples(row: dict[str, Any], fmt: str, where: str, first: bool = False) -> Iterable[Example]:
    """The examples of ``row`` in format ``fmt`` (one, or one per instance of an ``instruction`` row); the ``first``
    row of a file, of another format than ``fmt``, is refused naming the setting that reads it."""
    missing = [f for f in _REQUIRED[fmt] if "|" not in f and row.get(f) is None]
    if fmt == "instruction" and row.get("output") is None and row.get("instances") is None:
        missing.append("output (or instances)")
    if missing:
        has = sorted(k for k, v in row.items() if v is not None)
        wanted = [name for f in _REQUIRED[fmt] for name in f.split(" | ")]
        try:  # a file of another format: name the setting that reads it (data=arithmetic sets format qa)
            other = f"; it looks like the {(detected := detect_format(row))!r} format: data.format={detected} (or auto)" if first else ""
        except ValueError:
            other = ""
        raise ValueError(
            f"{where}: the {fmt!r} format needs the fields {list(_REQUIRED[fmt])}; missing or null: {missing} "
            f"(the row has {has}{_close_keys(has, wanted)}){other}"
        )
    if row.get("tools"):
        raise ValueError(f"{where}: 'tools' (tool definitions) are not supported: tool-calling conversations are not "
                         "trained; leave such rows out")
    if fmt == "text":
        yield Example(text=_string(row, "text", where), source=where)
    elif fmt == "qa":
        messages = (_msg("user", _string(row, "question", where)), _msg("assistant", _string(row, "answer", where)))
        yield Example(messages=messages, source=where)
    elif fmt == "prompt_completion":
        yield _prompt_completion(row, where)
    elif fmt == "instruction":
        instruction = _string(row, "instruction", where)
        instances = row.get("instances")
        flat = instances is None  # instruction, input, output in the row itself
        if flat:
            instances = [{"input": row.get("input"), "output": row["output"]}]
        if not isinstance(instances, list) or not instances:
            raise ValueError(f"{where}: 'instances' must be a non-empty list of {{input, output}}")
        for j, inst in enumerate(instances):
            if not isinstance(inst, dict) or inst.get("output") is None:
                has = sorted(inst) if isinstance(inst, dict) else []
                raise ValueError(
                    f"{where}: instances[{j}] needs an 'output' field"
                    + (f" (it has {has}{_close_keys(has, ['input', 'output'])})" if isinstance(inst, dict) else f", got a {type(inst).__name__}")
                )
            inst_where = where if flat else f"{where} instances[{j}]"
            given = inst.get("input")
            given = "" if given is None else _string(inst, "input", inst_where)
            prompt = f"{instruction}\n\n{given}" if given else instruction
            yield Example(messages=(_msg("user", prompt), _msg("assistant", _string(inst, "output", inst_where))), source=where)
    else:
        yield Example(messages=tuple(_messages(row, "messages", where)), source=where)


def _prompt_completion(row: dict[str, Any], where: str) -> Example:
    """A ``prompt_completion`` row's example: plain text with the prompt as context (two strings), or the
    conversation whose last messages, the completion, are the targets (two message lists)."""
    prompt, completion = row["prompt"], row["completion"]
    if isinstance(prompt, str) and isinstance(completion, str):
        return Example(text=completion, prompt=prompt, source=where)
    if isinstance(prompt, list) and isinstance(completion, list):
        replies = _messages(row, "completion", where)
        if others := [f"completion[{j}] has the role {m['role']!r}" for j, m in enumerate(replies) if m["role"] != "assistant"]:
            raise ValueError(
                f"{where}: {others[0]}; the completion holds the assistant's reply (earlier turns go in 'prompt')"
            )
        return Example(messages=tuple(_messages(row, "prompt", where) + replies), source=where, completion_turns=len(replies))
    if not isinstance(prompt, (str, list)):
        raise ValueError(
            f"{where}: field 'prompt' must be a string or a list of {{role, content}} messages, got {type(prompt).__name__}"
        )
    wanted = "a string" if isinstance(prompt, str) else "a list of {role, content} messages"
    raise ValueError(f"{where}: field 'completion' must be {wanted}, as 'prompt' is, got {type(completion).__name__}")


def _messages(row: dict[str, Any], key: str, where: str) -> list[dict[str, str]]:
    """``row[key]``, a non-empty list of ``{role, content}`` messages, checked (each error names ``key[j]``)."""
    messages = row[key]
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: {key!r} must be a non-empty list of {{role, content}}")
    out = []
    for j, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"{where}: {key}[{j}] must be an object with 'role' and 'content', got a {type(m).__name__}")
        if m.get("role") in TOOL_ROLES or any(m.get(k) for k in TOOL_KEYS):
            raise ValueError(
                f"{where}: {key}[{j}] is a tool call or a tool's result: tool-calling conversations are not supported "
                f"(each message is a {', '.join(ROLES)} turn of text); leave such rows out"
            )
        if absent := [k for k in ("role", "content") if k not in m]:
            raise ValueError(
                f"{where}: {key}[{j}] has no {' or '.join(map(repr, absent))} "
                f"(it has {sorted(m)}{_close_keys(sorted(m), ['role', 'content'])})"
            )
        if m["role"] not in ROLES:
            raise ValueError(f"{where}: {key}[{j}] has the unknown role {m['role']!r}; expected one of {ROLES}")
        # keys set to None are absent (parquet and datasets rows hold every key of their schema)
        ignored = tuple(sorted(k for k, v in m.items() if v is not None and k not in ("role", "content", *TOOL_KEYS)))
        if ignored and ignored not in _IGNORED_WARNED:
            _IGNORED_WARNED.add(ignored)
            log.warning("%s: %s[%d]: the message keys %s are ignored (only 'role' and 'content' are read; "
                        "warned once per set of keys)", where, key, j, list(ignored))
        out.append(_msg(m["role"], _string(m, "content", f"{where}: {key}[{j}]")))
    return out


def _msg(role: str, content: str) -> dict[str, str]:
    return {"role": role, "content": content}


def _string(row: dict[str, Any], key: str, where: str) -> str:
    value = row.get(key)
    if not isinstance(value, str):
        raise ValueError(f"{where}: field {key!r} must be a string, got {type(value).__name__}")
    return value
