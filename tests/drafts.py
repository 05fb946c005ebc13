"""Tiny drafts that accept something: a phrase corpus, a tiny target and its MTP draft trained on
it (`models/tiny_train.py`), an EAGLE-3 head trained for that target, and acceptance measured
with the engine. Shared by the speculation tests and bench/train_mtp.py, bench/train_eagle3.py."""

from __future__ import annotations

import json
import os
import random
import time
from collections import Counter

import torch
from torch import nn

from dserve.models.tiny import eagle3_config, save_eagle3
from dserve.models.tiny_train import VOCAB, RMSNorm, train_with_mtp


def corpus(num_phrases: int, seed: int):
    """A sampler of token sequences made of `num_phrases` fixed phrases strung together at random."""
    rng = random.Random(seed)
    phrases = [
        [rng.randrange(10, VOCAB) for _ in range(rng.randrange(4, 9))] for _ in range(num_phrases)
    ]

    def sample(n: int) -> list[int]:
        out = []
        while len(out) < n:
            out += rng.choice(phrases)
        return out[:n]

    return sample


def train(
    arch: str, out: str, steps: int, seed: int = 0, log=print, shapes: dict | None = None
) -> dict:
    """Train on the phrase corpus and write the checkpoint (`models/tiny_train.py`); `shapes`
    overrides fields of the tiny config. Returns the losses and held-out prompts."""
    sample = corpus(24, seed)
    losses = train_with_mtp(arch, out, steps, sample, seed, log, shapes)
    return {
        "arch": arch,
        "steps": steps,
        "final_target_loss": losses[-1][0],
        "final_draft_loss": losses[-1][1],
        "prompts": [sample(12) for _ in range(8)],
    }


def measure(
    path: str,
    prompts: list[list[int]],
    steps_list=(1, 2, 3),
    max_new_tokens: int = 48,
    speculative: dict | None = None,
    topk: int = 1,
    naive: bool = False,
) -> list[dict]:
    """Mean acceptance length (tokens per verify) and tokens/s per draft-step count (draft trees of
    `topk` branches per pass; `naive`: the fused one-call step); output checked equal to the plain
    engine's. `speculative`: the Engine's draft arguments (default: MTP)."""
    from dserve.runtime import Engine

    params = {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True}
    plain = Engine(path, device="cpu", load_progress=False)
    start = time.perf_counter()
    expected = [r.output_ids for r in plain.generate(input_ids=prompts, sampling_params=params)]
    seconds = time.perf_counter() - start
    plain.shutdown()
    tokens = sum(map(len, expected))
    rows = [
        {
            "steps": 0,
            "topk": 0,
            "naive": False,
            "accept_length": 1.0,  # speculation off
            "tokens_per_s": tokens / seconds,
        }
    ]
    for steps in steps_list:
        engine = Engine(
            path,
            device="cpu",
            load_progress=False,
            speculative_num_steps=steps,
            speculative_eagle_topk=topk,
            speculative_naive=naive,
            **(speculative or {"speculative_algorithm": "mtp"}),
        )
        start = time.perf_counter()
        got = engine.generate(input_ids=prompts, sampling_params=params)
        seconds = time.perf_counter() - start
        engine.shutdown()
        if [r.output_ids for r in got] != expected:
            raise AssertionError(f"speculation with {steps} steps changed the output")
        tokens = sum(len(r.output_ids) for r in got)
        verifies = sum(r.meta["spec_verify_ct"] for r in got)
        rows.append(
            {
                "steps": steps,
                "topk": topk,
                "naive": naive,
                "accept_length": tokens / verifies,
                "tokens_per_s": tokens / seconds,
            }
        )
    return rows


