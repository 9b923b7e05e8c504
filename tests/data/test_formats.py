import json

import pytest

from lightning_ft.data.formats import detect_format, read_rows, to_examples


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_detects_each_format():
    assert detect_format({"question": "q", "answer": "a"}) == "qa"
    assert detect_format({"instruction": "i", "input": "", "output": "o"}) == "instruction"
    assert detect_format({"instruction": "i", "instances": []}) == "instruction"
    assert detect_format({"messages": []}) == "chat"
    assert detect_format({"text": "t"}) == "text"
    assert detect_format({"prompt": "p", "completion": "c"}) == "prompt_completion"
    assert detect_format({"prompt": [], "completion": [], "text": None}) == "prompt_completion"
    with pytest.raises(ValueError, match=r"fields \['prompt'\];.*a prompt without a completion has nothing to train on"):
        detect_format({"prompt": "p"})
    with pytest.raises(ValueError, match="cannot tell the data format.*prompt_completion: prompt, completion"):
        detect_format({"prompt": "x"}, "f.jsonl row 1")
    with pytest.raises(ValueError, match=r"data.format=qna: expected one of auto, qa, instruction, chat, prompt_completion, text; "
                                         r"did you mean data.format=qa\?"):
        to_examples([{"question": "q", "answer": "a"}], "qna")
    with pytest.raises(ValueError, match=r"data.format=prompt-completion: .*did you mean data.format=prompt_completion\?"):
        to_examples([{"prompt": "p", "completion": "c"}], "prompt-completion")


def test_qa_and_instruction_become_conversations():
    (qa,) = to_examples([{"question": "2+2?", "answer": "4"}])
    assert qa.messages == ({"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"})
    ex = to_examples([{"instruction": "Add.", "instances": [{"input": "1 1", "output": "2"}, {"input": "", "output": "0"}]}])
    assert [m[0]["content"] for m in (e.messages for e in ex)] == ["Add.\n\n1 1", "Add."]
    assert [e.messages[1]["content"] for e in ex] == ["2", "0"]


def test_prompt_completion_rows_become_text_or_conversations():
    """Two strings: plain text, the prompt as context (no system prompt: no template renders it); two message lists:
    the prompt's messages then the completion's, whose count marks the targets (the prompt's assistant turns are
    context)."""
    (standard,) = to_examples([{"prompt": "2+2?", "completion": " 4"}], system_prompt="Be brief.")
    assert (standard.prompt, standard.text, standard.messages) == ("2+2?", " 4", None)
    prompt = [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"}, {"role": "user", "content": "2+2?"}]
    completion = [{"role": "assistant", "content": "4"}]
    (conv,) = to_examples([{"prompt": prompt, "completion": completion}], system_prompt="Be brief.")
    assert conv.messages == ({"role": "system", "content": "Be brief."}, *prompt, *completion)
    assert conv.completion_turns == 1


def test_system_prompt_is_prepended_once_and_the_rows_that_keep_their_own_are_counted(caplog):
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    own = [{"role": "system", "content": "Be verbose."}, *turns]
    with caplog.at_level("INFO", logger="lightning_ft.data.formats"):
        (ex,) = to_examples([{"messages": turns}], system_prompt="Be brief.")
        assert ex.messages[0] == {"role": "system", "content": "Be brief."}
        assert "data.system_prompt" not in caplog.text  # every example took it: nothing to say
        examples = to_examples([{"messages": turns}, {"messages": own}], source="chat.jsonl", system_prompt="Be brief.")
    assert [e.messages[0]["content"] for e in examples] == ["Be brief.", "Be verbose."]
    assert "data.system_prompt: chat.jsonl: put first in 1 of 2 examples; 1 have a system message of their own" in caplog.text


def test_missing_fields_name_the_row_and_the_fields():
    with pytest.raises(ValueError, match=r"data row 2: the 'qa' format needs .*missing or null: \['answer'\]"):
        to_examples([{"question": "a", "answer": "b"}, {"question": "c"}], fmt="qa")


def test_unknown_role_names_the_row():
    rows = [{"messages": [{"role": "user", "content": "x"}, {"role": "robot", "content": "y"}]}]
    with pytest.raises(ValueError, match=r"row 1: messages\[1\] has the unknown role 'robot'"):
        to_examples(rows)


@pytest.mark.parametrize(
    "message",
    [
        {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f"}}]},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f"}}]},
        {"role": "assistant", "tool_calls": [{"function": {"name": "f"}}]},
        {"role": "tool", "content": "42"},
    ],
    ids=["tool_calls", "tool_calls_empty_content", "tool_calls_no_content", "tool_result"],
)
def test_tool_calling_rows_are_refused_by_name(message):
    rows = [{"messages": [{"role": "user", "content": "x"}, message]}]
    with pytest.raises(ValueError, match=r"row 1: messages\[1\] is a tool call or a tool's result: tool-calling "
                                         r"conversations are not supported"):
        to_examples(rows)


