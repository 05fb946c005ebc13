"""Train an EAGLE-3 draft for the tiny target that bench/train_mtp.py trained, on the same phrase
corpus, so EAGLE-3 acceptance means something too.

The target stays frozen. The draft reads the target's hidden states after the configured layers at
position i (transformers' `output_hidden_states`) and the embedding of token i+1, and learns token
i+2 over a reduced vocabulary: the corpus's most frequent tokens (as SpecForge builds `d2t`). Only
the first draft step is trained (no training-time test unrolling), so later steps, which feed the
draft its own hidden state, are accepted less often. The result is written in the public EAGLE-3
layout, then measured with the engine:

    python -m bench.train_mtp --out /tmp/mtp-trained
    python -m bench.train_eagle3 --target /tmp/mtp-trained --out /tmp/eagle3-trained

prints the losses, then decode tokens/s and the mean acceptance length with speculation off and
with EAGLE-3 at 1, 2 and 3 draft steps, and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
from collections import Counter

import torch
from torch import nn

from bench.train_mtp import RMSNorm, corpus, measure, report
from dserve.models.tiny import eagle3_config, save_eagle3


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True, help="a target trained by bench.train_mtp")
    parser.add_argument("--out", required=True, help="EAGLE-3 checkpoint directory to write")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--json", default="bench/results/train_eagle3.json")
    args = parser.parse_args()
    info = train_eagle3(args.target, args.out, args.steps)
    sample = corpus(24, 0)  # the phrases the target learned
    prompts = [sample(12) for _ in range(8)]
    draft = {"speculative_algorithm": "eagle3", "speculative_draft_model_path": args.out}
    rows = (
        measure(args.target, prompts, speculative=draft)
        + measure(args.target, prompts, (1, 3), speculative=draft, topk=4)[1:]
        + measure(args.target, prompts, (1,), speculative=draft, naive=True)[1:]
    )
    report("eagle3", rows, info, args.json)


if __name__ == "__main__":
    main()
