"""The `dserve` command line. Engine flags are generated from `EngineConfig`, so every Engine keyword
argument is a flag of the same name in kebab case, its help the field's docstring."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import json
import logging
import sys
import textwrap
import typing

SHORT_FLAGS = {"tp_size": ["--tp"], "dp_size": ["--dp"], "ep_size": ["--ep"]}


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per EngineConfig field (`model_path` is `--model`)."""
    from dserve.runtime.config import EngineConfig

    group = parser.add_argument_group("engine")
    group.add_argument(
        "--model",
        "--model-path",
        dest="model_path",
        required=True,
        help="Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer)",
    )
    _add_dataclass_flags(group, EngineConfig, {"model_path"}, SHORT_FLAGS)


def field_docs(cls) -> dict[str, str]:
    """A config dataclass's fields documented where they are declared: the docstring below each
    field becomes the flag's help, so the two never drift apart."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(after, ast.Expr):
            text = after.value.value if isinstance(after.value, ast.Constant) else None
            if isinstance(text, str):
                words = " ".join(text.split()).rstrip(".")
                docs[node.target.id] = (
                    words[0].lower() + words[1:] if words[1:2].islower() else words
                )
    return docs


def _add_dataclass_flags(group, cls, skip=(), short=None) -> None:
    hints = typing.get_type_hints(cls)
    comments = field_docs(cls)
    for field in dataclasses.fields(cls):
        if field.name in skip:
            continue
        flags = ["--" + field.name.replace("_", "-")] + (short or {}).get(field.name, [])
        hint = hints[field.name]
        text = comments.get(field.name, "").replace("%", "%%")
        if hint is bool:
            group.add_argument(
                *flags,
                dest=field.name,
                action=argparse.BooleanOptionalAction,
                default=field.default,
                help=f"{text} (default: {'on' if field.default else 'off'})".strip(),
            )
        else:
            base, choices = _flag_type(hint)
            default = "" if field.default is None else f" (default: {field.default})"
            group.add_argument(
                *flags,
                dest=field.name,
                type=base,
                choices=choices,
                default=field.default,
                help=(text + default).strip(),
            )


def _flag_type(hint) -> tuple[type, list | None]:
    """A field's value type and, for a Literal, its choices (`X | None` gives X's)."""
    if typing.get_origin(hint) is not typing.Literal:
        args = [t for t in typing.get_args(hint) if t is not type(None)]
        hint = args[0] if args else hint
    if typing.get_origin(hint) is typing.Literal:
        choices = list(typing.get_args(hint))
        return type(choices[0]), choices
    return hint, None


def add_server_flags(parser: argparse.ArgumentParser, role: str) -> None:
    from dserve.runtime.server_config import ServerConfig

    skip = {"role"} | ({"bootstrap_port", "bootstrap_timeout_s"} if role == "colocated" else set())
    if role == "decode":
        skip.add("bootstrap_port")
    if role != "decode":
        skip.add("prealloc_timeout_s")
    if role != "prefill":
        skip |= {"transfer_report_margin_s", "transfer_stall_rooms"}
    if role == "colocated":
        skip |= {"transfer_fail_rate", "transfer_timeout_s"}
    _add_dataclass_flags(parser.add_argument_group("server"), ServerConfig, skip)


def server_config(args: argparse.Namespace, role: str):
    from dserve.runtime.server_config import ServerConfig

    names = [
        f.name
        for f in dataclasses.fields(ServerConfig)
        if f.name != "role" and hasattr(args, f.name)
    ]
    return ServerConfig(role=role, **{n: getattr(args, n) for n in names})


def engine_kwargs(args: argparse.Namespace) -> dict:
    from dserve.runtime.config import EngineConfig

    return {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(EngineConfig)
        if f.name != "model_path"
    }


def _cmd_make_tiny(args: argparse.Namespace) -> None:
    from dserve.models.tiny import make_tiny

    if args.eagle3_for:
        from dserve.models.tiny import make_tiny_eagle3

        out = make_tiny_eagle3(args.eagle3_for, args.out, seed=args.seed)
        print(f"wrote a tiny EAGLE-3 draft for {args.eagle3_for} to {out}")
        return
    if not args.arch:
        raise SystemExit(
            "dserve make-tiny: give --arch (a target) or --eagle3-for TARGET_DIR (a draft)"
        )
    block = tuple(int(x) for x in args.fp8_block.split(","))
    out = make_tiny(
        args.arch, args.out, mtp=args.mtp, seed=args.seed, fp8=args.fp8, fp8_block=block
    )
    print(f"wrote a tiny {args.arch} checkpoint{' with an MTP layer' if args.mtp else ''} to {out}")


def preflight(args: argparse.Namespace) -> None:
    """The checks before any port is bound or weight read (`StartupError`: one line, exit 2)."""
    from dserve.runtime.startup import check_device, check_model_dir

    check_model_dir(args.model_path)
    if args.speculative_draft_model_path:
        check_model_dir(
            args.speculative_draft_model_path, "--speculative-draft-model-path", target=False
        )
    check_device(args.device)


def _cmd_generate(args: argparse.Namespace) -> None:
    from dserve.runtime.engine import Engine

    preflight(args)
    from dserve.scheduler.request import SamplingParams

    params = SamplingParams(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
    )
    with Engine(args.model_path, **engine_kwargs(args)) as engine:
        for result in engine.generate(list(args.prompt), sampling_params=params):
            print(
                json.dumps(
                    {
                        "text": result.text,
                        "output_ids": result.output_ids,
                        "finish_reason": result.finish_reason,
                        "meta": result.meta,
                    }
                )
            )


def _cmd_serve(args: argparse.Namespace) -> None:
    preflight(args)
    kwargs = engine_kwargs(args)
    if kwargs["node_rank"] > 0:  # another host of a multi-host instance: its ranks only
        from dserve.runtime.config import EngineConfig
        from dserve.runtime.nodes import run_node

        run_node(EngineConfig(args.model_path, **kwargs))
        return
    from dserve.runtime.http_server import serve

    serve(args.model_path, server_config(args, args.role), **kwargs)


def _cmd_router(args: argparse.Namespace) -> None:
    from dserve.runtime.router import run_router
    from dserve.runtime.server_config import RouterConfig

    split = lambda values: [u for v in values for u in v.split(",") if u]
    names = [f.name for f in dataclasses.fields(RouterConfig)]
    config = RouterConfig(**{n: getattr(args, n) for n in names})
    run_router(split(args.prefill), split(args.decode), config)


INSTANCE_HELP = {
    "serve": (
        "serve the HTTP API from one colocated instance (prefill and decode together)",
        "colocated",
    ),
    "prefill": (
        "run a prefill instance: computes prompts and pushes their KV to decode instances",
        "prefill",
    ),
    "decode": ("run a decode instance: receives prompts' KV and generates", "decode"),
}


def _add_router(sub) -> None:
    from dserve.runtime.server_config import RouterConfig

    router = sub.add_parser(
        "router",
        help="route requests over prefill and decode instances",
        description="One OpenAI-compatible endpoint in front of prefill and decode instances. "
        "Each request goes to one prefill and one decode instance at once, and to another "
        "pair if one fails before any token went out.",
    )
    router.add_argument(
        "--prefill",
        action="append",
        required=True,
        metavar="URL[,URL...]",
        help="prefill instance URL(s), e.g. http://127.0.0.1:30001 (repeatable)",
    )
    router.add_argument(
        "--decode",
        action="append",
        required=True,
        metavar="URL[,URL...]",
        help="decode instance URL(s) (repeatable)",
    )
    _add_dataclass_flags(router.add_argument_group("router"), RouterConfig)
    router.set_defaults(func=_cmd_router)


LOG_LEVELS = ["debug", "info", "warning", "error"]


def _log_level_flag(parser: argparse.ArgumentParser, default) -> None:
    parser.add_argument(
        "--log-level",
        default=default,
        choices=LOG_LEVELS,
        help="logging threshold (default: info)",
    )


class _SubParsers(argparse._SubParsersAction):
    """Every subcommand also takes --log-level (after its name, as after `dserve`)."""

    def add_parser(self, name, **kwargs):
        parser = super().add_parser(name, **kwargs)
        _log_level_flag(parser, argparse.SUPPRESS)  # a value given before the name stays
        return parser


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole command line; with `only="router"`, the router's subcommand
    alone, which imports neither torch nor the model code (a router host
    need not have them, and it starts in half a second)."""
    parser = argparse.ArgumentParser(
        prog="dserve",
        description="Disaggregated LLM inference for DeepSeek-V3/R1 and GLM-4.5 class MoE models.",
    )
    _log_level_flag(parser, "info")
    sub = parser.add_subparsers(
        dest="command", required=True, metavar="COMMAND", action=_SubParsers
    )
    if only != "router":
        _add_engine_commands(sub)
    _add_router(sub)
    return parser


