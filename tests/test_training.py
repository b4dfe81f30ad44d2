"""pfl_core.runtime.training: optimiser construction and the shared mini-batch loop, by hand.

Every update below is worked out on paper on a 1-layer Linear model whose weights are set,
so a wrong gradient, a missing zero_grad, a wrong loss, a wrong batch order or a wrong mean
shows up as a number that differs from the hand computation.
"""

import pytest
import torch
from torch import nn

from pfl_core.runtime.training import batch_order, make_optimizer, reset_optimizer, run_epochs
from pfl_core.spec import TrainingSection


def linear(weights, bias=None):
    """nn.Linear(len(weights), 1) holding the given weights (and bias, or none)."""
    model = nn.Linear(len(weights), 1, bias=bias is not None)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([weights]))
        if bias is not None:
            model.bias.fill_(bias)
    return model


def mse(model, x, y, logits):
    return ((logits.squeeze(1) - y) ** 2).mean()


def output_sum(model, x, y, logits):
    """Loss = sum of outputs: its gradient with respect to the weights is the batch's x summed."""
    return logits.sum()


def sgd(model, lr, **kw):
    return torch.optim.SGD(model.parameters(), lr=lr, **kw)


# -- make_optimizer ----------------------------------------------------------------------------


def test_sgd_is_the_default_with_lr_momentum_and_weight_decay_from_the_spec():
    training = TrainingSection(lr=0.3, momentum=0.7, weight_decay=0.02)
    opt = make_optimizer(nn.Linear(2, 1).parameters(), training)
    assert type(opt) is torch.optim.SGD
    (group,) = opt.param_groups
    assert group["lr"] == 0.3 and group["momentum"] == 0.7 and group["weight_decay"] == 0.02
    assert TrainingSection().optimizer == "sgd"


def test_adam_gets_lr_and_weight_decay():
    training = TrainingSection(optimizer="adam", lr=0.004, weight_decay=0.01, momentum=0.5)
    opt = make_optimizer(nn.Linear(2, 1).parameters(), training)
    assert type(opt) is torch.optim.Adam
    (group,) = opt.param_groups
    assert group["lr"] == 0.004 and group["weight_decay"] == 0.01
    assert group["betas"] == (0.9, 0.999)  # momentum is SGD's; Adam keeps its own betas


@pytest.mark.parametrize("name", ["sgd", "adam"])
def test_an_explicit_lr_overrides_the_spec_and_none_keeps_it(name):
    training = TrainingSection(optimizer=name, lr=0.3)
    assert make_optimizer(nn.Linear(2, 1).parameters(), training, lr=0.05).param_groups[0]["lr"] == 0.05
    assert make_optimizer(nn.Linear(2, 1).parameters(), training, lr=None).param_groups[0]["lr"] == 0.3


def test_the_optimizer_steps_the_parameters_it_was_given_only():
    model = linear([1.0, 1.0], bias=0.0)
    opt = make_optimizer([model.weight], TrainingSection(lr=0.5))
    output_sum(model, None, None, model(torch.tensor([[1.0, 2.0]]))).backward()
    opt.step()
    # d(sum)/dw = x = [1, 2]: w = [1, 1] - 0.5 * [1, 2]; the bias was not given
    assert torch.equal(model.weight.detach(), torch.tensor([[0.5, 0.0]]))
    assert float(model.bias.detach()) == 0.0


def test_momentum_and_weight_decay_act_on_the_update_by_hand():
    # loss = w * x with x = 1: gradient 1 (+ weight_decay * w). lr 0.1, momentum 0.9, wd 0.5.
    model = linear([1.0])
    opt = make_optimizer(model.parameters(), TrainingSection(lr=0.1, momentum=0.9, weight_decay=0.5))
    x = torch.ones(1, 1)
    for _ in range(2):
        opt.zero_grad()
        output_sum(model, x, None, model(x)).backward()
        opt.step()
    # step 1: g = 1 + 0.5 * 1 = 1.5, v = 1.5, w = 1 - 0.15 = 0.85
    # step 2: g = 1 + 0.5 * 0.85 = 1.425, v = 0.9 * 1.5 + 1.425 = 2.775, w = 0.85 - 0.2775 = 0.5725
    assert float(model.weight.detach()) == pytest.approx(0.5725, abs=1e-6)


