"""Tiny random checkpoints written through `transformers` (`save_pretrained`, sharded safetensors,
published key layout) plus a small byte-level BPE tokenizer, so tests and the demo need no download.

`--mtp` appends one NextN layer as DeepSeek/GLM publish it: `model.layers.{num_hidden_layers}.`
`{enorm,hnorm,eh_proj,shared_head.norm,shared_head.head,embed_tokens,self_attn.*,mlp.*,...}`.
"""

from __future__ import annotations

import json
import os

import torch

ARCHES = (
    "deepseek_v3",
    "deepseek_v2",
    "glm4_moe",
    "deepseek_v32",
    "glm_moe_dsa",
    "glm_moe_dsa_full",
)
# DeepSeek-V3's and the sparse models' latent attention and routing, tiny
MLA = dict(
    num_key_value_heads=4,
    kv_lora_rank=32,
    q_lora_rank=48,
    qk_rope_head_dim=16,
    qk_nope_head_dim=16,
    v_head_dim=24,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
)
# sparse attention (DSA): a top-k well below the tests' prompts, and enough indexer heads that
# no two context positions tie on the indexer's score (ReLU zeroes every head's term with
# probability 2^-heads), which would leave the selection to the top-k's tie order
DSA = dict(index_topk=6, index_head_dim=32, index_n_heads=16)
SPECIAL_TOKENS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|pad|>",
]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
CORPUS = """The quick brown fox jumps over the lazy dog. A serving engine splits prefill and decode.
Prefill computes the key value cache of the prompt; decode generates one token at a time.
Pages of sixteen tokens hold the cache, and a page table maps each request to its pages.
Mixture of experts layers route every token to a few experts chosen by a small router.
Latent attention stores one compressed vector per token instead of keys and values per head.
Speculative decoding drafts several tokens and verifies them with one pass of the target model.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000. Punctuation: , . ; : ! ? ( ) [ ] { } " ' - + = / *
Hello world! How are you today? Tell me a story about a robot who learns to paint.
Once upon a time there was a small model that wanted to be exactly like its reference.
"""


def train_tokenizer(vocab_size: int, corpus: str = CORPUS):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([corpus] * 4, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|begin_of_text|>",
        eos_token="<|end_of_text|>",
        pad_token="<|pad|>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=4096,
    )


def _hf_config(arch: str, vocab_size: int, bos: int, eos: int, num_layers: int):
    import transformers as tf

    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
        max_position_embeddings=1024,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=None,
        initializer_range=0.1,
        tie_word_embeddings=False,
    )
    if arch == "deepseek_v3":
        return tf.DeepseekV3Config(
            **common,
            **MLA,
            n_group=4,
            topk_group=2,
            num_nextn_predict_layers=0,
            rope_scaling={
                "type": "yarn",
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 256,
                "beta_fast": 32,
                "beta_slow": 1,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
            },
        )
    if arch in ("deepseek_v32", "glm_moe_dsa", "glm_moe_dsa_full"):
        return _dsa_config(arch, common)
    if arch == "deepseek_v2":
        return tf.DeepseekV2Config(
            **common,
            num_key_value_heads=4,
            kv_lora_rank=32,
            q_lora_rank=None,
            qk_rope_head_dim=16,
            qk_nope_head_dim=16,
            v_head_dim=24,
            n_group=4,
            topk_group=2,
            topk_method="group_limited_greedy",
            routed_scaling_factor=1.5,
        )
    if arch == "glm4_moe":
        return tf.Glm4MoeConfig(
            **common,
            num_key_value_heads=2,
            head_dim=32,
            attention_bias=True,
            use_qk_norm=True,
            partial_rotary_factor=0.5,
            n_group=2,
            topk_group=1,
            norm_topk_prob=True,
            routed_scaling_factor=2.0,
            num_nextn_predict_layers=0,
        )
    raise ValueError(f"unknown tiny architecture {arch!r}; choose from {', '.join(ARCHES)}")


def _dsa_config(arch: str, common: dict):
    """DeepSeek-V3.2 (yarn RoPE, every layer indexed) or GLM-5 (its layers "full" or, in
    `glm_moe_dsa`, the middle one "shared": it reuses the first layer's selection)."""
    import transformers as tf

    mla = dict(MLA, **DSA)
    if arch == "deepseek_v32":
        rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}
        rope.update(rope_theta=10000.0, beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0)
        return tf.DeepseekV32Config(**common, **mla, n_group=4, topk_group=2, rope_parameters=rope)
    n = common["num_hidden_layers"]
    types = ["full"] * n
    if arch == "glm_moe_dsa":
        types = ["full" if i % 2 == 0 else "shared" for i in range(n)]
    return tf.GlmMoeDsaConfig(**common, **mla, n_group=2, topk_group=1, indexer_types=types)


