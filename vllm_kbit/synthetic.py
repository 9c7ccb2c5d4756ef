"""Random-init Hugging Face checkpoints (model + tokenizer) for tests, examples and benchmarks.

`make_random_model` writes a folder that `transformers`, vLLM and `vllm_kbit.convert` load like
a downloaded one: config.json, generation_config.json, safetensors weights (sharded with an
index json when `max_shard_size` is small), and a byte-level BPE tokenizer trained on the spot
(tokenizer.json + tokenizer_config.json, loadable as `PreTrainedTokenizerFast`). `arch` picks
one of ARCHITECTURES (Llama by default, `make_random_llama`): each stands for a way in which
checkpoints reach vLLM's linear layers differently.

Real shapes work too (Llama-3-8B: hidden 4096, intermediate 14336, 32 layers, 32 heads, 8 kv
heads, vocab 128256): the model is built on the meta device and each tensor is materialized
directly in `dtype`, so peak host memory is about one copy of the weights in `dtype`.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

# Bytes-level BPE needs the 256 byte tokens plus the specials before any merge.
_SPECIALS = ("<unk>", "<s>", "</s>")
MIN_VOCAB_SIZE = 256 + len(_SPECIALS)

_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# Training text for the tokenizer: enough variety for a few hundred merges.
_CORPUS = """\
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.
Language models predict the next token from the tokens that came before it. Quantization stores
each weight with fewer bits: a codebook of two to the k values, one scale per block of thirty-two
weights, and the index of the nearest codebook entry for every weight. The scale is written as an
eight-bit float with four exponent bits and four mantissa bits.
Once upon a time, in a small village by the sea, there lived an old fisherman and his wife.
Every morning he rowed out past the harbour wall, and every evening he came home with the tide.
def main():
    for i in range(10):
        print(f"step {i}: loss={1.0 / (i + 1):.3f}")
    return 0
