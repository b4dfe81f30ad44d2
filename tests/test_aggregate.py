"""pfl_core.runtime.aggregate.weighted_average, hand-computed on two- and three-client states."""

import torch

from pfl_core.runtime.aggregate import weighted_average


def states():
    a = {"w": torch.tensor([[1.0, 2.0], [3.0, 4.0]]), "b": torch.tensor([0.5]),
         "num_batches_tracked": torch.tensor(7)}
    b = {"w": torch.tensor([[5.0, -2.0], [7.0, 0.0]]), "b": torch.tensor([-1.5]),
         "num_batches_tracked": torch.tensor(11)}
    return a, b


def test_weighted_mean_by_hand():
    a, b = states()
    avg = weighted_average([(0.25, a), (0.75, b)])
    # 0.25 * [[1, 2], [3, 4]] + 0.75 * [[5, -2], [7, 0]] = [[4, -1], [6, 1]]
    assert torch.equal(avg["w"], torch.tensor([[4.0, -1.0], [6.0, 1.0]]))
    assert torch.equal(avg["b"], torch.tensor([0.25 * 0.5 + 0.75 * -1.5]))  # -1.0


def test_weights_are_used_as_given_not_renormalised_nor_uniform():
    a, b = states()
    avg = weighted_average([(0.5, a), (0.25, b)])  # sums to 0.75: no renormalisation
    assert torch.equal(avg["w"], torch.tensor([[1.75, 0.5], [3.25, 2.0]]))
    assert torch.equal(avg["b"], torch.tensor([0.5 * 0.5 + 0.25 * -1.5]))


def test_three_clients_and_order_of_the_weights():
    s = [{"x": torch.tensor([float(v)])} for v in (2.0, 4.0, 10.0)]
    # 0.5 * 2 + 0.25 * 4 + 0.25 * 10 = 4.5; the weights follow their states: 0.25 * 2 + 0.25 * 4 + 0.5 * 10 = 6.5
    assert torch.equal(weighted_average([(0.5, s[0]), (0.25, s[1]), (0.25, s[2])])["x"], torch.tensor([4.5]))
    assert torch.equal(weighted_average([(0.25, s[0]), (0.25, s[1]), (0.5, s[2])])["x"], torch.tensor([6.5]))


def test_non_float_buffers_come_from_the_first_state_unaveraged():
    a, b = states()
    avg = weighted_average([(0.25, a), (0.75, b)])
    assert avg["num_batches_tracked"].dtype == torch.int64
    assert int(avg["num_batches_tracked"]) == 7
    assert int(weighted_average([(0.75, b), (0.25, a)])["num_batches_tracked"]) == 11


def test_one_state_is_scaled_by_its_weight():
    a, _ = states()
    avg = weighted_average([(1.0, a)])
    assert torch.equal(avg["w"], a["w"]) and int(avg["num_batches_tracked"]) == 7
    assert torch.equal(weighted_average([(0.5, a)])["w"], 0.5 * a["w"])


def test_no_state_gives_none():
    assert weighted_average([]) is None
    assert weighted_average(iter(())) is None


def test_inputs_are_not_modified_and_the_result_does_not_alias_them():
    a, b = states()
    copies = [{k: v.clone() for k, v in s.items()} for s in (a, b)]
    avg = weighted_average([(1.0, a), (0.5, b)])
    for original, copy in zip((a, b), copies):
        assert all(torch.equal(original[k], copy[k]) for k in copy)
    avg["w"].add_(100.0)
    avg["num_batches_tracked"].add_(1)
    assert torch.equal(a["w"], copies[0]["w"]) and int(a["num_batches_tracked"]) == 7


def test_streams_one_state_at_a_time_from_a_generator():
    seen = []

    def pairs():
        for i, value in enumerate((1.0, 3.0)):
            state = {"x": torch.tensor([value])}
            seen.append(i)
            yield 0.5, state
            state["x"].fill_(-1000.0)  # the next client overwrites the shared working model

    assert torch.equal(weighted_average(pairs())["x"], torch.tensor([2.0]))
    assert seen == [0, 1]


def test_keeps_dtypes_and_does_not_track_gradients():
    w = torch.nn.Parameter(torch.tensor([2.0, 4.0], dtype=torch.float64))
    avg = weighted_average([(0.5, {"w": w}), (0.5, {"w": torch.tensor([0.0, 2.0], dtype=torch.float64)})])
    assert avg["w"].dtype == torch.float64 and not avg["w"].requires_grad
    assert torch.equal(avg["w"], torch.tensor([1.0, 3.0], dtype=torch.float64))
