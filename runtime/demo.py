"""`make demo`: the product on a laptop's CPU, in about a minute.

A tiny DeepSeek-V3 with an MTP (NextN) layer is trained for a few seconds on a synthetic chat
corpus (`DIALOGUES`), so its answers read as text (cached in .dserve/demo-chat after the first
run, trained again when the corpus changes). It is then served disaggregated, as in production:
a prefill and a decode instance, both with speculative decoding (MTP, two draft steps), behind
`dserve router`, each a process of its own with KV moving over UCX. Questions go through the
official `openai` client; each answer streams as it comes, with the time to its first token and
the decode speed measured; then every question at once for the batched throughput, and the
decode's speculative acceptance from its `/metrics`.

    python -m dserve.runtime.demo [--model-dir DIR] [--train-steps N] [--questions N]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

DEFAULT_MODEL_DIR = os.path.join(".dserve", "demo-chat")
DIALOGUES = [
    (
        "What is dserve?",
        "dserve is a serving engine for large mixture of experts models. It splits prefill "
        "and decode into separate instances.",
    ),
    (
        "How does speculative decoding work?",
        "A small draft model proposes a few tokens, and the target model verifies them all "
        "in one pass.",
    ),
    (
        "Tell me a story.",
        "Once upon a time there was a small model that wanted to be exactly like its "
        "reference. It trained hard, and one day it was.",
    ),
    (
        "What does the prefill instance do?",
        "It computes the key value cache of the prompt and sends the pages to a decode instance.",
    ),
    (
        "What does the decode instance do?",
        "It receives the cache and generates one token at a time for many requests at once.",
    ),
    (
        "What is a page?",
        "A page holds the cache of sixteen tokens, and a page table maps each request to its "
        "pages.",
    ),
    ("Hello!", "Hello! How can I help you today?"),
    (
        "What does the router do?",
        "The router sends each request to a prefill and a decode instance, and tries another "
        "pair if one fails.",
    ),
]
SPECULATIVE = ["--speculative-algorithm", "mtp", "--speculative-num-steps", "2"]
TRAIN_STEPS = 300


def ensure_default_model() -> str:
    """The demo model (the embedded default model of the benchmarks too), trained if need be."""
    return ensure_model(DEFAULT_MODEL_DIR, TRAIN_STEPS)


# ---- the model ------------------------------------------------------------------------------------
def ensure_model(path: str, steps: int) -> str:
    """The trained demo model in `path`, trained now unless a model of this corpus is there."""
    stamp = hashlib.sha256(json.dumps([DIALOGUES, steps]).encode()).hexdigest()
    stamp_file = os.path.join(path, "demo-stamp")
    if read(stamp_file) == stamp:
        return path
    print(f"training the demo model ({steps} steps, once; cached in {path}) ...", flush=True)
    start = time.perf_counter()
    train(path, steps)
    with open(stamp_file, "w") as f:
        f.write(stamp)
    print(f"trained in {time.perf_counter() - start:.0f}s", flush=True)
    return path


def read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def train(path: str, steps: int) -> None:
    """A tokenizer and a target with its MTP draft, on conversations in the chat template."""
    from transformers.utils import logging as hf_logging

    from dserve.models.tiny import CORPUS, train_tokenizer
    from dserve.models.tiny_train import VOCAB, train_with_mtp

    hf_logging.disable_progress_bar()  # no bars for writing the checkpoint's shards

    text = CORPUS + "\n".join(f"{q} {a}" for q, a in DIALOGUES)
    tokenizer = train_tokenizer(VOCAB, text)
    conversations = [conversation(tokenizer, q, a) for q, a in DIALOGUES]
    rng = random.Random(0)

    def sample(n: int) -> list[int]:
        out = []
        while len(out) < n:
            out += rng.choice(conversations)
        return out[:n]

    log = lambda line: print("  " + line, flush=True)
    train_with_mtp("deepseek_v3", path, steps, sample, tokenizer=tokenizer, length=96, log=log)


def conversation(tokenizer, question: str, answer: str) -> list[int]:
    turns = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    ids = tokenizer.apply_chat_template(turns, tokenize=True, return_dict=False)
    return list(ids) + [tokenizer.eos_token_id]


# ---- the servers ----------------------------------------------------------------------------------
class Servers:
    """A prefill, a decode and a router, each a `dserve` process; logs in `log_dir`."""

    def __init__(self, model: str, log_dir: str):
        os.makedirs(log_dir, exist_ok=True)
        self.log_dir, self.procs = log_dir, []
        ports = free_ports(4)
        self.prefill = f"http://127.0.0.1:{ports[0]}"
        self.decode = f"http://127.0.0.1:{ports[1]}"
        self.router = f"http://127.0.0.1:{ports[3]}"
        common = ["--model", model, "--device", "cpu", "--no-load-progress", *SPECULATIVE]
        boot = ["--bootstrap-port", str(ports[2])]
        self._start("prefill", ["prefill", *common, "--port", str(ports[0]), *boot])
        self._start("decode", ["decode", *common, "--port", str(ports[1])])
        self.wait(self.prefill, self.decode)
        route = ["--prefill", self.prefill, "--decode", self.decode, "--port", str(ports[3])]
        self._start("router", ["router", *route, "--health-interval-s", "0.5"])
        self.wait(self.router)

    def _start(self, name: str, args: list[str]) -> None:
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "UCX_WARN_UNUSED_ENV_VARS": "n",
        }
        log = open(os.path.join(self.log_dir, f"{name}.log"), "w")  # noqa: SIM115
        cmd = [sys.executable, "-m", "dserve.runtime.cli", *args]
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        self.procs.append((name, proc))

    def wait(self, *urls: str, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        for url in urls:
            while not healthy(url):
                for name, proc in self.procs:
                    if proc.poll() is not None:
                        raise SystemExit(f"the {name} stopped; see {self.log_dir}/{name}.log")
                if time.monotonic() > deadline:
                    raise SystemExit(f"{url} not ready in {timeout:.0f}s; logs: {self.log_dir}")
                time.sleep(0.2)

    def stop(self) -> None:
        for _, proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for _, proc in self.procs:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


# ---- the client -----------------------------------------------------------------------------------
def ask_streamed(client, model: str, question: str, max_tokens: int) -> dict:
    """Stream one answer to the terminal; its TTFT, tokens and decode speed."""
    print(f"\n> {question}\n  ", end="", flush=True)
    start = time.perf_counter()
    first = usage = None
    chunks = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": question}],
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    text = ""
    for chunk in chunks:
        usage = chunk.usage or usage
        delta = chunk.choices[0].delta.content if chunk.choices else None
        if delta:
            first = first or time.perf_counter()
            text += delta
            print(delta, end="", flush=True)
    end = time.perf_counter()
    tokens = usage.completion_tokens
    speed = (tokens - 1) / (end - first) if tokens > 1 else 0.0
    print(f"\n  [{tokens} tokens, TTFT {(first - start) * 1e3:.0f} ms, {speed:.1f} tokens/s]")
    return {"text": text, "tokens": tokens, "ttft": first - start, "tokens_per_s": speed}


def ask_all(client, model: str, questions: list[str], max_tokens: int) -> tuple[int, float]:
    """Every question at once (batched on the decode): tokens generated and seconds taken."""

    def one(question: str) -> int:
        answer = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": question}],
            max_tokens=max_tokens,
            temperature=0,
        )
        return answer.usage.completion_tokens

    start = time.perf_counter()
    with ThreadPoolExecutor(len(questions)) as pool:
        tokens = sum(pool.map(one, questions))
    return tokens, time.perf_counter() - start


def accept_length(decode_url: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(decode_url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "dserve_spec_accept_length":
                return sample.value
    return 0.0


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", default=DEFAULT_MODEL_DIR, help="where the model is cached")
    parser.add_argument("--train-steps", type=int, default=TRAIN_STEPS, help="training steps")
    parser.add_argument("--questions", type=int, default=3, help="questions to stream")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per answer at most")
    args = parser.parse_args(argv)
    import openai

    model = ensure_model(args.model_dir, args.train_steps)
    print("starting a prefill and a decode instance (MTP, 2 draft steps) and a router ...")
    start = time.perf_counter()
    servers = Servers(model, os.path.join(args.model_dir, "logs"))
    try:
        print(f"ready in {time.perf_counter() - start:.0f}s; router at {servers.router}")
        client = openai.OpenAI(base_url=servers.router + "/v1", api_key="unused")
        name = client.models.list().data[0].id
        questions = [q for q, _ in DIALOGUES]
        answers = [
            ask_streamed(client, name, q, args.max_tokens) for q in questions[: args.questions]
        ]
        tokens, seconds = ask_all(client, name, questions, args.max_tokens)
        ttft = sorted(a["ttft"] for a in answers)[len(answers) // 2]
        print(
            f"\nmedian TTFT {ttft * 1e3:.0f} ms; {len(questions)} questions at once: {tokens} "
            f"tokens in {seconds:.2f}s = {tokens / seconds:.1f} tokens/s on the CPU; "
            f"speculative acceptance {accept_length(servers.decode):.2f} tokens per step"
        )
        return answers
    finally:
        servers.stop()


if __name__ == "__main__":
    main()
