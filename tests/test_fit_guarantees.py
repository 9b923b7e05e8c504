"""What the main job guarantees, checked through the real CLI (``python -m lightning_ft fit``).

DDP gives one process's gradients; a killed run resumes exactly; a PEFT adapter trained elsewhere
continues training; bad input and stopped runs give one readable error and keep what was written;
adapters that get no gradient stop the run; sweeps get a summary table; validation can generate.
"""

import csv
import json
import logging
import math
import re
import shutil
from pathlib import Path

import lightning as L
import pytest
import torch
from cli_helpers import FAST, assert_first_step_grads_close, run_cli, summary


@pytest.mark.slow
def test_ddp_on_two_cpu_processes_gives_the_gradients_of_one_process(tmp_path):
    """2 ranks × 1 micro-batch vs 1 rank × 2 micro-batches: the same rows, the same normalised step loss."""
    # head_dim: a key Qwen3MoeConfig does not declare (logged), the value it derives (hidden_size / heads)
    common = (*FAST, "trainer.max_steps=1", "+callbacks.dump._target_=cli_helpers.DumpGradients", "+model.config.head_dim=32")
    ddp = run_cli(tmp_path / "ddp", *common, "trainer.devices=2", f"+callbacks.dump.path={tmp_path / 'g2'}")
    run_cli(tmp_path / "one", *common, "trainer.accumulate_grad_batches=2", f"+callbacks.dump.path={tmp_path / 'g1'}")

    rank0, rank1 = (torch.load(tmp_path / "g2" / f"rank{r}.pt") for r in (0, 1))
    assert_first_step_grads_close(rank0, torch.load(tmp_path / "g1" / "rank0.pt"))
    assert all(torch.equal(rank0[n], rank1[n]) for n in rank0)  # all-reduced
    # rank 0 alone writes the summary and the adapter, and says once what both ranks do
    out = ddp.stdout + ddp.stderr
    assert out.count("summary: ") == 1 and out.count("result: ") == 1
    assert out.count("device: the CPU path") == 1 and out.count("model.config.head_dim: not a declared field") == 1
    assert summary(tmp_path / "ddp")["world_size"] == 2
    # trainer.strategy=auto with 2 devices: our DDP (strategy=ddp), not Lightning's
    assert "trainer.strategy=auto with several devices: lightning_ft_ddp" in ddp.stdout + ddp.stderr
    assert (tmp_path / "ddp" / "adapter" / "adapter_model.safetensors").exists()


def test_processes_counts_devices_times_nodes_and_leaves_auto_to_lightning():
    from lightning_ft.fit import _processes

    assert [_processes({"devices": d}) for d in (1, 2, "2", "0,1", [0, 1, 2], [3], "auto", -1, "-1")] == [1, 2, 2, 2, 3, 1, 0, 0, 0]
    assert _processes({"devices": 2, "num_nodes": 2}) == 4
    assert [_processes({"devices": d, "num_nodes": n}) for d, n in ((None, 1), (2, None), (True, 1), (1.5, 1))] == [0, 0, 0, 0]


@pytest.mark.parametrize("rank_env,moved", [({}, True), ({"LOCAL_RANK": "1"}, False), ({"NODE_RANK": "1"}, False)])
def test_only_the_jobs_first_process_moves_the_metrics_aside_on_resume(tmp_path, monkeypatch, rank_env, moved):
    from lightning_ft.run_dir import keep_previous_metrics

    for name in ("LOCAL_RANK", "NODE_RANK"):
        monkeypatch.delenv(name, raising=False)
    for name, value in rank_env.items():  # another node's local rank 0 shares the folder too
        monkeypatch.setenv(name, value)
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "metrics.csv").write_text("step,loss\n1,2.0\n")
    keep_previous_metrics(tmp_path)
    assert (logs / "metrics.1.csv").exists() == moved
    assert (logs / "metrics.csv").exists() == (not moved)
    if moved:  # no metrics.csv now: a resume takes the newest one aside, a new run none; a new run moves its own aside
        assert keep_previous_metrics(tmp_path) == logs / "metrics.1.csv" and keep_previous_metrics(tmp_path, resuming=False) is None
        (logs / "metrics.csv").write_text("step,loss\n1,3.0\n")
        assert keep_previous_metrics(tmp_path, resuming=False) == logs / "metrics.earlier.1.csv"
        (logs / "metrics.1.csv").unlink()  # ... under a name a later resume never takes for an interrupted attempt's rows
        assert keep_previous_metrics(tmp_path) is None and (logs / "metrics.earlier.1.csv").exists()


def test_lightnings_cloud_tips_are_hidden_and_its_other_notices_kept(caplog, tmp_path):
    import lightning as L

    from lightning_ft.fit import _quiet_library_notices

    rank_zero = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    filters = list(rank_zero.filters)
    try:
        _quiet_library_notices(resuming=False)
        with caplog.at_level(logging.INFO):
            # no LitLogger: Lightning logs its litlogger tip
            L.Trainer(accelerator="cpu", logger=False, default_root_dir=tmp_path)
    finally:
        rank_zero.filters = filters
    assert not [m for m in caplog.messages if "Tip" in m or "litlogger" in m or "litmodels" in m]
    assert any("GPU available" in m for m in caplog.messages)  # Lightning's other notices still print


@pytest.mark.slow
def test_killed_run_resumes_exactly_mid_epoch_and_at_an_epoch_boundary(tmp_path):
    """15 packed rows, 2 micro-batches per step: epoch 0 is steps 1-8 (step 8 is a partial step of one row).

    Killed after step 8 (its checkpoint is the end of epoch 0), resumed from ``last`` and, in another
    folder, from step 7's checkpoint (mid-epoch). LoRA dropout makes the RNG state matter.
    """
    common = (*FAST, "trainer.max_steps=12", "trainer.accumulate_grad_batches=2", "lora.dropout=0.1",
              "callbacks.checkpoint.every_n_train_steps=1", "callbacks.checkpoint.save_top_k=2")
    run_cli(tmp_path / "full", *common)
    expected = summary(tmp_path / "full")["step_losses"]
    assert len(expected) == 12 and None not in expected

    killed = tmp_path / "killed"
    run_cli(killed, *common, "+callbacks.crash._target_=cli_helpers.CrashAtStep", "+callbacks.crash.step=8", ok=False)
    assert not (killed / "summary.json").exists()
    assert sorted(p.name for p in (killed / "checkpoints").iterdir()) == ["last.ckpt", "step000007.ckpt", "step000008.ckpt"]

    run_cli(tmp_path / "mid", *common, f"ckpt_path={killed / 'checkpoints' / 'step000007.ckpt'}")
    # what a kill -9 in the middle of a checkpoint write leaves (no later save replaces it): the resume removes it
    (killed / "checkpoints" / "step000009.ckpt.tmp").write_bytes(b"half a checkpoint")
    resumed = run_cli(killed, *common, "ckpt_path=last")
    assert "step000009.ckpt.tmp, a checkpoint write the interrupted run did not finish" in resumed.stdout + resumed.stderr
    for resumed, first in ((tmp_path / "mid", 7), (killed, 8)):
        losses = summary(resumed)["step_losses"]
        assert len(losses) == 12
        for step in range(first, 12):
            assert abs(losses[step] - expected[step]) <= 1e-6, (resumed.name, step + 1, losses[step], expected[step])
        # the loss curve's learning rates (RunSummary's state) go on from the checkpoint's
        assert summary(resumed)["learning_rates"] == summary(tmp_path / "full")["learning_rates"]
    # the run folder keeps the last k = 2 step checkpoints
    assert sorted(p.name for p in (killed / "checkpoints").iterdir()) == ["last.ckpt", "step000011.ckpt", "step000012.ckpt"]


