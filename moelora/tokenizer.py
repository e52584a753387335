"""The model folder's tokenizer (tokenizer.json + tokenizer_config.json) and its chat template."""

from __future__ import annotations

import json
from pathlib import Path

from moelora.errors import InvalidRequestError


class Tokenizer:
    def __init__(self, model_path: str, extra_eos_ids: list[int]):
        from transformers import AutoTokenizer  # costly import: only when a folder has one

        self._tok = AutoTokenizer.from_pretrained(model_path)
        eos = set(extra_eos_ids)
        if self._tok.eos_token_id is not None:
            eos.add(self._tok.eos_token_id)
        self.eos_token_ids = sorted(eos)
        template = Path(model_path) / "chat_template.jinja"
        if self._tok.chat_template is None and template.exists():
            self._tok.chat_template = template.read_text()

    @staticmethod
    def exists(model_path: str) -> bool:
        return (Path(model_path) / "tokenizer.json").exists() or (
            Path(model_path) / "tokenizer_config.json"
        ).exists()

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=True)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def decode_incremental(
        self, ids: list[int], offsets: tuple[int, int]
    ) -> tuple[str, tuple[int, int]]:
        """The text the newest tokens add, decoding a short window instead of the whole list.

        offsets = (prefix, read): ids[prefix:read] is the window already turned into text. The
        window is decoded with and without the new tokens and the difference is the new text;
        it is held back while it ends in an incomplete UTF-8 character.
        """
        prefix, read = offsets
        before = self.decode(ids[prefix:read])
        after = self.decode(ids[prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            return after[len(before) :], (read, len(ids))
        return "", offsets

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        if self._tok.chat_template is None:
            raise InvalidRequestError("this model folder has no chat template")
        text = self._tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self._tok.encode(text, add_special_tokens=False)


def eos_ids_from_folder(model_path: str, hf_eos: int | list[int] | None) -> list[int]:
    """EOS ids of config.json and generation_config.json (the latter often lists several)."""
    ids = _as_list(hf_eos)
    gen = Path(model_path) / "generation_config.json"
    if gen.exists():
        ids += _as_list(json.loads(gen.read_text()).get("eos_token_id"))
    return sorted(set(ids))


def _as_list(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)