# -- reset_optimizer ---------------------------------------------------------------------------


def test_reset_clears_momentum_so_the_next_client_starts_fresh():
    model = linear([1.0])
    opt = make_optimizer(model.parameters(), TrainingSection(lr=0.1, momentum=0.9))
    x = torch.ones(1, 1)
    output_sum(model, x, None, model(x)).backward()
    opt.step()
    assert len(opt.state) == 1  # a momentum buffer exists
    assert reset_optimizer(opt) is opt
    assert len(opt.state) == 0
    with torch.no_grad():
        model.weight.fill_(1.0)
    opt.zero_grad()
    output_sum(model, x, None, model(x)).backward()
    opt.step()
    # fresh: v = g = 1, w = 1 - 0.1 (with the old buffer: v = 0.9 + 1, w = 1 - 0.19)
    assert float(model.weight.detach()) == pytest.approx(0.9, abs=1e-7)


def test_reset_clears_adam_moments():
    model = linear([1.0])
    opt = make_optimizer(model.parameters(), TrainingSection(optimizer="adam", lr=0.1))
    x = torch.ones(1, 1)
    output_sum(model, x, None, model(x)).backward()
    opt.step()
    assert "exp_avg" in opt.state[model.weight]
    reset_optimizer(opt)
    assert not opt.state


# -- run_epochs: one step by hand ----------------------------------------------------------------


def test_one_sgd_step_by_hand():
    # w = [1, 2], b = 0.5; x = [[1, 0], [0, 1], [1, 1]], y = [1, 3, 2]; loss = mean squared error
    # predictions [1.5, 2.5, 3.5], residuals r = [0.5, -0.5, 1.5], loss = (0.25 + 0.25 + 2.25) / 3
    # dL/dw = 2/3 * sum r_i x_i = 2/3 * [2, 1] = [4/3, 2/3]; dL/db = 2/3 * sum r_i = 1
    # lr 0.3: w = [1 - 0.4, 2 - 0.2] = [0.6, 1.8], b = 0.5 - 0.3 = 0.2
    model = linear([1.0, 2.0], bias=0.5)
    x = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    y = torch.tensor([1.0, 3.0, 2.0])
    out = run_epochs(model, sgd(model, 0.3), x, y, epochs=1, batch_size=3, loss_fn=mse,
                     generator=torch.Generator().manual_seed(0))
    assert torch.allclose(model.weight.detach(), torch.tensor([[0.6, 1.8]]), atol=1e-6)
    assert float(model.bias.detach()) == pytest.approx(0.2, abs=1e-6)
    assert out == {"train_loss": pytest.approx(2.75 / 3, abs=1e-6)}  # the loss before the step


def test_two_steps_use_only_their_own_batch_gradient():
    # loss = sum(w * x): gradient = the batch's x. Batches of one, in order: x = 2 then x = 3.
    # w = 1 - 0.1 * 2 = 0.8, then 0.8 - 0.1 * 3 = 0.5 (gradients accumulated: 0.8 - 0.5 = 0.3).
    # losses 1 * 2 = 2 and 0.8 * 3 = 2.4: train_loss = 2.2
    model = linear([1.0])
    out = run_epochs(model, sgd(model, 0.1), torch.tensor([[2.0], [3.0]]), torch.zeros(2), epochs=1,
                     batch_size=1, loss_fn=output_sum, shuffle=False)
    assert float(model.weight.detach()) == pytest.approx(0.5, abs=1e-6)
    assert out["train_loss"] == pytest.approx(2.2, abs=1e-6)


def test_the_loss_fn_is_what_is_minimised():
    # maximising the output instead: gradient of -sum(w x) is -x, so w grows by lr * x
    model = linear([1.0])
    run_epochs(model, sgd(model, 0.1), torch.tensor([[2.0]]), torch.zeros(1), epochs=1, batch_size=1,
               loss_fn=lambda m, x, y, logits: -logits.sum())
    assert float(model.weight.detach()) == pytest.approx(1.2, abs=1e-6)