@pytest.mark.slow
def test_resume_without_a_checkpoint_is_an_error(tmp_path):
    proc = run_cli(tmp_path, *FAST, "ckpt_path=last", ok=False)
    assert "ckpt_path=last: no checkpoint in" in proc.stderr and "run it again without ckpt_path" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_adapter_trained_elsewhere_with_peft_continues_training(tmp_path):
    from omegaconf import OmegaConf
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file
    from test_cli import _compose

    from lightning_ft.model.build import load_causal_lm

    cfg = _compose([f"run_dir={tmp_path}"])  # the default model: the tiny Qwen3-MoE
    base = load_causal_lm(None, "random", OmegaConf.to_container(cfg.model.config), vocab_size=512)
    peft_model = get_peft_model(base, LoraConfig(r=6, lora_alpha=12, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():  # "trained": lora_B away from its zero init
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.2)
    peft_model.save_pretrained(tmp_path / "elsewhere")
    before = load_file(tmp_path / "elsewhere" / "adapter_model.safetensors")

    proc = run_cli(tmp_path / "run", *FAST, f"lora.init_from={tmp_path / 'elsewhere'}", "trainer.max_steps=3")
    assert "rank 6, alpha 12, targets ['q_proj', 'v_proj'], modules_to_save [] (lora.rank/alpha/targets/modules_to_save ignored)" in proc.stdout + proc.stderr
    out = summary(tmp_path / "run")
    adapter_config = json.loads((tmp_path / "run" / "adapter" / "adapter_config.json").read_text())
    assert adapter_config["r"] == 6 and sorted(adapter_config["target_modules"]) == ["q_proj", "v_proj"]
    after = load_file(tmp_path / "run" / "adapter" / "adapter_model.safetensors")
    assert after.keys() == before.keys()
    delta = max((after[k] - before[k]).abs().max().item() for k in before)
    assert 0 < delta < 0.05  # three small AdamW steps from the loaded weights, not a fresh init
    assert out["steps"] == 3


@pytest.mark.slow
def test_missing_model_path_and_non_causal_config_are_readable_errors(tmp_path):
    from transformers import ViTConfig

    proc = run_cli(tmp_path / "a", *FAST, "model=pretrained", f"model.name_or_path={tmp_path / 'nope'}", ok=False)
    assert f"model.name_or_path='{tmp_path / 'nope'}'" in proc.stderr and "Traceback" not in proc.stderr
    data_folder = tmp_path / "data"  # a folder, but no model: said before its tokenizer is looked for there
    data_folder.mkdir()
    proc = run_cli(tmp_path / "c", *FAST, "model=pretrained", f"model.name_or_path={data_folder}", ok=False)
    assert f"model.name_or_path='{data_folder}': no config.json in that folder" in proc.stderr and "tokenizer" not in proc.stderr

    ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64).save_pretrained(tmp_path / "vit")
    proc = run_cli(tmp_path / "b", *FAST, "model=pretrained", f"model.name_or_path={tmp_path / 'vit'}",
                   "model.tokenizer=builtin", "model.dtype=float32", ok=False)
    assert "a 'vit' config is not a causal LM" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_a_run_that_fails_before_its_first_step_leaves_a_failed_summary_and_a_reusable_folder(tmp_path):
    empty, run_dir = tmp_path / "empty", tmp_path / "run"
    empty.mkdir()
    proc = run_cli(run_dir, *FAST, "model=pretrained", f"model.name_or_path={empty}", "model.tokenizer=builtin",
                   "model.dtype=float32", ok=False)
    assert f"model.name_or_path='{empty}': no config.json in that folder" in proc.stderr and "Traceback" not in proc.stderr
    assert "result: failed after 0 steps" in proc.stdout + proc.stderr  # not "result: 0 steps", as of a finished run
    failed = summary(run_dir)
    assert failed["status"] == "failed" and failed["steps"] == 0  # an error, not a stop by signal or check
    (run_dir / "logs").mkdir(exist_ok=True)
    (run_dir / "logs" / "metrics.csv").write_text("step,train/loss\n0,9.5\n")  # an earlier run's: kept aside, not deleted
    proc = run_cli(run_dir, *FAST, "trainer.max_steps=2")  # nothing to resume there: a new run is not refused
    assert summary(run_dir)["status"] == "completed" and summary(run_dir)["steps"] == 2
    assert (run_dir / "logs" / "metrics.earlier.1.csv").read_text() == "step,train/loss\n0,9.5\n"
    assert "9.5" not in (run_dir / "logs" / "metrics.csv").read_text() and "moved to metrics.earlier.1.csv" in proc.stdout + proc.stderr
    assert "will be deleted" not in proc.stdout + proc.stderr  # Lightning's notice: untrue here


def test_unknown_key_or_group_option_gets_hydras_error_and_our_hint(tmp_path):
    proc = run_cli(tmp_path, "data.max_token=3", ok=False)
    assert proc.returncode == 1 and proc.stderr.startswith("error: Could not override 'data.max_token'.\n")  # Hydra's
    assert "hint: data.max_token: no key 'max_token' in data; did you mean data.max_tokens?" in proc.stderr
    # Hydra's advice to add the key with `+` (refused: nothing reads it) and to set HYDRA_FULL_ERROR are left out
    assert "+data.max_token" not in proc.stderr and "HYDRA_FULL_ERROR" not in proc.stderr
    assert "--cfg job" in proc.stderr
    proc = run_cli(tmp_path, "trainer.max_step=3", ok=False)  # not in the trainer config, nor a Trainer argument
    assert "hint: trainer.max_step: not an argument of lightning.Trainer; did you mean trainer.max_steps" in proc.stderr
    proc = run_cli(tmp_path, "model=qwen3_tiny", ok=False)
    hint = next(line for line in proc.stderr.splitlines() if line.startswith("hint: model=qwen3_tiny"))
    assert hint.startswith("hint: model=qwen3_tiny: not an option of the `model` group; did you mean qwen")
    assert "options: " in hint and "qwen3_moe_tiny" in hint.split("options: ")[1]
    proc = run_cli(tmp_path / "plus", "+data.max_token=3", "+lora.rnk=4", ok=False)  # `+` adds them: refused, not ignored
    assert "not keys of the config, nothing would read them: data.max_token (did you mean data.max_tokens?), lora.rnk (did you mean lora.rank?)" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "plus" / "config.json").exists()
    proc = run_cli(tmp_path / "sgd", "optimizer._target_=torch.optim.SGD", ok=False)  # AdamW's betas left behind
    assert "error: optimizer.betas: torch.optim.SGD takes no argument 'betas'" in proc.stderr
    assert "drop it with '~optimizer.betas'" in proc.stderr and not (tmp_path / "sgd" / "config.json").exists()


