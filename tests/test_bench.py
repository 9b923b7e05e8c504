"""The benchmark harness: FLOP counting, a CPU smoke run of the real `bench` command, the
``unsloth`` system's plumbing on the CPU (Unsloth itself needs a GPU; a stand-in with its loader API
checks the checkpoint folder, the arguments, the import order and the loop), the results table and
``bench report``."""

import importlib.util
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_ft.bench.flops import matmul_params_per_token, train_step_flops
from lightning_ft.bench.systems import import_unsloth
from lightning_ft.config import config_dir

#: FastLanguageModel's loader API (unsloth 2026.10.9's keyword names) over transformers + PEFT; like the
#: real one must be, it is imported before transformers and with the Hub offline, or refuses to import
STAND_IN_UNSLOTH = '''
import os
import sys

if {"transformers", "peft", "trl"} & set(sys.modules) or os.environ.get("HF_HUB_OFFLINE") != "1":
    raise RuntimeError("stand-in unsloth: imported after transformers, or online")


class FastLanguageModel:
    @staticmethod
    def from_pretrained(*, model_name, max_seq_length, dtype, load_in_4bit, load_in_8bit, load_in_16bit, full_finetuning,
                        use_gradient_checkpointing):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        assert load_in_16bit != load_in_4bit and not (load_in_8bit or full_finetuning)
        quantization = {}
        if load_in_4bit:  # QLoRA as Unsloth loads it: bitsandbytes' NF4 with double quantisation
            from transformers import BitsAndBytesConfig

            quantization["quantization_config"] = BitsAndBytesConfig(
                load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=dtype)
        model = AutoModelForCausalLM.from_pretrained(model_name, dtype=dtype, **quantization)
        return model, AutoTokenizer.from_pretrained(model_name)

    @staticmethod
    def get_peft_model(model, *, r, lora_alpha, lora_dropout, target_modules, target_parameters, bias,
                       use_gradient_checkpointing):
        from peft import LoraConfig, get_peft_model

        if use_gradient_checkpointing:
            model.gradient_checkpointing_enable()
        return get_peft_model(model, LoraConfig(r=r, lora_alpha=lora_alpha, lora_dropout=lora_dropout, bias=bias,
                                                target_modules=target_modules, target_parameters=target_parameters,
                                                task_type="CAUSAL_LM"))

    @staticmethod
    def for_training(model):
        model.train()
'''


