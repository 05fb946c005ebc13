"""Tool-call parsers (`--tool-call-parser`): the models' own tool-call formats read from a chat
answer as it streams, into OpenAI `tool_calls` deltas (a call's id and name first, then its
arguments piece by piece); the text around the calls stays content.

`deepseekv3` (DeepSeek-V3/R1):
    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```
    <｜tool▁call▁end｜> (more calls, each after a newline) <｜tool▁calls▁end｜>
`glm45` (GLM-4.5):
    <tool_call>NAME\\n<arg_key>K</arg_key>\\n<arg_value>V</arg_value>\\n...</tool_call>
    (a value is JSON unless the tool's schema says string, or it does not parse).
`grammar` gives the EBNF that forces one call in the format (`tool_choice` required or named).
"""

from __future__ import annotations

import json
import re
import uuid

from dserve.runtime.reasoning import held_back

PARSERS = ("deepseekv3", "glm45")
DS_CALLS_BEGIN, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL_BEGIN, DS_CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>"
DS_SEP, DS_ARGS_END = "<｜tool▁sep｜>", "\n```" + DS_CALL_END
DS_HEADER = re.compile(r"(\w*)" + re.escape(DS_SEP) + r"([^\n]*)\n```json\n")
GLM_BEGIN, GLM_END = "<tool_call>", "</tool_call>"
GLM_ARG = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)


class ToolCallParser:
    """Content pieces in, OpenAI delta objects out (`feed`, then `finish`)."""

    begin = ""

    def __init__(self, tools: list[dict] | None):
        self.tools = {t["function"]["name"]: t["function"] for t in tools or []}
        self.buffer, self.state, self.count = "", "text", 0
        self.out: list[dict] = []

    @property
    def called(self) -> bool:
        return self.count > 0

    def feed(self, text: str) -> list[dict]:
        self.buffer += text
        self.out = []
        while self._step():
            pass
        return self.out

    def finish(self) -> list[dict]:
        """Text left over (a call cut short stays content)."""
        self.out = []
        if self.buffer:
            self._content(self.buffer)
            self.buffer = ""
        return self.out

    def _step(self) -> bool:
        raise NotImplementedError

    def _content(self, text: str) -> None:
        if text:
            self.out.append({"content": text})

    def _text(self, *begins: str) -> str | None:
        """In plain text: emit content up to a call's opening (or what may begin one); the
        opening found, if any."""
        found = [(self.buffer.find(b), b) for b in begins if b in self.buffer]
        if found:
            at, begin = min(found)
            self._content(self.buffer[:at])
            self.buffer = self.buffer[at + len(begin) :]
            return begin
        keep = max(held_back(self.buffer, b) for b in begins)
        self._content(self.buffer[: len(self.buffer) - keep])
        self.buffer = self.buffer[len(self.buffer) - keep :]
        return None

    def _open_call(self, name: str) -> None:
        call = {"index": self.count, "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function"}
        call["function"] = {"name": name, "arguments": ""}
        self.out.append({"tool_calls": [call]})
        self.count += 1

    def _arguments(self, piece: str) -> None:
        if piece:
            call = {"index": self.count - 1, "function": {"arguments": piece}}
            self.out.append({"tool_calls": [call]})


class DeepSeekV3Calls(ToolCallParser):
    arguments_as_text = True

    def _step(self) -> bool:
        if self.state == "text":
            begin = self._text(DS_CALLS_BEGIN, DS_CALL_BEGIN)
            if begin is None:
                return False
            self.state = "calls" if begin == DS_CALLS_BEGIN else "header"
            return True
        if self.state == "calls":
            return self._between_calls()
        if self.state == "header":
            match = DS_HEADER.match(self.buffer)
            if match is None:
                return False
            self._open_call(match.group(2).strip())
            self.buffer, self.state = self.buffer[match.end() :], "args"
            return True
        return self._args()

    def _between_calls(self) -> bool:
        rest = self.buffer.lstrip()
        for marker, state in ((DS_CALL_BEGIN, "header"), (DS_CALLS_END, "text")):
            if rest.startswith(marker):
                self.buffer, self.state = rest[len(marker) :], state
                return True
        if any(m.startswith(rest) for m in (DS_CALL_BEGIN, DS_CALLS_END)):
            return False  # wait for more
        self.state = "text"  # not a call after all: text
        return True

    def _args(self) -> bool:
        at = self.buffer.find(DS_ARGS_END)
        if at >= 0:
            self._arguments(self.buffer[:at])
            self.buffer, self.state = self.buffer[at + len(DS_ARGS_END) :], "calls"
            return True
        keep = held_back(self.buffer, DS_ARGS_END)
        self._arguments(self.buffer[: len(self.buffer) - keep])
        self.buffer = self.buffer[len(self.buffer) - keep :]
        return False


