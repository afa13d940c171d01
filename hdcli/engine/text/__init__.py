"""Text in and out of token ids: prompts and chat templates, tools, and grammars.

    prompts.py    prompt or messages -> token ids (chat template); tokens -> text pieces; stop strings
    templates.py  a model's chat template rendered with bounded time and size
    tools.py      OpenAI tools: checked, rendered into the prompt, call grammars, calls parsed back
    constrain.py  grammar constraints (JSON, JSON Schema, regex, Lark, GBNF) by llguidance
"""