@pytest.mark.slow
def test_nonfinite_step_stops_and_keeps_the_last_good_checkpoint(tmp_path):
    proc = run_cli(tmp_path, *FAST, "trainer.max_steps=5", "callbacks.checkpoint.every_n_train_steps=1",
                   "+callbacks.nan._target_=cli_helpers.NonFiniteAtStep", "+callbacks.nan.step=3", ok=False)
    assert "error: non-finite loss or gradient at optimizer step 3" in proc.stderr
    assert "last good checkpoint is" in proc.stderr and "Traceback" not in proc.stderr
    last = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)
    assert last["global_step"] == 2
    assert all(torch.isfinite(v).all() for v in last["state_dict"].values())
    out = summary(tmp_path)
    assert out["status"] == "stopped" and "step 3" in out["error"] and len(out["step_losses"]) == 2


@pytest.mark.slow
def test_nonfinite_step_is_skipped_and_overlong_examples_are_counted(tmp_path):
    rows = [{"question": f"What is {i} + {i}?", "answer": f"{i} + {i} = {2 * i}"} for i in range(40)]
    rows[5]["answer"] = " ".join(["long"] * 300)  # far over data.max_tokens=128
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    proc = run_cli(tmp_path / "run", *FAST, f"data.path={data}", "data.num_examples=null", "trainer.max_steps=5",
                   "train.on_nonfinite=skip", "+callbacks.nan._target_=cli_helpers.NonFiniteAtStep", "+callbacks.nan.step=2")
    out = summary(tmp_path / "run")
    assert out["skipped_steps"] == {"no_target_tokens": 0, "nonfinite": 1}
    assert out["step_losses"][1] is None and all(math.isfinite(x) for i, x in enumerate(out["step_losses"]) if i != 1)
    with open(tmp_path / "run" / "logs" / "metrics.csv") as f:  # the skipped step logs NaN, not the previous loss
        logged = {int(r["step"]): float(r["train/loss"]) for r in csv.DictReader(f) if r.get("train/loss")}
    assert math.isnan(logged[1]) and logged[0] == pytest.approx(out["step_losses"][0])
    assert out["status"] == "completed" and out["steps"] == 5
    assert out["data"]["truncated"] == 1 and out["data"]["examples"] == 40
    assert "1 of 40 examples are longer than data.max_tokens=128" in proc.stdout + proc.stderr


@pytest.mark.slow
def test_adapter_bypassed_by_the_forward_stops_the_run_with_its_name(tmp_path):
    proc = run_cli(tmp_path, *FAST, "trainer.max_steps=5", "+callbacks.bypass._target_=cli_helpers.BypassLora",
                   "+callbacks.bypass.module=model.layers.1.self_attn.v_proj", ok=False)
    assert "never received a non-zero gradient" in proc.stderr
    assert "model.layers.1.self_attn.v_proj (lora_A, lora_B)" in proc.stderr
    assert "model.layers.1.self_attn.q_proj" not in proc.stderr


@pytest.mark.slow
def test_sweep_runs_each_job_in_its_folder_and_writes_a_summary_table(tmp_path):
    proc = run_cli(tmp_path, "-m", "lora.rank=4,8", "trainer.max_steps=5", *FAST)
    (sweep,) = tmp_path.glob("multirun/*/*")  # the default sweep folder: one for all its jobs
    assert re.fullmatch(r"\d\d-\d\d-\d\d\.\d{3}_p\d+", sweep.name), sweep
    jobs = [summary(sweep / str(i)) for i in (0, 1)]
    assert [j["config"]["lora"]["rank"] for j in jobs] == [4, 8]
    table = (sweep / "sweep_summary.md").read_text().splitlines()
    assert table[0].startswith("| job | overrides | status | steps | final_loss")
    for i, job in enumerate(jobs):
        assert f"| {i} | lora.rank={4 * (i + 1)} trainer.max_steps=5 " in table[2 + i]
        assert f"| {job['final_loss']:.4f} |" in table[2 + i]
    csv_lines = (sweep / "sweep_summary.csv").read_text().splitlines()
    assert len(csv_lines) == 3 and csv_lines[0].startswith("job,overrides,status")
    assert (proc.stdout + proc.stderr).count("sweep summary of") == 1 and "sweep summary of 2 jobs" in proc.stdout + proc.stderr


@pytest.mark.slow
def test_validation_file_reports_loss_perplexity_and_exact_match(tmp_path):
    val = tmp_path / "val.jsonl"
    val.write_text("".join(
        json.dumps({"question": f"Tom has {i} apples and buys {i}. How many?", "answer": f"{i} + {i} = {2 * i}\n#### {2 * i}"}) + "\n"
        for i in range(6)
    ))
    run_cli(tmp_path / "run", *FAST, "trainer.max_steps=3", f"data.val_path={val}", "eval.generate=true",
            "eval.num_examples=3", "eval.max_new_tokens=12", "eval.every_n_steps=2")
    out = summary(tmp_path / "run")
    assert out["data"]["val_examples"] == 6
    with (tmp_path / "run" / "logs" / "metrics.csv").open() as f:  # validated after step 2 and after the last step
        assert len([r for r in csv.DictReader(f) if r["val/exact_match"]]) == 2
    assert math.isfinite(out["val_loss"]) and out["val_perplexity"] == pytest.approx(math.exp(out["val_loss"]), rel=1e-5)
    assert 0.0 <= out["val_exact_match"] <= 1.0


