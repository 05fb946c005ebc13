"""The command line reads like a real tool's: every flag of every subcommand says what it does, and
engine/server flags take their text from the docstring of the config field."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys

import pytest

from dserve.runtime.cli import build_parser, field_docs
from dserve.runtime.config import EngineConfig


def subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


@pytest.mark.parametrize("name", ["serve", "prefill", "decode", "router", "generate", "make-tiny"])
def test_every_flag_is_explained(name):
    parser = subcommands()[name]
    for action in parser._actions:
        if action.option_strings and action.dest != "help":
            words = re.sub(r"\(default: [^)]*\)", "", action.help or "").strip()
            assert len(words) >= 8, (
                f"dserve {name} {action.option_strings[0]}: help is {action.help!r}"
            )


def test_engine_flag_help_comes_from_the_field_docstring():
    docs = field_docs(EngineConfig)
    assert docs["page_size"] == "tokens per KV page; default 16 on CPU, 64 on GPU"
    assert set(docs) >= {f for f in EngineConfig.field_names() if f != "model_path"}
    serve = subcommands()["serve"]
    help_of = {a.dest: a.help for a in serve._actions}
    assert help_of["speculative_num_steps"].startswith("draft passes per step")
    assert help_of["enable_prefix_caching"].endswith("(default: on)")


def test_make_tiny_offers_every_tiny_architecture():
    from dserve.models.tiny import ARCHES

    arch = next(a for a in subcommands()["make-tiny"]._actions if a.dest == "arch")
    assert list(arch.choices) == list(ARCHES) and "glm_moe_dsa" in arch.choices


def test_log_level_after_the_subcommand():
    parser = build_parser()
    assert parser.parse_args(["router", "--prefill", "u", "--decode", "v"]).log_level == "info"
    after = parser.parse_args(["router", "--prefill", "u", "--decode", "v", "--log-level", "debug"])
    assert after.log_level == "debug"
    before = parser.parse_args(["--log-level", "error", "serve", "--model", "m"])
    assert before.log_level == "error", "a value before the subcommand is kept"
    assert parser.parse_args(["serve", "--model", "m", "--log-level", "warning"]).log_level == (
        "warning"
    )


def test_flags_with_a_fixed_set_of_values_list_them():
    serve = subcommands()["serve"]
    choices = {a.dest: a.choices for a in serve._actions if a.choices}
    assert choices["attention_backend"] == ["auto", "torch", "triton", "flashinfer"]
    assert choices["speculative_algorithm"] == ["mtp", "eagle3"]
    assert choices["dtype"] == ["auto", "float32", "bfloat16", "float16"]
    assert "{auto,torch,triton,flashinfer}" in serve.format_help()
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["serve", "--model", "m", "--load-format", "bogus"])
    assert exit_info.value.code == 2


def test_the_router_command_imports_no_torch():
    """`dserve router` builds only its own parser: a router host needs
    neither torch nor the model code, and the router starts in half a
    second instead of four."""
    code = (
        "import sys\n"
        "from dserve.runtime import cli\n"
        "from dserve.runtime.router import run_router\n"
        "args = cli.build_parser('router').parse_args(\n"
        "    ['--log-level', 'debug', 'router', '--prefill', 'http://a:1',\n"
        "     '--decode', 'http://b:2'])\n"
        "assert args.command == 'router', args\n"
        "assert cli._command(['--log-level', 'info', 'router']) == 'router'\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr
