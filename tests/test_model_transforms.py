"""What researchers do to a loaded model before decoding or fine-tuning it: wrap it in PEFT adapters, enable
activation checkpointing, quantize it, save it in shards. Each must decode (and train) as the untransformed model
where the transform is exact, and run where it is not.

PEFT is not a dependency: its tests skip without it; what it needed from our classes is tested without it too.
"""

from __future__ import annotations

import re

import pytest
import torch
from conftest import EOS_ID, MASK_ID, make_tiny_dream, make_tiny_llada

import hf_blockbatch as hb

FAMILIES = ["llada", "dream"]
#: each model family's attention projections, as the official checkpoints name them (LoRA's usual targets)
ATTENTION = {"llada": ["q_proj", "k_proj", "v_proj", "attn_out"], "dream": ["q_proj", "k_proj", "v_proj", "o_proj"]}


def _model(family: str) -> torch.nn.Module:
    return make_tiny_llada() if family == "llada" else make_tiny_dream()


def _prompts() -> dict[str, torch.Tensor]:
    """Two prompts, the second left-padded."""
    ids = torch.tensor([[5, 6, 7, 8, 9, 10], [EOS_ID, EOS_ID, 11, 12, 13, 14]])
    return {"input_ids": ids, "attention_mask": (torch.arange(6) >= torch.tensor([[0], [2]])).long()}


CONFIGS = {
    "vanilla": lambda: hb.VanillaDiffusionConfig(max_new_tokens=16, steps=16, block_length=8, mask_token_id=MASK_ID),
    "fast_dllm": lambda: hb.FastDLLMConfig(max_new_tokens=16, block_length=8, threshold=0.5, mask_token_id=MASK_ID),
    "blockbatch": lambda: hb.BlockBatchConfig(max_new_tokens=16, mask_token_id=MASK_ID),
    "drafted": lambda: hb.FastDLLMConfig.drafted(max_new_tokens=16, block_length=16, threshold=0.5,
                                                 mask_token_id=MASK_ID),  # fmt: skip
}


def _decode(model: torch.nn.Module, name: str) -> torch.Tensor:
    return model.generate(**_prompts(), generation_config=CONFIGS[name]())


@pytest.mark.parametrize("family", FAMILIES)
def test_prepare_inputs_for_generation_exists_for_wrappers_and_refuses_a_call(family: str) -> None:
    """PEFT's causal-LM wrapper reads ``prepare_inputs_for_generation`` when it wraps a model: our classes lacked it
    (``AttributeError`` inside ``get_peft_model``). It exists, and a call says what to call instead."""
    model = _model(family)
    with pytest.raises(NotImplementedError, match="masked diffusion: generate\\(\\) builds its canvas"):
        model.prepare_inputs_for_generation(torch.tensor([[5, 6]]))


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_refuses_a_model_whose_step_inputs_a_wrapper_replaced(family: str) -> None:
    """PEFT's prompt-learning adapters (prompt tuning, prefix tuning) replace ``prepare_inputs_for_generation`` on
    the model itself, to add their virtual tokens at each left-to-right step: this decode never calls it, and gave
    the base model's tokens, the adapter ignored. Refused; with the replacement deleted, the base model decodes."""
    model = _model(family)
    ref = _decode(model, "fast_dllm")
    model.prepare_inputs_for_generation = lambda *args, **kwargs: {}
    for name in CONFIGS:
        with pytest.raises(NotImplementedError, match="prepare_inputs_for_generation was replaced on this model"):
            _decode(model, name)
    del model.prepare_inputs_for_generation
    assert torch.equal(_decode(model, "fast_dllm"), ref)


