import pytest
import torch
import torch.nn.functional as F

import meshlm.models.losses as losses
from meshlm.models.config import ModelConfig
from meshlm.models.language_model import LanguageModel
from meshlm.models.losses import IGNORE_INDEX, linear_cross_entropy

TOKENS, HIDDEN, VOCAB = 37, 16, 50


def inputs(dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(TOKENS, HIDDEN, generator=generator).to(dtype).requires_grad_()
    weight = torch.randn(VOCAB, HIDDEN, generator=generator).to(dtype).requires_grad_()
    labels = torch.randint(0, VOCAB, (TOKENS,), generator=generator)
    labels[::4] = IGNORE_INDEX
    return hidden, weight, labels


def unfused_loss(hidden, weight, labels):
    return F.cross_entropy(F.linear(hidden, weight).float(), labels, ignore_index=IGNORE_INDEX)


def loss_and_grads(loss_fn, hidden, weight, labels, upstream=2.5):
    loss = loss_fn(hidden, weight, labels)
    grad_hidden, grad_weight = torch.autograd.grad(loss * upstream, (hidden, weight))
    return loss, grad_hidden, grad_weight


@pytest.mark.parametrize("tokens_per_chunk", [1, 5, 8, 36, 37, 1000])
def test_fp32_loss_and_gradients_equal_unfused(tokens_per_chunk):
    hidden, weight, labels = inputs()
    expected = loss_and_grads(unfused_loss, hidden, weight, labels)
    fused = loss_and_grads(lambda *args: linear_cross_entropy(*args, tokens_per_chunk), hidden, weight, labels)
    for name, got, want in zip(("loss", "grad hidden", "grad weight"), fused, expected):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6 * want.abs().max().item(), msg=name)


@pytest.mark.parametrize("tokens_per_chunk", [5, 1000])
@pytest.mark.parametrize("softcap", [None, 3.0], ids=["uncapped", "capped"])
@pytest.mark.parametrize("compiled_softmax", [False, True], ids=["eager", "plain-ops softmax"])
def test_a_bias_on_the_logits_gets_its_gradient(tokens_per_chunk, softcap, compiled_softmax):
    """``model.output_bias``: z = H W^T + b, dloss/db the sum of dloss/dz over the tokens."""
    hidden, weight, labels = inputs()
    bias = torch.randn(VOCAB, generator=torch.Generator().manual_seed(3)).requires_grad_()

    def unfused(h, w, y):
        logits = F.linear(h, w, bias).float()
        return F.cross_entropy(logits if softcap is None else softcap * torch.tanh(logits / softcap), y,
                               ignore_index=IGNORE_INDEX)

    softmax = losses.softmax_cross_entropy_chunk if compiled_softmax else None
    fused = lambda h, w, y: linear_cross_entropy(h, w, y, tokens_per_chunk, softmax, softcap, bias=bias)  # noqa: E731
    for name, got, want in zip(("loss", "grad hidden", "grad weight", "grad bias"),
                               (fused(hidden, weight, labels), *torch.autograd.grad(
                                   2.5 * fused(hidden, weight, labels), (hidden, weight, bias))),
                               (unfused(hidden, weight, labels), *torch.autograd.grad(
                                   2.5 * unfused(hidden, weight, labels), (hidden, weight, bias)))):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6 * want.abs().max().item(), msg=name)
    assert (linear_cross_entropy(hidden, weight, labels, bias=bias) - linear_cross_entropy(hidden, weight, labels)
            ).abs() > 1e-3  # the bias changes the loss


def test_leading_dimensions_are_flattened():
    hidden, weight, labels = inputs()
    loss = linear_cross_entropy(hidden[:36].reshape(4, 9, HIDDEN), weight, labels[:36].reshape(4, 9), 7)
    torch.testing.assert_close(loss, unfused_loss(hidden[:36], weight, labels[:36]), rtol=1e-6, atol=0)


def test_bf16_inputs_give_bf16_gradients_close_to_unfused():
    hidden, weight, labels = inputs(torch.bfloat16)
    expected = loss_and_grads(unfused_loss, hidden, weight, labels)
    fused = loss_and_grads(lambda *args: linear_cross_entropy(*args, 5), hidden, weight, labels)
    assert fused[0].dtype == torch.float32
    assert fused[1].dtype == fused[2].dtype == torch.bfloat16
    torch.testing.assert_close(fused[0], expected[0], rtol=1e-5, atol=0)  # same bf16 logits, fp32 after
    for got, want in zip(fused[1:], expected[1:]):
        torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=2e-2 * want.abs().max().item())


