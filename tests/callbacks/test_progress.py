from types import SimpleNamespace

from lightning_ft.callbacks.progress import ProgressBar


def test_step_bounded_runs_show_the_epoch_alone_and_bounded_ones_lightnings_description():
    bar = ProgressBar()
    bar._trainer = SimpleNamespace(max_epochs=-1)
    assert bar._get_train_description(3).strip() == "Epoch 3"
    bar._trainer = SimpleNamespace(max_epochs=5)
    assert bar._get_train_description(3).strip() == "Epoch 3/4"