@pytest.mark.parametrize("family", FAMILIES)
def test_peft_prompt_tuning_is_refused_not_ignored(family: str) -> None:
    """With peft: a prompt-tuning adapter's generate is refused (it decoded the base model's tokens)."""
    peft = pytest.importorskip("peft")
    model = _model(family)
    geometry = {"num_attention_heads": 4, "num_layers": 2, "token_dim": 64, "num_transformer_submodules": 1}
    tuned = peft.get_peft_model(model, peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4, **geometry))
    with pytest.raises(NotImplementedError, match="PEFT's prompt tuning, prefix tuning and P-tuning do so"):
        _decode(tuned, "fast_dllm")


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("task_type", [None, "CAUSAL_LM"])
def test_peft_lora_decodes_trains_and_merges(family: str, task_type: str | None) -> None:
    """LoRA on the attention projections: with B at its zero init every decoder gives the base model's tokens; one
    step of the SFT objective trains the adapters only; the merged model decodes as the adapted one."""
    peft = pytest.importorskip("peft")
    from hf_blockbatch.training.objective import apply_noise, sft_loss

    model = _model(family)
    ref = {name: _decode(model, name) for name in CONFIGS}
    kwargs = {"task_type": task_type} if task_type else {}
    torch.manual_seed(1)
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=ATTENTION[family],
                                                      lora_dropout=0.0, **kwargs))  # fmt: skip
    for name in CONFIGS:
        assert torch.equal(_decode(lora, name), ref[name]), name
    lora.train()
    ids = torch.randint(0, 90, (2, 12), generator=torch.Generator().manual_seed(0))
    is_prompt = torch.arange(12).expand(2, 12) < 4
    noisy, masked = apply_noise(ids, is_prompt, MASK_ID, torch.Generator().manual_seed(0))
    loss = sft_loss(lora(noisy).logits, ids, masked, lora.logit_shift)
    loss.backward()
    torch.optim.SGD([p for p in lora.parameters() if p.requires_grad], lr=1.0).step()
    trained = {n for n, p in lora.named_parameters() if p.grad is not None}
    assert trained and all("lora_" in n for n in trained)
    lora.eval()
    adapted = _decode(lora, "fast_dllm")
    merged = lora.merge_and_unload()
    assert type(merged) is type(model)
    assert torch.equal(_decode(merged, "fast_dllm"), adapted)