def _add_engine_commands(sub) -> None:
    from dserve.models.tiny import ARCHES as TINY_ARCHES

    tiny = sub.add_parser(
        "make-tiny",
        help="write a tiny random checkpoint (for tests and demos)",
        description="Write a tiny random checkpoint through transformers' save_pretrained.",
    )
    tiny.add_argument(
        "--arch",
        choices=TINY_ARCHES,
        help="architecture of the checkpoint to write",
    )
    tiny.add_argument("--out", required=True, help="output directory")
    tiny.add_argument(
        "--mtp", action="store_true", help="append one MTP (NextN) layer in the public key layout"
    )
    tiny.add_argument(
        "--eagle3-for",
        metavar="TARGET_DIR",
        help="instead, write a random EAGLE-3 draft (public layout) for the checkpoint in TARGET_DIR",
    )
    tiny.add_argument(
        "--fp8",
        choices=["block", "channel"],
        help="write the decoder layers' projections as FP8: DeepSeek's block layout "
        "(weight_scale_inv per block) or GLM-4.5-FP8's compressed-tensors per channel",
    )
    tiny.add_argument(
        "--fp8-block",
        default="32,32",
        help="rows,input features of a scale block with --fp8 block (default: 32,32)",
    )
    tiny.add_argument("--seed", type=int, default=0, help="seed of the random weights (default: 0)")
    tiny.set_defaults(func=_cmd_make_tiny)

    gen = sub.add_parser(
        "generate",
        help="generate offline for prompts given on the command line",
        description="Run the engine in this process on the given prompts; one JSON line each.",
    )
    gen.add_argument("prompt", nargs="+", help="prompt text (several allowed)")
    gen.add_argument(
        "--max-new-tokens", type=int, default=32, help="tokens to generate at most (default: 32)"
    )
    gen.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sampling temperature; 0 is greedy (default: 0)",
    )
    gen.add_argument(
        "--top-p", type=float, default=1.0, help="nucleus sampling mass (default: 1.0)"
    )
    gen.add_argument(
        "--top-k",
        type=int,
        default=-1,
        help="sample among the k likeliest tokens; -1: all (default: -1)",
    )
    gen.add_argument("--seed", type=int, default=None, help="seed of the request's sampling")
    gen.add_argument(
        "--ignore-eos", action="store_true", help="keep generating past the end-of-text token"
    )
    add_engine_flags(gen)
    gen.set_defaults(func=_cmd_generate)

    for name, (text, role) in INSTANCE_HELP.items():
        cmd = sub.add_parser(
            name,
            help=text,
            description=text[0].upper() + text[1:] + ". Every Engine keyword "
            "argument is a flag of the same name.",
        )
        add_engine_flags(cmd)
        add_server_flags(cmd, role)
        cmd.set_defaults(func=_cmd_serve, role=role)


def _command(argv: list[str]) -> str | None:
    """The subcommand named in argv (the first word that is not a flag or
    the value of --log-level)."""
    words = iter(argv)
    for word in words:
        if word == "--log-level":
            next(words, None)
        elif not word.startswith("-"):
            return word
    return None


def main(argv: list[str] | None = None) -> None:
    from dserve.runtime.startup import StartupError

    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(_command(argv)).parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    try:
        args.func(args)
    except (StartupError, ValueError, FileNotFoundError) as e:
        print(f"dserve {args.command}: error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:  # before the server's own handlers are in place
        sys.exit(130)


if __name__ == "__main__":
    main()