def test_all_labels_ignored_gives_nan_loss_and_zero_gradients_like_cross_entropy():
    hidden, weight, labels = inputs()
    labels.fill_(IGNORE_INDEX)
    expected = loss_and_grads(unfused_loss, hidden, weight, labels)
    fused = loss_and_grads(lambda *args: linear_cross_entropy(*args, 8), hidden, weight, labels)
    assert torch.isnan(expected[0]) and torch.isnan(fused[0])
    for got, want in zip(fused[1:], expected[1:]):
        assert torch.equal(got, want) and not got.any()


def test_no_grad_computes_the_loss_only(monkeypatch):
    hidden, weight, labels = inputs()
    expected = unfused_loss(hidden, weight, labels).detach()

    def fail(*args, **kwargs):
        raise AssertionError("gradients computed under no_grad")

    monkeypatch.setattr(losses, "softmax_minus_onehot", fail)
    with torch.no_grad():
        loss = linear_cross_entropy(hidden, weight, labels, 8)
    assert loss.grad_fn is None
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=0)
    frozen = linear_cross_entropy(hidden.detach(), weight.detach(), labels, 8)  # nothing requires grad
    assert frozen.grad_fn is None


def test_frozen_weight_gets_no_gradient():
    hidden, weight, labels = inputs()
    frozen = weight.detach()
    linear_cross_entropy(hidden, frozen, labels, 8).backward()
    expected, = torch.autograd.grad(unfused_loss(hidden, frozen, labels), hidden)
    assert frozen.grad is None
    torch.testing.assert_close(hidden.grad, expected, rtol=1e-6, atol=1e-6 * expected.abs().max().item())


def test_second_backward_with_retained_graph_accumulates_the_same_gradient():
    hidden, weight, labels = inputs()
    loss = linear_cross_entropy(hidden, weight, labels, 8)
    loss.backward(retain_graph=True)
    once = weight.grad.clone()
    loss.backward()
    torch.testing.assert_close(weight.grad, 2 * once)


def test_default_chunk_keeps_a_few_megabytes_of_logits_and_a_floor_of_tokens():
    assert losses.default_tokens_per_chunk(8192) * 8192 * 4 == 16 * 2 ** 20
    assert losses.default_tokens_per_chunk(2 ** 17) == losses.MIN_TOKENS_PER_CHUNK
    assert losses.default_tokens_per_chunk(8192, "cpu") == losses.default_tokens_per_chunk(8192)


