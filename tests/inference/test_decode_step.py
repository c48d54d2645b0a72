"""The decode step generation can compile: the same logits as the model's cached forward, one graph."""

import pytest
import torch

from meshlm.inference.decode_step import DecodeStep
from meshlm.inference.generate import left_pad
from meshlm.inference.prefill import prefill
from meshlm.models.cache import InferenceCache
from tests.inference.test_generate import PROMPTS, tiny_model


def prefilled(model, prompts, extra_tokens=8):
    input_ids, token_mask = left_pad(prompts, 0, torch.device("cpu"))
    cache = InferenceCache(max_tokens=input_ids.shape[1] + extra_tokens)
    prefill(model, input_ids, token_mask, cache)
    return cache


@pytest.mark.parametrize("pattern", ["M*-M-", "*-*-", "M0L-"])
@pytest.mark.parametrize("prompts", [PROMPTS[:1], PROMPTS], ids=["one", "left_padded"])
@torch.inference_mode()
def test_eager_step_equals_the_cached_forward(pattern, prompts):
    model = tiny_model(pattern)
    step, cache, reference = DecodeStep(model), prefilled(model, prompts), prefilled(model, prompts)
    assert step.supports(cache)
    tokens = torch.arange(len(prompts)) + 3
    for _ in range(4):
        logits = step(tokens, cache)
        expected = model(tokens[:, None], cache=reference).logits[:, -1]
        torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
        tokens = logits.argmax(-1)
    assert cache.num_seen_tokens == reference.num_seen_tokens


@torch.inference_mode()
def test_other_models_and_caches_take_the_ordinary_forward():
    moe = tiny_model("*E*-")
    assert not DecodeStep(moe).supports(prefilled(moe, PROMPTS[:1]))
    hybrid = tiny_model("M*-M-")
    cache = prefilled(hybrid, PROMPTS[:1])
    assert not DecodeStep(hybrid).supports(InferenceCache())  # nothing prefilled
    cache.enable_rollback(2)  # speculative decoding's cache
    assert not DecodeStep(hybrid).supports(cache)


@torch.inference_mode()
def test_compiled_step_is_one_graph_for_every_context_length():
    torch._dynamo.reset()
    model = tiny_model("M*-")
    step, cache, reference = DecodeStep(model, compile=True, backend="aot_eager"), *(
        prefilled(model, PROMPTS[:2]) for _ in range(2))
    tokens = torch.tensor([3, 4])
    torch.testing.assert_close(step(tokens, cache), model(tokens[:, None], cache=reference).logits[:, -1])
    with torch.compiler.set_stance("fail_on_recompile"):  # the cache grows, the graph stays
        for _ in range(3):
            torch.testing.assert_close(step(tokens, cache), model(tokens[:, None], cache=reference).logits[:, -1])
    assert step.compiled and step.compile_seconds > 0


@torch.inference_mode()
def test_a_backend_that_cannot_compile_leaves_the_step_eager_and_says_why():
    def failing_backend(graph_module, example_inputs):
        raise RuntimeError("no C++ compiler")

    torch._dynamo.reset()
    model, messages = tiny_model("M*-"), []
    step = DecodeStep(model, compile=True, backend=failing_backend, report=messages.append)
    cache, reference = prefilled(model, PROMPTS[:1]), prefilled(model, PROMPTS[:1])
    tokens = torch.tensor([3])
    torch.testing.assert_close(step(tokens, cache), model(tokens[:, None], cache=reference).logits[:, -1])
    assert not step.compiled and len(messages) == 1 and "decoding eagerly" in messages[0]


@torch.inference_mode()
def test_gemma_style_blocks_step_like_the_cached_forward():
    """Output norms after each mixer, GeGLU, scaled embeddings, sliding windows with their own RoPE
    base: the decode step runs the same block as the model's forward."""
    from meshlm.models.config import ModelConfig
    from meshlm.models.language_model import LanguageModel

    torch.manual_seed(0)
    model = LanguageModel(ModelConfig(vocab_size=97, hidden_size=32, pattern="*-*-", num_attention_heads=4,
                                      num_kv_heads=2, init_std=0.1, mlp_activation="geglu", qk_norm=True,
                                      block_output_norm=True, norm_zero_centered=True, embedding_multiplier=32 ** 0.5,
                                      sliding_window=3, sliding_window_pattern="SF", rope_local_theta=100.0)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(0.0, 0.1)
    step, cache, reference = DecodeStep(model), prefilled(model, PROMPTS), prefilled(model, PROMPTS)
    assert step.supports(cache)
    tokens = torch.arange(len(PROMPTS)) + 3
    for _ in range(4):
        logits = step(tokens, cache)
        torch.testing.assert_close(logits, model(tokens[:, None], cache=reference).logits[:, -1], rtol=1e-5, atol=1e-5)
        tokens = logits.argmax(-1)


@torch.inference_mode()
def test_compiled_step_keeps_one_graph_while_sliding_windows_drop_keys():
    """A sliding block's cache drops old keys in place between steps (its buffers shrink once, at
    the first step after a long prompt): the compiled step still needs one graph, and the logits
    stay the cached forward's."""
    from meshlm.models.config import ModelConfig
    from meshlm.models.language_model import LanguageModel

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = LanguageModel(ModelConfig(vocab_size=97, hidden_size=32, pattern="*-*-", num_attention_heads=4,
                                      num_kv_heads=2, init_std=0.1, sliding_window=3,
                                      sliding_window_pattern="SF")).eval()
    step = DecodeStep(model, compile=True, backend="aot_eager")
    cache, reference = (prefilled(model, PROMPTS[:2], extra_tokens=12) for _ in range(2))
    tokens = torch.tensor([3, 4])
    torch.testing.assert_close(step(tokens, cache), model(tokens[:, None], cache=reference).logits[:, -1])
    sliding = cache.layers[0]
    with torch.compiler.set_stance("fail_on_recompile"):
        for _ in range(10):
            torch.testing.assert_close(step(tokens, cache), model(tokens[:, None], cache=reference).logits[:, -1])
    assert sliding.window == 3 and sliding.start > 0 and sliding.key_buffer.shape[2] <= 4 * 2 + 2  # make_room's bound
    assert cache.layers[2].window is None and cache.layers[2].start == 0
