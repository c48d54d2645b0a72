"""Upcycling: the MoE model's outputs equal the dense model's at step 0 (fp32), routing is spread,
the scale of the approximate routers is right, and ``meshlm upcycle`` writes a loadable folder --
one tensor at a time, so an MoE model larger than the process's memory cap is written -- that
trains with router balancing unless the user chose it."""

from __future__ import annotations

import pytest
import torch

from meshlm.adapt.upcycle import down_projection_scale, is_exact, upcycle_model, upcycled_config
from meshlm.checkpoint.model_files import load_model, read_model_config, save_model
from meshlm.cli import main
from meshlm.config import load_run_config
from meshlm.errors import ConfigError
from meshlm.models.config import ModelConfig
from meshlm.models.language_model import LanguageModel

DENSE = dict(vocab_size=64, hidden_size=32, pattern="*-*-", num_attention_heads=4, ffn_hidden_size=64)
HYBRID = dict(vocab_size=64, hidden_size=32, pattern="M*-M-", num_attention_heads=4, ffn_hidden_size=64,
              mlp_activation="squared_relu", mamba_head_dim=8, mamba_state_size=8, mamba_chunk_size=8)
TOLERANCE = 1e-5


def dense_model(**values) -> LanguageModel:
    torch.manual_seed(0)
    model = LanguageModel(ModelConfig(**values))
    with torch.no_grad():  # larger than init so the MLPs matter to the logits
        for name, param in model.named_parameters():
            if "_proj" in name:
                param.normal_(std=0.2)
    return model.eval()


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual - expected).abs().max() / expected.abs().max())