@pytest.mark.parametrize(
    "row",
    [
        {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]},
        {"prompt": [{"role": "user", "content": "x"}], "completion": [{"role": "assistant", "content": "y"}]},
    ],
    ids=["chat", "prompt_completion"],
)
def test_rows_with_tool_definitions_are_refused_by_name(row):
    with pytest.raises(ValueError, match=r"row 1: 'tools' \(tool definitions\) are not supported"):
        to_examples([{**row, "tools": [{"type": "function"}]}])


def test_message_keys_besides_role_and_content_are_named_once(caplog, monkeypatch):
    from lightning_ft.data import formats

    monkeypatch.setattr(formats, "_IGNORED_WARNED", set())
    rows = [{"messages": [{"role": "user", "content": "x", "name": "ann"},  # a key set to None counts as absent
                          {"role": "assistant", "content": "y", "name": None}]}] * 3
    with caplog.at_level("WARNING"):
        examples = to_examples(rows, source="chat.jsonl")
    assert [m["content"] for m in examples[0].messages] == ["x", "y"]
    warned = [r.getMessage() for r in caplog.records if "are ignored" in r.getMessage()]
    assert warned == ["chat.jsonl row 1: messages[0]: the message keys ['name'] are ignored (only 'role' and 'content' "
                      "are read; warned once per set of keys)"]


@pytest.mark.parametrize(
    "name, text, error",
    [
        ("bad.jsonl", '{"text": "ok"}\n{"text": "broken"\n', r"bad.jsonl:2: not valid JSON"),
        ("value.jsonl", '{"a": 1}\n{"question": "2+2", "answer": \n{"a": 2}\n', r"value.jsonl:2: not valid JSON \(Expecting value at column 31\)$"),
        ("bad.json", '[\n  {"text": "a"},\n  {"text": "b",,}\n]\n', r"bad.json:3:16: not valid JSON \(Expecting"),
        ("lines.json", '{"text": "a"}\n{"text": "b",}\n', r"lines.json:2: not valid JSON"),  # JSON Lines as .json
    ],
)
def test_malformed_json_names_file_and_position(tmp_path, name, text, error):
    (tmp_path / name).write_text(text)
    with pytest.raises(ValueError, match=error):
        read_rows(str(tmp_path / name))


def test_auto_format_is_the_first_rows_and_a_later_misfit_is_named(tmp_path):
    # `datasets` gives every row the union of all rows' keys (None where missing): a key only a
    # later row has must not decide the format, and that later row is the one the error names.
    qa = [{"question": f"q{i}", "answer": f"a{i}"} for i in range(4)]
    chat = {"messages": [{"role": "user", "content": "x"}]}
    extra = read_rows(_jsonl(tmp_path / "extra.jsonl", qa[:2] + [{**qa[2], **chat}]))
    assert detect_format(extra[0]) == "qa" and detect_format({**extra[0], "messages": None}) == "qa"
    assert [e.messages[1]["content"] for e in to_examples(extra)] == ["a0", "a1", "a2"]
    instruction = {"instruction": "i", "input": "x", "output": "o"}
    mixed = read_rows(_jsonl(tmp_path / "mixed.jsonl", qa[:2] + [instruction] + qa[3:]))
    has = r"\(the row has \['input', 'instruction', 'output'\]\)"
    with pytest.raises(ValueError, match=rf"data:3: the 'qa' format needs .*{has}"):  # the row's line
        to_examples(mixed)