class Eagle3Head(nn.Module):
    """The EAGLE-3 layer with transformers' Llama attention (q/k/v over 2 * hidden) and MLP."""

    def __init__(self, cfg: dict):
        super().__init__()
        import transformers
        from transformers.models.llama import modeling_llama as ml

        h, eps, heads = cfg["hidden_size"], cfg["rms_norm_eps"], cfg["num_attention_heads"]
        llama = transformers.LlamaConfig(**{k: v for k, v in cfg.items() if k != "eagle_config"})
        wide = transformers.LlamaConfig(
            **{**llama.to_dict(), "hidden_size": 2 * h, "head_dim": h // heads}
        )
        wide._attn_implementation = "sdpa"  # causal without a mask
        self.fc = nn.Linear(3 * cfg["target_hidden_size"], h, bias=False)
        self.input_layernorm, self.hidden_norm = RMSNorm(h, eps), RMSNorm(h, eps)
        self.self_attn = ml.LlamaAttention(wide, layer_idx=0)
        self.self_attn.o_proj = nn.Linear(heads * (h // heads), h, bias=False)
        self.rotary = ml.LlamaRotaryEmbedding(wide)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.mlp = ml.LlamaMLP(llama)
        self.norm = RMSNorm(h, eps)
        self.lm_head = nn.Linear(h, cfg["draft_vocab_size"], bias=False)

    def forward(self, emb_next: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        hidden = self.fc(aux)
        x = torch.cat([self.input_layernorm(emb_next), self.hidden_norm(hidden)], dim=-1)
        pos = torch.arange(x.shape[1])[None]
        residual = (
            hidden
            + self.self_attn(x, position_embeddings=self.rotary(x, pos), attention_mask=None)[0]
        )
        y = residual + self.mlp(self.post_attention_layernorm(residual))
        return self.lm_head(self.norm(y))

    def public_tensors(self) -> dict[str, torch.Tensor]:
        """The weights under the public checkpoint's keys (the layer's under `midlayer.`)."""
        out = {}
        for name, t in self.state_dict().items():
            if name.startswith(
                (
                    "self_attn.",
                    "mlp.",
                    "input_layernorm.",
                    "hidden_norm.",
                    "post_attention_layernorm.",
                )
            ):
                out["midlayer." + name] = t
            elif not name.startswith("rotary."):
                out[name] = t
        return out

    @classmethod
    def from_checkpoint(cls, path: str) -> "Eagle3Head":
        """The head of a public-layout EAGLE-3 checkpoint (its `d2t`/`t2d` left out)."""
        from safetensors.torch import load_file

        with open(os.path.join(path, "config.json")) as f:
            head = cls(json.load(f))
        tensors = load_file(os.path.join(path, "model.safetensors"))
        head.load_state_dict(
            {k.removeprefix("midlayer."): v for k, v in tensors.items() if k not in ("d2t", "t2d")}
        )
        return head.eval()


def train_eagle3(
    target_dir: str, out: str, steps: int, seed: int = 0, draft_vocab: int = 256, log=print
) -> dict:
    import transformers

    torch.manual_seed(seed)
    transformers.logging.set_verbosity_error()
    target = transformers.AutoModelForCausalLM.from_pretrained(
        target_dir, dtype=torch.float32
    ).eval()
    target.requires_grad_(False)
    cfg = eagle3_config(target.config.to_dict(), draft_vocab)
    aux_ids = cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    sample = corpus(24, seed)  # the target's corpus: same seed, same phrases
    counts = Counter(t for _ in range(64) for t in sample(64))
    hot = torch.tensor(sorted(t for t, _ in counts.most_common(draft_vocab)))
    hot = torch.cat(
        [hot, torch.tensor([t for t in range(cfg["vocab_size"]) if t not in set(hot.tolist())])]
    )
    hot = hot[:draft_vocab].sort().values
    # -100: not in the draft vocabulary
    to_draft = torch.full((cfg["vocab_size"],), -100, dtype=torch.long)
    to_draft[hot] = torch.arange(draft_vocab)
    head = Eagle3Head(cfg)
    opt = torch.optim.AdamW(head.parameters(), lr=3e-3)
    ce = nn.CrossEntropyLoss(ignore_index=-100)
    losses = []
    for step in range(steps):
        ids = torch.tensor([sample(64) for _ in range(16)])
        with torch.no_grad():
            states = target.model(ids, output_hidden_states=True).hidden_states
        aux = torch.cat([states[i + 1] for i in sorted(aux_ids)], dim=-1)
        logits = head(target.model.embed_tokens(ids[:, 1:]), aux[:, :-1])
        loss = ce(logits[:, :-1].flatten(0, 1), to_draft[ids[:, 2:]].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if step % 50 == 0 or step == steps - 1:
            log(f"step {step:4d}  draft loss {loss.item():.3f}")
    save_eagle3(out, cfg, head.public_tensors(), hot)
    return {"steps": steps, "final_draft_loss": losses[-1]}