def test_loss_fn_gets_the_model_the_batch_and_the_logits_of_that_batch():
    model = linear([1.0, -1.0], bias=0.0)
    x = torch.arange(10.0).reshape(5, 2)
    y = torch.arange(5)
    calls = []

    def loss_fn(m, xb, yb, logits):
        assert m is model and m.training
        calls.append((xb.clone(), yb.clone(), logits.detach().clone(), m(xb).detach().clone()))
        return logits.sum() * 0.0  # no update: the model stays as it was

    run_epochs(model, sgd(model, 0.1), x, y, epochs=1, batch_size=2, loss_fn=loss_fn,
               generator=torch.Generator().manual_seed(3), drop_last=False)
    assert [len(c[1]) for c in calls] == [2, 2, 1]
    seen = torch.cat([c[1] for c in calls])
    assert sorted(seen.tolist()) == [0, 1, 2, 3, 4]  # every sample once
    for xb, yb, logits, recomputed in calls:
        assert torch.equal(xb, x[yb])  # x and y sliced by the same indices
        assert torch.equal(logits, recomputed)  # the logits are model(xb)


# -- batch order ------------------------------------------------------------------------------


def _order(n, batch_size=1, epochs=1, **kw):
    seen = []

    def loss_fn(m, x, y, logits):
        seen.extend(y.tolist())
        return logits.sum()

    model = linear([0.0])
    run_epochs(model, sgd(model, 0.0001), torch.zeros(n, 1), torch.arange(n), epochs=epochs,
               batch_size=batch_size, loss_fn=loss_fn, drop_last=False, **kw)
    return seen


def test_shuffle_false_keeps_the_data_order_every_epoch():
    assert _order(7, batch_size=3, epochs=2, shuffle=False) == list(range(7)) * 2
    assert batch_order(4, torch.Generator().manual_seed(0), shuffle=False).tolist() == [0, 1, 2, 3]


def test_the_generator_seeds_the_order_and_each_epoch_draws_a_new_one():
    a = _order(12, batch_size=5, epochs=2, generator=torch.Generator().manual_seed(7))
    b = _order(12, batch_size=5, epochs=2, generator=torch.Generator().manual_seed(7))
    c = _order(12, batch_size=5, epochs=2, generator=torch.Generator().manual_seed(8))
    assert a == b  # same seed, same order
    assert a != c  # the seed decides the order
    assert sorted(a[:12]) == list(range(12)) and sorted(a[12:]) == list(range(12))
    expected = torch.Generator().manual_seed(7)
    first, second = torch.randperm(12, generator=expected), torch.randperm(12, generator=expected)
    assert a == first.tolist() + second.tolist()  # one permutation per epoch from the generator


def test_shuffling_is_the_default():
    order = _order(12, generator=torch.Generator().manual_seed(1))
    assert order == torch.randperm(12, generator=torch.Generator().manual_seed(1)).tolist()
    assert order != list(range(12))


# -- the returned loss, epochs and mode --------------------------------------------------------


def _batch_mean_label_loss(m, x, y, logits):
    """A loss whose value is the batch's mean label (and whose gradient is 0)."""
    return logits.sum() * 0.0 + y.float().mean()


@pytest.mark.parametrize("epochs", [1, 3])
def test_train_loss_is_the_mean_over_steps_not_over_samples(epochs):
    # batches of labels [0, 1], [2, 3], [4]: losses 0.5, 2.5, 4 -> mean over steps 7/3
    # (over samples it would be 10/5 = 2)
    model = linear([0.0])
    out = run_epochs(model, sgd(model, 0.1), torch.zeros(5, 1), torch.arange(5), epochs=epochs, batch_size=2,
                     loss_fn=_batch_mean_label_loss, shuffle=False, drop_last=False)
    assert out["train_loss"] == pytest.approx(7 / 3)


def test_drop_last_loss_mean_counts_only_the_steps_taken():
    model = linear([0.0])
    out = run_epochs(model, sgd(model, 0.1), torch.zeros(5, 1), torch.arange(5), epochs=2, batch_size=2,
                     loss_fn=_batch_mean_label_loss, shuffle=False, drop_last=True)
    assert out["train_loss"] == pytest.approx(1.5)  # (0.5 + 2.5) / 2 each epoch


