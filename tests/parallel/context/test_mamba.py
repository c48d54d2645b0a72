"""Mamba-2 under context parallelism (meshlm/parallel/context/mamba.py) equals the single-process mixer.

A Mamba-2 mixer (2 B/C groups, conv bias, SSD chunks of 4 inside context-parallel chunks of 4
or 8 tokens) runs forward and backward on a whole sequence in one process; then each spawned
rank runs the CP version on its two chunks with its rows of the same output gradient. Its output
and input gradient must equal the single-process rows at its positions, and its parameter
gradients summed over the CP group the single-process ones (fp32, relative error <= 1e-5) -- at
cp 2 and 4, and at cp2 x tp2 (heads and groups split over TP as well). One process checks the
conv window hand-over and the state scan on their own, and the refusal of chunks shorter than
the conv window.
"""

import pytest
import torch

from meshlm.config import ParallelConfig
from meshlm.errors import ConfigError
from meshlm.models.config import ModelConfig
from meshlm.models.context import SequenceContext
from meshlm.models.mamba2 import Mamba2Mixer
from meshlm.parallel.collective_checks import compare_collectives
from meshlm.parallel.collectives import all_reduce_
from meshlm.parallel.context.chunks import local_token_positions
from meshlm.parallel.context.mamba import make_context_parallel_mamba, previous_windows
from meshlm.parallel.mesh import ParallelContext, build_parallel_context
from meshlm.parallel.tensor.mamba import parallelize_mamba
from meshlm.parallel.tensor.sharding import gather_full_tensor
from tests.helpers.distributed import run_distributed
from tests.helpers.tiny_training import relative_error

MODEL = dict(vocab_size=64, hidden_size=32, pattern="M", mamba_head_dim=8, mamba_state_size=8, mamba_num_groups=2,
             mamba_chunk_size=4, mamba_conv_bias=True)
TOLERANCE = 1e-5


def mixer_and_data(seq_len: int):
    config = ModelConfig(**MODEL)
    torch.manual_seed(0)
    mixer = Mamba2Mixer(config, 0)
    with torch.no_grad():
        mixer.conv1d.bias.normal_()
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, seq_len, 32, generator=generator, requires_grad=True)
    grad_out = torch.randn(2, seq_len, 32, generator=generator)
    return config, mixer, hidden, grad_out


def run_mixer(mixer, hidden):
    return mixer(hidden, SequenceContext.for_tokens(torch.zeros(hidden.shape[:2], dtype=torch.long)))


def cp_mixer_errors(cp: int, tp: int, seq_len: int) -> dict:
    config, mixer, hidden, grad_out = mixer_and_data(seq_len)
    context = build_parallel_context(ParallelConfig(cp=cp, tp=tp, check_collectives=True), config, torch.device("cpu"))
    out = run_mixer(mixer, hidden)
    out.backward(grad_out)
    expected_grads = {name: param.grad.clone() for name, param in mixer.named_parameters()}
    mixer.zero_grad()
    parallelize_mamba(mixer, context)
    make_context_parallel_mamba(mixer, context)
    positions = local_token_positions(seq_len, context.cp_rank, cp)
    local_hidden = hidden.detach()[:, positions].clone().requires_grad_()
    local_out = run_mixer(mixer, local_hidden)
    local_out.backward(grad_out[:, positions])
    errors = {"out": relative_error(local_out, out.detach()[:, positions]),
              "d_hidden": relative_error(local_hidden.grad, hidden.grad[:, positions])}
    for name, param in mixer.named_parameters():
        grad = param.grad.clone()
        all_reduce_(grad, context.cp_group)
        errors[name] = relative_error(gather_full_tensor(param, grad, context), expected_grads[name])
    compare_collectives(context, "after the CP Mamba mixer")
    return errors


@pytest.mark.parametrize("cp, tp, seq_len", [(2, 1, 16), (4, 1, 32), (2, 2, 16)])
def test_context_parallel_mamba_equals_single_process(cp, tp, seq_len):
    for rank, errors in enumerate(run_distributed(cp_mixer_errors, cp * tp, cp, tp, seq_len)):
        assert max(errors.values()) <= TOLERANCE, (rank, errors)
        assert len(errors) == 2 + 8, errors  # every parameter's gradient was compared


# --- one process: the pieces --------------------------------------------------------------------------

def conv_windows(cp: int) -> list:
    """Every rank's windows of a sequence 0..15 (one channel), gathered on each rank."""
    context = build_parallel_context(ParallelConfig(cp=cp), ModelConfig(), torch.device("cpu"))
    sequence = torch.arange(16.0).view(1, 16, 1)
    mine = sequence[:, local_token_positions(16, context.cp_rank, cp)].view(1, 2, 16 // cp // 2, 1)
    mine = mine.clone().requires_grad_()
    windows = previous_windows(mine, 2, context)
    windows.sum().backward()  # adjoint: each row's gradient counts the windows it was copied into
    return [windows.detach().flatten().tolist(), mine.grad.flatten().tolist()]


def test_conv_windows_come_from_the_previous_chunk_in_sequence_order():
    results = run_distributed(conv_windows, 2, 2)
    # cp 2: chunks of 4; rank 0 holds chunks 0 (zeros before it) and 3 (after chunk 2: 10, 11)
    assert results[0][0] == [0.0, 0.0, 10.0, 11.0]
    assert results[1][0] == [2.0, 3.0, 6.0, 7.0]  # chunks 1 (after 0) and 2 (after 1)
    # chunk 0's tail went to rank 1, chunk 3's nowhere; chunks 1 and 2 both handed their tails on
    assert results[0][1] == [0, 0, 1, 1, 0, 0, 0, 0]
    assert results[1][1] == [0, 0, 1, 1, 0, 0, 1, 1]


def test_chunks_shorter_than_the_conv_window_are_refused():
    chunks = torch.zeros(1, 2, 2, 3)
    with pytest.raises(ConfigError, match="shorter than the Mamba conv window of 3"):
        previous_windows(chunks, 3, ParallelContext(cp_size=2))