def _sft_grads(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], int]:
    """One SFT-objective backward on a fixed noised batch: every parameter's gradient, and the bytes autograd saved
    for the backward."""
    from hf_blockbatch.training.objective import apply_noise, sft_loss

    ids = torch.randint(0, 90, (2, 24), generator=torch.Generator().manual_seed(0))
    is_prompt = torch.arange(24).expand(2, 24) < 8
    noisy, masked = apply_noise(ids, is_prompt, MASK_ID, torch.Generator().manual_seed(0))
    saved = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = sft_loss(model(noisy).logits, ids, masked, model.logit_shift)
    loss.backward()
    return {n: p.grad for n, p in model.named_parameters()}, saved[0]


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing_.*` is deprecated:FutureWarning")  # what users still write
@pytest.mark.parametrize("family", FAMILIES)
def test_gradient_checkpointing_recomputes_layers_with_the_same_gradients(family: str) -> None:
    """transformers' ``gradient_checkpointing_enable()`` (``activation_checkpointing_enable``) was refused ("does not
    support activation checkpointing"), though both official codes checkpoint their blocks: fine-tuning an 8B model
    kept every layer's activations. It now checkpoints each layer in training mode: the gradients are bitwise those
    of the plain backward, with far less saved for it; ``every_n_layers`` picks layers; decoding (eval or training
    mode) gives the same tokens, enabled and after ``gradient_checkpointing_disable()``."""
    ref = {name: _decode(_model(family), name) for name in CONFIGS}
    plain_grads, plain_saved = _sft_grads(_model(family).train())
    model = _model(family)
    model.gradient_checkpointing_enable()
    assert all(layer.gradient_checkpointing for layer in model._decoder_layers())
    grads, saved = _sft_grads(model.train())
    assert all(torch.equal(grads[n], plain_grads[n]) for n in plain_grads)
    assert saved < plain_saved / 2
    for name in CONFIGS:  # generate() runs without gradients: no recompute, in training mode too
        assert torch.equal(_decode(model, name), ref[name]), name
    model.eval()
    assert torch.equal(_decode(model, "drafted"), ref["drafted"])
    model.gradient_checkpointing_disable()
    assert not any(layer.gradient_checkpointing for layer in model._decoder_layers())
    assert torch.equal(_decode(model, "fast_dllm"), ref["fast_dllm"])
    every_other = _model(family)
    every_other.activation_checkpointing_enable(every_n_layers=2)
    assert [layer.gradient_checkpointing for layer in every_other._decoder_layers()] == [True, False]
    grads, _ = _sft_grads(every_other.train())
    assert all(torch.equal(grads[n], plain_grads[n]) for n in plain_grads)


@pytest.mark.parametrize("family", FAMILIES)
def test_peft_lora_trains_under_gradient_checkpointing(family: str) -> None:
    """PEFT on a model with checkpointing on (PEFT then makes the embeddings' output require gradients, so that the
    frozen layers' recompute reaches the adapters): the adapters get gradients, and decoding is unchanged."""
    peft = pytest.importorskip("peft")
    model = _model(family)
    ref = _decode(model, "drafted")
    model.activation_checkpointing_enable()
    torch.manual_seed(1)
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=ATTENTION[family], task_type="CAUSAL_LM"))
    grads, _ = _sft_grads(lora.train())
    assert any(g is not None and bool(g.ne(0).any()) for n, g in grads.items() if "lora_B" in n)
    assert torch.equal(_decode(lora, "drafted"), ref)


def _quantized(model: torch.nn.Module, embedding: bool) -> torch.nn.Module:
    """``quantize_dynamic`` to int8: the Linear layers, and with ``embedding`` the embedding table too (torch has
    deprecated ``torch.ao.quantization`` for torchao: skipped once it is gone)."""
    quantization = pytest.importorskip("torch.ao.quantization")
    spec = {torch.nn.Linear: quantization.default_dynamic_qconfig}
    if embedding:
        spec[torch.nn.Embedding] = quantization.float_qparams_weight_only_qconfig
    return quantization.quantize_dynamic(model, spec)


#: torch.ao.quantization's deprecation notices, which say nothing about our code
QUANTIZATION_WARNINGS = pytest.mark.filterwarnings("ignore:torch.ao.quantization is deprecated:DeprecationWarning",
                                                   "ignore:torch.quantize_per_tensor:UserWarning")


@QUANTIZATION_WARNINGS
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("embedding", [False, True])
def test_dynamically_quantized_models_decode(family: str, embedding: bool) -> None:
    """CPU dynamic quantization (int8 Linear layers, and the embedding too) runs every decoder family: the layers
    call their modules, never read a Linear's weight. Not exact, so: it decodes, with the prompt kept."""
    model = _quantized(_model(family), embedding)
    assert isinstance(model._decoder_layers()[0].mlp.down_proj if family == "dream" else model._decoder_layers()[0].ff_out,
                      torch.ao.nn.quantized.dynamic.Linear)  # fmt: skip
    for name in CONFIGS:
        out = _decode(model, name)
        assert out.shape == (2, 22) and torch.equal(out[:, :6], _prompts()["input_ids"]), name


@QUANTIZATION_WARNINGS
def test_bench_runs_a_model_with_a_quantized_embedding(tmp_path) -> None:
    """``run_bench(settings, model, tokenizer)`` on a model whose embedding is quantized failed before decoding with
    ``AttributeError: 'function' object has no attribute 'device'``: the runner read the embedding's ``weight`` as a
    tensor to place the prompts, and a quantized embedding's is a method. The prompts now go where the model computes."""
    from hf_blockbatch.eval.runner import BenchSettings, ShardInfo, run_bench

    model, tok = hb.load_model("tiny-llada")
    settings = BenchSettings(model="tiny-llada", tasks=["arith"], limit=2, batch_size=2, gen_length=16, progress=False,
                             plots=False, methods=["fast_dllm"], output_dir=str(tmp_path))  # fmt: skip
    summary = run_bench(settings, _quantized(model, embedding=True), tok, shard=ShardInfo())
    assert summary["tasks"]["arith"]["methods"]["fast_dllm"]["n"] == 2


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("keep", [[0, 1, 1], [1]], ids=["duplicated", "pruned"])
def test_layer_surgery_is_refused_until_the_layers_are_renumbered(family: str, keep: list[int], tmp_path) -> None:
    """Duplicating layers (depth up-scaling) or removing some (pruning), config updated: each layer still wrote the
    cache slot of its old index. Duplicated layers shared a slot, and every cached decoder gave tokens other than
    the same model's saved and reloaded (vanilla, uncached, was right); a pruned model failed with IndexError in
    the cache. A cached decode now says how to renumber, and once renumbered decodes as the reloaded model."""
    import copy

    model = _model(family)
    layers = torch.nn.ModuleList(copy.deepcopy(model._decoder_layers()[i]) for i in keep)
    if family == "llada":
        model.model.transformer.blocks = layers
        model.config.n_layers = len(keep)
    else:
        model.model.layers = layers
        model.config.num_hidden_layers = len(keep)
    model.save_pretrained(tmp_path)  # loading builds the layers afresh, numbered by position: the reference
    reloaded = type(model).from_pretrained(tmp_path).eval()
    assert torch.equal(_decode(model, "vanilla"), _decode(reloaded, "vanilla"))  # uncached: no slots
    attr = "self_attn.layer_idx" if family == "dream" else "layer_idx"
    for name in ("fast_dllm", "blockbatch", "drafted"):
        with pytest.raises(ValueError, match=f"set layer.{re.escape(attr)} = i for each i, layer in enumerate"):
            _decode(model, name)
    for i, layer in enumerate(layers):
        (layer.self_attn if family == "dream" else layer).layer_idx = i
    for name in CONFIGS:
        assert torch.equal(_decode(model, name), _decode(reloaded, name)), name


class _Wrapped(torch.nn.Module):
    """A model wrapped as PEFT's ``PeftModel`` wraps one: attributes delegated, and a ``generate`` of its own that
    calls the inner model's."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.inner, name)

    def generate(self, *args, **kwargs):
        return self.inner.generate(*args, **kwargs)


@pytest.mark.parametrize("wrap", ["module", "peft"])
def test_pipeline_of_a_wrapped_model_returns_the_answer(wrap: str) -> None:
    """transformers' text-generation pipeline returns the text up to the end token (generate pads after it when a
    pipeline calls). It read the direct caller of generate, which for a wrapped model (PEFT's LoRA) is the
    wrapper's own generate: the pipeline returned the canvas past the end ("He4, so 2 * 2 = 12.\\n#### 12" after
    the answer on this item)."""
    from transformers import pipeline

    from hf_blockbatch.tasks import get_suite

    model, tok = hb.load_model("tiny-llada")
    if wrap == "peft":
        peft = pytest.importorskip("peft")
        wrapped = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=ATTENTION["llada"]))
    else:
        wrapped = _Wrapped(model)
    question = get_suite("arith").items("test", 17)[16].question
    chat = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False)
    ids = tok(chat, add_special_tokens=False, return_tensors="pt").input_ids
    cfg = hb.FastDLLMConfig(max_new_tokens=64, block_length=32)
    canvas = model.generate(ids, generation_config=cfg)[:, ids.shape[1] :]
    answer = hb.answer_texts(tok, canvas, hb.end_token_ids(tok, model.config))[0]
    assert answer != tok.decode(canvas[0], skip_special_tokens=True)  # text past the end: what the pipeline must drop
    pipe = pipeline("text-generation", model=wrapped, tokenizer=tok)
    got = pipe(chat, generation_config=cfg, return_full_text=False, add_special_tokens=False)[0]["generated_text"]
    assert got == answer


@pytest.mark.parametrize("family", FAMILIES)
def test_checkpointing_refuses_cached_forwards_with_gradients_in_training(family: str) -> None:
    """Under checkpointing a layer reruns in backward: a cached forward's rerun wrote its (by then stale) K/V over
    the cache's later ones, and a window forward's attended to what the cache held by then, so its gradients were
    silently wrong where, without checkpointing, autograd refuses the in-place change. Such forwards are refused in
    training mode with gradients on; without gradients, or in eval mode, they run."""
    model = _model(family)
    model.activation_checkpointing_enable()
    model.train()
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])
    with pytest.raises(ValueError, match="Activation checkpointing is on and this forward writes or reads a cache"):
        model(ids, use_cache=True)
    cache = model.new_cache(1, 8)
    with torch.no_grad():
        model(ids, cache=cache)
    with pytest.raises(ValueError, match="Activation checkpointing is on"):
        model.forward_windows(ids, [4], [8], cache)
    with torch.no_grad():
        model.forward_windows(ids, [4], [8], cache)
    model(ids).logits.sum().backward()  # training without a cache: checkpointed
    model.eval()
    assert model.forward_windows(ids, [4], [8], cache).logits.requires_grad  # eval: nothing reruns, so it runs


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("adapter", ["dora", "ia3"])
def test_peft_dora_and_ia3_decode_and_merge(family: str, adapter: str) -> None:
    """The other adapters that act in the layers: at their identity init every decoder gives the base model's
    tokens; at a random one the merged model decodes as the adapted one."""
    peft = pytest.importorskip("peft")
    mlp_out = "ff_out" if family == "llada" else "down_proj"

    def config(identity: bool):
        if adapter == "dora":
            return peft.LoraConfig(r=4, target_modules=ATTENTION[family], use_dora=True, init_lora_weights=identity)
        return peft.IA3Config(target_modules=["k_proj", "v_proj", mlp_out], feedforward_modules=[mlp_out],
                              init_ia3_weights=identity)  # fmt: skip

    model = _model(family)
    ref = {name: _decode(model, name) for name in CONFIGS}
    torch.manual_seed(1)
    same = peft.get_peft_model(_model(family), config(identity=True))
    for name in CONFIGS:
        assert torch.equal(_decode(same, name), ref[name]), name
    torch.manual_seed(1)
    adapted = peft.get_peft_model(_model(family), config(identity=False))
    with torch.no_grad():  # IA3's random init is ones plus noise: scale it up so that the tokens change
        for n, p in adapted.named_parameters():
            if "ia3_l" in n:
                p.mul_(3)
    tokens = _decode(adapted, "drafted")
    assert not torch.equal(tokens, ref["drafted"])
    assert torch.equal(_decode(adapted.merge_and_unload(), "drafted"), tokens)


def test_sharded_checkpoint_loads_to_the_same_tokens(tmp_path) -> None:
    """``save_pretrained(d, max_shard_size=...)`` in many shards: AutoModel and our class load it, and decode as the
    saved model."""
    from transformers import AutoModel

    model = make_tiny_llada()
    model.save_pretrained(tmp_path, max_shard_size="40KB")
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 3
    ref = {name: _decode(model, name) for name in ("fast_dllm", "drafted")}
    for loaded in (AutoModel.from_pretrained(tmp_path).eval(), hb.LLaDAModelLM.from_pretrained(tmp_path).eval()):
        for name, tokens in ref.items():
            assert torch.equal(_decode(loaded, name), tokens), name


@pytest.mark.parametrize("family", FAMILIES)
def test_a_transformers_cache_with_a_prefix_mask_is_refused_for_the_cache(family: str) -> None:
    """PEFT's prefix tuning calls the forward with ``past_key_values`` (a transformers ``DynamicCache`` holding the
    prefix) and an ``attention_mask`` widened by the prefix: the refusal named the mask's shape ("expected (1, 4)"),
    not the cache that this forward cannot take."""
    from transformers import DynamicCache

    model = _model(family)
    ids = torch.tensor([[5, 6, 7, 8]])
    with pytest.raises(TypeError, match=r"must be a hf_blockbatch.BranchCache .* got DynamicCache: a left-to-right"):
        model(ids, attention_mask=torch.ones(1, 6, dtype=torch.long), past_key_values=DynamicCache())
