"""FedBABU: Oh et al., "FedBABU: Toward Enhanced Representation for Federated Image
Classification", ICLR 2022 (Algorithm 1).

Body (layers 1..k, default every layer but the last, ``head_layers = 1``) learned by FedAvg; the
head (the classifier) is frozen at its random initialisation during federated training, the
same for every client, so it is never sent. Personalisation is fine-tuning of the whole model.

    server: body theta_b; head theta_h fixed at the seeded initial weights
    each round t, each participant i:
        receive theta_b^t; tau local epochs of SGD on the body only (head frozen)
        upload theta_b^i
    theta_b^{t+1} <- sum_i n_i/n theta_b^i
    evaluation: each client fine-tunes (theta_b, theta_h) for ``finetune_epochs`` epochs on its
    own training split and is scored with the fine-tuned model.

Decisions (the issue leaves them open): the fine-tuning runs at every evaluation (so the
accuracy curve is that of the personalised models; the stored global body is never changed by
it); ``finetune_epochs`` defaults to 5, the fine-tuning epochs of the paper's main results.
Cold-start clients fine-tune the final (body, initial head) for
``experiment.coldstart_epochs`` epochs (the core default).
"""

from __future__ import annotations

from typing import Optional

from attrs import define, field

from pfl_core.api import PartialModel, at_least, hookimpl, load_state, only_training


@define
class FedBABUParams:
    head_layers: Optional[int] = field(default=1, validator=at_least(1), metadata={
        "doc": "how many parameterised layers, counted from the output, form the frozen head (the rest is "
               "the body, learned by FedAvg); 1: the classifier; none: the middle (L - L // 2)"})
    finetune_epochs: int = field(default=5, validator=at_least(0), metadata={
        "doc": "epochs of fine-tuning the whole model on the client's training split before every "
               "evaluation (the paper's main results)"})


class FedBABU(PartialModel):
    name = "fedbabu"
    Params = FedBABUParams
    shared_part = "base"

    @hookimpl
    def local_train(self, ctx, client):
        # Nothing personal is kept: the frozen head is the seeded initial one, which
        # PartialModel.load_personal loads for a client without personal state.
        with only_training(client.model, set(self.shared_keys(ctx, client.arch))) as body:
            return client.train(optimizer=client.optimizer(params=body))

    @hookimpl
    def personalized_models(self, ctx, client, message):
        model = self.load_personal(ctx, client)  # the seeded initial head: nothing personal is kept
        load_state(model, message["weights"])  # + the global body
        if self.params.finetune_epochs:
            client.train(epochs=self.params.finetune_epochs)
        return {"": model}