Hello, world! How are you today? I am fine, thank you. What time is it? It is half past three.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 16 32 64 128 256 512 1024 2048 4096 8192 16384 32768 65536.
The capital of France is Paris. The capital of Japan is Tokyo. Water boils at one hundred degrees.
Matrix multiplication, attention, feed-forward layers, normalization, embeddings and softmax.
"""


def _train_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(_SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS.splitlines(), trainer)
    # Prepend BOS like the Llama tokenizers do.
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    return tok


# arch -> (transformers config class, model class, config overrides, what it exercises).
ARCHITECTURES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}, "separate q/k/v and gate/up shards merged by vLLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM", {}, "Llama's layers under another model class"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}, "q/k/v biases (the op's bias path)"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}, "q/k norms between the projections and attention"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {}, "GeGLU, logit soft-capping, tied embeddings"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}, "qkv_proj / gate_up_proj fused in the checkpoint"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2},
                "kbit MoE experts (w1 / w3 / w2) beside a float router"),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", {"num_experts": 4, "num_experts_per_tok": 2},
                  "kbit experts and a kbit shared expert beside float gates"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {"num_experts": 8, "num_experts_per_tok": 2},
                  "kbit experts; vLLM hands its router (`mlp.gate`) the quant_config, which keeps it float"),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    {"n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1, "n_group": 1,
                     "topk_group": 1, "first_k_dense_replace": 1, "q_lora_rank": 64, "kv_lora_rank": 512,
                     "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "rope_scaling": None},
                    "MLA attention, a dense first layer, kbit routed and shared experts, float router"),
}
# MoE architectures: their experts' intermediate size is intermediate_size / 2 (Mixtral's:
# intermediate_size); keep it a multiple of 64 for the kbit MoE kernels' tiles.
MOE_ARCHITECTURES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3")


def make_random_llama(dst, **kwargs) -> Path:
    """`make_random_model(dst, arch="llama", ...)`."""
    return make_random_model(dst, arch="llama", **kwargs)


def make_random_model(dst, *, arch: str = "llama", hidden_size: int = 256, intermediate_size: int = 512,
                      num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2,
                      vocab_size: int = 512, max_position_embeddings: int = 2048,
                      dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                      max_shard_size: int | str = "5GB", tie_word_embeddings: bool | None = None,
                      init_std: float = 0.02) -> Path:
    """Write a random-init checkpoint of architecture `arch` (ARCHITECTURES) with a matching
    tokenizer to `dst`.

    Weights and biases ~ N(0, init_std) (norm weights 1: Gemma 2's norms scale by 1 + weight, so
    its four norms a layer and the final one each double), deterministic in `seed`. Every
    architecture gets head_dim = hidden_size / num_heads (DeepSeek-V3: MLA with DeepSeek-V3's head
    dims, which vLLM's MLA kernels require);
    the MoE ones (MOE_ARCHITECTURES) 4 experts (Qwen3-MoE 8) of intermediate_size / 2 (Mixtral's
    of intermediate_size), Qwen2-MoE beside a shared expert of intermediate_size, DeepSeek-V3
    beside one shared expert and after a dense first layer. `tie_word_embeddings`
    None keeps the architecture's default (Gemma 2 ties, the others do not). The tokenizer is
    trained with at most `vocab_size` tokens (fewer when the built-in text runs out of merges);
    its <s>/</s> ids are the model's bos/eos (and pad). Returns `dst` as a Path."""
    import transformers
    from transformers import GenerationConfig, PreTrainedTokenizerFast

    if arch not in ARCHITECTURES:
        raise ValueError(f"arch must be one of {sorted(ARCHITECTURES)}, got {arch!r}")
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be at least {MIN_VOCAB_SIZE} (byte-level tokenizer), got {vocab_size}")
    if hidden_size % num_heads:
        raise ValueError(f"hidden_size {hidden_size} is not a multiple of num_heads {num_heads}")
    config_name, model_name, overrides, _ = ARCHITECTURES[arch]
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)

    tok = _train_tokenizer(vocab_size)
    bos, eos = tok.token_to_id("<s>"), tok.token_to_id("</s>")
    extra = dict(overrides)
    if arch == "qwen2_moe":
        extra.update(moe_intermediate_size=intermediate_size // 2,
                     shared_expert_intermediate_size=intermediate_size)
    if arch in ("qwen3_moe", "deepseek_v3"):
        extra.update(moe_intermediate_size=intermediate_size // 2)
    if arch == "deepseek_v3":  # MLA: every head has its own keys; the rotary part sets head_dim
        extra.update(num_key_value_heads=num_heads, head_dim=extra["qk_rope_head_dim"])
    if arch == "phi3":  # (its default, 4096, asks for long-rope scaling past max_position_embeddings)
        extra.update(original_max_position_embeddings=max_position_embeddings)
    if tie_word_embeddings is not None:
        extra.update(tie_word_embeddings=tie_word_embeddings)
    config = getattr(transformers, config_name)(**{
        **dict(hidden_size=hidden_size, intermediate_size=intermediate_size, num_hidden_layers=num_layers,
               num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, head_dim=hidden_size // num_heads,
               vocab_size=vocab_size, max_position_embeddings=max_position_embeddings,
               bos_token_id=bos, eos_token_id=eos, pad_token_id=eos, initializer_range=init_std, dtype=dtype),
        **extra})
    model_cls = getattr(transformers, model_name)

    # Meta first, then one allocation per tensor in `dtype`: no float32 copy of an 8B model.
    with torch.device("meta"):
        model = model_cls(config)
    model = model.to(dtype).to_empty(device="cpu")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():  # tied weights are listed once
            if "norm" in name and p.dim() == 1:
                p.fill_(1.0)
            else:  # weights, and biases (Qwen2's q/k/v): random, so that a dropped bias shows
                p.normal_(0.0, init_std, generator=gen)
    # to_empty left the non-persistent buffers uninitialised. They are not saved, so only the
    # folder matters; the rotary tables are rebuilt anyway, the one such buffer every
    # architecture here has (Gemma 2's embedding scale is another: no model is returned).
    model.model.rotary_emb = type(model.model.rotary_emb)(config=config)
    if config.tie_word_embeddings:
        model.tie_weights()
    model.generation_config = GenerationConfig(bos_token_id=bos, eos_token_id=eos, do_sample=False)
    model.save_pretrained(dst, max_shard_size=max_shard_size)
    del model

    PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        model_max_length=max_position_embeddings, chat_template=_CHAT_TEMPLATE,
    ).save_pretrained(dst)
    # transformers 5 writes its own class name ("TokenizersBackend"); the portable name loads
    # with transformers 4.x as well as 5.x.
    tc_path = dst / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text())
    tc["tokenizer_class"] = "PreTrainedTokenizerFast"
    tc_path.write_text(json.dumps(tc, indent=2) + "\n")
    return dst
