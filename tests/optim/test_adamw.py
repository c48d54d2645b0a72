import torch

from meshlm.config import OptimConfig
from meshlm.models.config import ModelConfig
from meshlm.models.language_model import LanguageModel
from meshlm.optim.adamw import build_adamw


def tiny(**overrides) -> LanguageModel:
    values = dict(vocab_size=64, hidden_size=32, pattern="M*-E", num_attention_heads=4, mamba_head_dim=8,
                  moe_num_experts=4, moe_ffn_hidden_size=32, attention_bias=True, mlp_bias=True)
    values.update(overrides)
    torch.manual_seed(0)
    return LanguageModel(ModelConfig(**values))


def group_names(optimizer) -> dict[str, set[str]]:
    return {group["name"]: set(group["param_names"]) for group in optimizer.param_groups}


def test_matrices_decay_and_embeddings_norms_biases_and_vectors_do_not():
    model = tiny()
    optimizer = build_adamw(list(model.named_parameters()), OptimConfig(weight_decay=0.1))
    groups = group_names(optimizer)
    assert {g["name"]: g["weight_decay"] for g in optimizer.param_groups} == {"decay": 0.1, "no_decay": 0.0}
    for name in ("embedding.weight", "blocks.0.norm.weight", "blocks.0.mixer.A_log", "blocks.0.mixer.D",
                 "blocks.0.mixer.dt_bias", "blocks.0.mixer.norm.weight", "blocks.0.mixer.conv1d.bias",
                 "blocks.1.mixer.q_proj.bias", "blocks.2.mixer.up_proj.bias", "final_norm.weight"):
        assert name in groups["no_decay"], name
    for name in ("output.weight", "blocks.0.mixer.in_proj.weight", "blocks.0.mixer.conv1d.weight",
                 "blocks.1.mixer.q_proj.weight", "blocks.2.mixer.down_proj.weight",
                 "blocks.3.mixer.router.weight", "blocks.3.mixer.experts.up_weight"):
        assert name in groups["decay"], name
    assert groups["decay"] | groups["no_decay"] == {name for name, _ in model.named_parameters()}
    assert not groups["decay"] & groups["no_decay"]


def test_tied_embedding_does_not_decay():
    model = tiny(tie_embeddings=True, pattern="*-")
    groups = group_names(build_adamw(list(model.named_parameters()), OptimConfig()))
    assert "embedding.weight" in groups["no_decay"] and "output.weight" not in groups["decay"]


def test_flag_moves_everything_into_the_decay_group():
    model = tiny()
    optimizer = build_adamw(list(model.named_parameters()), OptimConfig(decay_embeddings_norms_biases=True))
    assert [group["name"] for group in optimizer.param_groups] == ["decay"]
    assert {"embedding.weight", "blocks.0.norm.weight", "blocks.0.mixer.A_log"} <= group_names(optimizer)["decay"]


def test_names_decide_groups_while_the_given_tensors_are_updated():
    model = tiny(pattern="*-")
    masters = [(name, torch.nn.Parameter(p.detach().clone())) for name, p in model.named_parameters()]
    optimizer = build_adamw(masters, OptimConfig())
    updated = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert updated == {id(p) for _, p in masters}


def test_adamw_step_matches_torch_adamw_with_the_same_groups():
    torch.manual_seed(0)
    config = OptimConfig(lr=0.05, weight_decay=0.3, beta1=0.8, beta2=0.9, eps=1e-6)
    matrix, vector = torch.randn(4, 3), torch.randn(3)
    ours = [("layer.weight", torch.nn.Parameter(matrix.clone())), ("layer.bias", torch.nn.Parameter(vector.clone()))]
    theirs = [torch.nn.Parameter(matrix.clone()), torch.nn.Parameter(vector.clone())]
    optimizer = build_adamw(ours, config)
    reference = torch.optim.AdamW([{"params": [theirs[0]], "weight_decay": 0.3},
                                   {"params": [theirs[1]], "weight_decay": 0.0}],
                                  lr=0.05, betas=(0.8, 0.9), eps=1e-6, foreach=False)
    inputs, targets = torch.randn(16, 3), torch.randn(16, 4)
    for _ in range(5):
        for params, opt in (([p for _, p in ours], optimizer), (theirs, reference)):
            opt.zero_grad()
            ((inputs @ params[0].T + params[1].sum() - targets) ** 2).mean().backward()
            opt.step()
    torch.testing.assert_close(ours[0][1], theirs[0], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(ours[1][1], theirs[1], rtol=1e-6, atol=1e-7)
    assert not torch.equal(ours[0][1], matrix)  # it did move
