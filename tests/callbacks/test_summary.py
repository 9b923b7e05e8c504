import math

from lightning_ft.callbacks.summary import loss_curve_figure, plot_loss_curve, result_line


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
    s = {"steps": 0, "initial_loss": None, "final_loss": None, "val_loss": None, "train_tokens": None, "tokens_per_s": None,
         "data": None}
    assert result_line(s) == "0 steps"
    s |= {"steps": 3, "initial_loss": 7.0, "final_loss": 6.51234, "train_tokens": 12000, "tokens_per_s": 34567.8,
          "data": {"packing_efficiency": 0.9744}}
    assert result_line(s) == ("3 steps; loss 7.000 → 6.512; 12,000 tokens at 34,568 tokens/s; "
                              "packing efficiency 97.4% (tokens / rows × data.max_tokens)")