def tokens(batch=3, seq=16) -> torch.Tensor:
    return torch.randint(0, 64, (batch, seq), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("model_values", [DENSE, HYBRID], ids=["dense", "hybrid"])
@pytest.mark.parametrize("experts, top_k, granularity, routing", [
    (4, 2, 1, {}),                                                       # softmax, renormalized top-k
    (8, 2, 2, {}),                                                       # fine-grained, 1 group per token
    (8, 4, 4, {}),                                                       # experts of width ffn/4, 1 group
    (16, 8, 4, dict(moe_softmax_before_topk=False)),                     # top-k then softmax, 2 groups
    (8, 4, 2, dict(moe_score_function="sigmoid", moe_routed_scaling_factor=2.5)),   # DeepSeek-style
    (8, 2, 2, dict(moe_router_num_groups=2, moe_router_group_top_k=1)),  # group-limited routing
], ids=["E4K2G1", "E8K2G2", "E8K4G4", "topk-softmax-E16K8G4", "sigmoid-E8K4G2", "router-groups"])
def test_upcycled_model_equals_the_dense_model_at_step_0(model_values, experts, top_k, granularity, routing):
    dense = dense_model(**model_values)
    moe = upcycle_model(dense, experts, top_k, granularity, **routing).eval()
    assert moe.config.pattern == model_values["pattern"].replace("-", "E") and is_exact(moe.config)
    assert moe.config.moe_ffn_hidden_size == 64 // granularity
    with torch.no_grad():
        expected, output = dense(tokens()).logits, moe(tokens())
    assert relative_error(output.logits, expected) <= TOLERANCE
    visited = torch.stack(output.tokens_per_expert)  # [blocks, E]: the members of a virtual group travel together
    assert torch.equal(visited, visited.reshape(len(visited), -1, granularity)[..., :1].expand(
        -1, -1, granularity).reshape_as(visited))


def test_down_projection_scale_of_each_router():
    config = upcycled_config(ModelConfig(**DENSE), 8, 4, 2)
    assert down_projection_scale(config, 2) == pytest.approx(2.0)                  # G / s
    sigmoid = upcycled_config(ModelConfig(**DENSE), 8, 4, 2, moe_score_function="sigmoid",
                              moe_routed_scaling_factor=2.5)
    assert down_projection_scale(sigmoid, 2) == pytest.approx(2 / 2.5)
    plain = upcycled_config(ModelConfig(**DENSE), 8, 4, 2, moe_normalize_topk=False)
    assert not is_exact(plain) and down_projection_scale(plain, 2) == pytest.approx(8 * 2 / 4)  # E G / K
    plain_sigmoid = upcycled_config(ModelConfig(**DENSE), 8, 4, 2, moe_normalize_topk=False,
                                    moe_score_function="sigmoid")
    assert down_projection_scale(plain_sigmoid, 2) == pytest.approx(2 * 2 / 4)   # 2 G / K


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
def test_unnormalized_routers_are_close_when_the_router_starts_small(score_function):
    dense = dense_model(**DENSE)
    with torch.no_grad():
        expected = dense(tokens()).logits
    errors = {}
    for std in (1e-2, 1e-4):
        moe = upcycle_model(dense, 8, 4, 2, router_init_std=std, moe_normalize_topk=False,
                            moe_score_function=score_function).eval()
        with torch.no_grad():
            errors[std] = relative_error(moe(tokens()).logits, expected)
    assert errors[1e-4] < 1e-3 and errors[1e-4] < errors[1e-2] / 10, errors


def test_routing_starts_spread_over_the_virtual_groups():
    dense = dense_model(**HYBRID)
    moe = upcycle_model(dense, 16, 4, 2).eval()  # 8 virtual groups, each token picks 2
    isotropic = torch.randn(4096, 32, generator=torch.Generator().manual_seed(2))
    for block in (moe.blocks[2], moe.blocks[4]):
        # the router alone, on isotropic inputs: the 8 groups share the traffic evenly
        ids = block.mixer.router(isotropic).expert_ids
        per_group = torch.bincount(ids.flatten() // 2, minlength=8).float()
        assert per_group.max() / per_group.mean() < 1.1, per_group
    with torch.no_grad():  # the model's own hidden states (64 token ids): every group gets traffic
        counts = moe(torch.randint(0, 64, (8, 64), generator=torch.Generator().manual_seed(2))).tokens_per_expert
    for per_expert in counts:
        per_group = per_expert.reshape(8, 2)[:, 0].float()  # both members carry the same count
        assert (per_group > 0).all(), per_group


@pytest.mark.parametrize("values, arguments, words", [
    (dict(DENSE, mlp_bias=True), (8, 2, 1), "mlp_bias"),
    (dict(DENSE, pattern="**"), (8, 2, 1), "no dense MLP"),
    (DENSE, (6, 3, 3), "divide the dense FFN"),
    (DENSE, (8, 3, 2), "multiples of --granularity"),
    (DENSE, (8, 2, 2, dict(moe_router_num_groups=8, moe_router_group_top_k=2)), "whole virtual groups"),
    (DENSE, (8, 2, 2, dict(moe_capacity_factor=1.0)), "dropless"),
    (DENSE, (8, 2, 2, dict(hidden_size=16)), "moe_\\* model fields"),
])
def test_refusals(values, arguments, words):
    overrides = arguments[3] if len(arguments) > 3 else {}
    with pytest.raises(ConfigError, match=words):
        upcycled_config(ModelConfig(**values), *arguments[:3], **overrides)


def test_cli_writes_a_folder_that_loads_and_refuses_an_existing_one(tmp_path, capsys):
    dense = dense_model(**HYBRID)
    save_model(dense, tmp_path / "dense")
    (tmp_path / "dense" / "tokenizer.json").write_text("{}")
    code = main(["upcycle", str(tmp_path / "dense"), str(tmp_path / "moe"), "--experts", "8", "--top-k", "4",
                 "--granularity", "2", "--seed", "3",
                 "--set", "moe_aux_loss_coeff=0.01", "model.moe_bias_update_rate=1e-3"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "train.init_from=" in printed and "model.pattern='M*EME'" in printed
    assert sorted(path.name for path in tmp_path.iterdir()) == ["dense", "moe"]  # no temporary folder left
    assert (tmp_path / "moe" / "tokenizer.json").is_file()
    loaded = load_model(tmp_path / "moe")
    assert loaded.config.moe_aux_loss_coeff == 0.01 and loaded.config.moe_bias_update_rate == 1e-3
    reference = upcycle_model(dense, 8, 4, 2, seed=3, moe_aux_loss_coeff=0.01, moe_bias_update_rate=1e-3)
    for name, value in reference.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name
    with torch.no_grad():
        assert relative_error(loaded.eval()(tokens()).logits, dense(tokens()).logits) <= TOLERANCE
    code = main(["upcycle", str(tmp_path / "dense"), str(tmp_path / "moe"), "--experts", "8", "--top-k", "2"])
    assert code == 2 and "already exists" in capsys.readouterr().err


@pytest.mark.parametrize("chosen, expected", [
    ([], dict(moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001, moe_bias_update_rate=0.0)),
    (["moe_aux_loss_coeff=0.02"], dict(moe_aux_loss_coeff=0.02, moe_z_loss_coeff=0.001)),
    (["moe_bias_update_rate=0.001"], dict(moe_aux_loss_coeff=0.0, moe_z_loss_coeff=0.001, moe_bias_update_rate=0.001)),
    (["moe_aux_loss_coeff=0", "moe_z_loss_coeff=0"], dict(moe_aux_loss_coeff=0.0, moe_z_loss_coeff=0.0)),
], ids=["defaults", "aux-chosen", "aux-loss-free", "both-off"])
def test_the_printed_command_trains_with_router_balancing(tmp_path, capsys, chosen, expected):
    """Without a balancing loss the copied experts' router collapses: upcycle sets Switch's 0.01 and
    ST-MoE's 0.001 z-loss unless --set chose the balancing, and its train command, applied to the
    dense config, describes exactly the folder's model (so train.init_from accepts it)."""
    save_model(dense_model(**DENSE), tmp_path / "dense")
    arguments = ["--set", *chosen] if chosen else []
    assert main(["upcycle", str(tmp_path / "dense"), str(tmp_path / "moe"), "--experts", "4", "--top-k", "2",
                 *arguments]) == 0
    printed = capsys.readouterr().out
    written = read_model_config(tmp_path / "moe")
    assert {name: getattr(written, name) for name in expected} == expected
    command = next(line for line in printed.splitlines() if line.startswith("train it with:"))
    for name, value in expected.items():
        assert (f"model.{name}={value:g}" in command) == (value != 0.0), name
    overrides = [word for word in command.split()[5:] if word.startswith("model.")]
    dense_run = [f"model.{key}={value}" for key, value in DENSE.items()]
    assert load_run_config(None, [*dense_run, *overrides]).model == written
    assert "router balancing: " + ("none" if not any(expected.values()) else "moe_") in printed


def test_upcycling_writes_a_model_larger_than_the_memory_cap(tmp_path):
    """``meshlm upcycle`` reads the dense model tensor by tensor and writes each expert tensor as it
    is made: a 136 MiB dense model becomes a ~400 MiB MoE model (64 MiB per stacked expert tensor)
    in a process whose data size is capped 192 MiB above its baseline, where upcycling in memory
    fails (``tests/helpers/capped_process.py``). With G = 1 every expert is the dense MLP, and the
    exact router (top-2 of 4, renormalized) scales the down projections by G / (K w0) = 1."""
    from safetensors import safe_open

    from tests.helpers.capped_process import run_capped

    mib, headroom = 2**20, 192
    config = ModelConfig(vocab_size=1024, hidden_size=1024, pattern="*-*-", num_attention_heads=8,
                         ffn_hidden_size=4096)
    save_model(LanguageModel(config), tmp_path / "dense")
    streamed = run_capped("upcycle", headroom, tmp_path / "dense", tmp_path / "moe", "--experts", "4", "--top-k", "2")
    expert_tensor, dense_weight = 4 * 4096 * 1024 * 4, 4096 * 1024 * 4
    assert streamed["ok"] and streamed["data_peak"] <= expert_tensor + dense_weight + 64 * mib, streamed
    in_memory = run_capped("upcycle-in-memory", headroom, tmp_path / "dense", 4, 2)
    assert not in_memory["ok"] and "allocate" in in_memory["error"], in_memory
    print(f"\nupcycled under a {headroom} MiB cap: {streamed}\nin memory: {in_memory}")
    with safe_open(str(tmp_path / "dense" / "model.safetensors"), "pt") as dense, \
            safe_open(str(tmp_path / "moe" / "model.safetensors"), "pt") as moe:
        assert (tmp_path / "moe" / "model.safetensors").stat().st_size > 2 * headroom * mib
        for name in dense.keys():
            if "_proj" in name and name.startswith(("blocks.1.", "blocks.3.")):
                ours = name.replace("gate_proj.weight", "experts.gate_weight").replace(
                    "up_proj.weight", "experts.up_weight").replace("down_proj.weight", "experts.down_weight")
                assert torch.equal(moe.get_tensor(ours), dense.get_tensor(name).expand(4, -1, -1)), name
            else:
                assert torch.equal(moe.get_tensor(name), dense.get_tensor(name)), name
        assert moe.get_tensor("blocks.1.mixer.router.weight").shape == (4, 1024)