def run_bench(tmp_path, *overrides, env=None, ran=True):
    """``python -m lightning_ft bench +bench=tiny_cpu`` for one 48-token length, its rows appended to
    ``tmp_path/results.csv``; returns the result rows. ``ran=False``: no row runs, so the command ends with status 1
    (after writing the results) and its last line says why."""
    cmd = [sys.executable, "-m", "lightning_ft", "bench", "+bench=tiny_cpu", f"hydra.run.dir={tmp_path}",
           "seq_lens=[48]", "warmup_steps=1", "timed_steps=1", f"results_table={tmp_path / 'results.csv'}", *overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == (0 if ran else 1), proc.stderr[-3000:]
    if not ran:
        assert proc.stderr.splitlines()[-1].startswith("error: bench: no row ran (") and "Traceback" not in proc.stderr
    return json.loads((tmp_path / "results.json").read_text())["rows"]

DENSE = dict(model_type="llama", hidden_size=8, num_attention_heads=2, num_key_value_heads=1, head_dim=4,
             intermediate_size=16, num_hidden_layers=3, vocab_size=10)


def test_flops_count_by_hand():
    # per layer: q 8·8, o 8·8, k 8·4, v 8·4 = 192; mlp 3·8·16 = 384 → 576; head 80
    assert matmul_params_per_token(DENSE) == (3 * 576, 80)
    # router 8·5 and top-2 of 5 experts of gate/up/down 3·8·6 (norms of q and k, 1-D, not counted)
    moe = {**DENSE, "model_type": "qwen3_moe", "num_experts": 5, "num_experts_per_tok": 2, "moe_intermediate_size": 6}
    assert matmul_params_per_token(moe)[0] == 3 * (192 + 8 * 5 + 2 * 3 * 8 * 6)
    # LoRA (frozen base), no checkpointing: 4·P per token, plus forward + 2× backward of attention
    attn_fwd = 3 * 2 * 2 * 4 * (5 * 5 + 2 * 2)  # layers · 2 · heads · head_dim · Σ n²
    assert train_step_flops(DENSE, [5, 2], gradient_checkpointing=False) == 4 * (1728 + 80) * 7 + 3 * attn_fwd
    # checkpointing recomputes the layers' forward (not the LM head) and the attention forward
    assert train_step_flops(DENSE, [5, 2], True) - train_step_flops(DENSE, [5, 2], False) == 2 * 1728 * 7 + attn_fwd
    # full fine-tuning adds the weight gradients
    assert train_step_flops(DENSE, [5, 2], False, base_trainable=True) - train_step_flops(DENSE, [5, 2], False) == 2 * (1728 + 80) * 7


def test_flops_count_the_architecture_as_it_computes():
    """gpt-oss: top-4 of 32 biased experts (gate_up interleaved in one weight), a router; its sliding-window layers
    score at most ``window`` keys a query: n²/2 − (n − w)²/2 pairs for a document of n > w tokens."""
    oss = dict(model_type="gpt_oss", hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, num_local_experts=32, num_experts_per_tok=4, sliding_window=8,
               layer_types=["sliding_attention", "full_attention"], vocab_size=100)
    attention = 64 * 64 * 2 + 64 * 32 * 2  # q, o; k, v
    experts = 4 * (64 * 2 * 32 + 32 * 64)  # top-4 of gate_up [64 → 2·32] and down [32 → 64]
    assert matmul_params_per_token(oss) == (2 * (attention + 64 * 32 + experts), 6400)
    pairs_full, pairs_window = 20 * 20 / 2, 20 * 20 / 2 - 12 * 12 / 2
    with_attention = train_step_flops(oss, [20], gradient_checkpointing=False)
    assert with_attention - 4 * 20 * sum(matmul_params_per_token(oss)) == 3 * 2 * 4 * 32 * (pairs_full + pairs_window)


@pytest.mark.slow
def test_bench_smoke_runs_both_systems_with_the_same_math(tmp_path):
    rows = run_bench(tmp_path, "profile=true")
    assert [(r["system"], r["status"]) for r in rows] == [("hf_peft", "ok"), ("lightning_ft", "ok")]
    # name: null names the results after the model option; out_dir: null puts them in the run folder
    config = json.loads((tmp_path / "results.json").read_text())["config"]
    assert config["name"] == rows[0]["model"] == "qwen3_moe_tiny" and config["out_dir"] == str(tmp_path)
    # same random model, same tokens, same optimizer: the same losses after two steps
    assert rows[1]["loss_last"] == pytest.approx(rows[0]["loss_last"], rel=1e-4)
    assert rows[1]["x_vs_hf_peft"] > 0
    assert "| hf_peft |" in (tmp_path / "results.md").read_text()
    assert (tmp_path / "results.png").stat().st_size > 0
    # profile=true ranks the timed step's ops (on the CPU by host time) for each row, then per input shape
    for system in ("hf_peft", "lightning_ft"):
        profile = (tmp_path / f"profile_{system}_48.txt").read_text()
        assert "aten::mm" in profile and "Input Shapes" in profile
        assert "BENCH_ROW " in (tmp_path / f"worker_{system}_48.log").read_text()  # each worker's whole output
    # each row appended to the results table, with the columns of the schema
    from lightning_ft.bench.table import COLUMN_NAMES, read_rows

    assert (tmp_path / "results.csv").read_text().splitlines()[0] == ",".join(COLUMN_NAMES)
    table = read_rows(tmp_path / "results.csv")
    assert [(r["system"], r["seq_len"], r["layers"], r["status"]) for r in table] == [("hf_peft", 48, 4, "ok"), ("lightning_ft", 48, 4, "ok")]
    for r, row in zip(table, rows):
        assert r["ms_per_step"] == pytest.approx(row["ms_per_step"], abs=1e-3) and r["tokens_per_s"] > 0 and r["loss_last"] > 0
        assert r["commit"] and r["gpu"] and r["torch"] and r["run"] == table[0]["run"] and (r["warmup_steps"], r["timed_steps"]) == (1, 1)
        assert r["table"] is None  # profile=true changes what is measured: history, in no RESULTS.md table
    assert table[0]["settings"] == "fp32 ckpt lora=r16a32:q,k,v,o" and table[1]["settings"].endswith("kernels=none moe=hf")
    assert "+bench=tiny_cpu" in table[0]["command"] and "results_table" not in table[0]["command"]


@pytest.mark.slow
def test_bench_qlora_runs_every_system_over_the_same_nf4_base(tmp_path):
    """``model.quantization=nf4``: hf_peft's in-memory bitsandbytes layers, Unsloth's ``load_in_4bit`` load (the
    stand-in loads through transformers' bitsandbytes quantizer, as from_pretrained does for a user) and ours
    quantise the same random weights alike: the same losses, which differ from the 16/32-bit base's; every row's
    settings say nf4."""
    pytest.importorskip("bitsandbytes", reason='model.quantization=nf4 needs bitsandbytes: pip install -e ".[qlora]"')
    site, tmp = tmp_path / "site", tmp_path / "tmp"
    (site / "unsloth").mkdir(parents=True)
    (site / "unsloth" / "__init__.py").write_text(STAND_IN_UNSLOTH)
    tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp), "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    rows = run_bench(tmp_path / "run", "systems=[hf_peft,unsloth,lightning_ft]", "model.quantization=nf4", env=env)
    assert [(r["system"], r["status"]) for r in rows] == [("hf_peft", "ok"), ("unsloth", "ok"), ("lightning_ft", "ok")]
    assert rows[1]["loss_last"] == pytest.approx(rows[0]["loss_last"], rel=1e-5)
    assert rows[2]["loss_last"] == pytest.approx(rows[0]["loss_last"], rel=1e-4)
    from lightning_ft.bench.table import read_rows

    table = read_rows(tmp_path / "run" / "results.csv")
    assert all(" nf4 lora=" in r["settings"] for r in table) and {r["table"] for r in table} == {None}
    dense = run_bench(tmp_path / "dense", "systems=[hf_peft]")
    assert abs(dense[0]["loss_last"] - rows[0]["loss_last"]) > 1e-3  # the 4-bit base changed the numbers


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("unsloth") is not None, reason="unsloth is installed here, so it cannot be missing")
def test_bench_unsloth_missing_is_a_row_saying_why(tmp_path):
    (row,) = run_bench(tmp_path, "systems=[unsloth]", ran=False)
    assert row["status"] == ("error: ImportError: unsloth not importable: ModuleNotFoundError: No module named 'unsloth'; "
                             'install the peers with pip install -e ".[bench]" (needs a CUDA GPU for unsloth)')
    assert f"| unsloth | 4 | 48 | {row['status']} |" in (tmp_path / "results.md").read_text()
    assert "Traceback" in (tmp_path / "worker_unsloth_48.log").read_text()