def test_a_resume_may_change_how_often_it_logs_and_the_expert_chunks_but_not_the_math(tmp_path):
    from lightning_ft.run_dir import CONFIG_FILE, check_resumed_config

    saved = {"trainer": {"max_steps": 3, "log_every_n_steps": 50}, "moe": {"backend": "auto", "chunk_tokens": "auto"},
             "lora": {"rank": 16}}
    (tmp_path / CONFIG_FILE).write_text(json.dumps(saved))
    changed = {"trainer": {"max_steps": 6, "log_every_n_steps": 1}, "moe": {"backend": "auto", "chunk_tokens": 4096},
               "lora": {"rank": 16}}
    check_resumed_config(changed, "last", tmp_path)
    with pytest.raises(ValueError, match=r"lora.rank: 16 in the interrupted run, 4 now\. Repeat .*trainer.max_epochs, "
                                         r"trainer.log_every_n_steps, .* moe.lora_slots and moe.chunk_tokens may change\)"):
        check_resumed_config(changed | {"lora": {"rank": 4}}, "last", tmp_path)


@pytest.mark.slow
def test_resume_with_another_config_is_refused_before_anything_is_written(tmp_path):
    run_cli(tmp_path, *FAST, "trainer.max_steps=3")
    hydra_record = (tmp_path / ".hydra" / name for name in ("config.yaml", "hydra.yaml", "overrides.yaml"))
    kept = (tmp_path / "summary.json", tmp_path / "config.json", *hydra_record)  # Hydra's record of the run too
    before = {p.name: p.read_bytes() for p in kept}
    assert summary(tmp_path)["checkpoint_path"].endswith("last.ckpt")  # short runs name their last checkpoint too
    proc = run_cli(tmp_path, *FAST, "trainer.max_steps=5", "ckpt_path=last", "lora.rank=4", ok=False)
    assert "lora.rank: 16 in the interrupted run, 4 now" in proc.stderr
    # switches a resume may change, but not on this machine: refused before anything is written too
    proc = run_cli(tmp_path, *FAST, "trainer.max_steps=5", "ckpt_path=last", "strategy.activation_offload=true", ok=False)
    assert "strategy.activation_offload=true needs CUDA graphs, which strategy.cuda_graphs=auto leaves off" in proc.stderr
    proc = run_cli(tmp_path, *FAST, "ckpt_path=last", "strategy.cuda_graphs=true", "strategy.activation_offload=true", ok=False)
    assert "set strategy.cuda_graphs=false strategy.activation_offload=false" in proc.stderr
    # refused after the data is read (a change a resume may make, that this run cannot do): config.json and .hydra/ kept too
    proc = run_cli(tmp_path, *FAST, "trainer.max_steps=5", "ckpt_path=last", "eval.generate=true", ok=False)
    assert "eval.generate=true needs validation data" in proc.stderr
    # a new run (no ckpt_path) in this folder would replace the finished run's files
    proc = run_cli(tmp_path, *FAST, "trainer.max_steps=2", ok=False)
    assert "holds a run already (summary.json, checkpoints/): resume it with ckpt_path=last" in proc.stderr
    proc = run_cli(tmp_path, *FAST, "ckpt_path=checkpoints/nope.ckpt", ok=False)
    assert "ckpt_path='checkpoints/nope.ckpt': no such checkpoint file" in proc.stderr
    # another run's checkpoint resumed here would rotate this folder's step checkpoints out: a new run here
    other = tmp_path.parent / f"{tmp_path.name}_other"
    (other / "checkpoints").mkdir(parents=True)
    shutil.copy(tmp_path / "config.json", other)
    shutil.copy(tmp_path / "checkpoints" / "last.ckpt", other / "checkpoints")
    proc = run_cli(tmp_path, *FAST, "trainer.max_steps=5", f"ckpt_path={other / 'checkpoints' / 'last.ckpt'}", ok=False)
    assert "holds another run (summary.json, checkpoints/); resume from that checkpoint in an empty folder" in proc.stderr
    assert {p.name: p.read_bytes() for p in kept} == before
    assert not (tmp_path / "logs" / "metrics.1.csv").exists()
    # a checkpoint file that is no archive (cut short, overwritten) is named and refused before anything moves
    last = Path(summary(tmp_path)["checkpoint_path"])
    good = last.read_bytes()
    last.write_bytes(b"not a checkpoint")
    proc = run_cli(tmp_path, *FAST, "trainer.max_steps=5", "ckpt_path=last", ok=False)
    assert f"{last}: not a readable checkpoint" in proc.stderr and "Traceback" not in proc.stderr
    assert {p.name: p.read_bytes() for p in kept} == before
    assert not (tmp_path / "logs" / "metrics.1.csv").exists()
    # a resume that fails before training resumes (an archive Lightning cannot restore) keeps the summary, config and .hydra/
    torch.save({"not": "a Lightning checkpoint"}, last)
    run_cli(tmp_path, *FAST, "trainer.max_steps=5", "ckpt_path=last", ok=False)
    assert {p.name: p.read_bytes() for p in kept} == before
    last.write_bytes(good)
    (tmp_path / "logs" / "metrics.1.csv").rename(tmp_path / "logs" / "metrics.csv")  # as it was before that attempt
    # a longer run of the same config is fine (its learning-rate schedule stretches: warned), and so is a
    # switch that does not change the math; from another working directory, ``last`` is still this folder's
    proc = run_cli(tmp_path, *FAST, "trainer.max_steps=5", "ckpt_path=last", "strategy.keep_attention=false", cwd=tmp_path.parent)
    assert "resume with trainer.max_steps: 3 → 5: the learning-rate schedule is rebuilt" in proc.stdout + proc.stderr
    assert summary(tmp_path)["steps"] == 5
    # a resume that trains records its own overrides in .hydra/, as Hydra did when it wrote them
    overrides = (tmp_path / ".hydra" / "overrides.yaml").read_text()
    assert "- ckpt_path=last\n" in overrides and "- strategy.keep_attention=false\n" in overrides
    # one metrics.csv holds the whole run: the first run's rows (steps 0-2), then the resumed run's, each step once
    assert not (tmp_path / "logs" / "metrics.1.csv").exists()
    with (tmp_path / "logs" / "metrics.csv").open() as f:
        assert [int(r["step"]) for r in csv.DictReader(f) if r["train/loss"]] == [0, 1, 2, 3, 4]
    # resuming the finished run (a scheduler re-running the job): says so, trains nothing, changes nothing
    def run_files():  # all but Hydra's job log (appended to) and the folder's lock
        return {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file() and p.name not in (".lock", "__main__.log")}

    files = run_files()
    proc = run_cli(tmp_path, *FAST, "trainer.max_steps=5", "ckpt_path=last")
    assert "last.ckpt is at step 5 and trainer.max_steps=5: the run is finished" in proc.stdout + proc.stderr
    assert run_files() == files and any(p.suffix == ".ckpt" for p in files) and any(p.suffix == ".csv" for p in files)
    assert any(".hydra" in p.parts for p in files)
    # a resume Lightning refuses (a trainer value) leaves logs/ as it was too
    metrics = (tmp_path / "logs" / "metrics.csv").read_bytes()
    proc = run_cli(tmp_path, *FAST, "trainer.max_steps=6", "ckpt_path=last", "trainer.devices=0", ok=False)
    assert "trainer.devices=0: Lightning refused it" in proc.stderr
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == ["metrics.csv"]
    # killed while exporting (no adapter/): the resume trains nothing, exports, and keeps the whole metrics.csv
    shutil.rmtree(tmp_path / "adapter")
    run_cli(tmp_path, *FAST, "trainer.max_steps=5", "ckpt_path=last")
    assert summary(tmp_path)["status"] == "completed" and (tmp_path / "adapter").is_dir()
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == ["metrics.csv"]
    assert (tmp_path / "logs" / "metrics.csv").read_bytes() == metrics