@pytest.mark.parametrize(
    "rows, error, fmt",
    [case if len(case) == 3 else (*case, "auto") for case in [  # fmt: data.format (auto unless named)
        ([{"question": "q", "answer": "a"}, {"question": "q", "answr": "a"}],
         r"train.jsonl:4: the 'qa' format needs the fields \['question', 'answer'\]; missing or null: \['answer'\] "
         r"\(the row has \['answr', 'question'\]; did you mean 'answer' for 'answr'\?\)"),
        ([{"instruction": "i", "output": "o"}, {"instruction": "i", "instances": [{"input": "x", "ouptut": "o"}]}],
         r"train.jsonl:4: instances\[0\] needs an 'output' field \(it has \['input', 'ouptut'\]; did you mean 'output' for 'ouptut'\?\)"),
        ([{"messages": [{"role": "user", "content": "x"}]}, {"messages": [{"role": "user", "text": "x"}]}],
         r"train.jsonl:4: messages\[0\] has no 'content' \(it has \['role', 'text'\]\)"),
        ([{"prompt": "p", "completion": "c"}, {"prompt": "p", "completion": None}],
         r"train.jsonl:4: the 'prompt_completion' format needs the fields \['prompt', 'completion'\]; missing or null: "
         r"\['completion'\] \(the row has \['prompt'\]\)"),
        ([{"prompt": "p", "completion": "c"}, {"question": "q", "answer": "a"}],  # a row of another format
         r"train.jsonl:4: the 'prompt_completion' format needs .*missing or null: \['prompt', 'completion'\] "
         r"\(the row has \['answer', 'question'\]\)"),
        ([{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}],  # a file of another format
         r"train.jsonl:1: the 'qa' format needs .*\(the row has \['messages'\]\); it looks like the 'chat' format: "
         r"data.format=chat \(or auto\)$", "qa"),
        ([{"prompt": "p", "completion": "c"}, {"prompt": 7, "completion": "c"}],
         r"train.jsonl:4: field 'prompt' must be a string or a list of \{role, content\} messages, got int"),
        ([{"prompt": "p", "completion": "c"}, {"prompt": "p", "completion": [{"role": "assistant", "content": "c"}]}],
         r"train.jsonl:4: field 'completion' must be a string, as 'prompt' is, got list"),
        ([{"prompt": [{"role": "user", "content": "p"}], "completion": [{"role": "user", "content": "c"}]}],
         r"train.jsonl:1: completion\[0\] has the role 'user'; the completion holds the assistant's reply"),
        ([{"prompt": [{"role": "user", "content": "p"}], "completion": [{"role": "assistant", "content": 4}]}],
         r"train.jsonl:1: completion\[0\]: field 'content' must be a string, got int"),
        ([{"question": "q", "answr": "a"}],
         r"train.jsonl:1: cannot tell the data format from the fields \['answr', 'question'\]; .*; did you mean 'answer' for 'answr'\?"),
    ]],
)
def test_a_row_missing_a_field_is_named_by_file_line_and_the_field(tmp_path, rows, error, fmt):
    """The row's line in the file (blank lines counted), the missing key, and the row's key closest to it; a first row
    of another format than the one set, the setting that reads it."""
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps(rows[0]) + "\n" + "".join(f"\n\n{json.dumps(r)}\n" for r in rows[1:]))
    with pytest.raises(ValueError, match=error.replace("train.jsonl", str(path))):
        to_examples(read_rows(str(path)), fmt, source=str(path))


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_json_rows_are_read_as_written(tmp_path, suffix):
    # not typed per column as `datasets`' reader does, which would turn "007" into 7 beside an integer
    # row (trained on silently) and all-ISO-date strings into timestamps (refused as not strings)
    rows = [
        {"instruction": "Repeat the code", "input": "007", "output": "007"},
        {"instruction": "Repeat the code", "input": 5, "output": "5"},
        {"question": "When did it end?", "answer": "1945-05-08"},
    ]
    path = tmp_path / f"rows{suffix}"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) if suffix == ".jsonl" else json.dumps(rows))
    assert read_rows(str(path)) == rows
    (first,) = to_examples(read_rows(str(path))[:1])
    assert first.messages[0]["content"] == "Repeat the code\n\n007"
    with pytest.raises(ValueError, match=r"data(:| row )2: field 'input' must be a string, got int"):  # :line in .jsonl
        to_examples(read_rows(str(path))[:2])
    assert to_examples(read_rows(str(path))[2:])[0].messages[1]["content"] == "1945-05-08"