def _model_class(arch: str):
    import transformers as tf

    return {
        "deepseek_v3": tf.DeepseekV3ForCausalLM,
        "deepseek_v2": tf.DeepseekV2ForCausalLM,
        "glm4_moe": tf.Glm4MoeForCausalLM,
        "deepseek_v32": tf.DeepseekV32ForCausalLM,
        "glm_moe_dsa": tf.GlmMoeDsaForCausalLM,
        "glm_moe_dsa_full": tf.GlmMoeDsaForCausalLM,
    }[arch]


def make_tiny(
    arch: str,
    out: str,
    mtp: bool = False,
    seed: int = 0,
    vocab_size: int = 512,
    num_layers: int = 3,
    fp8: str | None = None,
    fp8_block: tuple[int, int] = (32, 32),
    chat_format: str | None = None,
) -> str:
    """Write a tiny random checkpoint of `arch` into `out`; returns `out`. `fp8` ("block" or
    "channel") writes its decoder layers' projections in that published FP8 layout
    (`models/tiny_fp8.py`; `fp8_block`: the block's rows and input features); `chat_format`
    ("deepseek" or "glm45") a chat template in that model's format."""
    torch.manual_seed(seed)
    tokenizer = train_tokenizer(vocab_size)
    if chat_format is not None:  # a published model's conversation format (`tiny_chat.py`)
        from dserve.models.tiny_chat import TEMPLATES

        tokenizer.chat_template = TEMPLATES[chat_format]
    cfg = _hf_config(arch, vocab_size, tokenizer.bos_token_id, tokenizer.eos_token_id, num_layers)
    model = _model_class(arch)(cfg).eval()
    # make the routing bias matter: the published checkpoints' is far from zero
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.rand_like(buf) * 0.1)
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out, max_shard_size="300KB")
    tokenizer.save_pretrained(out)
    if mtp:
        _append_mtp_layer(arch, cfg, out, seed)
    if fp8:
        from dserve.models.tiny_fp8 import quantize_checkpoint

        quantize_checkpoint(out, fp8, fp8_block)
    return out


def one_layer_more(cfg):
    """`cfg` with one more decoder layer (where a checkpoint's NextN layer sits)."""
    more = {**cfg.to_dict(), "num_hidden_layers": cfg.num_hidden_layers + 1}
    for per_layer in ("mlp_layer_types", "layer_types"):  # derived again for n + 1 layers
        more.pop(per_layer, None)
    if "indexer_types" in more:  # sparse attention: the NextN layer has its own indexer
        more["indexer_types"] = [*more["indexer_types"], "full"]
    return type(cfg)(**more)


def _append_mtp_layer(arch: str, cfg, out: str, seed: int) -> None:
    """One more decoder layer (from a deeper random model) plus the NextN projection tensors."""
    torch.manual_seed(seed + 1)
    h, v = cfg.hidden_size, cfg.vocab_size
    deeper = _model_class(arch)(one_layer_more(cfg))
    std = cfg.initializer_range
    append_mtp_layer(
        out,
        deeper,
        {
            "enorm.weight": 1 + 0.1 * torch.randn(h),
            "hnorm.weight": 1 + 0.1 * torch.randn(h),
            "eh_proj.weight": std * torch.randn(h, 2 * h),
            "shared_head.norm.weight": 1 + 0.1 * torch.randn(h),
            "shared_head.head.weight": std * torch.randn(v, h),
            "embed_tokens.weight": std * torch.randn(v, h),
        },
        random_bias=True,
    )