class _Stop(Exception):
    """Raised by `_StopAtStep`: the run ends there, as a killed one."""


class _StopAtStep(L.Callback):
    """Ends the run once ``step`` optimizer steps are done (its checkpoints stay)."""

    def __init__(self, step):
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step >= self.step:
            raise _Stop


def _fit_boring(run_dir, max_epochs, max_steps, stop_at=None, ckpt_path=None, **checkpoint):
    """Lightning's BoringModel, 10 batches an epoch, with ModelCheckpoint(save_last=True, **checkpoint)
    into ``run_dir``; returns how many training batches ran."""
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
    from torch.utils.data import DataLoader

    class Model(BoringModel):
        batches = 0

        def train_dataloader(self):
            return DataLoader(RandomDataset(32, 40), batch_size=4)

        def on_train_batch_start(self, batch, batch_idx):
            Model.batches += 1

    callbacks = [ModelCheckpoint(dirpath=run_dir, save_last=True, **checkpoint)]
    if stop_at is not None:
        callbacks.append(_StopAtStep(stop_at))
    trainer = L.Trainer(max_epochs=max_epochs, max_steps=max_steps, limit_val_batches=0, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=callbacks)
    try:
        trainer.fit(Model(), ckpt_path=ckpt_path)
    except _Stop:
        pass
    return Model.batches


@pytest.mark.parametrize(
    ("first", "checkpoint", "again", "finished"),
    [
        # (max_epochs, max_steps, stopped after step) of the run, its ModelCheckpoint, (max_epochs, max_steps) of the re-run
        ((2, -1, None), {"every_n_train_steps": 50}, (2, -1), "max_epochs"),  # last.ckpt at the end of training
        ((2, -1, None), {"every_n_train_steps": 1}, (2, -1), "max_epochs"),  # at the end of the last batch
        ((2, -1, None), {}, (2, -1), "max_epochs"),  # at the end of the last epoch (every_n_epochs=1)
        ((2, -1, None), {"every_n_train_steps": 50}, (3, -1), None),  # extended by an epoch: trains on
        ((3, -1, 15), {"every_n_train_steps": 1}, (3, -1), None),  # stopped mid-epoch
        ((3, -1, 10), {"every_n_train_steps": 1}, (3, -1), None),  # stopped at the end of epoch 1's last batch
        ((3, -1, 10), {"every_n_train_steps": 1}, (1, -1), "max_epochs"),  # ... which is the last with max_epochs=1
        ((3, -1, 10), {}, (3, -1), None),  # stopped after epoch 1's checkpoint, before max_epochs
        ((1, 30, None), {"every_n_train_steps": 50}, (1, 30), "max_epochs"),  # both limits: the epochs came first
        ((3, 15, None), {"every_n_train_steps": 50}, (3, 15), "max_steps"),  # the steps came first, mid-epoch
        ((3, 15, None), {"every_n_train_steps": 50}, (3, 25), None),  # more steps: trains on
        # an epoch max_steps cut short counts as done for Lightning: max_epochs=2 stops the longer run at once
        ((2, 15, None), {"every_n_train_steps": 50}, (2, 25), "max_epochs"),
    ],
)
def test_finished_run_is_detected_by_max_epochs_exactly_as_lightning_resumes(tmp_path, first, checkpoint, again, finished):
    """`finished_at` says finished exactly where Lightning, resuming from the same checkpoint, trains no batch."""
    from lightning_ft.run_dir import finished_at

    max_epochs, max_steps, stop_at = first
    _fit_boring(tmp_path / "run", max_epochs, max_steps, stop_at, **checkpoint)
    last = tmp_path / "run" / "last.ckpt"
    got = finished_at(str(last), [], {"max_epochs": again[0], "max_steps": again[1]})
    assert (None if got is None else [key.removeprefix("trainer.") for key in got[1]]) == (finished and [finished])
    trained = _fit_boring(tmp_path / "again", *again, ckpt_path=last, **checkpoint)
    assert (trained == 0) == (finished is not None), trained


@pytest.mark.slow
def test_resuming_a_run_that_reached_max_epochs_trains_nothing_and_touches_nothing(tmp_path):
    """A run limited by trainer.max_epochs (8 examples: 2 steps an epoch), run again in its folder with
    ckpt_path=last, is a success that changes nothing, as one that reached trainer.max_steps."""
    common = ("callbacks.progress_bar=null", "data.num_examples=8", "data.max_tokens=128", "trainer.log_every_n_steps=1",
              "trainer.max_steps=-1", "trainer.max_epochs=2")
    run_cli(tmp_path, *common)
    assert summary(tmp_path)["status"] == "completed" and summary(tmp_path)["steps"] == 4
    files = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file() and p.name not in (".lock", "__main__.log")}
    proc = run_cli(tmp_path, *common, "ckpt_path=last")
    assert (f"{tmp_path / 'checkpoints' / 'last.ckpt'} has finished 2 epochs and trainer.max_epochs=2: the run is "
            "finished, nothing is trained") in proc.stdout + proc.stderr
    assert "to train on, resume with a larger trainer.max_epochs" in proc.stdout + proc.stderr
    after = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file() and p.name not in (".lock", "__main__.log")}
    assert after == files and any(".hydra" in p.parts for p in files) and any(p.suffix == ".csv" for p in files)


def _signal_at_step(run_dir, step, *overrides, signal_name=None):
    """A 50-step run (with ``overrides``) that `cli_helpers.SignalAtStep` signals once step ``step`` is done."""
    signal = [f"+callbacks.term.signal_name={signal_name}"] if signal_name else []
    return run_cli(run_dir, *FAST, "trainer.max_steps=50", *overrides, "+callbacks.term._target_=cli_helpers.SignalAtStep",
                   f"+callbacks.term.step={step}", *signal, ok=False)