class Glm45Calls(ToolCallParser):
    arguments_as_text = False

    def _step(self) -> bool:
        if self.state == "text":
            if self._text(GLM_BEGIN) is None:
                return False
            self.state, self.args = "header", 0
            return True
        if self.state == "header":
            ends = [self.buffer.find(m) for m in ("\n", "<arg_key>", GLM_END)]
            ends = [at for at in ends if at >= 0]
            if not ends:
                return False
            at = min(ends)
            self.name = self.buffer[:at].strip()
            self._open_call(self.name)
            self.buffer, self.state = self.buffer[at:].removeprefix("\n"), "args"
            return True
        return self._arg()

    def _arg(self) -> bool:
        rest = self.buffer.lstrip()
        if rest.startswith(GLM_END):
            self._arguments("}" if self.args else "{}")
            self.buffer, self.state = rest[len(GLM_END) :], "text"
            return True
        match = GLM_ARG.match(self.buffer)
        if match is None:
            return False
        key, value = match.group(1).strip(), self._value(match.group(1).strip(), match.group(2))
        prefix = "{" if not self.args else ", "
        self._arguments(f"{prefix}{json.dumps(key)}: {json.dumps(value, ensure_ascii=False)}")
        self.args += 1
        self.buffer = self.buffer[match.end() :]
        return True

    def _value(self, key: str, text: str):
        params = self.tools.get(self.name, {}).get("parameters", {})
        kind = params.get("properties", {}).get(key, {}).get("type")
        if kind == "string":
            return text
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            return text


CLASSES = {"deepseekv3": DeepSeekV3Calls, "glm45": Glm45Calls}


def make_parser(name: str, tools: list[dict] | None) -> ToolCallParser:
    return CLASSES[name](tools)


def arguments_as_text(name: str | None) -> bool:
    """Whether the parser's chat template takes a call's arguments as JSON text (else a dict)."""
    return name is None or CLASSES[name].arguments_as_text


def grammar(name: str, tools: list[dict], only: str | None) -> str:
    """EBNF for one call in the parser's format, to one of `tools` (or the one named `only`),
    its arguments JSON that the tool's parameter schema accepts."""
    import xgrammar as xg

    def lit(text: str):
        return xg.Grammar.from_ebnf("root ::= " + json.dumps(text, ensure_ascii=False))

    calls = []
    for tool in tools:
        fn = tool["function"]
        if only is not None and fn["name"] != only:
            continue
        schema = xg.Grammar.from_json_schema(json.dumps(fn["parameters"]), any_whitespace=False)
        if name == "deepseekv3":
            head = f"{DS_CALL_BEGIN}function{DS_SEP}{fn['name']}\n```json\n"
            calls.append(xg.Grammar.concat(lit(head), schema, lit(DS_ARGS_END)))
        else:
            calls.append(_glm_call(fn, lit))
    body = calls[0] if len(calls) == 1 else xg.Grammar.union(*calls)
    if name == "deepseekv3":
        return str(xg.Grammar.concat(lit(DS_CALLS_BEGIN), body, lit(DS_CALLS_END)))
    return str(body)


def _glm_call(fn: dict, lit):
    """<tool_call>NAME, then each required parameter as a key and its JSON value (strings
    bare), then </tool_call>."""
    import xgrammar as xg

    params = fn["parameters"]
    parts = [lit(f"{GLM_BEGIN}{fn['name']}\n")]
    for key in params.get("required", []):
        prop = params.get("properties", {}).get(key, {})
        parts.append(lit(f"<arg_key>{key}</arg_key>\n<arg_value>"))
        if prop.get("type") == "string":
            parts.append(xg.Grammar.from_regex(r"[^<\n]{1,40}"))
        else:
            parts.append(xg.Grammar.from_json_schema(json.dumps(prop), any_whitespace=False))
        parts.append(lit("</arg_value>\n"))
    parts.append(lit(GLM_END))
    return xg.Grammar.concat(*parts)
