"""Prompts through the checkpoint's chat template (``tokenizer_config.json``'s ``chat_template``).

The engine's tokenizer is the bare ``tokenizers`` library, which renders no templates; the
template is Jinja, rendered here in jinja2's sandbox (jinja2 comes with torch; pyproject names
it). A checkpoint without a template gets DeepSeek's plain layout
``<bos><｜User｜>{prompt}<｜Assistant｜>`` and the generation file records which one was used.
"""

from __future__ import annotations

import json
from pathlib import Path

from .errors import EvalError

FALLBACK = "{bos}<｜User｜>{content}<｜Assistant｜>"


def _token(value: object) -> str:
    # tokenizer_config spells special tokens as a string or as {"content": ...}
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return "" if value is None else str(value)


def _raise(message: str) -> None:
    from jinja2 import TemplateError

    raise TemplateError(message)


class ChatTemplate:
    def __init__(self, model_dir: str | Path) -> None:
        config_file = Path(model_dir) / "tokenizer_config.json"
        config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
        self.bos, self.eos = _token(config.get("bos_token")), _token(config.get("eos_token"))
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: the default one
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        self.source = "tokenizer_config" if template else "fallback"
        self._file = config_file
        self._template = None
        if template:
            from jinja2 import TemplateError
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)  # as HF renders them
            env.globals["raise_exception"] = _raise  # HF templates refuse bad conversations with it
            try:
                self._template = env.from_string(template)
            except TemplateError as e:
                raise EvalError(f"{config_file}: chat_template does not compile ({e})") from None

    def render(self, content: str) -> str:
        """One user turn, ready for the assistant's reply."""
        if self._template is None:
            return FALLBACK.format(bos=self.bos, content=content)
        from jinja2 import TemplateError

        try:
            return self._template.render(
                messages=[{"role": "user", "content": content}],
                add_generation_prompt=True,
                bos_token=self.bos,
                eos_token=self.eos,
            )
        except TemplateError as e:
            raise EvalError(f"{self._file}: chat_template failed on a user turn ({e})") from None