@pytest.mark.slow
def test_bench_unsloth_system_trains_the_same_random_model_through_a_checkpoint_folder(tmp_path):
    site, tmp = tmp_path / "site", tmp_path / "tmp"
    (site / "unsloth").mkdir(parents=True)
    (site / "unsloth" / "__init__.py").write_text(STAND_IN_UNSLOTH)
    tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp), "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    rows = run_bench(tmp_path / "run", "systems=[hf_peft,unsloth]", env=env)
    assert [(r["system"], r["status"]) for r in rows] == [("hf_peft", "ok"), ("unsloth", "ok")]
    # the folder held hf_peft's random weights and, as the stand-in (unlike Unsloth) does not reseed, PEFT draws
    # the same adapters: the same losses
    assert rows[1]["loss_last"] == pytest.approx(rows[0]["loss_last"], rel=1e-5)
    assert not list(tmp.glob("lightning_ft_unsloth_*")), "the checkpoint folder is deleted after the run"
    from lightning_ft.bench.table import read_rows

    # only lengths, systems and steps overridden: the rows belong to the preset's table
    assert [(r["table"], r["system"]) for r in read_rows(tmp_path / "run" / "results.csv")] == [("tiny_cpu", "hf_peft"), ("tiny_cpu", "unsloth")]


def test_import_unsloth_refuses_to_come_after_transformers():
    import transformers  # noqa: F401  (Unsloth must be first: it patches transformers when imported)

    with pytest.raises(RuntimeError, match="unsloth must be imported before transformers"):
        import_unsloth()