def test_instruction_input_must_be_a_string_and_empty_or_null_is_none():
    with pytest.raises(ValueError, match=r"row 1 instances\[1\]: field 'input' must be a string, got dict"):
        to_examples([{"instruction": "i", "instances": [{"input": "a", "output": "o"}, {"input": {"a": 1}, "output": "o"}]}])
    for given in ("", None):
        (ex,) = to_examples([{"instruction": "Add.", "input": given, "output": "0"}])
        assert ex.messages[0]["content"] == "Add."


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_text_that_is_not_utf8_names_the_line(tmp_path, suffix):
    path = tmp_path / f"latin1{suffix}"
    path.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=rf"latin1{suffix}:2: not UTF-8 text \(byte 0xe9\)"):
        read_rows(str(path))
    path.write_bytes(b'\xef\xbb\xbf{"text": "a byte-order mark first"}\n')  # UTF-8 with a BOM: read
    assert read_rows(str(path)) == [{"text": "a byte-order mark first"}]


def test_empty_and_missing_files(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match="no rows"):
        read_rows(str(empty))
    with pytest.raises(FileNotFoundError, match="no such file"):
        read_rows(str(tmp_path / "nope.jsonl"))
    with pytest.raises(FileNotFoundError, match=r"data.val_path='.*nope.jsonl': no such file"):
        read_rows(str(tmp_path / "nope.jsonl"), key="data.val_path")
    with pytest.raises(ValueError, match="is a folder; expected a .jsonl, .json or .parquet file"):
        read_rows(str(tmp_path))
    (tmp_path / "rows.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match=r"data.path='.*rows.csv': unsupported file type '.csv'"):
        read_rows(str(tmp_path / "rows.csv"))


def test_reads_jsonl_and_parquet(tmp_path):
    rows = [{"question": "q1", "answer": "a1"}, {"question": "q2", "answer": "a2"}]
    assert read_rows(_jsonl(tmp_path / "d.jsonl", rows)) == rows
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    assert read_rows(str(tmp_path / "d.parquet")) == rows


_CUT = r"the file ends inside this {}: it is truncated \(cut short while being written or copied\)"


@pytest.mark.parametrize(
    "name, data, error",
    [
        ("cut.jsonl", b'{"text": "ok"}\n{"text": "brok', r"cut.jsonl:2: not valid JSON \(Unterminated string starting at column 10\); " + _CUT.format("line")),
        ("cut.jsonl", b'{"text": "ok"}\n{"text": "ok"', r"cut.jsonl:2: not valid JSON \(Expecting ',' delimiter at column 14\); " + _CUT.format("line")),
        ("cut.jsonl", b'{"text": "ok"}\n{"text": "caf\xc3', r"cut.jsonl:2: " + _CUT.format("UTF-8 character")),  # inside a 2-byte é
        ("cut.json", b'[{"text": "a"},\n {"text": "b', r"cut.json:2:11: not valid JSON \(Unterminated string starting at\); " + _CUT.format("array")),
        # not cut short: a wrong character in the middle is not called truncated
        ("bad.jsonl", b'{"text": "ok"}}\n{"text": "b"}\n', r"bad.jsonl:1: not valid JSON \(Extra data at column 15\)$"),
    ],
)
def test_a_truncated_file_is_named_with_its_line_and_called_truncated(tmp_path, name, data, error):
    (tmp_path / name).write_bytes(data)
    with pytest.raises(ValueError, match=error):
        read_rows(str(tmp_path / name))


def test_a_corrupt_or_truncated_parquet_file_is_named(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"text": "x" * 40}] * 50), tmp_path / "d.parquet")
    data = (tmp_path / "d.parquet").read_bytes()
    for corrupt in (data[: len(data) // 2], data[:8] + bytes(len(data) - 16) + data[-8:]):
        (tmp_path / "bad.parquet").write_bytes(corrupt)
        with pytest.raises(ValueError, match=r"bad.parquet: could not read it as .parquet \(.*\); is it corrupt or truncated\?"):
            read_rows(str(tmp_path / "bad.parquet"))
