"""A chat request's messages -> prompt token ids through the checkpoint's chat template (or the
one `--chat-template` gives), with the request's tools and `chat_template_kwargs`."""

from __future__ import annotations

import jinja2

from dserve.runtime.openai_protocol import ChatOptions
from dserve.runtime.protocol import BadRequest

# apply_chat_template's own arguments: not for a template's variables
RESERVED = {
    "conversation",
    "tools",
    "documents",
    "chat_template",
    "add_generation_prompt",
    "continue_final_message",
    "tokenize",
    "padding",
    "truncation",
    "max_length",
    "return_tensors",
    "return_dict",
    "return_assistant_tokens_mask",
    "tokenizer_kwargs",
}


def render_chat(tokenizer, chat: ChatOptions, template: str | None = None) -> list[int]:
    clash = sorted(set(chat.template_kwargs) & RESERVED)
    if clash:
        raise BadRequest(f"chat_template_kwargs may not set {', '.join(clash)}")
    tools = chat.tools if chat.tool_choice != "none" else None
    try:
        ids = tokenizer.apply_chat_template(
            chat.messages,
            tools=tools,
            chat_template=template,
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
            **chat.template_kwargs,
        )
    except (jinja2.TemplateError, TypeError, ValueError) as e:
        raise BadRequest(f"the chat template failed on these messages: {e}") from e
    return list(ids)