def test_bench_config_errors_are_one_line_naming_the_key(tmp_path):
    cmd = [sys.executable, "-m", "lightning_ft", "bench", "+bench=tiny_cpu", f"hydra.run.dir={tmp_path / 'new'}", "systems=[hf_peft,unslot]"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr and "Error executing job" not in proc.stderr
    assert proc.stderr.splitlines()[-1] == "error: systems: unknown ['unslot']; did you mean unsloth? known: ['hf_peft', 'liger', 'unsloth', 'lightning_ft']"
    assert not (tmp_path / "new").exists()  # the folder Hydra created for the refused run is removed
    for override, message in (("+strategy.activation_offloading=true", "strategy.activation_offloading: no key 'activation_offloading' in "
                                                                       "strategy; did you mean strategy.activation_offload?"),
                              ("strategy.activation_offload=maybe", "strategy.activation_offload: Value 'maybe' is not a valid bool"),
                              ("model.activation_offload=true", "model.activation_offload: moved to strategy.activation_offload"),
                              ("timed_steps=0", "error: timed_steps=0: expected an integer of at least 1"),
                              ("seq_lens=[]", "error: seq_lens=[]: expected a list of token counts"),
                              ("seq_lens=[1k]", "error: seq_lens=['1k']: expected a list of token counts"),
                              ("num_layers=0", "error: num_layers=0: expected an integer of at least 1")):
        cmd = [sys.executable, "-m", "lightning_ft", "bench", "+bench=tiny_cpu", f"hydra.run.dir={tmp_path}", override]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert proc.returncode != 0 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    if not __import__("torch").cuda.is_available():  # the GPU presets on a machine without one
        cmd = [sys.executable, "-m", "lightning_ft", "bench", f"hydra.run.dir={tmp_path / 'gpu'}"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert "no CUDA GPU" in proc.stderr and "Traceback" not in proc.stderr


def test_unknown_bench_preset_gets_the_closest_and_all_presets(tmp_path):
    cmd = [sys.executable, "-m", "lightning_ft", "bench", "+bench=tiny_cp", f"hydra.run.dir={tmp_path}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "hint: +bench=tiny_cp: not an option of the `bench` group; did you mean tiny_cpu? options: llama8b, " in proc.stderr
    assert "`python -m lightning_ft bench --help` lists the config groups and their options" in proc.stderr


def test_a_group_of_the_other_command_is_named_as_such():
    from lightning_ft.config import override_hints

    assert override_hints(["+bench=tiny_cpu"], "fit")[0] == "+bench: `bench` is a config group of `python -m lightning_ft bench`, not of `fit`"
    assert override_hints(["+experiment=gsm8k_tiny"], "bench")[0] == (
        "+experiment: `experiment` is a config group of `python -m lightning_ft fit`, not of `bench`"
    )
    assert override_hints(["model=qwen3_moe_tiny"], "bench")[:-1] == []  # a group both read, a known option


def test_the_peak_is_not_applicable_on_the_cpu_rather_than_none(tmp_path, caplog):
    from hydra import compose, initialize_config_dir

    from lightning_ft.bench.runner import run_bench
    from lightning_ft.config import config_dir, register_configs

    register_configs()
    with initialize_config_dir(config_dir(), version_base="1.3"):
        cfg = compose("benchmark", overrides=["+bench=tiny_cpu", "systems=[]", "name=tiny", f"out_dir={tmp_path}"])
    with caplog.at_level(logging.INFO, logger="lightning_ft.bench.runner"):
        run_bench(cfg)  # no systems: only the header line
    assert "bench: tiny on " in caplog.text and ", peak n/a (CPU)" in caplog.text


def test_host_overhead_counts_fewer_python_calls_with_the_lora_switch(tmp_path):
    """benchmarks/host_overhead.py runs as documented, and kernels.lora removes host work (exact counts, not time)."""
    out = tmp_path / "host.json"
    subprocess.run([sys.executable, "benchmarks/host_overhead.py", "--layers", "2", "--timed-steps", "1", "--out", str(out)],
                   check=True, capture_output=True, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    off, on = json.loads(out.read_text())["rows"]
    assert (off["switch"], off["on"], on["on"]) == ("lora", False, True)
    assert on["python_calls_per_step"] < off["python_calls_per_step"] and on["aten_ops_per_step"] < off["aten_ops_per_step"]


def _compose_bench(*overrides):
    from hydra import compose, initialize_config_dir

    from lightning_ft.config import config_dir, register_configs

    register_configs()
    with initialize_config_dir(config_dir(), version_base="1.3"):
        return compose("benchmark", overrides=list(overrides))


def test_bench_row_log_line_is_readable_and_results_json_keeps_the_row(tmp_path, caplog, monkeypatch):
    from lightning_ft.bench import runner

    row = {"system": "lightning_ft", "model": "tiny", "seq_len": 8192, "layers": 12, "status": "ok", "ms_per_step": 172.4014269999543,
           "ms_min": 171.6, "tokens_per_s": 47517.00808139002, "tflops_per_s": 406.82, "mfu": 0.5132813118744723,
           "peak_mem_gib": 19.212421894073486, "peak_reserved_gib": 21.47265625, "loss_last": 12.207749931327067}
    monkeypatch.setattr(runner, "_run_worker", lambda spec, timeout_s, log: dict(row))
    cfg = _compose_bench("+bench=tiny_cpu", "systems=[lightning_ft]", "seq_lens=[8192]", "name=tiny", f"out_dir={tmp_path}")
    with caplog.at_level(logging.INFO, logger="lightning_ft.bench.runner"):
        runner.run_bench(cfg)
    assert ("bench row: lightning_ft seq 8192: 172.4 ms/step, 47,517 tokens/s, MFU 51.3%, peak 19.21 GiB allocated / 21.47 GiB "
            "reserved, loss 12.2077") in caplog.messages
    assert json.loads((tmp_path / "results.json").read_text())["rows"] == [{**row, "x_vs_hf_peft": None, "mem_vs_hf_peft": None}]
    # unknown on the CPU: n/a; a row that did not run: its status
    cpu = {**row, "mfu": None, "peak_mem_gib": None, "peak_reserved_gib": None}
    assert runner.row_text(cpu) == "lightning_ft seq 8192: 172.4 ms/step, 47,517 tokens/s, MFU n/a, peak n/a, loss 12.2077"
    assert runner.row_text({"system": "unsloth", "seq_len": 8192, "status": "OOM"}) == "unsloth seq 8192: OOM"


def test_bench_help_has_no_unresolved_values_and_names_the_cpu_preset():
    proc = subprocess.run([sys.executable, "-m", "lightning_ft", "bench", "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "${" not in proc.stdout and "\nname: null\n" in proc.stdout and "\nout_dir: null\n" in proc.stdout
    header = proc.stdout.split("== Configuration groups ==")[0]
    presets = [p.stem for p in (Path(config_dir()) / "bench").glob("*.yaml")]
    on_cpu = [p for p in presets if _compose_bench(f"+bench={p}").device == "cpu"]
    assert on_cpu == ["tiny_cpu"] and _compose_bench().device == "cuda"
    assert "need a CUDA GPU: `+bench=tiny_cpu` runs on the CPU" in " ".join(header.split())


def test_bench_key_typos_get_the_closest_key_and_added_ones_are_refused(tmp_path):
    from omegaconf import OmegaConf

    from lightning_ft.bench.runner import run_bench
    from lightning_ft.config import command_schema, override_hints

    assert override_hints(["warmup_step=2"], "bench")[0].startswith(
        "warmup_step: no key 'warmup_step' in the top level; did you mean warmup_steps? keys: name, systems, ")
    assert override_hints(["lora.rnak=2"], "bench")[0].startswith("lora.rnak: no key 'rnak' in lora; did you mean lora.rank? ")
    assert override_hints(["model.config.num_layers=2", "seq_lens=[64]"], "bench")[:-1] == []  # free-form, known
    proc = subprocess.run([sys.executable, "-m", "lightning_ft", "bench", "warmup_step=2"], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "hint: warmup_step: no key 'warmup_step' in the top level; did you mean warmup_steps?" in proc.stderr
    # Hydra's advice, `+warmup_step=2`, adds a key nothing reads: refused before any row runs
    with pytest.raises(ValueError, match=r"^warmup_step: no key 'warmup_step' in the top level; did you mean warmup_steps\?"):
        run_bench(_compose_bench("+bench=tiny_cpu", "+warmup_step=2", f"out_dir={tmp_path}"))
    assert not list(tmp_path.iterdir())
    for preset in (p.stem for p in (Path(config_dir()) / "bench").glob("*.yaml")):  # every preset passes the check
        OmegaConf.merge(OmegaConf.structured(command_schema("bench")), _compose_bench(f"+bench={preset}"))


def _table_row(**values):
    row = {"table": "qwen3_moe", "run": "2026-12-03T19:25:00Z", "date": "2026-12-03 19:25", "commit": "3af38d2", "gpu": "NVIDIA H200",
           "system": "lightning_ft", "model": "qwen3_moe_30b_a3b", "layers": 48, "seq_len": 8192, "status": "ok",
           "ms_per_step": 482.04, "ms_min": 476.8, "ms_max": 494.4, "tokens_per_s": 16994.4, "mfu": 0.63912, "peak_mem_gib": 85.53,
           "peak_reserved_gib": 87.32, "loss_last": 12.2111, "settings": "bf16 ckpt", "command": "python -m lightning_ft bench +bench=qwen3_moe",
           "torch": "2.11.0"}
    return {**row, **values}


def test_results_table_round_trips_and_appends(tmp_path):
    from lightning_ft.bench.table import COLUMN_NAMES, append_rows, read_rows

    path = tmp_path / "sub" / "results.csv"
    assert append_rows(path, [_table_row(), _table_row(system="hf_peft", mfu=None, tokens_per_s=4996.3)]) == 2
    append_rows(path, [_table_row(table="", seq_len=1024, command="a, b \n c")])
    lines = path.read_text().splitlines()
    assert lines[0] == ",".join(COLUMN_NAMES) and len(lines) == 4  # one header, rows appended below it
    rows = read_rows(path)
    assert set(rows[0]) == set(COLUMN_NAMES)
    assert (rows[0]["layers"], rows[0]["seq_len"], rows[0]["ms_per_step"], rows[0]["mfu"], rows[0]["unsloth"]) == (48, 8192, 482.04, 0.6391, None)
    assert rows[1]["system"] == "hf_peft" and rows[1]["mfu"] is None and rows[1]["tokens_per_s"] == 4996.3
    assert rows[2]["table"] is None and rows[2]["command"] == "a, b c"  # one line per row; a comma is quoted


def test_results_table_refuses_other_columns_naming_them_and_the_file(tmp_path):
    from lightning_ft.bench.table import TableError, append_rows, read_rows

    path = tmp_path / "results.csv"
    with pytest.raises(TableError, match=r"results.csv: row 0 .*unknown columns \['tokens'\]; missing columns \['seq_len'\]"):
        append_rows(path, [{**{k: v for k, v in _table_row().items() if k != "seq_len"}, "tokens": 8192}])
    assert not path.exists()  # nothing written
    path.write_text("table,run,date,tokens\n")
    with pytest.raises(TableError, match=r"results.csv: the header .*missing columns \['commit', .*unknown columns \['tokens'\]"):
        append_rows(path, [_table_row()])
    with pytest.raises(TableError, match=str(path)):
        read_rows(path)
    assert path.read_text() == "table,run,date,tokens\n"


def test_bench_report_regenerates_results_md_deterministically(tmp_path):
    from lightning_ft.bench.report import main
    from lightning_ft.bench.table import append_rows

    table = tmp_path / "results.csv"
    old = {"run": "2026-12-01T10:00:00Z", "date": "2026-12-01 10:00", "commit": "aaaaaaa"}
    append_rows(table, [
        _table_row(system="hf_peft", seq_len=8192, ms_per_step=1700.0, tokens_per_s=4818.8, peak_mem_gib=80.0, **old),
        _table_row(seq_len=8192, ms_per_step=500.0, tokens_per_s=16384.0, **old),
        _table_row(system="hf_peft", ms_per_step=1639.6, tokens_per_s=4996.3, peak_mem_gib=79.59),
        _table_row(),  # the latest lightning_ft row at 8K, with hf_peft in its run
        _table_row(system="hf_peft", seq_len=65536, status="OOM", ms_per_step=None, tokens_per_s=None, peak_mem_gib=None),
        _table_row(table="", seq_len=8192, ms_per_step=1.0, run="2026-12-05T00:00:00Z", date="2026-12-05 00:00"),  # history
        _table_row(table="qwen3_moe_long", seq_len=262144, status="OOM", ms_per_step=None, tokens_per_s=None, peak_mem_gib=None),
    ])
    out = tmp_path / "docs" / "RESULTS.md"
    assert main(["--table", str(table), "--out", str(out)]) == 0
    text = out.read_text()
    png = tmp_path / "docs" / "plots" / "qwen3_moe.png"
    assert "## qwen3_moe" in text and "Reproduce: `python -m lightning_ft bench +bench=qwen3_moe`" in text
    assert ("| 8192 | 48 | `lightning_ft` | 482.0 (476.8–494.4) | 16,994 | 3.40× | 63.9% | 85.53 / 87.32 | 1.07× | 12.2111 | "
            "2026-12-03 (3af38d2) |") in text
    assert "| 65536 | 48 | `hf_peft` | OOM |" in text and "| 1.0 " not in text and "2026-12-01" not in text
    assert "![qwen3_moe](plots/qwen3_moe.png)" in text and png.stat().st_size > 0
    assert "Session" not in text and "session" not in text
    # a table whose rows all ran out of memory: its rows, no empty plot
    assert "| 262144 | 48 | `lightning_ft` | OOM |" in text and "qwen3_moe_long.png" not in text
    assert not (png.parent / "qwen3_moe_long.png").exists()
    first = (text, png.read_bytes())
    main(["--table", str(table), "--out", str(out)])
    assert (out.read_text(), png.read_bytes()) == first  # same table, same files


def test_bench_report_is_a_plain_command_listed_in_the_help():
    proc = subprocess.run([sys.executable, "-m", "lightning_ft", "bench", "report", "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "--table TABLE" in proc.stdout and "--out OUT" in proc.stdout
    proc = subprocess.run([sys.executable, "-m", "lightning_ft", "bench", "report", "--table", "no/such.csv"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and "no results table at no/such.csv" in proc.stderr and "Traceback" not in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "lightning_ft", "--help"], capture_output=True, text=True, timeout=120)
    assert "bench report" in proc.stdout


def test_bench_appends_to_the_repository_table_only_on_cuda_from_a_checkout(tmp_path):
    from lightning_ft.bench.runner import _table_target

    assert _table_target(_compose_bench("+bench=tiny_cpu")) == (None, "")  # auto on the CPU: nowhere
    assert _table_target(_compose_bench("+bench=tiny_cpu", f"results_table={tmp_path}/t.csv", "table=mine")) == (tmp_path / "t.csv", "mine")
    assert _table_target(_compose_bench("+bench=qwen3_moe", "results_table=null"))[0] is None


def test_micro_benchmark_results_become_rows_of_their_own_table_and_a_report_section(tmp_path):
    from lightning_ft.bench.report import main
    from lightning_ft.bench.table import MICRO, append_rows, micro_rows, read_rows

    common = {"date": "2026-11-29 12:53:53", "device": "NVIDIA H200", "smoke": False, "versions": {"torch": "2.11.0", "liger_kernel": "0.8.5"}}
    kernels = {**common, "rows": [
        {"op": "rms_norm", "impl": impl, "mode": "fwd", "shape": "16384x4096 bf16", "ms": ms, "gbps": gbps, "tflops": None, "peak_mib": None}
        for impl, ms, gbps in (("ours", 0.043, 6241.5), ("reference", 0.446, 601.0))]}
    moe = {**common, "dtype": "bfloat16", "shape": {"hidden_size": 2048, "moe_intermediate_size": 768, "num_experts": 128,
                                                  "num_experts_per_tok": 8, "lora_rank": 16},
           "rows": [{"tokens": 1024, "impl": "hf_peft", "fwd_ms": 3.97, "fwd_bwd_ms": 6.29, "peak_mib": 1664.8}]}
    attention = {**common, "command": "python benchmarks/attention_bench.py --cuda-graphs --out /x/a.json", "documents": "sampled",
                 "rows": [{"section": "cache", "model": "qwen3_0_6b", "tokens": 2041, "docs": 6, "backend": "varlen", "variant": "cached",
                           "ms": 98.3, "tokens_per_s": 20753.3, "peak_gib": 7.0, "skipped": None}]}
    attention_kernels = {**common, "heads": [32, 8, 128], "rows": [
        {"layout": "1x16K", "tokens": 16384, "docs": 1, "provider": provider, "ms": ms, "tflops": 545.0}
        for provider, ms in (("cudnn_alone", 10.0), ("auto", 10.2))] + [{"layout": "1x64K", "provider": "flex", "skipped": "OOM"}]}
    assert micro_rows("kernels", {**kernels, "smoke": True}, "abc1234") == []  # a CPU check measures nothing
    rows = micro_rows("kernels", kernels, "abc1234") + micro_rows("moe", moe, "abc1234") + micro_rows("attention", attention, "abc1234")
    rows += micro_rows("attention_kernels", attention_kernels, "abc1234")
    path = tmp_path / "micro.csv"
    append_rows(path, rows, MICRO)
    back = read_rows(path, MICRO)
    assert [(r["table"], r["op"], r["mode"], r["provider"]) for r in back] == [
        ("kernels", "rms_norm", "fwd", "ours"), ("kernels", "rms_norm", "fwd", "reference"), ("moe", "moe_block", "fwd", "hf_peft"),
        ("moe", "moe_block", "fwd+bwd", "hf_peft"), ("attention", "attention_cache", "fwd+bwd cuda_graphs", "varlen:cached"),
        ("attention_kernels", "attention", "fwd+bwd", "cudnn_alone"), ("attention_kernels", "attention", "fwd+bwd", "auto")]
    assert back[2]["shape"] == "T=1024 H=2048 I=768 E=128 k=8 r=16 bfloat16" and back[3]["peak_mib"] == 1664.8
    assert back[4]["command"] == "python benchmarks/attention_bench.py --cuda-graphs" and back[4]["peak_mib"] == 7168.0
    append_rows(tmp_path / "results.csv", [_table_row()])
    main(["--table", str(tmp_path / "results.csv"), "--out", str(tmp_path / "RESULTS.md")])  # micro.csv beside the table
    text = (tmp_path / "RESULTS.md").read_text()
    assert "## kernels" in text and "| rms_norm | fwd | 16384x4096 bf16 | `ours` | 0.043 | 10.37× | 6,242 | 2026-11-29 (abc1234) |" in text
    assert "## moe" in text and "## attention" in text
    assert "| attention | fwd+bwd | 1x16K T=16384 docs=1 32q/8kv heads of 128 | `auto` | 10.200 | 0.98× | 545.0 |" in text


def test_attention_kernels_bench_smoke(tmp_path):
    """The script runs end to end on the CPU (sdpa, tiny shapes) and records nothing for a smoke run."""
    import json
    import subprocess
    import sys

    out, record = tmp_path / "a.json", tmp_path / "micro.csv"
    subprocess.run([sys.executable, "benchmarks/attention_kernels_bench.py", "--smoke", "--out", str(out), "--record", str(record)],
                   check=True, capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    result = json.loads(out.read_text())
    assert result["smoke"] and [r["provider"] for r in result["rows"]] == ["sdpa", "sdpa"] and not record.exists()


def test_fault_drill_rows_become_a_report_section_and_refuse_other_columns(tmp_path):
    from lightning_ft.bench.report import main
    from lightning_ft.bench.table import DRILL, TableError, append_rows, read_rows

    row = {"table": "fault_drill", "run": "2026-12-05T08:30Z", "date": "2026-12-05 08:30", "commit": "abc1234",
           "machine": "AMD EPYC, 2 cores", "steps": 20, "seed": 0, "kills": 20, "kills_step": 7, "kills_checkpoint": 7,
           "kills_export": 6, "partial_writes_left": 14, "restarted": 1, "resumed": 20, "equal_losses": 20, "equal_adapter": 20,
           "unreadable": 0, "max_loss_diff": 0.0, "max_adapter_diff": 0.0, "wall_s": 251.4,
           "command": "python benchmarks/fault_drill.py --kills 20 --seed 0", "torch": "2.13.0"}
    drills = tmp_path / "drills.csv"
    append_rows(drills, [row], DRILL)
    assert read_rows(drills, DRILL)[0]["max_loss_diff"] == 0.0
    with pytest.raises(TableError, match=r"unknown columns \['gpu'\]"):
        append_rows(drills, [{**row, "gpu": "x"}], DRILL)
    append_rows(tmp_path / "results.csv", [_table_row()])
    main(["--table", str(tmp_path / "results.csv"), "--out", str(tmp_path / "RESULTS.md")])  # drills.csv beside the table
    text = (tmp_path / "RESULTS.md").read_text()
    assert "[fault-drills](#fault-drills)" in text and "# Fault drills" in text
    assert ("| 20 (7 / 7 / 6) | 14 | 20/20 | 20/20 | 20/20 | 0 | 0, 0 | 20 | 251 | AMD EPYC, 2 cores | 2026-12-05 (abc1234) |"
            in text)
    assert "- `python benchmarks/fault_drill.py --kills 20 --seed 0` (2026-12-05, abc1234)" in text


def test_settings_name_fp8_base_weights():
    from lightning_ft.bench.table import settings_text

    config = {"dtype": "bfloat16", "lora": {"rank": 16, "alpha": 32, "target_modules": ["q_proj"]}, "kernels": {"lora": True}}
    assert settings_text({**config, "strategy": {"fp8": True}}, "lightning_ft") == "bf16 lora=r16a32:q kernels=lora fp8"
    assert settings_text({**config, "strategy": {"fp8": False}}, "lightning_ft") == "bf16 lora=r16a32:q kernels=lora"
    both = {"fp8": True, "fp8_lm_head": True}
    assert settings_text({**config, "strategy": both}, "lightning_ft") == "bf16 lora=r16a32:q kernels=lora fp8+head"


def test_settings_name_the_graphs_a_row_replayed():
    from lightning_ft.bench.table import settings_text

    config = {"dtype": "bfloat16", "lora": {"rank": 16, "alpha": 32, "target_modules": ["q_proj"]}, "kernels": {"lora": True}}
    auto = {**config, "strategy": {"cuda_graphs": "auto", "keep_attention": True, "keep_projections": False}}
    assert settings_text(auto, "lightning_ft", graphed=True) == "bf16 lora=r16a32:q kernels=lora graphs=keep:attn"
    assert settings_text(auto, "lightning_ft", graphed=False) == "bf16 lora=r16a32:q kernels=lora"  # auto resolved off
    assert settings_text({**config, "strategy": {"cuda_graphs": False}}, "lightning_ft") == "bf16 lora=r16a32:q kernels=lora"


def test_results_md_shows_the_offloading_copies_where_a_row_has_them():
    from lightning_ft.bench import runner

    base = {"system": "lightning_ft", "layers": 48, "seq_len": 32768, "status": "ok", "ms_per_step": 5000.0}
    plain = runner.markdown_table([base])
    offloading = runner.markdown_table([base, {**base, "cuda_graphs_copy_d2h_gbps": 21.53, "cuda_graphs_copy_h2d_gbps": 19.2,
                                               "cuda_graphs_compute_wait_ms_per_forward": 3.125}])
    assert "offload" not in plain
    head, _, no_offload, row = offloading.splitlines()
    assert head.endswith("| offload d2h GB/s | offload h2d GB/s | offload wait ms/step |")
    assert no_offload.endswith("| – | – | – |") and row.endswith("| 21.53 | 19.20 | 3.12 |")


def test_bench_report_keeps_rows_of_another_path_apart_and_names_it(tmp_path):
    """Rows of one system that ran another path (fp8, another MoE backend) are each shown, named in the system cell;
    a table with one path per system names none."""
    from lightning_ft.bench.report import latest_rows, markdown_table

    base = _table_row(seq_len=8192, settings="bf16 ckpt moe=auto")
    triton_fp8 = {**base, "settings": "bf16 ckpt moe=triton graphs fp8", "ms_per_step": 400.0}
    rows = [base, triton_fp8, {**base, "ms_per_step": 450.0}]  # the last: a later row of the first path
    shown = latest_rows(rows)
    assert [r["ms_per_step"] for r in shown] == [450.0, 400.0]
    text = markdown_table(shown, rows)
    assert "| `lightning_ft` moe=auto | 450.0" in text and "| `lightning_ft` moe=triton fp8 | 400.0" in text
    assert "`lightning_ft` moe=auto" not in markdown_table(latest_rows(rows[:1]), rows[:1])
    head = {**base, "settings": "bf16 ckpt moe=auto fp8+head", "ms_per_step": 380.0}  # the lm_head in e4m3 too: a path
    assert sorted(r["ms_per_step"] for r in latest_rows([*rows, head])) == [380.0, 400.0, 450.0]