@pytest.mark.slow
def test_sigterm_stops_with_exit_status_143_and_a_checkpoint_of_the_step_reached(tmp_path):
    # before the first periodic checkpoint (every 50 steps by default): SIGTERM itself saves one. The signal
    # comes as step 3's batch starts; Lightning stops after that batch, so at step 3.
    proc = _signal_at_step(tmp_path, 2)
    last = tmp_path / "checkpoints" / "last.ckpt"
    resume = (f"training stopped at step 3 by SIGTERM; resume from {last} with: python -m lightning_ft fit "
              f"{' '.join(FAST)} trainer.max_steps=50 +callbacks.term._target_=cli_helpers.SignalAtStep "
              f"+callbacks.term.step=2 ckpt_path=last hydra.run.dir={tmp_path}")
    assert resume in proc.stderr  # the run's own overrides, so the printed command is accepted as it is
    assert proc.returncode == 143 and proc.stderr.splitlines()[-1].startswith("interrupted: training stopped at step 3")
    assert "run again" not in proc.stderr  # the checkpoint is of the step reached
    assert summary(tmp_path)["status"] == "stopped" and summary(tmp_path)["checkpoint_path"] == str(last)
    assert summary(tmp_path)["error"] == "SIGTERM: stopped at the end of a step"
    assert torch.load(last, map_location="cpu", weights_only=False)["global_step"] == 3
    resumed = run_cli(tmp_path, *FAST, "trainer.max_steps=5", "ckpt_path=last")
    assert summary(tmp_path)["status"] == "completed" and summary(tmp_path)["steps"] == 5, resumed.stderr[-2000:]
    with (tmp_path / "logs" / "metrics.csv").open() as f:  # each step once, numbered as in a run never stopped
        assert [int(row["step"]) for row in csv.DictReader(f) if row.get("train/loss")] == list(range(5))