def append_mtp_layer(
    out: str, deeper, nextn: dict[str, torch.Tensor], random_bias: bool = False
) -> None:
    """Add layer `num_hidden_layers` of `deeper` (a model of the checkpoint's family with one more
    layer) and the NextN tensors `nextn` (keys without the layer prefix) to the checkpoint in `out`,
    in the published layout: one more shard, the index and `num_nextn_predict_layers` updated."""
    import tempfile

    from safetensors.torch import load_file, save_file

    n = deeper.config.num_hidden_layers - 1
    prefix = f"model.layers.{n}."
    tensors = {}
    # save_pretrained writes the published per-expert layout
    with tempfile.TemporaryDirectory() as tmp:
        deeper.save_pretrained(tmp)
        for name in sorted(os.listdir(tmp)):
            if name.endswith(".safetensors"):
                tensors.update(
                    {
                        k: t
                        for k, t in load_file(os.path.join(tmp, name)).items()
                        if k.startswith(prefix)
                    }
                )
    tensors.update({prefix + k: t.detach().contiguous() for k, t in nextn.items()})
    if random_bias:
        for name, t in tensors.items():
            if name.endswith("e_score_correction_bias"):
                tensors[name] = torch.rand_like(t) * 0.1
    shard = "model-mtp.safetensors"
    save_file(tensors, os.path.join(out, shard), metadata={"format": "pt"})
    index_path = os.path.join(out, "model.safetensors.index.json")
    with open(index_path) as f:
        index = json.load(f)
    index["weight_map"].update({name: shard for name in tensors})
    with open(index_path, "w") as f:
        json.dump(index, f, indent=2)
    config_path = os.path.join(out, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["num_nextn_predict_layers"] = 1
    with open(config_path, "w") as f:
        json.dump(config, f, indent=2)


def tiny_aux_layer_ids(num_layers: int) -> list[int]:
    """SGLang's default target layers for EAGLE-3 where they fit, else the first, second and last
    layers that can be read (-1 is the embedding)."""
    default = [1, num_layers // 2 - 1, num_layers - 4]
    if len(set(default)) == 3 and all(-1 <= i <= num_layers - 2 for i in default):
        return default
    return [-1, 0, num_layers - 2]  # a repeat where the target has only two layers


def eagle3_config(target: dict, draft_vocab: int) -> dict:
    """config.json of a small EAGLE-3 draft for the target config `target`: a Llama GQA layer (4
    heads, 2 KV heads) whatever the target's attention."""
    import transformers as tf

    h = target["hidden_size"]
    cfg = tf.LlamaConfig(
        vocab_size=target["vocab_size"],
        hidden_size=h,
        intermediate_size=2 * h,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    ).to_dict()
    cfg.update(
        architectures=["LlamaForCausalLMEagle3"],
        draft_vocab_size=draft_vocab,
        target_hidden_size=h,
        eagle_config={
            "eagle_aux_hidden_state_layer_ids": tiny_aux_layer_ids(target["num_hidden_layers"])
        },
    )
    return cfg


def save_eagle3(out: str, config: dict, tensors: dict[str, torch.Tensor], hot: torch.Tensor) -> str:
    """Write an EAGLE-3 checkpoint: `tensors` (keys of the public layout, without d2t/t2d) and the
    draft vocabulary `hot` (sorted target ids) as `d2t` / `t2d`."""
    from safetensors.torch import save_file

    t2d = torch.zeros(config["vocab_size"], dtype=torch.bool)
    t2d[hot] = True
    tensors = {**tensors, "d2t": hot - torch.arange(len(hot)), "t2d": t2d}
    os.makedirs(out, exist_ok=True)
    save_file(
        {k: v.detach().contiguous() for k, v in tensors.items()},
        os.path.join(out, "model.safetensors"),
        metadata={"format": "pt"},
    )
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return out


def make_tiny_eagle3(
    target_dir: str, out: str, seed: int = 0, draft_vocab_size: int | None = None
) -> str:
    """A random EAGLE-3 draft for the checkpoint in `target_dir`, in the public layout (see
    `dserve.spec.eagle3`), over a random half of the target's vocabulary."""
    with open(os.path.join(target_dir, "config.json")) as f:
        target = json.load(f)
    torch.manual_seed(seed + 2)
    cfg = eagle3_config(target, draft_vocab_size or target["vocab_size"] // 2)
    h, draft_vocab = cfg["hidden_size"], cfg["draft_vocab_size"]
    heads, kv_heads, inter = (
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
        cfg["intermediate_size"],
    )
    d = h // heads
    # the target ids of the draft vocabulary
    hot = torch.randperm(cfg["vocab_size"])[:draft_vocab].sort().values
    rand = lambda *shape: 0.1 * torch.randn(*shape)  # noqa: E731
    norm = lambda: 1 + 0.1 * torch.randn(h)  # noqa: E731
    return save_eagle3(
        out,
        cfg,
        {
            "fc.weight": rand(h, 3 * h),
            "norm.weight": norm(),
            "lm_head.weight": rand(draft_vocab, h),
            "midlayer.input_layernorm.weight": norm(),
            "midlayer.hidden_norm.weight": norm(),
            "midlayer.post_attention_layernorm.weight": norm(),
            "midlayer.self_attn.q_proj.weight": rand(heads * d, 2 * h),
            "midlayer.self_attn.k_proj.weight": rand(kv_heads * d, 2 * h),
            "midlayer.self_attn.v_proj.weight": rand(kv_heads * d, 2 * h),
            "midlayer.self_attn.o_proj.weight": rand(h, heads * d),
            "midlayer.mlp.gate_proj.weight": rand(inter, h),
            "midlayer.mlp.up_proj.weight": rand(inter, h),
            "midlayer.mlp.down_proj.weight": rand(h, inter),
        },
        hot,
    )