def test_epochs_repeat_the_pass_and_zero_epochs_train_nothing():
    # loss = w * x with x = 1, lr 0.1, one batch: each epoch subtracts 0.1
    model = linear([1.0])
    run_epochs(model, sgd(model, 0.1), torch.ones(1, 1), torch.zeros(1), epochs=3, batch_size=4,
               loss_fn=output_sum)
    assert float(model.weight.detach()) == pytest.approx(0.7, abs=1e-6)
    model = linear([1.0])
    assert run_epochs(model, sgd(model, 0.1), torch.ones(1, 1), torch.zeros(1), epochs=0, batch_size=4,
                      loss_fn=output_sum) == {}
    assert float(model.weight.detach()) == 1.0


def test_the_model_trains_in_train_mode_and_is_left_in_it():
    model = nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.5))
    model.eval()
    modes = []

    def loss_fn(m, x, y, logits):
        modes.append(m.training and m[1].training)
        return nn.functional.cross_entropy(logits, y)

    run_epochs(model, sgd(model, 0.1), torch.randn(4, 2), torch.tensor([0, 1, 0, 1]), epochs=1, batch_size=2,
               loss_fn=loss_fn, generator=torch.Generator().manual_seed(0))
    assert modes == [True, True]
    assert model.training and model[1].training


def test_train_loss_is_a_python_float_detached_from_the_graph():
    model = linear([1.0])
    out = run_epochs(model, sgd(model, 0.1), torch.ones(3, 1), torch.zeros(3), epochs=1, batch_size=3,
                     loss_fn=output_sum)
    assert type(out["train_loss"]) is float and out["train_loss"] == pytest.approx(3.0)


def test_run_epochs_keeps_the_last_partial_batch_unless_asked():
    # the loop's own default (client training passes training.drop_last, default true, explicitly)
    sizes = []

    def loss_fn(m, x, y, logits):
        sizes.append(len(y))
        return logits.sum()

    model = linear([0.0])
    run_epochs(model, sgd(model, 0.1), torch.zeros(5, 1), torch.zeros(5), epochs=1, batch_size=2, loss_fn=loss_fn,
               shuffle=False)
    assert sizes == [2, 2, 1]


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_loss_stops_training_naming_the_loss(bad):
    from pfl_core.errors import NonFiniteError

    model = linear([1.0])
    with pytest.raises(NonFiniteError) as info:
        run_epochs(model, sgd(model, 0.1), torch.ones(1, 1), torch.zeros(1), epochs=1, batch_size=1,
                   loss_fn=lambda m, x, y, logits: logits.sum() * bad)
    assert str(info.value) == f"the training loss became {bad}"


def test_a_parameter_a_batch_does_not_touch_is_not_moved_by_momentum():
    # batch 1: loss = w x + b (b gets gradient 1); batch 2: loss = w x only (b gets none).
    # SGD lr 0.1, momentum 0.9: b = 0 - 0.1 * 1 = -0.1 after batch 1 and stays there: its
    # gradient is cleared to None, not to 0 (a zero gradient would move it by the momentum
    # buffer again: -0.1 - 0.1 * 0.9 = -0.19).
    model = linear([1.0], bias=0.0)
    calls = []

    def loss_fn(m, x, y, logits):
        calls.append(len(calls))
        return logits.sum() if len(calls) == 1 else (m.weight * x).sum()

    run_epochs(model, sgd(model, 0.1, momentum=0.9), torch.ones(2, 1), torch.zeros(2), epochs=1, batch_size=1,
               loss_fn=loss_fn, shuffle=False)
    assert float(model.bias.detach()) == pytest.approx(-0.1, abs=1e-7)
    # w: gradient 1 twice: v = 1, w = 0.9; v = 1.9, w = 0.9 - 0.19 = 0.71
    assert float(model.weight.detach()) == pytest.approx(0.71, abs=1e-6)


def test_mean_training_loss_of_a_list_and_of_a_total_by_hand():
    from pfl_core.errors import NonFiniteError
    from pfl_core.runtime.training import mean_training_loss

    assert mean_training_loss([torch.tensor(1.0), torch.tensor(3.0)]) == {"train_loss": 2.0}
    assert mean_training_loss(torch.tensor(6.0), 4) == {"train_loss": 1.5}
    assert mean_training_loss([]) == {} and mean_training_loss(torch.tensor(0.0), 0) == {}
    with pytest.raises(NonFiniteError):
        mean_training_loss([torch.tensor(1.0), torch.tensor(float("nan"))])