def test_a_gpu_takes_few_big_chunks():
    """The 1B Llama shape of bench/gpu_throughput.py: 32768 tokens, vocabulary 32000. The CPU rule
    cuts it into 128 chunks; a GPU's into 8 even chunks of 4096 tokens (about 2^27 logits each)."""
    tokens, vocab = 32768, 32000
    cpu = losses.default_tokens_per_chunk(vocab, "cpu")
    assert -(-tokens // cpu) == 128
    gpu = losses.default_tokens_per_chunk(vocab, "cuda")
    assert gpu == 2 ** 27 // vocab == 4194
    assert losses.even_chunks(tokens, gpu) == 4096
    assert losses.default_tokens_per_chunk(2 ** 18, "cuda") == losses.ACCELERATOR_MIN_TOKENS_PER_CHUNK == 1024


@pytest.mark.parametrize("num_tokens, most, expected", [(32768, 4194, 4096), (10, 4, 4), (9, 4, 3), (8, 8, 8),
                                                        (7, 100, 7), (1, 1, 1), (0, 5, 1)])
def test_even_chunks_are_as_few_as_allowed_and_nearly_equal(num_tokens, most, expected):
    chunk = losses.even_chunks(num_tokens, most)
    assert chunk == expected and chunk <= most
    if num_tokens:
        chunks = -(-num_tokens // chunk)
        assert chunks == -(-num_tokens // most)  # no more chunks than the cap forces
        assert num_tokens - (chunks - 1) * chunk > 0  # the last chunk is not empty


def test_the_loss_chunks_by_the_tensors_device(monkeypatch):
    """linear_cross_entropy asks for the rule of the hidden states' device and evens the chunks."""
    asked = []
    real = losses.default_tokens_per_chunk

    def recording(vocab_size, device_type="cpu"):
        asked.append((vocab_size, device_type))
        return 4

    monkeypatch.setattr(losses, "default_tokens_per_chunk", recording)
    seen = []
    real_mm = torch.mm

    def recording_mm(a, b, **kwargs):
        seen.append(a.shape[0])
        return real_mm(a, b, **kwargs)

    hidden, weight, labels = inputs()
    monkeypatch.setattr(torch, "mm", recording_mm)
    linear_cross_entropy(hidden[:9], weight, labels[:9])  # at most 4 a chunk: 3 chunks of 3, not 4 + 4 + 1
    monkeypatch.setattr(torch, "mm", real_mm)
    assert asked == [(weight.shape[0], "cpu")] and real(weight.shape[0]) > 4
    assert seen == [3] * 6  # each chunk's logits and hidden-gradient matmuls


@pytest.mark.parametrize("tie_embeddings, output_bias", [(True, False), (False, False), (False, True)],
                         ids=["tied", "untied", "untied with a bias, divided logits"])
def test_language_model_fused_loss_and_grads_equal_the_logits_path(tie_embeddings, output_bias):
    config = ModelConfig(vocab_size=64, hidden_size=32, pattern="*-", num_attention_heads=4, num_kv_heads=2,
                         tie_embeddings=tie_embeddings, mtp_depth=1, mtp_loss_coeff=0.5, output_bias=output_bias,
                         logit_divisor=2.0 if output_bias else 1.0)
    torch.manual_seed(0)
    model = LanguageModel(config)
    if output_bias:
        with torch.no_grad():
            model.output.bias.normal_(0.0, 1.0)
    tokens = torch.randint(0, 64, (2, 12))
    labels = tokens.roll(-1, 1)
    labels[:, -1] = IGNORE_INDEX
    labels[0, :3] = IGNORE_INDEX

    def run(return_logits):
        model.zero_grad(set_to_none=True)
        output = model(tokens, labels, return_logits=return_logits)
        output.loss.backward()
        return output, {name: param.grad.clone() for name, param in model.named_parameters()}

    reference, reference_grads = run(return_logits=True)
    fused, fused_grads = run(return_logits=False)
    assert fused.logits is None and reference.logits is not None
    assert fused.losses.keys() == reference.losses.keys() == {"lm", "mtp_1", "mtp"}
    for name, value in reference.losses.items():
        torch.testing.assert_close(fused.losses[name], value, rtol=1e-6, atol=0, msg=name)
    assert fused_grads.keys() == reference_grads.keys()
    for name, grad in reference_grads.items():
        torch.testing.assert_close(fused_grads[name], grad, rtol=1e-5, atol=1e-6 * grad.abs().max().item(),
                                   msg=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("compiled", [False, True], ids=["plain", "compiled"])
def test_the_softmax_in_plain_ops_gives_the_eager_loss_and_gradients(dtype, compiled):
    """``softmax_cross_entropy_chunk`` (what train.compile hands the loss, compiled by Inductor) is
    the eager path's arithmetic: loss and both gradients equal to fp32 rounding, with ignored
    labels and uneven chunks (13 tokens in chunks of 5)."""
    hidden, weight, labels = inputs(dtype)
    labels[3] = labels[11] = IGNORE_INDEX
    softmax = losses.softmax_cross_entropy_chunk
    if compiled:
        torch._dynamo.reset()
        softmax = torch.compile(softmax, dynamic=False)
    expected = loss_and_grads(lambda h, w, y: linear_cross_entropy(h, w, y, tokens_per_chunk=5), hidden, weight, labels)
    actual = loss_and_grads(lambda h, w, y: linear_cross_entropy(h, w, y, tokens_per_chunk=5, chunk_softmax=softmax),
                            hidden, weight, labels)
    tolerance = {torch.float32: 1e-6, torch.bfloat16: 1e-2}[dtype]  # bf16: one rounding of the gradients
    for got, want in zip(actual, expected):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got.float(), want.float(), rtol=tolerance, atol=tolerance * want.abs().max().item())


def test_without_gradients_the_eager_kernels_compute_the_loss(monkeypatch):
    """Evaluation (no grad) never calls the training softmax: the loss alone comes from the eager kernels."""
    hidden, weight, labels = inputs()
    called = []
    with torch.no_grad():
        loss = linear_cross_entropy(hidden, weight, labels, chunk_softmax=lambda *args: called.append(1))
    assert not called
    torch.testing.assert_close(loss, unfused_loss(hidden, weight, labels))