def test_the_printed_resume_command_works_from_another_folder_with_a_relative_data_path(tmp_path):
    """A relative data.path starts from the working directory; config.json and the printed resume
    command hold it absolute, so the command resumes from any folder."""
    work = tmp_path / "work"
    work.mkdir()
    rows = [{"question": f"What is {i} + {i}?", "answer": f"{i} + {i} = {2 * i}"} for i in range(60)]
    (work / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = tmp_path / "run"
    proc = run_cli(run, *FAST, "data.path=train.jsonl", "trainer.max_steps=50", "+callbacks.term._target_=cli_helpers.SignalAtStep",
                   "+callbacks.term.step=2", ok=False, cwd=work)
    assert proc.returncode == 143 and f"data.path={work / 'train.jsonl'}" in proc.stderr
    assert summary(run)["config"]["data"]["path"] == str(work / "train.jsonl")
    run_cli(run, *FAST, f"data.path={work / 'train.jsonl'}", "trainer.max_steps=4", "+callbacks.term._target_=cli_helpers.SignalAtStep",
            "+callbacks.term.step=50", "ckpt_path=last", cwd=tmp_path)
    assert summary(run)["status"] == "completed" and summary(run)["steps"] == 4


def test_sigterm_while_the_run_loads_says_so_and_leaves_a_summary(tmp_path):
    """Before the training loop (loading the data and the model) SIGTERM's default action ended the process with no
    message and no summary.json; it is reported as SIGTERM, exit status 143, and the summary says where it stopped."""
    proc = run_cli(tmp_path, *FAST, "trainer.max_steps=5", "+callbacks.term._target_=cli_helpers.SignalInSetup", ok=False)
    assert proc.returncode == 143, proc.stderr[-2000:]
    assert proc.stderr.splitlines()[-1].startswith("interrupted: ") and "SIGTERM" in proc.stderr.splitlines()[-1]
    assert "Traceback" not in proc.stderr
    assert summary(tmp_path)["status"] == "stopped" and summary(tmp_path)["error"] == "SIGTERM: stopped before training started"


def test_sigterm_while_the_run_checks_its_config_says_so_and_writes_nothing(tmp_path):
    """A SIGTERM before the run folder holds anything (the checks import the optimizer named) is reported too: exit
    status 143, the interrupted line, nothing written but Hydra's record and log."""
    proc = run_cli(tmp_path, *FAST, "optimizer._target_=sigterm_on_import.AdamW", ok=False)
    assert proc.returncode == 143, proc.stderr[-2000:]
    assert proc.stderr.splitlines()[-1] == "interrupted: stopped by SIGTERM before training started"
    assert "Traceback" not in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == [".hydra", "__main__.log"]


@pytest.mark.slow
def test_sigterm_mid_accumulation_stops_at_the_end_of_that_step_and_saves_it(tmp_path):
    # the signal comes as the first of step 3's two micro-batches starts: the second one runs too, and the
    # run stops at step 3's end with its checkpoint (a half-accumulated step is never saved)
    proc = _signal_at_step(tmp_path, 2, "trainer.accumulate_grad_batches=2", "callbacks.checkpoint.every_n_train_steps=2")
    assert proc.returncode == 143 and "training stopped at step 3 by SIGTERM; resume from" in proc.stderr
    assert "(step 3" not in proc.stderr  # the checkpoint is of the step reached: no step runs again
    assert torch.load(tmp_path / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)["global_step"] == 3
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["last.ckpt", "step000002.ckpt", "step000003.ckpt"]


@pytest.mark.slow
def test_sigterm_to_every_ddp_process_stops_them_together_at_a_step_end(tmp_path):
    """Each of 2 CPU processes gets SIGTERM (``kill -TERM -<pgid>``, a scheduler stopping the job) in the middle of
    an accumulated step: both finish that step and stop, one checkpoint of it is written, rank 0 says how to resume
    and rank 1 only that it stopped. Lightning's own handler ran a collective inside the handler: they hung."""
    proc = _signal_at_step(tmp_path, 2, "trainer.devices=2", "trainer.accumulate_grad_batches=2")
    assert proc.returncode == 143, proc.stderr[-3000:]
    assert "interrupted: training stopped at step 3 by SIGTERM; resume from" in proc.stderr
    assert "interrupted: training stopped at step 3 by SIGTERM (process of rank 1)\n" in proc.stderr
    assert "nothing to resume" not in proc.stderr
    assert torch.load(tmp_path / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)["global_step"] == 3


@pytest.mark.slow
def test_sigterm_to_one_ddp_process_stops_both(tmp_path):
    """Only rank 1 is signalled (rank 0 runs on): the processes agree at the step's end and both stop there."""
    proc = _signal_at_step(tmp_path, 2, "trainer.devices=2", "+callbacks.term.rank=1")
    assert proc.returncode == 143, proc.stderr[-3000:]
    assert "interrupted: training stopped at step 3 by SIGTERM; resume from" in proc.stderr
    assert torch.load(tmp_path / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)["global_step"] == 3


@pytest.mark.slow
def test_sigterm_during_validation_finishes_it_and_keeps_its_loss(tmp_path):
    """SIGTERM in the validation of step 4: the validation finishes, its loss is in the summary and the metrics,
    the checkpoint is of step 4, and the resumed run does not lose that validation point."""
    val = ("data.val_fraction=0.2", "eval.every_n_steps=4")
    proc = _signal_at_step(tmp_path, 4, *val, "+callbacks.term.in_validation=true")
    assert proc.returncode == 143 and "training stopped at step 4 by SIGTERM; resume from" in proc.stderr
    assert [step for step, _ in summary(tmp_path)["val_losses"]] == [4]
    run_cli(tmp_path, *FAST, "trainer.max_steps=8", *val, "ckpt_path=last")
    assert [step for step, _ in summary(tmp_path)["val_losses"]] == [4, 8]
    with (tmp_path / "logs" / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    # the loggers' step counts from 0 (optimizer step 4 is row step 3), each step once, as in a run never stopped
    assert [int(row["step"]) for row in rows if row.get("val/loss")] == [3, 7]
    assert [int(row["step"]) for row in rows if row.get("train/loss")] == list(range(8))


@pytest.mark.slow
def test_ctrl_c_stops_with_a_message_that_says_how_to_resume(tmp_path):
    proc = _signal_at_step(tmp_path, 3, "callbacks.checkpoint.every_n_train_steps=2", signal_name="SIGINT")
    assert proc.returncode == 130  # one line, the last
    assert proc.stderr.splitlines()[-1].startswith("interrupted: training stopped at step 3 by Ctrl-C (SIGINT); resume from")
    assert "(step 2: steps after it run again) with: python -m lightning_ft fit" in proc.stderr
    assert f"ckpt_path=last hydra.run.dir={tmp_path}" in proc.stderr
    assert summary(tmp_path)["error"] == "KeyboardInterrupt: stopped by Ctrl-C (SIGINT)"


def test_zero_epochs_is_refused_like_zero_steps():
    from lightning_ft.fit import _check_trainer_arguments

    with pytest.raises(ValueError, match=r"^trainer.max_epochs=0 trains nothing: set at least 1"):
        _check_trainer_arguments({"max_epochs": 0, "max_steps": -1})
    _check_trainer_arguments({"max_epochs": 1, "max_steps": -1})


@pytest.mark.slow
def test_missing_required_values_and_trainer_typos_are_named(tmp_path):
    proc = run_cli(tmp_path / "a", "data=jsonl", ok=False)
    assert "required but not set: data.path" in proc.stderr
    proc = run_cli(tmp_path / "b", "+trainer.max_step=3", ok=False)
    assert "trainer.max_step: not an argument of lightning.Trainer; did you mean trainer.max_steps" in proc.stderr
    assert not (tmp_path / "b" / "summary.json").exists()
    proc = run_cli(tmp_path / "e", "trainer.max_steps=five", ok=False)
    assert "trainer.max_steps='five': expected an integer" in proc.stderr
    proc = run_cli(tmp_path / "f", "trainer.max_steps=0", ok=False)
    assert "trainer.max_steps=0 trains nothing" in proc.stderr
    proc = run_cli(tmp_path / "g", "data=jsonl", f"data.path={tmp_path}", ok=False)
    assert f"data.path='{tmp_path}' is a folder" in proc.stderr
    assert not any((tmp_path / d / "config.json").exists() for d in "efg")  # refused before anything is written
    # but a folder without Hydra's record gets it at once, as Hydra writes it (a sweep's table lists such a job)
    assert "- trainer.max_steps=five" in (tmp_path / "e" / ".hydra" / "overrides.yaml").read_text()
    assert "  output_subdir: .hydra\n" in (tmp_path / "e" / ".hydra" / "hydra.yaml").read_text()
    assert "max_steps: five" in (tmp_path / "e" / ".hydra" / "config.yaml").read_text()
    proc = run_cli(tmp_path / "c", "trainer.devices=0", ok=False)  # a value Lightning rejects: one line, the key named
    assert "trainer.devices=0: Lightning refused it" in proc.stderr
    assert "Traceback" not in proc.stderr
    proc = run_cli(tmp_path / "d", "trainer.strategy=ddpp", ok=False)
    assert "trainer.strategy=ddpp: Lightning refused it" in proc.stderr and "strategy=ddp or strategy=fsdp2" in proc.stderr


@pytest.mark.slow
def test_sweep_summary_is_written_even_when_a_job_fails(tmp_path):
    sweep = tmp_path / "sweep"
    run_cli(tmp_path, "-m", "data.max_tokens=16,128", "data.overflow=drop", "trainer.max_steps=2", *FAST[:2], "data.num_examples=60",
            f"hydra.sweep.dir={sweep}", ok=False)
    table = (sweep / "sweep_summary.md").read_text()
    assert "| 0 | data.max_tokens=16" in table and "| failed: " in table and "examples was filtered out" in table  # its error


@pytest.mark.slow
def test_a_folder_in_use_by_another_run_is_refused(tmp_path):
    import fcntl

    with open(tmp_path / ".lock", "w") as held:  # as a running job holds it
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        proc = run_cli(tmp_path, *FAST, "trainer.max_steps=2", ok=False)
    assert "another run is using this folder" in proc.stderr
    assert not (tmp_path / "summary.json").exists() and not (tmp_path / "checkpoints").exists()


@pytest.mark.slow
def test_runs_started_together_get_folders_of_their_own(tmp_path):
    """Two runs started at once with the default folders (no hydra.run.dir; one-second timestamps would
    collide): each finishes in its own folder."""
    import os
    import subprocess
    import sys

    from cli_helpers import TESTS_DIR

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS_DIR), os.environ.get("PYTHONPATH", "")])}
    for name in ("SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID", "SLURM_STEP_ID"):
        env.pop(name, None)
    fit = [sys.executable, "-m", "lightning_ft", "fit"]
    tiny = [*FAST, "trainer.max_steps=1"]
    procs = [subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for cmd in ([*fit, *tiny], [*fit, *tiny])]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n---\n".join(o[-3000:] for o in outputs)
    runs = sorted(p.parent for p in tmp_path.glob("outputs/*/*/summary.json"))
    assert len(runs) == 2 and all(summary(r)["status"] == "completed" for r in runs), runs
    assert all(re.fullmatch(r"\d\d-\d\d-\d\d\.\d{3}_p\d+", r.name) for r in runs), runs


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({}, r"\d\d-\d\d-\d\d\.\d{3}_p\d+"),
        ({"SLURM_JOB_ID": "77"}, r"\d\d-\d\d-\d\d\.\d{3}_slurm-77_p\d+"),  # a batch script
        ({"SLURM_JOB_ID": "78", "SLURM_ARRAY_JOB_ID": "77", "SLURM_ARRAY_TASK_ID": "3"}, r"\d\d-\d\d-\d\d\.\d{3}_slurm-77_3_p\d+"),
        ({"SLURM_JOB_ID": "78", "SLURM_ARRAY_JOB_ID": "77", "SLURM_ARRAY_TASK_ID": "3", "SLURM_STEP_ID": "0"}, r"slurm-77_3\.0"),
        ({"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "2"}, r"slurm-77\.2"),  # every srun task of the step: one folder
    ],
)
def test_default_run_folder_names_the_slurm_job_and_otherwise_the_time_and_process(environ, expected):
    from lightning_ft.config import run_name

    assert re.fullmatch(expected, run_name(environ)), run_name(environ)


