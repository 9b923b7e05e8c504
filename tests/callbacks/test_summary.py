import math

from lightning_ft.callbacks.summary import loss_curve_figure, offload_copies, offload_line, plot_loss_curve, result_line
from lightning_ft.strategies.planner import Bandwidth


def test_the_loss_curve_shows_validation_points_and_the_learning_rate_below(tmp_path):
    fig = loss_curve_figure([3.0, None, 2.0, 1.5], val_losses=[(2, 2.5), (4, 1.8)], learning_rates=[0.0, 1e-4, 2e-4, 1e-4])
    loss_ax, lr_ax = fig.axes
    train, val = loss_ax.lines
    assert train.get_label() == "train" and list(train.get_xdata()) == [1, 2, 3, 4] and math.isnan(train.get_ydata()[1])
    assert val.get_label() == "validation" and list(val.get_xdata()) == [2, 4] and list(val.get_ydata()) == [2.5, 1.8]
    assert list(lr_ax.lines[0].get_ydata()) == [0.0, 1e-4, 2e-4, 1e-4] and lr_ax.get_ylabel() == "learning rate"
    assert len(loss_curve_figure([3.0]).axes) == 1  # no validation, no learning rates: the loss alone
    plot_loss_curve([3.0, 2.0], tmp_path / "curve.png", [(2, 2.1)], [1e-4, 1e-4])
    assert (tmp_path / "curve.png").read_bytes()[:4] == b"\x89PNG"


def test_the_result_line_leaves_out_what_the_run_did_not_measure():
    s = {"status": "completed", "steps": 0, "initial_loss": None, "final_loss": None, "val_loss": None, "train_tokens": None,
         "tokens_per_s": None, "data": None}
    assert result_line(s) == "0 steps"
    s |= {"steps": 3, "initial_loss": 7.0, "final_loss": 6.51234, "train_tokens": 12000, "tokens_per_s": 34567.8,
          "data": {"packed_rows": 40, "packing_efficiency": 0.9744}}
    assert result_line(s) == ("3 steps; loss 7.000 → 6.512; 12,000 tokens at 34,568 tokens/s; "
                              "packing efficiency 97.4% (tokens / rows × data.max_tokens)")
    assert result_line(s | {"status": "stopped"}).startswith("stopped after 3 steps; loss 7.000 → 6.512; ")


def test_the_result_line_of_a_run_that_failed_before_training_says_so_and_not_0_percent_packing():
    # a data file that did not load: no step, no packed row (PackingStats' zeros)
    s = {"status": "failed", "steps": 0, "initial_loss": None, "final_loss": None, "val_loss": None, "train_tokens": 0,
         "tokens_per_s": None, "data": {"packed_rows": 0, "packing_efficiency": 0.0}}
    assert result_line(s) == "failed after 0 steps"


def _offload_stats(**timings):
    stats = {"offloaded_inputs": 94, "offloaded_kept": 0, "offloaded_bytes": 3 * 2**30, "reloaded_bytes": 3 * 2**30,
             "prefetched_loads": 94, "replayed_layer_calls": 96, "eager_layer_calls": 0}
    return {**stats, "copy_d2h_gbps": None, "copy_h2d_gbps": None, "compute_wait_ms": None, **timings}


def test_the_offload_copies_against_the_measured_ceiling_and_the_wait_per_step():
    class Plan:  # a memory plan's measured bandwidth (lightning_ft.strategies.planner.Plan.bandwidth)
        bandwidth = Bandwidth(device_to_host=25e9, host_to_device=26e9)

    graphs = _offload_stats(copy_d2h_gbps=21.5, copy_h2d_gbps=12.25, compute_wait_ms=12.0)
    copies = offload_copies(graphs, steps=4, plan=Plan())
    assert copies == {"copy_d2h_gbps": 21.5, "copy_h2d_gbps": 12.25, "ceiling_d2h_gbps": 25.0, "ceiling_h2d_gbps": 26.0,
                      "compute_wait_ms_per_step": 3.0}
    assert offload_line(graphs, copies) == (
        "activation offloading: 94 layer inputs and 0 layer calls' kept activations (3.00 GiB in all) waited in host "
        "memory for the backward; 94 of the inputs' reloads were prefetched; copies to the host at 21.5 GB/s and back "
        "at 12.2 GB/s (measured ceiling 25.0 GB/s and 26.0 GB/s); the compute stream waited 3.00 ms per step on copies "
        "(0: all hidden under compute)"
    )
    no_plan = offload_copies(graphs, steps=4)  # strategy.activation_offload=true without a memory budget: no ceiling
    assert no_plan["ceiling_d2h_gbps"] is None and "ceiling" not in offload_line(graphs, no_plan)
    untimed = offload_copies(_offload_stats(), steps=4)  # off CUDA
    assert set(untimed.values()) == {None} and offload_line(_offload_stats(), untimed).endswith("; copy times not measured (off CUDA)")
    assert offload_copies({"replayed_layer_calls": 3}, steps=4) is None and offload_copies(None, steps=4) is None


def test_the_export_hint_quotes_a_path_with_spaces_and_fits_full_fine_tuning(tmp_path):
    from lightning_ft.callbacks.summary import export_hint

    run = tmp_path / "ü run 1"
    assert export_hint(run, lora=True) == (f"python -m lightning_ft export '{run}' [--merge] (the adapter, or a merged model "
                                           "that serves, in its export/ folder)")
    assert export_hint(tmp_path, lora=False) == (f"python -m lightning_ft export {tmp_path} --merge (the trained model, which "
                                                 "serves, in its export/ folder)")
