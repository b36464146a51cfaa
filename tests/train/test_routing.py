"""The routing losses the task adds (llmlab.train.routing): in one process the load-balancing
term is HF's ``aux_loss`` for a ``MixtralForCausalLM`` with the same weights, and the task
differentiates ``CE + coef · aux`` while logging them apart; a model without routers adds
nothing; a pipeline with routing losses is refused up front. The distributed equality (one
process against data 2 × expert 2 with the aux loss on) is in
tests/integration/test_expert_parallel.py."""

from __future__ import annotations

import pytest
import torch

from llmlab.parallel.loss_mean import LossReplicas
from llmlab.train.routing import router_loss

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=96, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, router_aux_loss_coef=0.02, initializer_range=0.1,
    )  # fmt: skip
    hf = transformers.MixtralForCausalLM(config).eval()
    folder = tmp_path_factory.mktemp("mixtral")
    hf.save_pretrained(folder)
    return hf, folder


def test_the_aux_term_is_transformers_aux_loss_and_weighted_by_the_config(mixtral):
    from llmlab.models import from_pretrained

    hf, folder = mixtral
    ours = from_pretrained(folder)
    ids = torch.randint(0, 96, (3, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = hf(ids, output_router_logits=True)
    ours(ids)
    got = router_loss(ours, LossReplicas())
    assert got is not None and got.z is None
    # 1e-6: the same fp32 sums (HF: means of one-hot masks), in another order
    torch.testing.assert_close(got.aux, reference.aux_loss.float(), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got.total, 0.02 * got.aux, atol=1e-8, rtol=1e-6)
    assert got.total.requires_grad  # it reaches the router weights
    got.total.backward()
    assert ours.moe_layers()[0].router.weight.grad.abs().sum() > 0


def test_z_loss_is_the_mean_over_layers_of_the_models_own():
    from llmlab.models import build_model

    model = build_model(dict(arch="llama", vocab_size=64, n_layer=2, n_head=2, n_kv_head=1,
                             n_embd=32, intermediate_size=32, num_experts=4,
                             num_experts_per_tok=2, moe_intermediate_size=32,
                             router_aux_loss_coef=0.01, router_z_loss_coef=0.001))  # fmt: skip
    model(torch.randint(0, 64, (2, 8)))
    got = router_loss(model, LossReplicas())
    torch.testing.assert_close(got.total, model.router_loss(), atol=1e-8, rtol=1e-6)
    torch.testing.assert_close(got.aux, model.router_aux_loss().detach())


def test_models_without_routers_or_coefficients_add_nothing():
    from llmlab.models import build_model

    dense = build_model(dict(arch="llama", vocab_size=64, n_layer=1, n_head=2, n_embd=32))
    dense(torch.randint(0, 64, (1, 4)))
    gpt = build_model(dict(vocab_size=64, n_layer=1, n_head=2, n_embd=32, block_size=8))
    moe = build_model(dict(arch="llama", vocab_size=64, n_layer=1, n_head=2, n_embd=32,
                           num_experts=4, num_experts_per_tok=2))  # fmt: skip
    moe(torch.randint(0, 64, (1, 4)))
    for model in (dense, gpt, moe):  # the MoE model's coefficients default to 0
        assert router_loss(model, LossReplicas()) is None


def test_the_task_differentiates_the_aux_loss_and_logs_it_apart():
    from llmlab.train.task import CausalLMTask, causal_lm_loss

    model = dict(arch="llama", vocab_size=64, n_layer=2, n_head=2, n_kv_head=1, n_embd=32,
                 num_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.02)  # fmt: skip
    task = CausalLMTask(model=model)
    logged = {}
    task.log = lambda name, value, **kw: logged.__setitem__(name, value)
    task._trainer = type("T", (), {"strategy": None})()
    x = torch.randint(0, 64, (2, 9))
    loss = task.training_step((x[:, :-1], x[:, 1:]), 0)
    ce = causal_lm_loss(task.model(x[:, :-1]), x[:, 1:])
    torch.testing.assert_close(logged["train/loss"], ce.detach())
    aux = task.model.router_aux_loss().detach()
    torch.testing.assert_close(logged["train/aux_loss"], aux)
    torch.testing.assert_close(loss.detach(), ce.detach() + 0.02 * aux)


def test_the_bias_update_moves_after_each_optimizer_step_by_the_steps_loads():
    """γ · sign(mean - load) from the counts of every micro-batch of the step, once per step;
    a model without selection biases is refused by name."""
    from llmlab.models import build_model
    from llmlab.train.routing import BiasUpdate

    model = build_model(dict(arch="llama", vocab_size=64, n_layer=1, n_head=2, n_embd=32,
                             num_experts=4, num_experts_per_tok=2,
                             router_scoring="sigmoid"))  # fmt: skip
    update = BiasUpdate(0.5)
    loads = []
    for seed in (0, 1):  # two micro-batches of one step
        model(torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(seed)))
        update.add(model)
        loads.append(model.router_stats()[0].tokens_per_expert.float())
    update.apply(model, LossReplicas())
    load = loads[0] + loads[1]
    want = 0.5 * torch.sign(load.mean() - load)
    assert torch.equal(model.moe_layers()[0].router.bias, want) and update.counts == {}
    softmax = build_model(dict(arch="llama", vocab_size=64, n_layer=1, n_head=2, n_embd=32,
                               num_experts=4, num_experts_per_tok=2))  # fmt: skip
    softmax(torch.randint(0, 64, (1, 4)))
    update.add(softmax)
    with pytest.raises(ValueError, match="no selection bias"):
        update.apply(softmax, LossReplicas())


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["+model.num_experts_per_tok=2", "+model.router_aux_loss_coef=0.02"],
         r"router_aux_loss_coef=0\.02 with a pipeline of 2"),
        (["+model.router_scoring=sigmoid", "+task.update_bias_rate=0.001"],
         r"task\.update_bias_rate=0\.001 with a pipeline of 2"),
    ],
    ids=["routing losses", "bias update"],
)  # fmt: skip
def test_routing_terms_with_a_pipeline_are_refused(overrides, message):
    from llmlab.train.app import ConfigError, compose_config, validate_config

    base = ["model=llama", "+model.num_experts=4", "strategy=pipeline", "trainer.devices=2"]
    with pytest.raises(ConfigError, match=message):
        validate_config(compose_config([*base, *overrides]))
