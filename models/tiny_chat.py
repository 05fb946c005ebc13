"""Chat templates for tiny checkpoints that render conversations as the published models do:
DeepSeek-R1/V3 (the thinking opened in the generation prompt, tool calls between
`<｜tool▁calls▁begin｜>` and `<｜tool▁calls▁end｜>` with JSON arguments, `thinking` false closes
it) and GLM-4.5 (`<tool_call>` with `<arg_key>`/`<arg_value>` pairs, `<|observation|>` for tool
results, `enable_thinking` false adds an empty `<think></think>`). Shortened, the same shapes.
"""

from __future__ import annotations

DEEPSEEK = (
    "{{ bos_token }}"
    "{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] }}{% endif %}{% endfor %}"
    "{% if tools %}## Tools\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'user' %}<｜User｜>{{ m['content'] }}"
    "{% elif m['role'] == 'assistant' %}<｜Assistant｜>{{ m['content'] or '' }}"
    "{% if m['tool_calls'] %}<｜tool▁calls▁begin｜>{% for tc in m['tool_calls'] %}"
    "{% if not loop.first %}\n{% endif %}<｜tool▁call▁begin｜>function<｜tool▁sep｜>"
    "{{ tc['function']['name'] }}\n```json\n{{ tc['function']['arguments'] }}\n```"
    "<｜tool▁call▁end｜>{% endfor %}<｜tool▁calls▁end｜>{% endif %}<｜end▁of▁sentence｜>"
    "{% elif m['role'] == 'tool' %}<｜tool▁output▁begin｜>{{ m['content'] }}<｜tool▁output▁end｜>"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<｜Assistant｜>"
    "{% if thinking is defined and not thinking %}</think>{% else %}<think>\n{% endif %}"
    "{% endif %}"
)

GLM45 = (
    "[gMASK]<sop>"
    "{% if tools %}<|system|>\n# Tools\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}<|system|>\n{{ m['content'] }}"
    "{% elif m['role'] == 'user' %}<|user|>\n{{ m['content'] }}"
    "{% elif m['role'] == 'assistant' %}<|assistant|>\n{{ m['content'] or '' }}"
    "{% for tc in m['tool_calls'] or [] %}<tool_call>{{ tc['function']['name'] }}\n"
    "{% for k, v in tc['function']['arguments'].items() %}<arg_key>{{ k }}</arg_key>\n"
    "<arg_value>{{ v if v is string else v | tojson }}</arg_value>\n{% endfor %}</tool_call>"
    "{% endfor %}"
    "{% elif m['role'] == 'tool' %}<|observation|>\n<tool_response>\n{{ m['content'] }}\n"
    "</tool_response>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>"
    "{% if enable_thinking is defined and not enable_thinking %}\n<think></think>{% endif %}"
    "{% endif %}"
)

TEMPLATES = {"deepseek": DEEPSEEK, "glm45": GLM45}