@pytest.mark.slow
def test_validation_settings_without_validation_data_are_named(tmp_path):
    proc = run_cli(tmp_path, *FAST, "trainer.max_steps=1", "eval.every_n_steps=3", "eval.limit_batches=2")
    assert ("warning: eval.every_n_steps=3, eval.limit_batches=2: no validation data, so no validation runs; set "
            "data.val_fraction or data.val_path") in proc.stderr


@pytest.mark.slow
def test_a_run_ended_by_max_epochs_validates_and_checkpoints_its_last_step(tmp_path):
    """The last step of a run that trainer.max_epochs ends, between periodic saves and validations, is validated and
    saved (its step checkpoint and last.ckpt), and a resume from there with a larger max_epochs trains on exactly
    (a learning rate that does not depend on the run's length: the schedule is rebuilt for the new one). A stop
    within the epoch leaves last.ckpt inside it; a SIGTERM during the last step lets the run finish."""
    common = (*FAST[:-1], "trainer.max_steps=-1", "data.val_fraction=0.2",
              "scheduler._target_=transformers.get_constant_schedule_with_warmup")
    run_cli(tmp_path / "full", *common, "trainer.max_epochs=2")
    full = summary(tmp_path / "full")
    per_epoch = full["steps"] // 2
    assert per_epoch >= 4 and full["steps"] == 2 * per_epoch, full["steps"]
    every = (f"callbacks.checkpoint.every_n_train_steps={per_epoch - 1}", f"eval.every_n_steps={per_epoch - 1}")
    run_cli(tmp_path / "run", *common, *every, "trainer.max_epochs=1")
    ckpts = tmp_path / "run" / "checkpoints"
    assert torch.load(ckpts / "last.ckpt", weights_only=True)["global_step"] == per_epoch
    assert f"step{per_epoch:06d}.ckpt" in {p.name for p in ckpts.iterdir()}
    assert [step for step, _ in summary(tmp_path / "run")["val_losses"]] == [per_epoch - 1, per_epoch]
    run_cli(tmp_path / "run", *common, *every, "trainer.max_epochs=2", "ckpt_path=last")
    losses = summary(tmp_path / "run")["step_losses"]
    assert len(losses) == full["steps"]
    for step in range(per_epoch, full["steps"]):
        assert abs(losses[step] - full["step_losses"][step]) <= 1e-6, (step + 1, losses[step], full["step_losses"][step])

    # stopped within the epoch (trainer.should_stop, as a Timer does) after step 3: last.ckpt stays the periodic save of
    # step 2, inside the epoch, and the resume trains the epoch's other steps
    stop = ("callbacks.checkpoint.every_n_train_steps=2", "+callbacks.stop._target_=cli_helpers.StopAtStep",
            "+callbacks.stop.step=3")
    run_cli(tmp_path / "stopped", *common, *stop, "trainer.max_epochs=1")
    assert torch.load(tmp_path / "stopped" / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 2
    run_cli(tmp_path / "stopped", *common, "callbacks.checkpoint.every_n_train_steps=2", "trainer.max_epochs=1",
            "ckpt_path=last", "+callbacks.stop._target_=cli_helpers.StopAtStep", f"+callbacks.stop.step={10 * per_epoch}")
    assert summary(tmp_path / "stopped")["steps"] == per_epoch

    # SIGTERM during the last step of the last epoch: the run finishes (as one ended by trainer.max_steps does)
    run_cli(tmp_path / "signalled", *common, "trainer.max_epochs=1", "+callbacks.term._target_=cli_helpers.SignalAtStep",
            f"+callbacks.term.step={per_epoch - 1}")
    assert summary(tmp_path / "signalled")["status"] == "completed" and summary(tmp_path / "signalled")["steps"] == per_epoch


@pytest.mark.slow
def test_a_checkpoint_lightning_cannot_restore_is_one_error_line_naming_it(tmp_path):
    """A weights-only checkpoint and one of another adapter shape: one ``error:`` line naming the file and why, no
    traceback, the summary left as it was."""
    run_cli(tmp_path, *FAST, "trainer.max_steps=2")
    before = (tmp_path / "summary.json").read_text()
    last = tmp_path / "checkpoints" / "last.ckpt"
    state = torch.load(last, weights_only=False)
    key = next(k for k in state["state_dict"] if "lora_A" in k)
    weights_only = {k: v for k, v in state.items() if k != "optimizer_states"}
    reshaped = {**state, "state_dict": {**state["state_dict"], key: state["state_dict"][key][:1]}}
    for broken, reason in ((weights_only, "KeyError: Trying to restore optimizer state but checkpoint contains only the model"),
                           (reshaped, "RuntimeError: Error(s) in loading state_dict")):
        torch.save(broken, last)
        proc = run_cli(tmp_path, *FAST, "trainer.max_steps=4", "ckpt_path=last", ok=False)
        assert f"error: {last}: Lightning could not restore this checkpoint ({reason}" in proc.stderr
        assert "Traceback" not in proc.stderr and (tmp_path / "summary.json").read_text() == before


def test_only_errors_of_lightnings_restore_are_called_restore_failures(tmp_path):
    """Its checkpoint connector also saves (``dump_checkpoint``): an error there keeps its own traceback."""
    from lightning_ft.run_dir import restore_failure

    def raised_in(function):
        code = compile(f"def {function}():\n    raise RuntimeError('boom')\n",
                       "lightning/pytorch/trainer/connectors/checkpoint_connector.py", "exec")
        namespace = {}
        exec(code, namespace)
        with pytest.raises(RuntimeError) as info:
            namespace[function]()
        return info.value

    (tmp_path / "step000002.ckpt").write_bytes(b"")
    for function in ("restore_model", "_restore_modules_and_callbacks", "resume_start"):
        assert str(restore_failure(raised_in(function), tmp_path / "last.ckpt")) == (
            f"{tmp_path / 'last.ckpt'}: Lightning could not restore this checkpoint (RuntimeError: boom); the folder's "
            "other checkpoints: step000002.ckpt (pass one's path instead)")
    assert restore_failure(raised_in("dump_checkpoint"), tmp_path / "last.ckpt") is None
    assert restore_failure(RuntimeError("elsewhere"), tmp_path / "last.ckpt") is None
